"""Deployment configs (`configs/*.py`): schema, defaults and a device-free validation.

A deployment config says which model runs, how the rollout mesh is cut into instances
(`num_instances` slices of `tp` devices), the engine settings of every slice, the scheduling policy
and controller settings, sampling, and the trainer settings of the GRPO example. `validate_config` checks
the mesh arithmetic and the memory budget per device from the model's dimensions alone, so a
TPU-pod config can be checked on a laptop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from seer_jax.costs import GIB, get_accelerator
from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import ConfigError
from seer_jax.model.config import ARCHITECTURES, ModelConfig
from seer_jax.model.llama import LOGICAL_AXES, param_shapes
from seer_jax.model.mla_config import MlaConfig, YarnScaling
from seer_jax.model.moe_config import MoeConfig
from seer_jax.model.sharding import ShardingRules
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig
from seer_jax.rollout.core.controller_config import ControllerConfig
from seer_jax.rollout.core.policies import CATALOG, default_policy_options

PLATFORMS = ("cpu", "gpu", "tpu")
MODEL_DIM_KEYS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps",
                  "tie_word_embeddings", "max_position_embeddings", "dtype")


def default_config() -> ml_collections.ConfigDict:
    """The schema with CPU-demo defaults (a tiny random model on 4 fake CPU devices)."""
    c = ml_collections.ConfigDict()
    c.name = "demo"
    c.platform = "cpu"
    c.model = ml_collections.ConfigDict(dict(
        name="tiny",  # "tiny" (random init), "smollm2", a .gguf / HF dir / Orbax path
        architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=512,
        dtype="float32"))
    c.mesh = ml_collections.ConfigDict(dict(
        num_instances=2, tp=2, devices=4,
        hbm_gib_per_device=0.0,  # 0: do not check the memory budget (CPU)
        chip="",  # the accelerator (v5e, v5p, v6e, h100, h200): what `check-deploy --compile`
                  # compiles the step for; "" on CPU
    ))
    c.engine = ml_collections.ConfigDict(dict(
        page_size=16, num_pages=256, kv_memory_gib=0.0, max_num_seqs=32,
        max_num_batched_tokens=128, max_prefill_seqs=4, max_model_len=0,
        speculation=False))  # grouped speculative decoding
    # the grouped draft service with backend kind "ray": shard actors (groups hashed over them);
    # each engine actor drafts from a local replica, pushing and pulling every sync_every_steps
    # steps and waiting for a pull only once it is max_stale_steps steps old
    c.draft_service = ml_collections.ConfigDict(dict(shards=1, max_stale_steps=1,
                                                     sync_every_steps=1, pull_timeout_s=30.0))
    c.policies = "seer"  # the scheduling policy (one name)
    c.controller = ml_collections.ConfigDict(dataclasses.asdict(ControllerConfig(chunk_size=64)))
    c.policy = default_policy_options()  # policy.<name>.<option>
    # where instances run: "inprocess" (mesh slices of one process) or "ray" (one Ray actor and
    # one placement-group bundle per slice host; a slice spans hosts_per_slice hosts under
    # jax.distributed; see docs/deployment.md)
    c.backend = ml_collections.ConfigDict(dict(
        kind="inprocess", ray_address="", resource="CPU", strategy="SPREAD", step_timeout_s=600.0,
        hosts_per_slice=1, pipeline_depth=2))
    c.sampling = ml_collections.ConfigDict(dict(
        group_size=4, max_tokens=16, max_prompt_length=32, temperature=1.0, top_p=1.0, top_k=0))
    c.trainer = ml_collections.ConfigDict(dict(
        num_steps=30, batch_size=4, learning_rate=1e-2, beta=0.0, seed=0))
    return c


def moe_config(c: ml_collections.ConfigDict) -> MoeConfig | None:
    """The mixture-of-experts MLP of config.model.moe (MoeConfig's fields; a tuple for
    dense_layers), or None when the model has none (the key absent or empty)."""
    moe = c.model.get("moe")
    if not moe:
        return None
    known = {f.name for f in dataclasses.fields(MoeConfig)}
    values = moe.to_dict()
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"config.model.moe has unknown key(s) {unknown}; allowed: {sorted(known)}")
    values["dense_layers"] = tuple(values.get("dense_layers", ()))
    return MoeConfig(**values)


def mla_config(c: ml_collections.ConfigDict) -> MlaConfig | None:
    """The multi-head latent attention of config.model.mla (MlaConfig's fields; `yarn` a dict of
    YarnScaling's fields or None), or None when the model has none (the key absent or empty)."""
    mla = c.model.get("mla")
    if not mla:
        return None
    values = mla.to_dict()
    _check_keys(values, MlaConfig, "config.model.mla")
    yarn = values.get("yarn")
    if yarn:
        _check_keys(yarn, YarnScaling, "config.model.mla.yarn")
        values["yarn"] = YarnScaling(**yarn)
    else:
        values["yarn"] = None
    cfg = MlaConfig(**values)
    try:
        cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"config.model.mla: {e}") from None
    return cfg


def _check_keys(values: dict, cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {unknown}; allowed: {sorted(known)}")


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
    """The ModelConfig the config's model dimensions describe (config.model.moe: its
    mixture-of-experts MLP, `MoeConfig`'s fields; config.model.mla: its latent attention,
    `MlaConfig`'s fields)."""
    m = c.model
    values = {k: m[k] for k in MODEL_DIM_KEYS}
    values["moe"] = moe_config(c)
    values["mla"] = mla_config(c)
    values["eos_token_ids"] = tuple(m.get("eos_token_ids", ()))
    # what the architecture implies unless the config says otherwise (Qwen2: q/k/v biases;
    # Qwen3: q/k norms), as a checkpoint's config.json would
    bias, norm = ARCHITECTURES.get(m.architecture, (False, False))
    values["qkv_bias"] = bool(m.get("qkv_bias", bias))
    values["qk_norm"] = bool(m.get("qk_norm", norm))
    try:
        return ModelConfig(**values)
    except ConfigError as e:
        raise ConfigError(f"config.model: {e}") from None


def engine_config(c: ml_collections.ConfigDict) -> EngineConfig:
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(c.engine.keys()) - known)
    if unknown:
        raise ConfigError(f"config.engine has unknown key(s) {unknown}; allowed: {sorted(known)}")
    values = c.engine.to_dict()
    if values.get("kv_memory_gib") == 0.0:
        values.pop("kv_memory_gib")
        if not values.get("num_pages"):
            raise ConfigError("config.engine: set num_pages or kv_memory_gib (both are 0)")
    e = EngineConfig(**values)
    e.validate()
    return e


def weight_bytes_per_device(cfg: ModelConfig, tp: int, rules: ShardingRules = ShardingRules()) -> int:
    """Parameter bytes on one device of a tp slice under our sharding rules (replicated where a
    dimension does not divide)."""
    itemsize = 4 if cfg.dtype == "float32" else 2
    total = 0
    for name, shape in param_shapes(cfg).items():
        n = 1
        for size, axis in zip(shape, LOGICAL_AXES[name], strict=True):
            split = rules.mesh_axis(axis) == "tp" and tp > 1 and size % tp == 0
            n *= size // tp if split else size
        total += n * itemsize
    return total


def weight_bytes_read_per_device(cfg: ModelConfig, tp: int, batch: int,
                                 rules: ShardingRules = ShardingRules()) -> float:
    """Parameter bytes one device reads in a decode step of `batch` tokens: every weight, but
    of the routed experts only those the batch is expected to hit, E * (1 - (1 - k/E)^batch) of
    E (tokens routed independently and uniformly; at batch 128 and top-8 of 128, all but 0.03%)."""
    total = weight_bytes_per_device(cfg, tp, rules)
    if cfg.moe is None:
        return float(total)
    m = cfg.moe
    itemsize = 4 if cfg.dtype == "float32" else 2
    ep = tp if tp > 1 and m.num_experts % tp == 0 else 1
    experts = (cfg.num_moe_layers * m.num_experts // ep * 3 * cfg.hidden_size
               * m.expert_intermediate_size * itemsize)
    hit = 1.0 - (1.0 - m.num_experts_per_tok / m.num_experts) ** batch
    return total - experts + experts * hit


def validate_config(c: ml_collections.ConfigDict, num_devices: int | None = None) -> dict[str, Any]:
    """Check a deployment config without devices; returns a summary of the layout.

    Raises ConfigError naming the key, its value and what is allowed. `num_devices`: the devices
    actually present (jax.device_count()), checked against config.mesh.devices when given.
    """
    def bad(key: str, value: Any, allowed: str):
        raise ConfigError(f"config.{key}={value!r} is invalid; allowed: {allowed}")

    if c.platform not in PLATFORMS:
        bad("platform", c.platform, ", ".join(PLATFORMS))
    cfg = model_config(c)
    mesh = c.mesh
    for key in ("num_instances", "tp", "devices"):
        v = mesh[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            bad(f"mesh.{key}", v, "a positive integer")
    n, tp, devices = mesh.num_instances, mesh.tp, mesh.devices
    if n * tp != devices:
        bad("mesh.devices", devices, f"num_instances x tp = {n} x {tp} = {n * tp}")
    if num_devices is not None and num_devices != devices:
        bad("mesh.devices", devices, f"the {num_devices} devices present")
    if cfg.num_heads % tp:
        bad("mesh.tp", tp, f"a divisor of the model's num_heads={cfg.num_heads}")
    if cfg.intermediate_size % tp and cfg.num_moe_layers < cfg.num_layers:
        bad("mesh.tp", tp, f"a divisor of the model's intermediate_size={cfg.intermediate_size}")
    if cfg.moe is not None and cfg.moe.num_experts % tp:
        # expert parallelism: whole experts per device, over the slice's tp devices
        bad("mesh.tp", tp, f"a divisor of the model's moe.num_experts={cfg.moe.num_experts}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        bad("mesh.tp", tp, f"a divisor or multiple of the model's num_kv_heads={cfg.num_kv_heads}")
    eng = engine_config(c)
    CATALOG.check(c.policies, "policies")
    CATALOG.check_options(c.policy.to_dict(), "policy")
    try:
        ControllerConfig.from_mapping(c.controller.to_dict())
    except ConfigError as e:
        raise ConfigError(f"config.controller.{e}") from None
    s = c.sampling
    if not isinstance(s.group_size, int) or s.group_size < 2:
        bad("sampling.group_size", s.group_size, "an integer >= 2 (GRPO compares samples of a group)")
    if not isinstance(s.max_tokens, int) or s.max_tokens < 1:
        bad("sampling.max_tokens", s.max_tokens, "a positive integer")
    if not isinstance(s.max_prompt_length, int) or s.max_prompt_length < 1:
        bad("sampling.max_prompt_length", s.max_prompt_length, "a positive integer")
    if not s.temperature >= 0:
        bad("sampling.temperature", s.temperature, ">= 0 (0 = greedy)")
    if not 0 < s.top_p <= 1:
        bad("sampling.top_p", s.top_p, "in (0, 1]")
    if not isinstance(s.top_k, int) or s.top_k < 0:
        bad("sampling.top_k", s.top_k, "an integer >= 0 (0 = off)")
    context = eng.max_model_len or cfg.max_position_embeddings
    if s.max_prompt_length + s.max_tokens > context:
        bad("sampling.max_tokens", s.max_tokens,
            f"max_prompt_length + max_tokens <= the context of {context}")
    per_device = weight_bytes_per_device(cfg, tp)
    kv_gib = (eng.num_pages * eng.page_size * cfg.kv_bytes_per_token() / 2**30 if eng.num_pages
              else eng.kv_memory_gib)
    # the KV heads split over tp; fewer heads than tp: each repeated over tp / heads devices
    # (one head per device, `attention_backend.make_plan`); MLA's latent rows are shared by every
    # head, each device holds them all
    hkv = cfg.num_kv_heads
    if cfg.mla is not None:
        # TPU HBM tiles a row's lanes by 128: 576 latent values occupy 640
        width = cfg.mla.cache_width
        kv_per_device = kv_gib * (-(-width // 128) * 128 / width if c.platform == "tpu" else 1)
    else:
        kv_per_device = kv_gib / (tp if hkv % tp == 0 else hkv if tp % hkv == 0 else 1)
    hbm = float(mesh.hbm_gib_per_device)
    chip = mesh.get("chip", "")
    if chip:
        try:
            spec = get_accelerator(chip)
        except ConfigError as e:
            raise ConfigError(f"config.mesh.chip: {e}") from None
        if hbm * GIB > spec.hbm_bytes:
            bad("mesh.hbm_gib_per_device", hbm,
                f"at most the {spec.hbm_bytes / GIB:.0f} GiB of HBM of mesh.chip={chip!r}")
    need = per_device / 2**30 + kv_per_device
    if hbm > 0 and need > hbm:
        bad("engine.kv_memory_gib" if kv_per_device > 0 else "mesh.tp",
            eng.kv_memory_gib if kv_per_device > 0 else tp,
            f"weights {per_device / 2**30:.2f} GiB + KV {kv_per_device:.2f} GiB per device must fit "
            f"mesh.hbm_gib_per_device={hbm}")
    backend = validate_backend(c)
    draft = draft_service_config(c)
    t = c.trainer
    for key in ("num_steps", "batch_size"):
        if not isinstance(t[key], int) or t[key] < 1:
            bad(f"trainer.{key}", t[key], "a positive integer")
    if not t.learning_rate > 0:
        bad("trainer.learning_rate", t.learning_rate, "> 0")
    return {
        "devices": devices, "num_instances": n, "tp": tp,
        "weight_gib_per_device": per_device / 2**30, "kv_gib_per_device": kv_per_device,
        "kv_layout": "latent" if cfg.mla is not None else "k/v",
        "kv_tokens_per_instance": int(kv_gib * 2**30 // cfg.kv_bytes_per_token()),
        "responses_per_step": t.batch_size * s.group_size,
        "backend": c.backend.kind, "ray_bundles": backend,
        "draft_service_shards": draft.shards if eng.speculation and c.backend.kind == "ray" else 0,
    }


def draft_service_config(c: ml_collections.ConfigDict):
    """The `SyncConfig` of config.draft_service (ConfigError naming the key when bad)."""
    from seer_jax.drafting.replicated import SyncConfig

    return SyncConfig.from_mapping(c.draft_service.to_dict(), "config.draft_service.")


PLATFORM_RESOURCE = {"cpu": "CPU", "gpu": "GPU", "tpu": "TPU"}


def validate_backend(c: ml_collections.ConfigDict) -> list[dict[str, float]]:
    """Check config.backend; returns the Ray placement-group bundles (one per slice host; [] for
    the in-process backend)."""
    b = c.backend
    if b.kind not in ("inprocess", "ray"):
        raise ConfigError(f"config.backend.kind={b.kind!r} is invalid; allowed: inprocess, ray")
    if b.kind == "inprocess":
        return []
    hosts = b.hosts_per_slice
    try:
        ray_cfg = RayBackendConfig(address=b.ray_address, resource=b.resource, strategy=b.strategy,
                                   step_timeout_s=b.step_timeout_s,
                                   hosts_per_slice=hosts,
                                   pipeline_depth=b.get("pipeline_depth", 2)).validate()
    except ConfigError as e:
        raise ConfigError(f"config.backend.{e}".replace("ray ", "", 1)) from None
    if b.resource != PLATFORM_RESOURCE[c.platform]:
        raise ConfigError(f"config.backend.resource={b.resource!r} is invalid; allowed: "
                          f"{PLATFORM_RESOURCE[c.platform]!r} on platform {c.platform!r}")
    if c.mesh.tp % hosts:
        raise ConfigError(f"config.backend.hosts_per_slice={hosts!r} is invalid; allowed: a "
                          f"divisor of mesh.tp={c.mesh.tp} (each host holds tp / hosts_per_slice "
                          "devices of its slice)")
    return [ray_cfg.bundle(c.mesh.tp) for _ in range(c.mesh.num_instances * hosts)]
