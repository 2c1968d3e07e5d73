"""Tunix's Llama3 / Qwen2 / Qwen3 classes mapped onto our decoder: same logits (f32, 1e-5 of the
logit scale), config read from the Tunix model, LoRA adapters merged on sync."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.errors import ConfigError
from seer_jax.integrations.weight_sync import state_to_params
from seer_jax.model.generate import full_forward
from tests.integrations.tunix_tiny import VOCAB, randomize, tunix_logits, tunix_model

pytest.importorskip("tunix")
pytestmark = pytest.mark.slow  # imports Tunix and qwix: make test runs these, test-fast does not

TOKENS = np.random.RandomState(0).randint(3, VOCAB, (2, 12))


def _ours(model, state=None):
    from flax import nnx

    from seer_jax.integrations.tunix_models import family_of, model_config_from_tunix

    fam = family_of(model)
    cfg = model_config_from_tunix(model)
    params = state_to_params(state if state is not None else nnx.state(model, nnx.Param), cfg,
                             fam.mapping)
    return cfg, params


@pytest.mark.parametrize("family,tied", [("llama3", False), ("llama3", True), ("qwen2", False),
                                         ("qwen2", True), ("qwen3", True), ("qwen3", False)])
def test_mapped_params_give_the_tunix_models_logits(family, tied):
    model = tunix_model(family, tied=tied)
    cfg, params = _ours(model)
    assert cfg.tie_word_embeddings == tied and ("lm_head" in params) != tied
    assert (cfg.qkv_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    want = tunix_logits(model, TOKENS)
    got = np.asarray(full_forward(params, cfg, jnp.asarray(TOKENS)))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_rope_base_is_the_one_the_tunix_module_applies():
    from seer_jax.integrations.tunix_models import model_config_from_tunix

    # tunix 0.1.7: Qwen2 passes config.rope_theta; Llama3 and Qwen3 call apply_rope without it,
    # so its default (1e6) applies whatever the config says
    assert model_config_from_tunix(tunix_model("qwen2")).rope_theta == 10_000
    for family in ("llama3", "qwen3"):
        model = tunix_model(family)
        cfg = model_config_from_tunix(model)
        assert cfg.rope_theta == 1_000_000
        # the configured base would give other logits: reading the applied one matters
        _, params = _ours(model)
        import dataclasses

        off = np.asarray(full_forward(params, dataclasses.replace(cfg, rope_theta=10_000.0),
                                      jnp.asarray(TOKENS)))
        assert np.abs(off - tunix_logits(model, TOKENS)).max() > 1e-3


def test_unknown_class_and_incomplete_moe_are_config_errors():
    from flax import nnx
    from tunix.models.qwen3 import model as q3

    from seer_jax.integrations.tunix_models import family_of, model_config_from_tunix

    assert family_of(object()) is None
    with pytest.raises(ConfigError, match="not a Tunix model class"):
        model_config_from_tunix(object())
    moe = q3.ModelConfig(num_layers=1, vocab_size=32, embed_dim=16, hidden_dim=8, num_heads=2,
                         head_dim=8, num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6,
                         num_experts=4, num_experts_per_tok=2)
    model = q3.Qwen3(moe, rngs=nnx.Rngs(0))
    model.config = dataclasses.replace(moe, num_experts_per_tok=None)
    with pytest.raises(ConfigError, match="num_experts=4 with num_experts_per_tok=None"):
        model_config_from_tunix(model)


def test_tunix_qwen3_moe_gives_the_tunix_models_logits():
    """Tunix's Qwen3 MoE (experts stacked [E, ...] per layer, all layers routed) mapped to our
    Qwen3MoeForCausalLM: the same logits, and the same with its experts held per expert."""
    from flax import nnx

    model = tunix_model("qwen3_moe")
    cfg, params = _ours(model)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.expert_intermediate_size,
            cfg.moe.norm_topk_prob) == (8, 2, 32, True)
    assert params["layers"]["we_gate"].shape == (2, 8, 64, 32)
    want = tunix_logits(model, TOKENS)
    got = np.asarray(full_forward(params, cfg, jnp.asarray(TOKENS)))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    # per-expert layout: {"<e>": kernel} under each expert tensor's name
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for layer in pure["layers"].values():
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer["mlp"][name] = {str(e): {"kernel": w} for e, w in enumerate(layer["mlp"][name])}
    _, per_expert = _ours(model, pure)
    for k, v in params["layers"].items():
        np.testing.assert_array_equal(np.asarray(per_expert["layers"][k]), np.asarray(v))
    # weight sync onto a 2-device slice: whole experts per device (expert parallelism)
    from jax.sharding import Mesh

    from seer_jax.integrations.weight_sync import params_on, reshard_params

    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    on_slice = reshard_params(params, mesh, cfg)
    assert params_on(on_slice, mesh)
    assert on_slice["layers"]["we_down"].sharding.shard_shape((2, 8, 32, 64)) == (2, 4, 32, 64)
    for k, v in params["layers"].items():
        np.testing.assert_array_equal(np.asarray(on_slice["layers"][k]), np.asarray(v))


def _lora_model(family="qwen2", alpha=8.0):
    import qwix
    from flax import nnx

    base = tunix_model(family)
    provider = qwix.LoraProvider(module_path=".*(q_proj|v_proj|o_proj|gate_proj|down_proj)",
                                 rank=4, alpha=alpha)
    model = qwix.apply_lora_to_model(base, provider, **base.get_model_input(), rngs=nnx.Rngs(1))
    randomize(model, 5, nnx.LoRAParam)  # qwix starts b at zero: make the adapters matter
    return base, model


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_lora_merge_gives_the_lora_models_logits(family):
    from flax import nnx

    from seer_jax.integrations.lora import has_lora, lora_scale_fn, merge_lora, qwix_lora_rules

    base, model = _lora_model(family)
    assert [r.alpha for r in qwix_lora_rules(model)] == [8.0]
    want = tunix_logits(model, TOKENS)
    assert np.abs(want - tunix_logits(base, TOKENS)).max() > 1e-2  # the adapters change the output
    full = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert has_lora(full)
    scale = lora_scale_fn(model)
    merged = merge_lora(full, scale)
    assert not has_lora(merged)
    cfg, params = _ours(model, merged)
    got = np.asarray(full_forward(params, cfg, jnp.asarray(TOKENS)))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    # what Tunix syncs under LoRA: the adapters alone, merged over the frozen base
    adapters = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
    base_only = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    again = merge_lora(adapters, scale, base=base_only)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(merged), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_lora_alpha_override_and_bad_adapters():
    from seer_jax.integrations.lora import lora_scale_fn, merge_lora

    w = jnp.ones((4, 6))
    a, b = jnp.ones((4, 2)), jnp.ones((2, 6))
    merged = merge_lora({"m": {"w": w, "w_lora_a": a, "w_lora_b": b}}, lora_scale_fn(None, 3.0))
    np.testing.assert_allclose(np.asarray(merged["m"]["w"]), 1.0 + 1.5 * 2.0)
    with pytest.raises(ConfigError, match="lora_alpha=0"):
        lora_scale_fn(None, 0)
    with pytest.raises(ConfigError, match="pass lora_alpha="):
        merge_lora({"m": {"w": w, "w_lora_a": a, "w_lora_b": b}}, lora_scale_fn(object()))
    with pytest.raises(ConfigError, match="m/w.*does not cover"):
        merge_lora({"m": {"w": w, "w_lora_a": a, "w_lora_b": jnp.ones((2, 5))}},
                   lora_scale_fn(None, 1.0))
    with pytest.raises(ConfigError, match="no base weight"):
        merge_lora({"m": {"w_lora_a": a, "w_lora_b": b}}, lora_scale_fn(None, 1.0))
