"""The simulator's config: schema and defaults (`default_config`), validation, and the builders
that turn a config into an accelerator, a cost model and a workload."""

from __future__ import annotations

import ml_collections

from seer_jax import costs as cm
from seer_jax.errors import ConfigError
from seer_jax.rollout.core.policies import CATALOG, PolicyCatalog, default_policy_options
from seer_jax.sim import workloads as wl


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "custom"
    c.seed = 0
    # Policies compared by `seer-jax simulate`; ratios are taken against `baseline`. The CLI
    # also accepts the analysis policies (oracle_lfs and friends), which the presets add.
    c.policies = "seer,group_round_robin,request_fcfs"
    c.baseline = "group_round_robin"

    w = c.workload = ml_collections.ConfigDict()
    w.preset = ""  # "moonlight" | "qwen2-vl-72b" | "kimi-k2": fills the fields below
    w.trace_path = ""  # JSONL trace to replay instead of the synthetic model
    w.trace_num_groups = 0  # >0: resample the trace's groups to this many
    # A replayed trace keeps its own max_tokens (its "max_tokens" field, else its longest
    # response); > 0 sets one explicitly (it must cover the trace's longest response).
    # workload.max_tokens is the synthetic length model's cap and does not apply to a trace.
    w.trace_max_tokens = 0
    w.num_prompts = 64
    w.group_size = 8
    w.max_tokens = 8192
    w.sigma = 1.1  # log-std of output lengths: tail heaviness
    w.icc = 0.6  # intra-group correlation of log lengths
    w.truncated_fraction = 0.02
    w.min_tokens = 16
    w.prompt_len = 512
    w.prompt_len_sigma = 0.5

    k = c.cluster = ml_collections.ConfigDict()
    k.num_instances = 4
    k.model = "moonlight-16b-a3b"
    k.accelerator = "h800"
    # Per-chip overrides of the accelerator preset (0 = use the preset).
    k.peak_tflops = 0.0
    k.hbm_gbps = 0.0
    k.hbm_gib = 0.0
    k.chips_per_instance = 8
    k.expert_parallel = 1
    k.kv_replicas = 1
    k.mfu = 0.5
    k.mbu = 0.8
    k.step_overhead_ms = 2.0
    k.per_seq_overhead_us = 5.0
    k.memory_utilization = 0.9
    k.page_size = 16
    k.pool_gbps = 20.0  # KV pool import/export bandwidth per instance (GB/s)
    k.max_batch_size = 256
    k.max_prefill_tokens = 8192
    # Simulation fidelity: at most this many decode iterations per simulated step (1 = exact),
    # and how many real tokens one simulated token stands for (1 = exact; 16 for 100K-token
    # workloads: lengths, chunks and pages are counted in units of token_unit tokens).
    k.macro_steps = 64
    k.token_unit = 1
    # Calibrated mode: a `seer-jax bench --profile` JSON replaces the roofline step time.
    k.profile_path = ""
    k.kv_capacity_tokens = 0  # >0 overrides the computed KV capacity (required with a profile)

    r = c.controller = ml_collections.ConfigDict()
    # Passed to seer_jax.rollout.core.controller_config.ControllerConfig (same keys).
    r.chunk_size = 8192
    r.balance_threshold = 32
    r.max_in_flight_per_instance = 0
    r.dispatch_lookahead = 8
    r.estimate_chunks = False
    r.estimate_margin = 1.25
    r.min_chunk_size = 32

    # Each policy's own options, by policy name (see rollout.policies.default_policy_options).
    c.policy = default_policy_options()

    s = c.spec = ml_collections.ConfigDict()
    # Per-position conditional acceptance rates of grouped drafts once the group has context,
    # and of a request drafting only from its own prompt/output (no finished siblings).
    s.acceptance = [0.75, 0.65, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3]
    s.solo_acceptance = [0.45, 0.35, 0.25, 0.2, 0.15, 0.1, 0.1, 0.1]
    s.gamma_max = 8
    s.priority_weight = 2.0  # lambda of the high-priority class in the budget
    s.draft_overhead_ms = 0.2  # host-side drafting per step
    # A measured calibration (`benchmarks/drafting.py --calibration-out FILE`): its per-position
    # rates, by how many siblings have finished, replace acceptance / solo_acceptance.
    s.calibration = ""

    sw = c.sweep = ml_collections.ConfigDict()
    sw.iccs = [0.0, 0.3, 0.6, 0.9]
    sw.sigmas = [0.6, 1.1, 1.6]
    sw.num_prompts = 0  # 0 = the workload's num_prompts
    sw.policies = "seer,group_round_robin,request_fcfs"
    # a length trace whose measured ICC and sigma the sweep reports (and its plot marks):
    # where a real workload sits in the grid
    sw.reference_trace = ""
    return c


def _check(key: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config.{key}={value!r} is invalid; allowed: {allowed}")


def validate_config(cfg: ml_collections.ConfigDict, catalog: PolicyCatalog = CATALOG) -> None:
    """Raise ConfigError for the first invalid value (named key, value, what is allowed).
    `catalog`: the policies runs may name (the production ones unless given another)."""
    _check("seed", cfg.seed, isinstance(cfg.seed, int) and cfg.seed >= 0, "an int >= 0")
    policy_list(cfg.policies, catalog)
    catalog.check(cfg.baseline, "baseline")
    catalog.check_options(cfg.policy.to_dict(), "policy")
    w = cfg.workload
    if w.preset:
        _check("workload.preset", w.preset, w.preset in wl.WORKLOAD_PRESETS,
               f"'' or one of {sorted(wl.WORKLOAD_PRESETS)}")
    _check("workload.max_tokens", w.max_tokens, w.max_tokens >= 1, ">= 1")
    _check("workload.trace_max_tokens", w.trace_max_tokens, w.trace_max_tokens >= 0,
           "0 (the trace's own max_tokens) or a value >= the trace's longest response")
    max_tokens = build_workload(cfg).max_tokens if w.trace_path else int(w.max_tokens)
    if not w.trace_path:
        _check("workload.num_prompts", w.num_prompts, w.num_prompts >= 1, ">= 1")
        _check("workload.group_size", w.group_size, w.group_size >= 1, ">= 1")
        _check("workload.sigma", w.sigma, w.sigma >= 0, ">= 0")
        _check("workload.icc", w.icc, 0 <= w.icc <= 1, "in [0, 1]")
        _check("workload.truncated_fraction", w.truncated_fraction,
               0 < w.truncated_fraction < 1, "in (0, 1)")
        _check("workload.min_tokens", w.min_tokens, 1 <= w.min_tokens <= w.max_tokens,
               "in [1, workload.max_tokens]")
        _check("workload.prompt_len", w.prompt_len, w.prompt_len >= 1, ">= 1")
        _check("workload.prompt_len_sigma", w.prompt_len_sigma, w.prompt_len_sigma >= 0, ">= 0")
    _check("workload.trace_num_groups", w.trace_num_groups, w.trace_num_groups >= 0, ">= 0")

    k = cfg.cluster
    _check("cluster.num_instances", k.num_instances, k.num_instances >= 1, ">= 1")
    cm.get_model(k.model)  # raises "unknown model"
    if not (k.peak_tflops and k.hbm_gbps and k.hbm_gib):
        try:
            cm.get_accelerator(k.accelerator)
        except ConfigError as e:
            raise ConfigError(f"config.cluster.accelerator: {e}") from None
    for key in ("peak_tflops", "hbm_gbps", "hbm_gib"):
        _check(f"cluster.{key}", k[key], k[key] >= 0, ">= 0 (0 = the accelerator preset's value)")
    _check("cluster.chips_per_instance", k.chips_per_instance, k.chips_per_instance >= 1, ">= 1")
    _check("cluster.expert_parallel", k.expert_parallel, k.expert_parallel >= 1, ">= 1")
    _check("cluster.kv_replicas", k.kv_replicas, k.kv_replicas >= 1, ">= 1")
    _check("cluster.mfu", k.mfu, 0 < k.mfu <= 1, "in (0, 1]")
    _check("cluster.mbu", k.mbu, 0 < k.mbu <= 1, "in (0, 1]")
    _check("cluster.step_overhead_ms", k.step_overhead_ms, k.step_overhead_ms >= 0, ">= 0")
    _check("cluster.per_seq_overhead_us", k.per_seq_overhead_us, k.per_seq_overhead_us >= 0,
           ">= 0")
    _check("cluster.memory_utilization", k.memory_utilization, 0 < k.memory_utilization <= 1,
           "in (0, 1]")
    _check("cluster.page_size", k.page_size, k.page_size >= 1, ">= 1")
    _check("cluster.pool_gbps", k.pool_gbps, k.pool_gbps > 0, "> 0")
    _check("cluster.max_batch_size", k.max_batch_size, k.max_batch_size >= 1, ">= 1")
    _check("cluster.macro_steps", k.macro_steps, k.macro_steps >= 1, ">= 1")
    _check("cluster.token_unit", k.token_unit, 1 <= k.token_unit <= 1024, "in [1, 1024]")
    _check("cluster.token_unit", k.token_unit, k.token_unit <= max(1, max_tokens // 64),
           f"<= max_tokens / 64 = {max(1, max_tokens // 64)}")
    _check("cluster.max_prefill_tokens", k.max_prefill_tokens, k.max_prefill_tokens >= 1, ">= 1")
    _check("cluster.kv_capacity_tokens", k.kv_capacity_tokens, k.kv_capacity_tokens >= 0,
           ">= 0 (0 = computed from HBM)")
    if k.profile_path and not k.kv_capacity_tokens:
        raise ConfigError(
            "config.cluster.kv_capacity_tokens must be > 0 with cluster.profile_path "
            "(a step profile says nothing about memory)"
        )

    from seer_jax.rollout.core.controller_config import ControllerConfig

    try:
        ControllerConfig.from_mapping(cfg.controller.to_dict())
    except ConfigError as e:
        raise ConfigError(f"config.controller.{e}") from None

    s = cfg.spec
    for key in ("acceptance", "solo_acceptance"):
        rates = list(s[key])
        _check(f"spec.{key}", rates, len(rates) >= 1 and all(0 <= x <= 1 for x in rates),
               "a non-empty list of rates in [0, 1]")
    _check("spec.gamma_max", s.gamma_max, 0 <= s.gamma_max <= 64, "in [0, 64]")
    _check("spec.priority_weight", s.priority_weight, s.priority_weight > 0, "> 0")
    _check("spec.draft_overhead_ms", s.draft_overhead_ms, s.draft_overhead_ms >= 0, ">= 0")
    if s.get("calibration"):
        from seer_jax.drafting.calibration import SpecCalibration

        SpecCalibration.load(s.calibration)  # a ConfigError names spec.calibration

    sw = cfg.sweep
    _check("sweep.iccs", list(sw.iccs), len(sw.iccs) >= 1 and all(0 <= x <= 1 for x in sw.iccs),
           "a non-empty list of values in [0, 1]")
    _check("sweep.sigmas", list(sw.sigmas), len(sw.sigmas) >= 1 and all(x >= 0 for x in sw.sigmas),
           "a non-empty list of values >= 0")
    _check("sweep.num_prompts", sw.num_prompts, sw.num_prompts >= 0, ">= 0")
    policy_list(sw.policies, catalog)
    # Finally build the cost model once: capacity problems (weights do not fit) surface here.
    build_cost_model(cfg).kv_capacity_pages()


def policy_list(spec: str, catalog: PolicyCatalog = CATALOG) -> list[str]:
    names = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not names:
        raise ConfigError("config.policies is empty; give a comma-separated list of policies")
    for p in names:
        catalog.check(p, "policies")
    return names


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def build_accelerator(cfg: ml_collections.ConfigDict) -> cm.AcceleratorSpec:
    k = cfg.cluster
    if k.peak_tflops and k.hbm_gbps and k.hbm_gib:
        base = cm.AcceleratorSpec(k.accelerator or "custom", 0.0, 0.0, 0.0)
    else:
        base = cm.get_accelerator(k.accelerator)
    return cm.AcceleratorSpec(
        base.name,
        k.peak_tflops * 1e12 if k.peak_tflops else base.peak_flops,
        k.hbm_gbps * 1e9 if k.hbm_gbps else base.hbm_bytes_per_s,
        k.hbm_gib * cm.GIB if k.hbm_gib else base.hbm_bytes,
    )


def build_cost_model(cfg: ml_collections.ConfigDict):
    """The step-time model of one instance: roofline, or a calibrated profile."""
    k = cfg.cluster
    model = cm.get_model(k.model)
    if k.profile_path:
        return cm.ProfileCostModel(
            cm.StepProfile.load(k.profile_path),
            kv_capacity_tokens_=int(k.kv_capacity_tokens),
            page_size=int(k.page_size),
            pool_bytes_per_s=k.pool_gbps * 1e9,
            kv_bytes_per_token=model.kv_bytes_per_token,
        )
    roof = cm.RooflineCostModel(
        model=model,
        accelerator=build_accelerator(cfg),
        chips=int(k.chips_per_instance),
        expert_parallel=int(k.expert_parallel),
        kv_replicas=int(k.kv_replicas),
        mfu=float(k.mfu),
        mbu=float(k.mbu),
        step_overhead_s=k.step_overhead_ms * 1e-3,
        per_seq_overhead_s=k.per_seq_overhead_us * 1e-6,
        memory_utilization=float(k.memory_utilization),
        page_size=int(k.page_size),
        pool_bytes_per_s=k.pool_gbps * 1e9,
    )
    return roof


def kv_capacity_pages(cfg: ml_collections.ConfigDict, cost) -> int:
    k = cfg.cluster
    if k.kv_capacity_tokens:
        return int(k.kv_capacity_tokens) // int(k.page_size)
    return cost.kv_capacity_pages()


def build_workload(cfg: ml_collections.ConfigDict, seed: int | None = None) -> wl.Workload:
    w = cfg.workload
    seed = cfg.seed if seed is None else seed
    if w.trace_path:
        explicit = int(w.trace_max_tokens)
        try:
            work = wl.load_trace(w.trace_path, max_tokens=explicit or None)
        except wl.TraceTooLongError as e:
            raise ConfigError(
                f"config.workload.trace_max_tokens={explicit} is smaller than the longest "
                f"response of trace {w.trace_path} ({e.longest} tokens); allowed: 0 (the "
                f"trace's own max_tokens) or a value >= {e.longest}") from None
        if w.trace_num_groups:
            work = wl.scale_workload(work, int(w.trace_num_groups), seed=seed)
        return work
    lm = wl.LengthModel(
        num_prompts=int(w.num_prompts),
        group_size=int(w.group_size),
        max_tokens=int(w.max_tokens),
        sigma=float(w.sigma),
        icc=float(w.icc),
        truncated_fraction=float(w.truncated_fraction),
        min_tokens=int(w.min_tokens),
        prompt_len=int(w.prompt_len),
        prompt_len_sigma=float(w.prompt_len_sigma),
    )
    return wl.synthetic_workload(lm, seed=seed, name=w.preset or cfg.name)


def max_tokens_source(cfg: ml_collections.ConfigDict) -> str:
    """Where the run's max_tokens comes from (for the run header)."""
    w = cfg.workload
    if not w.trace_path:
        return "config.workload.max_tokens"
    if w.trace_max_tokens:
        return "config.workload.trace_max_tokens"
    return "the trace"


def preset_workload_fields(name: str) -> dict:
    """The workload.* values of a paper-shaped preset (configs/sim files use this)."""
    lm = wl.WORKLOAD_PRESETS[name]
    return {
        "preset": name,
        "num_prompts": lm.num_prompts,
        "group_size": lm.group_size,
        "max_tokens": lm.max_tokens,
        "sigma": lm.sigma,
        "icc": lm.icc,
        "truncated_fraction": lm.truncated_fraction,
        "min_tokens": lm.min_tokens,
        "prompt_len": lm.prompt_len,
        "prompt_len_sigma": lm.prompt_len_sigma,
    }
