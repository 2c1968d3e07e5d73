"""Cost model: roofline behaviour, presets, KV capacity, calibrated profiles."""

import json

import numpy as np
import pytest

from seer_jax.costs import (
    ACCELERATORS,
    MODELS,
    AcceleratorSpec,
    ProfileCostModel,
    RooflineCostModel,
    StepProfile,
    expected_distinct_experts,
    get_accelerator,
    get_model,
    profile_from_cost_model,
    spec_from_hf_config,
)
from seer_jax.errors import ConfigError


def _roofline(model="llama-3-8b", acc="h100", **kw):
    return RooflineCostModel(get_model(model), get_accelerator(acc), **kw)


def test_presets_cover_the_issue_list():
    for name in ["tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "h800", "h200"]:
        a = get_accelerator(name)
        assert a.peak_flops > 1e14 and a.hbm_bytes_per_s > 5e11 and a.hbm_bytes > 1e10
    assert get_accelerator("V5P") is ACCELERATORS["tpu-v5p"]
    for name in ["smollm2-135m", "llama-3-8b", "qwen2.5-7b", "moonlight-16b-a3b", "qwen2-vl-72b",
                 "kimi-k2"]:
        assert name in MODELS
    # GQA KV bytes/token: Llama-3-8B = 2 (K,V) * 32 layers * 8 heads * 128 dims * 2 bytes.
    assert get_model("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert get_model("smollm2").kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert get_model("kimi-k2").is_moe and not get_model("qwen2.5-7b").is_moe


def test_unknown_names_raise_clear_errors():
    with pytest.raises(ConfigError, match="unknown accelerator 'tpu-v9'"):
        get_accelerator("tpu-v9")
    with pytest.raises(ConfigError, match="unknown model"):
        get_model("gpt-17")


def test_negative_bandwidth_and_bad_fractions_rejected():
    bad = AcceleratorSpec("x", 1e14, -5.0, 1e10)
    with pytest.raises(ConfigError, match="hbm_bytes_per_s"):
        RooflineCostModel(get_model("smollm2"), bad)
    with pytest.raises(ConfigError, match="mbu"):
        _roofline(mbu=0.0)
    with pytest.raises(ConfigError, match="chips"):
        _roofline(chips=0)


def test_decode_is_memory_bound_and_weights_amortise():
    cm = _roofline()
    t1 = cm.spec_step_time(1, 0, 1024)
    t64 = cm.spec_step_time(64, 0, 64 * 1024)
    # weights dominate at small batch: 64x the batch costs far less than 64x the time
    assert t1 < t64 < 8 * t1
    # more context to read costs more
    assert cm.spec_step_time(8, 0, 8 * 32768) > cm.spec_step_time(8, 0, 8 * 1024)
    # a step time is overhead + max(memory, compute): check against hand-computed memory time
    m = get_model("llama-3-8b")
    acc = get_accelerator("h100")
    mem = (m.total_params * 2 + 1024 * m.kv_bytes_per_token) / (acc.hbm_bytes_per_s * cm.mbu)
    assert t1 == pytest.approx(cm.step_overhead_s + cm.per_seq_overhead_s + mem, rel=1e-9)


def test_chips_speed_up_steps():
    assert _roofline(chips=4).spec_step_time(32, 0, 32 * 4096) < _roofline(chips=1).spec_step_time(
        32, 0, 32 * 4096)


def test_speculation_is_cheap_at_small_batch_and_costly_at_large():
    cm = _roofline()
    small = cm.spec_step_time(2, 4, 2 * 4096) / cm.spec_step_time(2, 0, 2 * 4096)
    large = cm.spec_step_time(512, 4, 512 * 256) / cm.spec_step_time(512, 0, 512 * 256)
    assert small < 1.05
    assert large > 2.0


def test_moe_reads_fewer_weights_at_small_batch():
    cm = _roofline("moonlight", "h800", chips=8)
    assert cm.weight_bytes_read(1) < 0.5 * cm.weight_bytes_read(4096)
    assert cm.weight_bytes_read(100000) == pytest.approx(get_model("moonlight").total_params * 2,
                                                         rel=1e-3)


def test_kv_capacity():
    cm = _roofline(memory_utilization=0.9, page_size=16)
    m, acc = get_model("llama-3-8b"), get_accelerator("h100")
    expect = int((acc.hbm_bytes * 0.9 - m.total_params * 2) // m.kv_bytes_per_token)
    assert cm.kv_capacity_tokens() == expect
    assert cm.kv_capacity_pages() == expect // 16
    # replicated KV halves capacity
    assert _roofline(kv_replicas=2).kv_capacity_tokens() == pytest.approx(expect / 2, abs=1)
    with pytest.raises(ConfigError, match="does not fit"):
        _roofline("qwen2-vl-72b", "tpu-v5e").kv_capacity_tokens()
    # expert parallelism makes a 1T MoE fit one GPU
    assert _roofline("kimi-k2", "h800", expert_parallel=256).kv_capacity_tokens() > 100_000


def test_profile_fit_reproduces_a_roofline_grid(tmp_path):
    cm = _roofline("smollm2", "h100")
    prof = profile_from_cost_model(cm, model="smollm2")
    path = tmp_path / "profile.json"
    prof.save(path)
    loaded = StepProfile.load(path)
    pcm = ProfileCostModel(loaded, kv_capacity_tokens_=100_000)
    # at grid points and between them within 15%
    for b, g, ctx in [(8, 0, 4096), (16, 2, 512), (48, 0, 2000), (100, 1, 10000), (3, 0, 700)]:
        want = cm.spec_step_time(b, g, b * ctx)
        got = pcm.spec_step_time(b, g, b * ctx)
        assert got == pytest.approx(want, rel=0.15), (b, g, ctx)
    # monotone in batch size and context
    assert pcm.spec_step_time(64, 0, 64 * 1000) > pcm.spec_step_time(8, 0, 8 * 1000)
    assert pcm.spec_step_time(8, 0, 8 * 30000) > pcm.spec_step_time(8, 0, 8 * 1000)


def test_profile_minimal_grid_and_defaults():
    # A T(B, gamma) grid with only batch_size / gamma / step_s given.
    d = {"points": [{"batch_size": b, "gamma": g, "step_s": 0.01 + 0.001 * b * (1 + g)}
                    for b in (1, 4, 16) for g in (0, 2)]}
    prof = StepProfile.from_dict(d)
    assert prof.t_sd(4, 2) == pytest.approx(0.01 + 0.001 * 12, rel=1e-6)
    assert prof.t_sd(8, 0) == pytest.approx(0.018, rel=1e-6)  # interpolated
    assert prof.t_sd(64, 0) == pytest.approx(0.074, rel=1e-6)  # extrapolated along the last slope


def test_profile_errors(tmp_path):
    with pytest.raises(ConfigError, match="no points"):
        StepProfile.from_dict({"points": []})
    with pytest.raises(ConfigError, match="needs batch_size"):
        StepProfile.from_dict({"points": [{"gamma": 0, "step_s": 0.1}]})
    with pytest.raises(ConfigError, match="step_s"):
        StepProfile.from_dict({"points": [{"batch_size": 1, "step_s": -1.0}]})
    with pytest.raises(ConfigError, match="schema"):
        StepProfile.from_dict({"schema": "other/v9", "points": [{"batch_size": 1, "step_s": 1}]})
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        StepProfile.load(p)
    with pytest.raises(ConfigError, match="not found"):
        StepProfile.load(tmp_path / "missing.json")
    json.dumps(StepProfile.from_dict({"points": [{"batch_size": 1, "step_s": 1}]}).to_dict())


def test_profile_from_executed_steps_keeps_mean_step_time():
    # rows as EngineInstance.step_log records them: batch, prefill, decode, kv read, seconds
    rows = [(4, 0, 4, 300, 0.010), (4, 0, 4, 310, 0.030),  # same bucket: mean 0.020
            (4, 0, 4, 900, 0.040),                          # other KV bucket
            (2, 64, 1, 100, 0.050), (8, 0, 8, 0, 0.0)]       # zero duration: skipped
    prof = StepProfile.from_steps(rows, model="m", kv_bucket=256)
    pts = {(p.batch_size, p.num_tokens, p.kv_tokens // 256): p for p in prof.points}
    assert len(prof.points) == 3
    assert pts[(4, 4, 1)].step_s == pytest.approx(0.020)
    assert pts[(4, 4, 1)].kv_tokens == 305
    assert pts[(2, 65, 0)].num_tokens == 65  # prefill and decode tokens of a step add up
    assert prof.predict(4, 4, 900) > prof.predict(4, 4, 305)  # more KV read, slower
    with pytest.raises(ConfigError, match="no executed steps"):
        StepProfile.from_steps([(8, 0, 8, 0, 0.0)])


def test_profile_fit_is_isotonic_and_keeps_the_total_of_noisy_steps():
    # decode steps of batch 1..8 whose true time is 10 ms + 1 ms per token, with one noisy slow
    # level (batch 3) measured rarely: it must not lift every larger level (no running max)
    rng = np.random.default_rng(0)
    rows = []
    for b in range(1, 9):
        n_steps = 2 if b == 3 else 50
        for _ in range(n_steps):
            slow = 0.05 if b == 3 else 0.0
            rows.append((b, 0, b, 0, 0.010 + 0.001 * b + slow + rng.normal(0, 1e-4)))
    prof = StepProfile.from_steps(rows)
    assert prof.predict(8, 8, 0) == pytest.approx(0.018, rel=0.05)
    preds = [prof.predict(b, b, 0) for b in range(1, 9)]
    assert preds == sorted(preds)
    total = sum(r[4] for r in rows)
    assert sum(prof.predict(r[0], r[1] + r[2], r[3]) for r in rows) == pytest.approx(total, rel=0.02)


def test_distinct_experts_match_a_monte_carlo():
    rng = np.random.default_rng(0)
    for e, k, b in [(128, 8, 1), (128, 8, 16), (64, 6, 4), (384, 8, 64)]:
        # each token picks k distinct experts of e: the k smallest of e uniform draws
        picks = np.argsort(rng.random((400, b, e)), axis=-1)[..., :k]
        hit = np.zeros((400, e), dtype=bool)
        np.put_along_axis(hit, picks.reshape(400, b * k), True, axis=1)
        mc = hit.sum(axis=1).mean()
        assert expected_distinct_experts(e, k, b) == pytest.approx(mc, rel=0.02), (e, k, b)
    assert expected_distinct_experts(128, 8, 1) == 8
    assert expected_distinct_experts(128, 8, 10**6) == pytest.approx(128)


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9),
    ("moonlight-16b-a3b", 16e9, 3e9), ("kimi-k2", 1.04e12, 32.6e9)])
def test_moe_params_from_shapes_match_published_totals(name, total, active):
    m = get_model(name)
    # published totals are rounded (Moonlight "16B / 3B", Kimi-K2 "1.04T / 32.6B")
    assert m.total_params == pytest.approx(total, rel=0.03)
    assert m.active_params == pytest.approx(active, rel=0.04)
    assert m.shared_params < m.active_params < m.total_params
    routed = m.num_moe_layers * m.num_experts * m.params_per_expert
    assert m.total_params - m.shared_params == pytest.approx(routed, rel=1e-12)


def test_mla_cache_and_attention_flops():
    k2 = get_model("kimi-k2")
    assert k2.kv_bytes_per_token == 61 * (512 + 64) * 2  # latent + RoPE key, bf16
    # absorbed MLA, per pair and head: 576-wide scores, 512-wide weighted sum
    assert k2.attn_flops_per_pair == 2 * 61 * 64 * (576 + 512)
    assert get_model("qwen3-30b-a3b").kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    hf = {"model_type": "deepseek_v3", "num_hidden_layers": 27, "hidden_size": 2048,
          "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
          "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
          "moe_intermediate_size": 1408, "intermediate_size": 11264,
          "first_k_dense_replace": 1, "vocab_size": 163840}
    assert spec_from_hf_config(hf, "moonlight-16b-a3b") == get_model("moonlight")
    with pytest.raises(ConfigError, match="model_type 'gpt_oss'"):
        spec_from_hf_config({"model_type": "gpt_oss"})


@pytest.mark.parametrize("name, ep", [("kimi-k2", 256), ("kimi-k2", 1), ("qwen3-30b-a3b", 1),
                                      ("moonlight", 1)])
def test_moe_weight_reads_and_step_time_grow_with_batch(name, ep):
    cm = _roofline(name, "h800", chips=1 if ep > 1 else 8, expert_parallel=ep)
    m = cm.model
    # one token (ep = 1) reads the shared weights and exactly k experts per MoE layer
    if ep == 1:
        assert cm.weight_bytes_read(1) == pytest.approx(m.active_params * 2, rel=1e-12)
    reads = [cm.weight_bytes_read(b) for b in (1, 2, 8, 64, 512, 4096)]
    assert reads == sorted(reads) and reads[-1] <= cm.weight_bytes_stored() * (1 + 1e-12)
    times = [cm.spec_step_time(b, 0, b * 4096) for b in (1, 2, 4, 16, 64, 128, 256, 512)]
    assert all(a < b for a, b in zip(times, times[1:], strict=False)), times


def test_expert_dispatch_activations_counted_per_token():
    """A MoE step also moves the dispatch's activations: per token and MoE layer, k pairs of 9
    hidden-wide and 6 expert-hidden-wide rows in the model's dtype and the float32 sum; a dense
    model moves none. The engine's model config gives the same figure as the published shapes."""
    from seer_jax.model.config import tiny_config
    from seer_jax.model.moe_config import MoeConfig

    cm = _roofline("qwen3-30b-a3b", "h100")
    m = cm.model
    per_token = 48 * (8 * (9 * 2048 + 6 * 768) * 2 + 4 * 2048)
    assert m.expert_activation_bytes_per_token == per_token
    for tokens, kv in ((1, 8192), (2048, 2048)):
        assert cm.step_bytes(tokens, kv) - cm.weight_bytes_read(tokens) - kv * m.kv_bytes_per_token \
            == pytest.approx(tokens * per_token, rel=1e-12)
    assert get_model("llama-3-8b").expert_activation_bytes_per_token == 0
    moe = MoeConfig(num_experts=16, num_experts_per_tok=2, expert_intermediate_size=24)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_layers=3, moe=moe)
    spec = cfg.cost_spec()
    d = cfg.hidden_size
    assert spec.expert_activation_bytes_per_token == 3 * (2 * (9 * d + 6 * 24) * 4 + 4 * d)
