"""MLA configuration: Hugging Face fields, validation, and the latent cache's size."""

import pytest

from seer_jax.costs import get_model
from seer_jax.errors import ConfigError
from seer_jax.model.config import tiny_config
from seer_jax.model.mla_config import MlaConfig, mla_config_from_hf

# the attention fields of DeepSeek-V3's and Kimi-K2's config.json (Moonlight's: the same with
# q_lora_rank null)
DEEPSEEK_V3 = dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                   v_head_dim=128, num_hidden_layers=61)


def test_from_hf_and_cache_bytes():
    mla = mla_config_from_hf(DEEPSEEK_V3)
    assert mla == MlaConfig(512, 64, 128, 128, 1536)
    assert mla.cache_width == 576 and mla.qk_head_dim == 192
    assert mla.cache_bytes_per_token(61, 2) == 61 * 576 * 2
    assert mla_config_from_hf({**DEEPSEEK_V3, "q_lora_rank": None}).q_lora_rank is None


def test_model_config_counts_latent_rows():
    mla = MlaConfig(512, 64, 128, 128, 1536)
    cfg = tiny_config(num_layers=61, num_heads=64, num_kv_heads=64, head_dim=192, mla=mla,
                      dtype="bfloat16")
    # 576 values per token-layer instead of 2 x 64 heads x 192
    assert cfg.kv_bytes_per_token() == 61 * 576 * 2
    assert tiny_config(dtype="bfloat16").kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2
    spec = cfg.cost_spec("kimi-k2-like")
    preset = get_model("kimi-k2")
    assert spec.kv_bytes_per_token == preset.kv_bytes_per_token
    assert spec.kv_elems_per_layer == preset.kv_elems_per_layer


def test_bad_mla_fields_are_config_errors():
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        mla_config_from_hf({"qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128})
    with pytest.raises(ConfigError, match="qk_rope_head_dim=63"):
        mla_config_from_hf({**DEEPSEEK_V3, "qk_rope_head_dim": 63})
    with pytest.raises(ConfigError, match="v_head_dim=0"):
        tiny_config(mla=MlaConfig(512, 64, 128, 0))
