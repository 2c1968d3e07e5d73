"""Multi-head latent attention in its absorbed form equals transformers' DeepSeek-V3 attention
(which expands keys and values per head): float32, tiny random weights, with and without a
query LoRA, YaRN scaling and interleaved RoPE."""

import numpy as np
import pytest

from seer_jax.errors import ConfigError
from seer_jax.model import mla
from seer_jax.model.config import ModelConfig, tiny_config
from seer_jax.model.mla_config import MlaConfig, YarnScaling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, max_position_embeddings=4096,
            vocab_size=128, num_hidden_layers=1, intermediate_size=64, moe_intermediate_size=16,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}


def hf_attention(**over):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    cfg = transformers.DeepseekV3Config(**{**BASE, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = m.DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():  # norms too, so that they matter
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.5) + (1.0 if p.ndim == 1 else 0))
    return cfg, attn, m.DeepseekV3RotaryEmbedding(cfg)


@pytest.mark.parametrize("over", [
    dict(q_lora_rank=None, rope_interleave=False),
    dict(q_lora_rank=24, rope_interleave=True),
    dict(q_lora_rank=24, rope_interleave=True, rope_parameters=YARN),
], ids=["plain", "q_lora_interleave", "yarn"])
def test_absorbed_attention_equals_transformers(over):
    hf_cfg, attn, rotary = hf_attention(**over)
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    assert (cfg.mla.yarn is not None) == ("rope_parameters" in over)
    T = 11
    pos = np.arange(100, 100 + T)  # past the original context: YaRN's ramp matters
    x = np.random.RandomState(1).randn(1, T, BASE["hidden_size"]).astype(np.float32)
    with torch.no_grad():
        xt, pt = torch.from_numpy(x), torch.from_numpy(pos)[None]
        mask = torch.triu(torch.full((T, T), float("-inf")), 1)[None, None]
        want = attn(xt, rotary(xt, pt), mask)[0][0].numpy()
    sd = {k: v.numpy() for k, v in attn.state_dict().items()}
    lp = {ours: sd[hf].T if t else sd[hf] for ours, (hf, t) in mla.hf_layer_tensors(cfg).items()}
    assert set(lp) == set(mla.layer_param_shapes(cfg))
    assert all(lp[k].shape == s for k, s in mla.layer_param_shapes(cfg).items())
    import jax.numpy as jnp

    got = mla.attention_dense(jnp.asarray(x[0]), {k: jnp.asarray(v) for k, v in lp.items()}, cfg,
                              jnp.asarray(pos), jnp.tril(jnp.ones((T, T), bool)))
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale, rtol=0)


def test_cache_width_and_yarn_scales_are_deepseek_v3s():
    cfg = tiny_config(num_heads=128, num_kv_heads=128, hidden_size=7168, head_dim=192,
                      mla=MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                    v_head_dim=128, q_lora_rank=1536,
                                    yarn=YarnScaling(40.0, 4096, 32, 1, 1.0, 1.0)))
    assert cfg.mla.cache_width == 576
    m = 0.1 * np.log(40.0) + 1
    assert mla.softmax_scale(cfg) == pytest.approx(192 ** -0.5 * m * m)
    assert mla.rope_tables(cfg)[1] == pytest.approx(1.0)  # mscale / mscale_all_dim


def test_unsupported_attention_options_are_refused_by_name():
    hf = transformers.DeepseekV3Config(**BASE).to_dict()
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig.from_hf_dict({**hf, "attention_bias": True})
    with pytest.raises(ConfigError, match="rope type 'longrope'"):
        ModelConfig.from_hf_dict({**hf, "rope_parameters": {"rope_type": "longrope",
                                                            "factor": 2.0}})
