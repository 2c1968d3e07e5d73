"""DeepSeek-V3 and -V2 (multi-head latent attention over the paged latent cache, the DeepSeek MoE
block) vs transformers: logits, greedy continuations through the engine; draft-tree verify,
exported latent KV and shared prefixes, kernels and tp against the reference generator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from seer_jax.drafting.budget import BudgetConfig, SpeculationBudget
from seer_jax.drafting.draft import Draft
from seer_jax.engine.engine import Engine, EngineConfig
from seer_jax.engine.speculation import Speculator
from seer_jax.errors import ConfigError
from seer_jax.model.config import tiny_deepseek_config
from seer_jax.model.generate import full_forward, generate
from seer_jax.model.llama import init_params
from seer_jax.model.loading import load_safetensors_dir
from seer_jax.rollout.core.types import SamplingParams

torch = pytest.importorskip("torch")
from tests.model.hf_models import make_hf_model  # noqa: E402

PROMPTS = [np.random.RandomState(i).randint(0, 160, n).tolist()
           for i, n in enumerate((5, 19, 1, 33, 12, 8, 27, 3))]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek_v3")
    model = make_hf_model("deepseek_v3", d)
    cfg, params = load_safetensors_dir(d)
    return d, model, cfg, params


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_config_and_logits_match_transformers(deepseek, tmp_path, kind):
    if kind == "deepseek_v3":
        _, ref_model, cfg, params = deepseek
        assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.mla.q_lora_rank == 24
        assert cfg.moe.n_group == 2 and cfg.moe.scoring == "sigmoid"
    else:  # V2: no query LoRA, a softmax router
        ref_model = make_hf_model(kind, tmp_path)
        cfg, params = load_safetensors_dir(tmp_path)
        assert cfg.architecture == "DeepseekV2ForCausalLM" and cfg.mla.q_lora_rank is None
        assert cfg.moe.scoring == "softmax" and cfg.moe.routed_scaling_factor == 2.5
    assert cfg.layer_kinds == ("dense", "moe", "moe")
    assert cfg.mla.cache_width == 32 + 8
    assert cfg.mla.yarn is not None and cfg.mla.yarn.factor == 4.0
    assert cfg.moe.shared_intermediate_size == 32
    # latent rows per token-layer, not 2 x heads x head_dim
    assert cfg.kv_bytes_per_token() == 3 * 40 * 4
    lens = [37, 12, 25]
    rng = np.random.RandomState(1)
    toks = np.zeros((3, max(lens)), np.int64)
    mask = np.zeros_like(toks)
    for i, n in enumerate(lens):
        toks[i, :n] = rng.randint(0, cfg.vocab_size, n)
        mask[i, :n] = 1
    ours = np.asarray(full_forward(params, cfg, toks))
    with torch.no_grad():
        ref = ref_model(torch.tensor(toks), attention_mask=torch.tensor(mask)).logits.numpy()
    scale = max(np.abs(ref[i, :n]).max() for i, n in enumerate(lens))
    for i, n in enumerate(lens):
        np.testing.assert_allclose(ours[i, :n], ref[i, :n], atol=1e-5 * scale, rtol=0)


def _hf_greedy_agrees(ref_model, prompts, outputs) -> list[int]:
    """Whether transformers' greedy choice follows each prompt with our tokens: one batched
    forward over prompt + output (right-padded), its argmax at every position that chose a
    token (the same test as its `generate`, without 256 decoding calls). The prompts whose
    continuation differs."""
    seqs = [p + o for p, o in zip(prompts, outputs, strict=True)]
    T = max(map(len, seqs))
    toks = np.zeros((len(seqs), T), np.int64)
    mask = np.zeros_like(toks)
    for i, s in enumerate(seqs):
        toks[i, :len(s)], mask[i, :len(s)] = s, 1
    with torch.no_grad():
        logits = ref_model(torch.tensor(toks), attention_mask=torch.tensor(mask)).logits.numpy()
    bad = []
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        chosen = logits[i, len(p) - 1:len(p) - 1 + len(o)].argmax(-1).tolist()
        if chosen != list(o):
            bad.append(i)
    return bad


def _engine(cfg, params, **over) -> Engine:
    # two compiled step shapes (prefill, then decode beside the last prefill chunk and alone)
    config = EngineConfig(**{**dict(num_pages=160, page_size=4, max_num_batched_tokens=64,
                                    max_num_seqs=8, max_prefill_seqs=4), **over})
    return Engine(cfg, params, config, eos_ids=())


def _run(engine, prompts=PROMPTS) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, NEW_TOKENS, SamplingParams(temperature=0.0))
    done = {}
    while engine.has_unfinished():
        for r in engine.step():
            done[int(r.request_id)] = r.token_ids
    return [list(done[i]) for i in range(len(prompts))]


@pytest.mark.slow
def test_engine_greedy_equals_transformers_generate(deepseek):
    """8 prompts x 32 tokens through the paged latent cache (chunked prefill beside decodes)."""
    _, ref_model, cfg, params = deepseek
    engine = _engine(cfg, params)
    assert engine.runner.kv_all.shape == (3, 160, 4, 40)
    outputs = _run(engine)
    assert all(len(o) == NEW_TOKENS for o in outputs)
    assert _hf_greedy_agrees(ref_model, PROMPTS, outputs) == []


# ---------------------------------------------------------------------------- the latent cache
# a random tiny DeepSeek-V3 against the reference generator (dense latent cache)

TINY = tiny_deepseek_config(eos_token_ids=())
TINY_PARAMS = init_params(TINY, seed=3)
TINY_PROMPT = np.random.RandomState(5).randint(3, 256, 11).tolist()
TINY_ENGINE = EngineConfig(num_pages=32, page_size=4, max_num_seqs=4, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def tiny_reference():
    return generate(TINY_PARAMS, TINY, [TINY_PROMPT], 20)[0].token_ids


class _Scripted:
    """Draft service: a tree forking at the root, a wrong branch first, the right one second."""

    def __init__(self, ref):
        self.ref, self.tokens = ref, {}

    def append(self, group_id, request_id, token_ids):
        if request_id is not None:
            self.tokens.setdefault(request_id, []).extend(int(t) for t in token_ids)
        return 0

    def speculate(self, queries):
        out = []
        for q in queries:
            right = self.ref[len(self.tokens.get(q.request_id, [])):][:3]
            if not right:
                out.append(Draft.empty())
                continue
            tokens = [(right[0] + 1) % TINY.vocab_size] + right
            parents = [-1, -1] + list(range(1, len(right)))
            out.append(Draft(np.array(tokens, np.int32), np.array(parents, np.int32),
                             np.ones(len(tokens), np.float32)))
        return out


@pytest.mark.slow
def test_speculative_tree_verify_over_the_latent_cache(tiny_reference):
    """Draft trees verified over the latent cache (tree masks in the MLA attention, accepted
    rows moved within the cache): the greedy tokens of the reference generator."""
    ref = tiny_reference
    budget = SpeculationBudget(lambda b, g: 1.0, BudgetConfig(beta_init=0.9, max_width=4))
    spec = Speculator(_Scripted(ref), budget)
    config = dataclasses.replace(TINY_ENGINE, speculation=True)
    engine = Engine(TINY, TINY_PARAMS, config, speculator=spec, eos_ids=())
    engine.add_request("r", TINY_PROMPT, 20, SamplingParams(temperature=0.0))
    out = []
    while engine.has_unfinished():
        out += [r.token_ids for r in engine.step()]
    assert out == [ref]
    assert spec.accepted >= 10 and engine.step_count <= 12


@pytest.mark.slow
def test_latent_kv_export_import_and_shared_prefix(tiny_reference):
    """A request's latent rows leave one engine (`export_kv`) and continue in another; a second
    request with the same prompt starts from the first one's shared prompt pages."""
    ref = tiny_reference
    a, b = (Engine(TINY, TINY_PARAMS, TINY_ENGINE, eos_ids=()) for _ in range(2))
    a.add_request("r", TINY_PROMPT, 20, SamplingParams(temperature=0.0))
    for _ in range(5):
        a.step()
    a.add_request("s", TINY_PROMPT, 20, SamplingParams(temperature=0.0))
    a.step()  # s starts from r's prompt pages
    assert a.seqs["s"].pages[:2] == a.seqs["r"].pages[:2]
    blob = a.export_kv("r")
    L, W = TINY.num_layers, TINY.mla.cache_width
    assert blob.k.shape == (L, 1, blob.num_computed, W) and blob.v.size == 0
    assert blob.nbytes == TINY.kv_bytes_per_token() * blob.num_computed
    done = blob.output_ids
    b.add_request("r", TINY_PROMPT, 20 - len(done), SamplingParams(temperature=0.0),
                  output_ids=done, kv=blob)
    out = {}
    for engine in (a, b):
        while engine.has_unfinished():
            out.update({r.request_id: r.token_ids for r in engine.step()})
    assert done + list(out["r"]) == ref
    assert list(out["s"]) == ref


@pytest.mark.exhaustive  # kernels in interpret mode: ~20-30 s each on 2 cores
@pytest.mark.parametrize("impl, rank, rope, tp, layer_weights", [
    ("reference", 32, 8, 2, "stacked"),
    ("reference", 32, 8, 1, "per_layer"),
    ("tpu", 128, 64, 1, "stacked"),
    ("tpu", 128, 64, 2, "stacked"),
    ("gpu", 32, 16, 1, "stacked"),
])
def test_engine_impls_and_tp_token_identical(impl, rank, rope, tp, layer_weights):
    """The MLA kernels (interpret mode) and tensor parallelism (query heads split, the latent
    cache whole on every shard) give the reference generator's greedy tokens."""
    import jax

    from seer_jax.model.sharding import make_mesh

    cfg = tiny_deepseek_config(eos_token_ids=(), head_dim=16 + rope, mla=dataclasses.replace(
        TINY.mla, kv_lora_rank=rank, qk_rope_head_dim=rope))
    params = init_params(cfg, seed=3)
    prompts = [np.random.RandomState(i).randint(3, 256, n).tolist() for i, n in enumerate((9, 3))]
    ref = [g.token_ids for g in generate(params, cfg, prompts, 6)]
    config = EngineConfig(num_pages=16, page_size=8, max_num_seqs=2, max_num_batched_tokens=16,
                          max_prefill_seqs=2, impl=impl, layer_weights=layer_weights)
    mesh = make_mesh(jax.devices()[:tp]) if tp > 1 else None
    engine = Engine(cfg, params, config, mesh=mesh, eos_ids=())
    assert engine.runner.plan.impl == impl
    out = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, 6, SamplingParams(temperature=0.0))
    while engine.has_unfinished():
        out.update({int(r.request_id): list(r.token_ids) for r in engine.step()})
    assert [out[i] for i in range(2)] == ref


def test_kernel_shapes_the_mla_kernels_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="kv_lora_rank=32.*multiple of 128"):
        Engine(TINY, TINY_PARAMS, dataclasses.replace(TINY_ENGINE, impl="tpu"), eos_ids=())


def test_orbax_round_trip_keeps_the_latent_config(tmp_path):
    from seer_jax.model.llama import flat_params
    from seer_jax.model.loading import load_orbax, save_orbax

    cfg, params = load_orbax(save_orbax(tmp_path / "ckpt", TINY, TINY_PARAMS))
    assert cfg == TINY and cfg.mla.yarn == TINY.mla.yarn
    want, got = flat_params(TINY_PARAMS), flat_params(params)
    assert got.keys() == want.keys()
    assert all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want)
