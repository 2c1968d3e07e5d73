# seer_jax: `make demo` runs the main job on the embedded default model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU suite is bound by XLA:CPU compile time (hundreds of small step shapes). Its LLVM
# back end runs at -O0 there: about a quarter less time, same results; the hardware compile
# tests keep the compilers' defaults.
CPU_TEST_XLA_FLAGS ?= --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0
PYTEST := XLA_FLAGS="$(CPU_TEST_XLA_FLAGS)" $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --max-worker-restart=2
# compilers for TPU (libtpu) and NVIDIA GPUs (XLA:GPU, Triton, ptxas) in their own environment
# (about 2 GB), pinned to the jax of the main one: the hardware compile tests run there. Compiling
# for a GPU without one needs the CUDA plugin and ptxas only, not the CUDA runtime libraries
# (cuDNN, cuBLAS, NCCL, ...: 4.4 GB) that jax[cuda12] pulls in for running on one.
HWVENV ?= .venv-hw
HWPY := $(HWVENV)/bin/python

.PHONY: demo test test-all test-fast test-hardware test-hardware-all lint venv clean

$(VENV)/.installed-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-fast: $(VENV)/.installed-base
	$(PIP) install -q -e '.[test]'
	touch $@

# Reference checks (torch, transformers), the Tunix adapter and Mooncake Store (its wheel needs
# the Debian libraries .ci/run installs; without them its tests skip saying why). google-tunix 0.1.7 pins
# safetensors<0.8, which transformers >= 5.24 (whose GGUF tokenizer conversion we check against)
# cannot use; tunix's own dependencies come from the tunix-deps extra and tunix itself is
# installed last with --no-deps (it runs fine with safetensors 0.8).
$(VENV)/.installed-test: $(VENV)/.installed-fast
	$(PIP) install -q -e '.[test,ref,tunix-deps,mooncake]'
	$(PIP) install -q --no-deps google-tunix==0.1.7
	touch $@

# The project's own dependencies and this checkout on the path (a .pth file, no build, so this
# installs alongside the main environment's editable installs; `make test` runs both at once).
$(HWVENV)/.installed: pyproject.toml $(VENV)/.installed-base
	$(PYTHON) -m venv $(HWVENV)
	$(HWVENV)/bin/pip install -q --upgrade pip
	$(PY) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > $(HWVENV)/requirements.txt
	jax=$$($(PY) -c "import jax; print(jax.__version__)") && \
	  $(HWVENV)/bin/pip install -q "jax[tpu]==$$jax" "jax-cuda12-plugin==$$jax" \
	  "nvidia-cuda-nvcc-cu12>=12.6.85,<13" absl-py "pytest<9.2" pytest-xdist pytest-timeout \
	  -r $(HWVENV)/requirements.txt
	echo "$(CURDIR)" > "$$($(HWVENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/seer_jax_checkout.pth"
	touch $@

venv: $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(VENV)/bin/seer-jax fetch-model smollm2
	$(VENV)/bin/seer-jax generate --model smollm2 --chat --prompt "What is the capital of France?" --max-tokens 32
	$(VENV)/bin/seer-jax rollout --config configs/rollout/demo.py

# everything but the tests marked slow (engines, clusters, interpret-mode kernels); no torch or
# tunix needed (their tests skip)
test-fast: $(VENV)/.installed-fast
	$(VENV)/bin/seer-jax fetch-model smollm2
	$(NUMBA_WARM)
	$(PYTEST) -m "not slow"

# the draft service's numba kernels, compiled once into numba's cache before the test workers
# start (else each worker compiles them)
NUMBA_WARM := $(PY) -c "from seer_jax.drafting.arena import compile_kernels; compile_kernels()"

# the CPU suite, then the hardware compile tests (default set) in their own environment
test: $(VENV)/.installed-base
	$(MAKE) -j2 $(VENV)/.installed-test $(HWVENV)/.installed
	$(VENV)/bin/seer-jax fetch-model smollm2
	$(NUMBA_WARM)
	$(PYTEST) --ignore=tests/hardware -m "not exhaustive"
	$(MAKE) test-hardware

# everything: the CPU suite with the exhaustive kernel lowering, then the whole compile product
test-all: $(VENV)/.installed-base
	$(MAKE) -j2 $(VENV)/.installed-test $(HWVENV)/.installed
	$(VENV)/bin/seer-jax fetch-model smollm2
	$(NUMBA_WARM)
	$(PYTEST) --ignore=tests/hardware
	$(MAKE) test-hardware-all

# every kernel and each deployment config's engine step compiled for TPU v5e/v5p/v6e and
# H100/H200 on this host: the shipped models' shapes and a corner of the kernel product
test-hardware: $(HWVENV)/.installed
	SEER_REQUIRE_COMPILERS=1 $(HWPY) -m pytest -q -p no:cacheprovider -n 2 tests/hardware \
	  -m "not exhaustive"

# the whole kernel product: GQA group 1-10 x head_dim x dtype x page size x kernel x target
test-hardware-all: $(HWVENV)/.installed
	SEER_REQUIRE_COMPILERS=1 $(HWPY) -m pytest -q -p no:cacheprovider -n 2 tests/hardware

lint: $(VENV)/.installed-fast
	$(VENV)/bin/ruff check seer_jax tests benchmarks examples configs

clean:
	rm -rf $(VENV) $(HWVENV) .pytest_cache .ruff_cache
