"""Deployment configs: every top-level configs/*.py loads and validates without devices."""

import dataclasses
import pathlib

import pytest

from seer_jax.config_files import load_config_file
from seer_jax.errors import ConfigError
from seer_jax.integrations.deploy_config import (
    default_config,
    model_config,
    validate_config,
    weight_bytes_per_device,
)

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
FILES = sorted(CONFIG_DIR.glob("*.py"))


def test_config_files_exist():
    names = {f.stem for f in FILES}
    assert {"demo", "gpu_8xh200", "tpu_v5p64_qwen25_7b", "tpu_v6e32_llama3_8b"} <= names


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_file_loads_and_validates(path):
    c = load_config_file(path)
    summary = validate_config(c)
    assert summary["num_instances"] * summary["tp"] == c.mesh.devices
    if c.mesh.hbm_gib_per_device:
        assert summary["weight_gib_per_device"] + summary["kv_gib_per_device"] <= c.mesh.hbm_gib_per_device
    cfg = model_config(c)
    assert cfg.num_heads % c.mesh.tp == 0


def test_layouts_of_the_shipped_configs():
    expect = {"gpu_8xh200": (4, 2, 8), "tpu_v5p64_qwen25_7b": (8, 4, 32),
              "tpu_v6e32_llama3_8b": (8, 4, 32), "demo": (2, 2, 4)}
    for name, layout in expect.items():
        m = load_config_file(CONFIG_DIR / f"{name}.py").mesh
        assert (m.num_instances, m.tp, m.devices) == layout


def test_weight_bytes_follow_the_sharding_rules():
    c = load_config_file(CONFIG_DIR / "tpu_v6e32_llama3_8b.py")
    cfg = model_config(c)
    full = weight_bytes_per_device(cfg, 1)
    assert full == cfg.num_params() * 2  # bf16, nothing split
    # at tp4 everything but the norms is split 4 ways (embedding and LM head along the vocabulary)
    replicated = 2 * (cfg.hidden_size + 2 * cfg.num_layers * cfg.hidden_size)
    assert weight_bytes_per_device(cfg, 4) == replicated + (full - replicated) // 4
    # a vocabulary that does not divide tp stays replicated
    odd = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1)
    assert weight_bytes_per_device(odd, 4) - weight_bytes_per_device(cfg, 4) == (
        2 * 2 * (cfg.vocab_size + 1) * cfg.hidden_size - 2 * 2 * cfg.vocab_size * cfg.hidden_size // 4)


def test_configs_describe_the_real_model():
    """Qwen2.5 has q/k/v biases (its config.json says so through the architecture); a tied
    model has no LM head of its own."""
    qwen = model_config(load_config_file(CONFIG_DIR / "tpu_v5p64_qwen25_7b.py"))
    llama = model_config(load_config_file(CONFIG_DIR / "tpu_v6e32_llama3_8b.py"))
    assert qwen.qkv_bias and not qwen.qk_norm and not llama.qkv_bias
    tied = load_config_file(CONFIG_DIR / "demo.py", ["--config.model.tie_word_embeddings=True"])
    untied = load_config_file(CONFIG_DIR / "demo.py")
    cfg = model_config(untied)
    assert (weight_bytes_per_device(cfg, 1) - weight_bytes_per_device(model_config(tied), 1)
            == cfg.vocab_size * cfg.hidden_size * 4)


def test_chip_names_a_known_accelerator_and_bounds_the_hbm_budget():
    path = CONFIG_DIR / "tpu_v6e32_llama3_8b.py"
    with pytest.raises(ConfigError, match=r"config\.mesh\.chip: unknown accelerator 'v7x'; known"):
        validate_config(load_config_file(path, ["--config.mesh.chip=v7x"]))
    with pytest.raises(ConfigError, match=r"hbm_gib_per_device=40\.0 .*32 GiB of HBM of mesh.chip='v6e'"):
        validate_config(load_config_file(path, ["--config.mesh.hbm_gib_per_device=40.0"]))


@pytest.mark.parametrize("override, key", [
    (["--config.mesh.devices=16"], r"config\.mesh\.devices=16 .*num_instances x tp = 8 x 4 = 32"),
    (["--config.mesh.tp=8", "--config.mesh.devices=64"], r"config\.mesh\.tp=8 .*num_heads=28"),
    (["--config.engine.kv_memory_gib=900.0"], r"config\.engine\.kv_memory_gib=900\.0 .*hbm_gib_per_device"),
    (["--config.policies='fifo'"], r"config\.policies='fifo' is invalid; allowed: .*seer"),
    (["--config.controller.chunk_size=0"], r"config\.controller\.chunk_size=0"),
    (["--config.sampling.group_size=1"], r"config\.sampling\.group_size=1 .*>= 2"),
    (["--config.sampling.max_tokens=40000"], r"config\.sampling\.max_tokens=40000 .*context of 33792"),
    (["--config.engine.page_size=0"], r"page_size=0"),
])
def test_bad_values_name_key_value_and_allowed(override, key):
    c = load_config_file(CONFIG_DIR / "tpu_v5p64_qwen25_7b.py", override)
    with pytest.raises(ConfigError, match=key):
        validate_config(c)


def test_device_count_checked_when_given():
    c = default_config()
    assert validate_config(c, num_devices=4)["devices"] == 4
    with pytest.raises(ConfigError, match=r"mesh\.devices=4 .*the 8 devices present"):
        validate_config(c, num_devices=8)
    c.mesh.num_instances, c.mesh.tp, c.mesh.devices = 1, 3, 3
    with pytest.raises(ConfigError, match=r"mesh\.tp=3 .*num_heads=4"):
        validate_config(c)
    c = default_config()
    c.model.num_kv_heads = 3
    with pytest.raises(ConfigError, match=r"config\.model: .*num_kv_heads=3"):
        validate_config(c)


def test_pod_and_gpu_configs_run_on_ray_one_bundle_per_slice_host():
    v5p = validate_config(load_config_file(CONFIG_DIR / "tpu_v5p64_qwen25_7b.py"))
    assert v5p["backend"] == "ray" and v5p["ray_bundles"] == [{"TPU": 4.0}] * 8
    h200 = validate_config(load_config_file(CONFIG_DIR / "gpu_8xh200.py"))
    assert h200["backend"] == "ray" and h200["ray_bundles"] == [{"GPU": 2.0}] * 4
    assert validate_config(default_config())["ray_bundles"] == []


def test_multi_host_slices_get_one_bundle_per_host():
    c = load_config_file(CONFIG_DIR / "gpu_4x8xh100_llama31_405b.py")
    assert (c.mesh.num_instances, c.mesh.tp, c.backend.hosts_per_slice) == (2, 16, 2)
    assert validate_config(c)["ray_bundles"] == [{"GPU": 8.0}] * 4  # 2 slices x 2 hosts
    v5p = load_config_file(CONFIG_DIR / "tpu_v5p64_qwen25_7b.py",
                           ["--config.backend.hosts_per_slice=2"])
    assert validate_config(v5p)["ray_bundles"] == [{"TPU": 2.0}] * 16


@pytest.mark.parametrize("override, key", [
    (["--config.backend.kind=mpi"], r"config\.backend\.kind='mpi' is invalid; allowed: inprocess, ray"),
    (["--config.backend.resource=GPU"], r"config\.backend\.resource='GPU' is invalid; allowed: 'TPU' on platform 'tpu'"),
    (["--config.backend.strategy=RANDOM"], r"config\.backend\.strategy='RANDOM' is invalid; allowed: \['PACK'"),
    (["--config.backend.hosts_per_slice=3"], r"config\.backend\.hosts_per_slice=3 is invalid; allowed: a divisor of mesh\.tp=4"),
    (["--config.backend.hosts_per_slice=0"], r"config\.backend\.hosts_per_slice=0 is invalid; allowed: an integer >= 1"),
])
def test_bad_backend_values_name_key_value_and_allowed(override, key):
    c = load_config_file(CONFIG_DIR / "tpu_v5p64_qwen25_7b.py", override)
    with pytest.raises(ConfigError, match=key):
        validate_config(c)


def test_ray_configs_carry_the_draft_service_and_bad_values_name_the_key():
    h100 = validate_config(load_config_file(CONFIG_DIR / "gpu_4x8xh100_llama31_405b.py"))
    assert h100["draft_service_shards"] == 2
    assert validate_config(load_config_file(CONFIG_DIR / "gpu_8xh200.py"))["draft_service_shards"] == 1
    assert validate_config(default_config())["draft_service_shards"] == 0  # in process, no service
    for override, key in [
            (["--config.draft_service.shards=0"], r"config\.draft_service\.shards=0 is invalid: allowed: an integer >= 1"),
            (["--config.draft_service.max_stale_steps=-1"], r"config\.draft_service\.max_stale_steps=-1 is invalid"),
            (["--config.draft_service.sync_every_steps=0"], r"config\.draft_service\.sync_every_steps=0 is invalid")]:
        c = load_config_file(CONFIG_DIR / "tpu_v5p64_qwen25_7b.py", override)
        with pytest.raises(ConfigError, match=key):
            validate_config(c)


@pytest.mark.parametrize("name, preset", [
    ("tpu_v6e32_moonlight_16b_a3b", "moonlight-16b-a3b"), ("gpu_8xh100_moonlight_16b_a3b", "moonlight-16b-a3b"),
    ("tpu_v5p64_kimi_k2", "kimi-k2"), ("gpu_4x8xh200_kimi_k2", "kimi-k2")])
def test_latent_attention_configs_are_the_simulator_presets_models(name, preset):
    """The DeepSeek-V3-family configs describe the same model as the simulator's preset of that
    name: parameters (all and active), layers, heads and latent cache width; the cache is latent
    rows held whole on every device of a slice."""
    from seer_jax.costs import get_model

    c = load_config_file(CONFIG_DIR / f"{name}.py")
    cfg, spec = model_config(c), get_model(preset)
    assert cfg.mla is not None and cfg.moe is not None and cfg.moe.dense_layers == (0,)
    assert cfg.num_params() == spec.total_params
    assert cfg.num_params(active=True) == spec.active_params
    assert (cfg.num_layers, cfg.num_heads) == (spec.num_layers, spec.num_q_heads)
    assert cfg.mla.cache_width == spec.kv_elems_per_layer == 576
    summary = validate_config(c)
    # TPU HBM holds a 576-value row in 640 lanes: the memory check counts what the chip stores
    stored = c.engine.kv_memory_gib * (640 / 576 if c.platform == "tpu" else 1)
    assert summary["kv_layout"] == "latent"
    assert summary["kv_gib_per_device"] == pytest.approx(stored)


def test_latent_attention_keys_are_checked():
    c = load_config_file(CONFIG_DIR / "tpu_v5p64_kimi_k2.py")
    c.model.mla.kv_rank = 512
    with pytest.raises(ConfigError, match=r"config\.model\.mla has unknown key\(s\) \['kv_rank'\]"):
        validate_config(c)
    c = load_config_file(CONFIG_DIR / "tpu_v5p64_kimi_k2.py")
    c.model.mla.yarn.scale = 2.0
    with pytest.raises(ConfigError, match=r"config\.model\.mla\.yarn has unknown key\(s\) \['scale'\]"):
        validate_config(c)
    c = load_config_file(CONFIG_DIR / "tpu_v5p64_kimi_k2.py", ["--config.model.mla.qk_rope_head_dim=63"])
    with pytest.raises(ConfigError, match=r"config\.model\.mla: .*qk_rope_head_dim=63: must be even"):
        validate_config(c)



def test_deployment_models_are_named_once_and_unknown_names_are_refused():
    """Every shipped config of a model holds the same model fields (they come from one table),
    and a name not in it is refused with the known ones."""
    from seer_jax.integrations.deploy_models import MODELS, use_model

    pairs = [("tpu_v6e32_moonlight_16b_a3b", "gpu_8xh100_moonlight_16b_a3b"),
             ("tpu_v5p64_kimi_k2", "gpu_4x8xh200_kimi_k2"),
             ("tpu_v5p64_qwen3_30b_a3b", "gpu_8xh100_qwen3_30b_a3b"),
             ("tpu_v5p64_qwen3_235b_a22b", "gpu_8xh200_qwen3_235b_a22b")]
    for a, b in pairs:
        ma, mb = (load_config_file(CONFIG_DIR / f"{n}.py").model.to_dict() for n in (a, b))
        assert ma == mb
    assert len(pairs) == len(MODELS)
    with pytest.raises(ConfigError, match=r"unknown deployment model 'qwen3-8b'.*kimi-k2"):
        use_model(default_config(), "qwen3-8b")
