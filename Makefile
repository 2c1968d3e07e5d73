# seer_jax: `make demo` runs the main job on the embedded default model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test lint venv clean

$(VENV)/.installed-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test,ref,tunix]'
	# google-tunix 0.1.7 pins safetensors<0.8, which holds transformers at 5.12, whose GGUF
	# tokenizer conversion differs; the reference checks need transformers >= 5.24 (tunix runs fine with it)
	$(PIP) install -q 'transformers>=5.24' 'safetensors>=0.8'
	touch $@ $(VENV)/.installed-base

venv: $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(VENV)/bin/seer-jax fetch-model smollm2
	$(VENV)/bin/seer-jax generate --model smollm2 --chat --prompt "What is the capital of France?" --max-tokens 32
	$(VENV)/bin/seer-jax rollout --config configs/rollout/demo.py

test: $(VENV)/.installed-test
	$(VENV)/bin/seer-jax fetch-model smollm2
	$(PY) -m pytest -q

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check seer_jax tests benchmarks examples configs

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
