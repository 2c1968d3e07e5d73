"""Mixture-of-experts models vs transformers: logits, greedy continuations through the engine,
the DeepSeek-V3 MoE block, weight layouts, refusals."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from seer_jax.engine.engine import Engine, EngineConfig
from seer_jax.errors import ConfigError, SeerError
from seer_jax.model.config import ModelConfig, tiny_config
from seer_jax.model.generate import full_forward
from seer_jax.model.llama import flat_params, init_params, split_layers, stack_layers
from seer_jax.model.loading import load_orbax, load_safetensors_dir, moe_layer_from_hf, save_orbax
from seer_jax.model.moe import MOE_AXES, moe_mlp, route
from seer_jax.model.moe_config import MoeConfig, deepseek_v3_moe_config
from seer_jax.model.sharding import make_mesh, shard_params
from seer_jax.rollout.core.types import SamplingParams

torch = pytest.importorskip("torch")
from tests.model.hf_models import MOE_KINDS, make_hf_model  # noqa: E402

PROMPTS = [np.random.RandomState(i).randint(0, 160, n).tolist()
           for i, n in enumerate((5, 19, 1, 33, 12, 8, 27, 3))]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (kind, checkpoint dir, transformers model), each made once."""
    made = {}

    def get(kind):
        if kind not in made:
            d = tmp_path_factory.mktemp(kind)
            made[kind] = kind, d, make_hf_model(kind, d)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_logits_match_transformers(checkpoints, kind):
    kind, path, ref_model = checkpoints(kind)
    cfg, params = load_safetensors_dir(path)
    assert cfg.architecture == ref_model.config.architectures[0]
    assert cfg.layer_kinds == (("moe", "dense", "moe") if kind == "qwen2_moe" else ("moe", "moe"))
    assert cfg.moe.num_experts == 8 and cfg.moe.num_experts_per_tok == 2
    assert cfg.moe.shared_gate == (kind == "qwen2_moe")
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


def _hf_greedy(ref_model) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])  # an explicit mask: generate would mask the pad id's tokens
            ids = ref_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def _engine_greedy(cfg, params, layer_weights: str = "stacked", tp: int = 1,
                   stats: list | None = None) -> list[list[int]]:
    config = EngineConfig(num_pages=160, page_size=4, max_num_batched_tokens=48, max_num_seqs=8,
                          max_prefill_seqs=2, layer_weights=layer_weights)
    mesh = make_mesh(jax.devices()[:tp]) if tp > 1 else None
    engine = Engine(cfg, params, config, mesh=mesh, eos_ids=())
    if tp > 1:  # experts split over the devices, one expert-parallel MoE per layer
        assert engine.runner.plan.expert_mesh is mesh
        lp = engine.runner.params["layers"]
        lp = lp[0] if isinstance(lp, tuple) else lp
        assert lp["we_down"].addressable_shards[0].data.shape[-3] == cfg.moe.num_experts // tp
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, NEW_TOKENS, SamplingParams(temperature=0.0))
    done = {}
    while engine.has_unfinished():
        for r in engine.step():
            done[int(r.request_id)] = r.token_ids
    if stats is not None:
        stats.extend(engine.step_stats)
    return [list(done[i]) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("kind", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.exhaustive),
                                  pytest.param("qwen2_moe", marks=pytest.mark.exhaustive)])
def test_engine_greedy_equals_transformers_generate(checkpoints, kind):
    """8 prompts x 32 tokens, chunked prefill next to decodes; qwen2_moe (dense and MoE layers
    mixed) both with stacked weights (a scan per run of same-kind layers) and per layer."""
    kind, path, ref_model = checkpoints(kind)
    cfg, params = load_safetensors_dir(path)
    want = _hf_greedy(ref_model)
    stats = []
    assert _engine_greedy(cfg, params, "stacked", 1, stats) == want
    assert {s.moe_dispatch for s in stats} == {"local"}
    if kind == "qwen2_moe":
        assert _engine_greedy(cfg, params, "per_layer") == want


@pytest.mark.parametrize("tp, layer_weights, dispatch", [
    # CI: the all-to-all at tp 2 (the psum runs at tp 2 and 4 in the block tests below)
    pytest.param(2, "stacked", "psum", marks=pytest.mark.exhaustive),
    pytest.param(4, "stacked", "psum", marks=pytest.mark.exhaustive),
    (2, "stacked", "all_to_all"),
    pytest.param(4, "per_layer", "all_to_all", marks=pytest.mark.exhaustive),
    pytest.param(2, "per_layer", "psum", marks=pytest.mark.exhaustive)])
def test_expert_parallel_engine_is_token_identical(monkeypatch, checkpoints, tp, layer_weights,
                                                   dispatch):
    """Experts split over tp (attention tensor-parallel on the same devices), either dispatch
    (the all-to-all one on the CPU: its emulated ragged all-to-all): the same greedy tokens as
    transformers (and so as tp 1), and the step stats say which dispatch every step used."""
    from seer_jax.model import moe as moe_module

    _, path, ref_model = checkpoints("qwen3_moe")
    cfg, params = load_safetensors_dir(path)
    # the tiny model's 8 experts, top-2: the psum sends fewer bytes at tp 2 and 4
    assert moe_module.expert_dispatch(48, make_mesh(jax.devices()[:tp]), cfg.moe,
                                      cfg.hidden_size, 4) == "psum"
    if dispatch == "all_to_all":
        monkeypatch.setattr(moe_module, "expert_dispatch", lambda *a: "all_to_all")
    stats = []
    assert _engine_greedy(cfg, params, layer_weights, tp, stats) == _hf_greedy(ref_model)
    assert {s.moe_dispatch for s in stats} == {dispatch}


@pytest.mark.parametrize("router, tp", [
    ("softmax", 4), ("sigmoid_grouped_shared", 2),
    pytest.param("softmax", 2, marks=pytest.mark.exhaustive),
    pytest.param("sigmoid_grouped_shared", 4, marks=pytest.mark.exhaustive)])
def test_expert_parallel_block_equals_one_device(router, tp):
    if router == "softmax":
        moe = MoeConfig(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=16,
                        norm_topk_prob=True)
    else:
        moe = MoeConfig(num_experts=16, num_experts_per_tok=4, expert_intermediate_size=16,
                        scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                        score_correction_bias=True, n_group=4, topk_group=2,
                        shared_intermediate_size=16)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_layers=1, moe=moe)
    lp = split_layers(init_params(cfg, seed=4), cfg)["layers"][0]
    lp = {k: v for k, v in lp.items() if k in MOE_AXES}
    x = np.random.RandomState(0).randn(24, cfg.hidden_size).astype(np.float32)
    ref, ref_ids = moe_mlp(x, lp, moe)
    mesh = make_mesh(jax.devices()[:tp])
    sharded = shard_params({"layers": {k: v[None] for k, v in lp.items()}}, mesh)["layers"]
    sharded = {k: v[0] for k, v in sharded.items()}
    out, ids = jax.jit(moe_mlp, static_argnums=(2, 3))(x, sharded, moe, mesh)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6, rtol=0)
    assert np.array_equal(np.asarray(ids), np.asarray(ref_ids))


@pytest.mark.parametrize("tp", [1, 4])
def test_dense_experts_equal_the_grouped_ragged_dot(monkeypatch, tp):
    """The formulation TPU and GPU run for decode-sized batches (every local expert over every
    token, unchosen rows zeroed) gives the grouped ragged_dot's outputs, one device and
    expert-parallel; larger batches keep the ragged_dot."""
    from seer_jax.model import moe as moe_module

    moe = MoeConfig(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=16,
                    norm_topk_prob=True)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_layers=1, moe=moe)
    lp = split_layers(init_params(cfg, seed=5), cfg)["layers"][0]
    lp = {k: v for k, v in lp.items() if k in MOE_AXES}
    x = np.random.RandomState(1).randn(24, cfg.hidden_size).astype(np.float32)
    ref, ref_ids = moe_mlp(x, lp, moe)
    assert not moe_module.use_dense_experts(24, None)  # the CPU keeps the ragged_dot
    mesh = make_mesh(jax.devices()[:tp]) if tp > 1 else None
    if mesh is not None:
        sharded = shard_params({"layers": {k: v[None] for k, v in lp.items()}}, mesh)["layers"]
        lp = {k: v[0] for k, v in sharded.items()}
    calls = []
    real_dense = moe_module.dense_experts
    monkeypatch.setattr(moe_module, "use_dense_experts",
                        lambda n, m: n <= moe_module.DENSE_MAX_TOKENS)
    monkeypatch.setattr(moe_module, "dense_experts",
                        lambda *a, **k: calls.append(1) or real_dense(*a, **k))
    # a fresh function: jit's cache of moe_mlp holds traces made without the patch
    out, ids = jax.jit(lambda x, lp: moe_mlp(x, lp, moe, mesh))(x, lp)
    assert calls
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    assert np.array_equal(np.asarray(ids), np.asarray(ref_ids))


def test_sparse_experts_equal_the_dense_ones():
    """The small-batch formulation (only the chosen experts, padding slots skipped) gives
    `dense_experts`'s outputs, over all experts and over one device's block of them."""
    from seer_jax.model.moe import dense_experts, sparse_experts, use_sparse_experts

    rng = np.random.RandomState(3)
    E, d, f = 16, 8, 12
    w = [rng.randn(*s).astype(np.float32) / 3 for s in ((E, d, f), (E, d, f), (E, f, d))]
    assert use_sparse_experts(1, 8, 128) and use_sparse_experts(8, 8, 128)
    assert not use_sparse_experts(9, 8, 128)
    for N, k, first, local in ((1, 4, 0, E), (3, 2, 0, E), (2, 3, 4, 4), (5, 2, 8, 8)):
        x = rng.randn(N, d).astype(np.float32)
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
        ids[-1] = ids[0]  # tokens sharing experts
        wts = rng.rand(N, k).astype(np.float32)
        ws = [a[first:first + local] for a in w]
        ref = dense_experts(x, wts, ids, *ws, first)
        out = jax.jit(sparse_experts)(x, wts, ids, *ws, first)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_small_batches_run_only_the_chosen_experts(monkeypatch, tp):
    """A decode-sized batch hitting few experts on TPU and GPU runs `sparse_experts` (one
    device and expert-parallel under the psum) and gives the grouped ragged_dot's outputs."""
    from seer_jax.model import moe as moe_module

    moe = MoeConfig(num_experts=16, num_experts_per_tok=2, expert_intermediate_size=16,
                    norm_topk_prob=True)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_layers=1, moe=moe)
    lp = split_layers(init_params(cfg, seed=5), cfg)["layers"][0]
    lp = {k: v for k, v in lp.items() if k in MOE_AXES}
    x = np.random.RandomState(2).randn(4, cfg.hidden_size).astype(np.float32)
    ref, ref_ids = moe_mlp(x, lp, moe)
    mesh = make_mesh(jax.devices()[:tp]) if tp > 1 else None
    if mesh is not None:
        sharded = shard_params({"layers": {k: v[None] for k, v in lp.items()}}, mesh)["layers"]
        lp = {k: v[0] for k, v in sharded.items()}
    calls = []
    real = moe_module.sparse_experts
    monkeypatch.setattr(moe_module, "use_dense_experts",
                        lambda n, m: n <= moe_module.DENSE_MAX_TOKENS)
    monkeypatch.setattr(moe_module, "sparse_experts",
                        lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    out, ids = jax.jit(lambda x, lp: moe_mlp(x, lp, moe, mesh))(x, lp)
    assert calls
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    assert np.array_equal(np.asarray(ids), np.asarray(ref_ids))


@pytest.mark.parametrize("formulation, tp", [
    ("ragged", 1), ("sparse", 1), ("blocked", 1), ("dense", 1), ("sparse", 2), ("all_to_all", 2),
    ("sparse_kernel", 1), ("sparse_kernel", 2), ("blocked_kernel", 1),
    pytest.param("ragged", 2, marks=pytest.mark.exhaustive),
    pytest.param("blocked", 2, marks=pytest.mark.exhaustive)])
def test_padding_rows_reach_no_expert(monkeypatch, formulation, tp):
    """A step's padding rows (token_mask False) choose no expert: the real rows' outputs equal
    those of the real rows alone, the padding rows' are zero, and where a formulation runs only
    the experts its rows chose (`sparse_experts`, the blocked grouped matmul, also behind the
    all-to-all, and both through the GPU expert GEMM kernel in interpret mode) the experts only
    padding rows would choose are never run: their weights are NaN here (XLA:CPU's ragged_dot
    and `dense_experts` read every expert)."""
    from seer_jax.model import grouped_matmul
    from seer_jax.model import moe as moe_module

    moe = MoeConfig(num_experts=16, num_experts_per_tok=2, expert_intermediate_size=16,
                    norm_topk_prob=True)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_layers=1, moe=moe)
    lp = split_layers(init_params(cfg, seed=6), cfg)["layers"][0]
    lp = {k: np.asarray(v) for k, v in lp.items() if k in MOE_AXES}
    x = np.random.RandomState(4).randn(8, cfg.hidden_size).astype(np.float32)
    mask = np.array([True, False, True] + [False] * 5)
    ref, _ = moe_mlp(x[mask], lp, moe)
    _, ids = route(x, lp, moe)
    used = set(np.asarray(ids)[mask].ravel().tolist())
    assert set(np.asarray(ids)[~mask].ravel().tolist()) - used  # padding would hit others
    if formulation in ("sparse", "blocked", "all_to_all", "sparse_kernel", "blocked_kernel"):
        unused = np.array([e not in used for e in range(moe.num_experts)])
        lp = {k: np.where(unused[:, None, None], np.nan, v).astype(v.dtype)
              if k.startswith("we_") else v for k, v in lp.items()}
    mesh = make_mesh(jax.devices()[:tp]) if tp > 1 else None
    if mesh is not None:
        sharded = shard_params({"layers": {k: v[None] for k, v in lp.items()}}, mesh)["layers"]
        lp = {k: v[0] for k, v in sharded.items()}
    if formulation in ("sparse", "dense", "sparse_kernel"):
        monkeypatch.setattr(moe_module, "use_dense_experts", lambda *a: True)
        monkeypatch.setattr(moe_module, "use_sparse_experts",
                            lambda *a: formulation != "dense")
    if formulation == "sparse_kernel":
        monkeypatch.setattr(moe_module, "kernel_impl", lambda *a: "interpret")
    if formulation == "blocked_kernel":
        monkeypatch.setattr(moe_module, "use_blocked_experts", lambda *a: True)
        monkeypatch.setattr(moe_module, "kernel_impl", lambda *a: "interpret")
    if formulation in ("blocked", "all_to_all"):
        real = grouped_matmul.blocked_experts
        monkeypatch.setattr(moe_module, "use_blocked_experts", lambda *a: True)
        monkeypatch.setattr(moe_module, "blocked_experts",
                            lambda *a, **k: real(*a, block=4, group=2))
    if formulation == "all_to_all":
        monkeypatch.setattr(moe_module, "expert_dispatch", lambda *a: "all_to_all")
    out, got_ids = jax.jit(lambda x, lp, m: moe_mlp(x, lp, moe, mesh, m))(x, lp, mask)
    out = np.asarray(out)
    np.testing.assert_allclose(out[mask], np.asarray(ref), atol=1e-5, rtol=0)
    assert not out[~mask].any()
    assert np.array_equal(np.asarray(got_ids), np.asarray(ids))  # the router's choices


def test_engine_padding_rows_reach_no_expert(monkeypatch):
    """In the engine a decode batch of 1 runs in a bucket of 8 rows: the experts see one live row
    (the padding rows' ids are the no-expert id; here on the decode formulations TPU and GPU
    run), and the greedy tokens are those of a full forward (`generate`)."""
    from seer_jax.model import moe as moe_module
    from seer_jax.model.generate import generate

    moe = MoeConfig(num_experts=32, num_experts_per_tok=2, expert_intermediate_size=16,
                    norm_topk_prob=True)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_layers=2, moe=moe)
    params = init_params(cfg, seed=7)
    prompt = [3, 1, 4, 1, 5]
    want = generate(params, cfg, [prompt], 6, eos_ids=())[0].token_ids
    seen = []
    real = moe_module.local_experts

    def spy(x, w, ids, *a, **k):
        jax.debug.callback(lambda ids: seen.append(
            (ids.shape[0], int(np.sum(np.any(ids < moe.num_experts, axis=1))))), ids)
        return real(x, w, ids, *a, **k)

    monkeypatch.setattr(moe_module, "use_dense_experts", lambda *a: True)
    monkeypatch.setattr(moe_module, "local_experts", spy)
    jax.clear_caches()  # traced anew with the patches (and not kept for other tests)
    config = EngineConfig(num_pages=32, page_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                          max_prefill_seqs=1)
    engine = Engine(cfg, params, config, eos_ids=())
    engine.add_request("0", prompt, 6, SamplingParams(temperature=0.0))
    got = []
    while engine.has_unfinished():
        got += [list(r.token_ids) for r in engine.step()]
    jax.clear_caches()
    assert got == [list(want)]
    # the prompt's 5 tokens in a prefill bucket of 16 rows, then decodes of 1 live row of 8
    assert sorted(set(seen)) == [(8, 1), (16, 5)]


def test_mixed_layers_split_stack_and_orbax(checkpoints, tmp_path):
    _, path, _ = checkpoints("qwen2_moe")
    cfg, params = load_safetensors_dir(path)
    assert params["layers"]["w_gate"].shape[0] == 1 and params["layers"]["we_gate"].shape[0] == 2
    split = split_layers(params, cfg)
    assert "w_gate" in split["layers"][1] and "router" not in split["layers"][1]
    assert "router" in split["layers"][2] and "w_gate" not in split["layers"][2]
    with pytest.raises(ValueError, match="needs the cfg"):
        split_layers(params)
    back = flat_params(stack_layers(split))
    for k, v in flat_params(params).items():
        assert np.array_equal(np.asarray(back[k]), np.asarray(v)), k
    save_orbax(tmp_path / "ckpt", cfg, params)
    cfg2, params2 = load_orbax(tmp_path / "ckpt")
    assert cfg2 == cfg
    for k, v in flat_params(params2).items():
        assert np.array_equal(np.asarray(v), np.asarray(flat_params(params)[k])), k


def test_deepseek_v3_moe_block_matches_transformers():
    """Sigmoid scores with the correction bias, group-limited top-k, routed scaling, a shared
    expert: our block on the module's own (fused) tensors equals DeepseekV3MoE."""
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_cfg = tf.DeepseekV3Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                 n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                 n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                 num_hidden_layers=4, first_k_dense_replace=1, vocab_size=160)
    moe = deepseek_v3_moe_config(hf_cfg.to_dict())
    assert moe == MoeConfig(num_experts=16, num_experts_per_tok=4, expert_intermediate_size=32,
                            scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                            score_correction_bias=True, n_group=4, topk_group=2,
                            shared_intermediate_size=32, dense_layers=(0,))
    torch.manual_seed(0)
    block = DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        for name, p in list(block.named_parameters()) + list(block.named_buffers()):
            p.normal_(0.0, 0.3 if name.startswith("gate") else 0.1)
    lp = moe_layer_from_hf(moe, {f"mlp.{k}": v.numpy() for k, v in block.state_dict().items()})
    x = np.random.RandomState(0).randn(40, 64).astype(np.float32)
    with torch.no_grad():
        ref = block(torch.tensor(x)[None])[0].numpy()
        _, _, ref_ids = block.gate(torch.tensor(x))
    out, ids = jax.jit(moe_mlp, static_argnums=2)(x, lp, moe)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    assert (np.sort(np.asarray(ids), 1) == np.sort(ref_ids.numpy(), 1)).all()
    # the group limit matters here: plain top-k over all experts picks differently
    free = route(x, lp, MoeConfig(**{**moe.__dict__, "n_group": 1, "topk_group": 1}))[1]
    assert (np.sort(np.asarray(free), 1) != np.sort(np.asarray(ids), 1)).any()


@pytest.mark.exhaustive
def test_random_init_moe_runs_mixed_layers_like_per_layer():
    moe = MoeConfig(num_experts=4, num_experts_per_tok=2, expert_intermediate_size=16,
                    dense_layers=(0, 3))
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", num_layers=4, qk_norm=True, moe=moe)
    params = init_params(cfg, seed=1)
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 9))
    ref = np.asarray(full_forward(params, cfg, toks))
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    np.testing.assert_allclose(np.asarray(full_forward(split_layers(params, cfg), cfg, toks)), ref,
                               atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------- refusals

_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("arch, extra, match", [
    ("GptOssForCausalLM", {"num_local_experts": 32}, "GptOssForCausalLM.*num_local_experts=32"),
    ("Llama4ForCausalLM", {"num_local_experts": 16}, "Llama4ForCausalLM.*num_local_experts=16"),
    ("DeepseekV2ForCausalLM", {"topk_method": "group_limited_greedy", "n_group": 8},
     "DeepseekV2ForCausalLM.*topk_method='group_limited_greedy'"),
    ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 32, "use_sliding_window": True},
     "Qwen3MoeForCausalLM.*use_sliding_window"),
    ("MixtralForCausalLM", {"num_local_experts": 8, "sliding_window": 4096},
     "MixtralForCausalLM.*sliding_window=4096"),
    ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 9,
                             "moe_intermediate_size": 32}, "num_experts_per_tok=9"),
])
def test_unsupported_moe_refused(arch, extra, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict({"architectures": [arch], **_BASE, **extra})


def test_deepseek_router_options_we_lack_refused():
    base = {**_BASE, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(ConfigError, match="topk_method='greedy'"):
        deepseek_v3_moe_config({**base, "topk_method": "greedy"})
    with pytest.raises(ConfigError, match="scoring_func='softmax'"):
        deepseek_v3_moe_config({**base, "scoring_func": "softmax"})


def test_checkpoint_missing_an_expert(checkpoints, tmp_path):
    _, path, _ = checkpoints("mixtral")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(SeerError, match=r"layer 1 tensor 'we_down'.*missing \[5\]"):
        load_safetensors_dir(tmp_path)


@pytest.mark.parametrize("overlap", [True, False])
def test_routed_experts_equal_a_full_forward(checkpoints, overlap):
    """Per generated token and MoE layer, the expert ids the engine's router chose (at the
    position that produced the token) equal a full forward's over prompt + response."""
    from seer_jax.model.generate import full_routing

    _, path, _ = checkpoints("qwen3_moe")
    cfg, params = load_safetensors_dir(path)
    config = EngineConfig(num_pages=160, page_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                          max_prefill_seqs=2, overlap=overlap, return_routed_experts=True)
    engine = Engine(cfg, params, config, eos_ids=())
    prompts = PROMPTS[:4]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, 10, SamplingParams(
            temperature=0.0 if i % 2 else 1.0, seed=i, return_routed_experts=i != 3))
    done = engine.run_until_done()
    assert done["3"].routed_experts is None
    for i, p in enumerate(prompts[:3]):
        out = done[str(i)]
        ids = np.asarray(out.routed_experts)
        assert ids.shape == (10, 2, 2)  # tokens, MoE layers, experts per token
        seq = np.array([p + out.token_ids[:-1]])
        want = np.asarray(full_routing(params, cfg, seq))[0, len(p) - 1:]
        assert np.array_equal(np.sort(ids, -1), np.sort(want, -1)), i


def test_routed_experts_refused_where_unavailable(checkpoints):
    from seer_jax.errors import InputError

    cfg = tiny_config()
    with pytest.raises(ConfigError, match="no mixture-of-experts"):
        Engine(cfg, init_params(cfg), EngineConfig(num_pages=16, return_routed_experts=True))
    _, path, _ = checkpoints("qwen3_moe")
    moe_cfg, params = load_safetensors_dir(path)
    engine = Engine(moe_cfg, params, EngineConfig(num_pages=16))
    with pytest.raises(InputError, match="return_routed_experts needs an engine"):
        engine.add_request("a", [1, 2], 4, SamplingParams(return_routed_experts=True))


def test_parameter_counts_and_cost_spec():
    """Qwen3-30B-A3B's published sizes: 30.5B parameters, 3.3B active (ours counts both the
    embedding and the LM head among the active ones: 3.35B)."""
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
          "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
          "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
          "moe_intermediate_size": 768, "norm_topk_prob": True, "tie_word_embeddings": False}
    cfg = ModelConfig.from_hf_dict(hf, dtype="bfloat16")
    assert round(cfg.num_params() / 1e9, 1) == 30.5
    assert round(cfg.num_params(active=True) / 1e9, 2) == 3.35
    spec = cfg.cost_spec()
    assert spec.is_moe and spec.active_params == cfg.num_params(active=True)
    # what every token uses: all but the 48 x 128 routed experts
    assert spec.total_params - spec.shared_params == 48 * 128 * 3 * 2048 * 768
