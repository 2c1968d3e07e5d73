"""The rollout config: its schema (`default_config`, `bench_config`) and its validation
(`validate_config`, a ConfigError naming the key, its value and what is allowed).

Configs are Python files (`configs/rollout/*.py`) returning a `ml_collections.ConfigDict` built
from `default_config()`. `seer_jax.rollout.api.run_rollout` runs one.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from seer_jax.errors import ConfigError
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig
from seer_jax.rollout.core.concurrent_driver import FAULT_WHEN
from seer_jax.rollout.core.controller_config import ControllerConfig
from seer_jax.rollout.core.driver import CLOCKS
from seer_jax.rollout.core.policies import CATALOG, PolicyCatalog, default_policy_options


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "smollm2"
    c.dtype = "float32"
    c.prompts = "natural"  # built-in set name, or a .jsonl path
    c.num_prompts = 8
    c.chat = True
    c.group_size = 4
    c.max_tokens = 128
    c.temperature = 1.0
    c.top_p = 1.0
    c.top_k = 0
    c.seed = 0
    c.num_instances = 2
    c.tp = 1
    c.policies = "seer"  # comma-separated: each runs on the same prompts and seeds
    c.baseline = "group_round_robin"  # ratios are taken against it when it ran (else the first)
    # Controller settings: every field of seer_jax.rollout.core.controller_config.ControllerConfig.
    c.controller = ml_collections.ConfigDict(dataclasses.asdict(ControllerConfig(chunk_size=64)))
    c.policy = default_policy_options()  # policy.<name>.<option>
    # "emulated" (virtual clock per instance), "wall" (instances stepped in turn) or
    # "concurrent" (wall clock, every instance stepping at once)
    c.clock = "emulated"
    # where instances run: "inprocess" (mesh slices of this process) or "ray" (one Ray actor
    # per slice; pip install 'seer-jax[ray]')
    c.backend = "inprocess"
    c.ray_address = ""  # "" = start a local cluster on 127.0.0.1; else join this cluster
    c.ray_resource = "CPU"  # what each slice's placement-group bundle reserves: CPU, GPU or TPU
    # liveness (docs/deployment.md): a step may run the larger of ray_step_timeout_s and
    # ray_step_timeout_factor x the actor's longest step so far; an actor that does not answer
    # a ping (served mid-step) within ray_liveness_timeout_s is silent; either is lost
    c.ray_step_timeout_s = 600.0
    c.ray_step_timeout_factor = 10.0
    c.ray_liveness_timeout_s = 60.0
    c.ray_startup_timeout_s = 600.0  # starting the actors: imports, weights, engine build
    # go on with the live slices after some were lost (False: the next policy's rollout starts
    # a full set of actors again)
    c.allow_fewer_slices = False
    # hosts one slice spans: one actor and bundle per host, tp / hosts devices each, joined
    # under jax.distributed
    c.ray_hosts_per_slice = 1
    # where a multi-host slice's jax.distributed coordinator listens: "" = its leader's cluster
    # address, or an IP address of the leader host (never every interface: no authentication)
    c.ray_coordinator_bind_address = ""
    # steps queued on each actor (clock concurrent): 2 = the next step starts while the
    # controller reads the last one's results; 1 = one step per round trip
    c.ray_pipeline_depth = 2
    # start a replacement actor for each lost one (clock concurrent; single-host slices only)
    c.ray_replace_lost = False
    # the KV pool between chunks: "" = the backend's own ("host" in process, "ray": object
    # store), or "mooncake" (Mooncake Store; pip install 'seer-jax[mooncake]')
    c.kv_pool = ""
    c.mooncake_master = ""  # "host:port" of mooncake_master; "" = start one on 127.0.0.1
    c.mooncake_metadata_server = ""  # "http://host:port/metadata" (with mooncake_master)
    c.mooncake_segment_mb = 256  # host memory each process adds to the store
    # journal the rollout here ("" = off): every finished response and chunk end, so that
    # `seer-jax rollout --resume DIR` continues it after a crash (see docs/deployment.md)
    c.journal_dir = ""
    c.journal_fsync = False  # also fsync each record (survives a host crash; slower)
    # partial rollout across calls (off: every rollout waits for every group, on-policy): with
    # carry_over each policy's rollout returns once target_groups groups are complete (0: every
    # group) and carries the others, tokens and all (`RolloutRun.carry`), into the next
    # `run_rollout(config, carry=run.carry)`; see docs/deployment.md
    c.carry_over = False
    c.target_groups = 0
    # fault injection (clock "concurrent"): kill instance K after N chunks ended (-1 = off), at
    # once ("chunks"), right after it put KV into the pool ("kv_put") or while it imports KV
    # another instance wrote ("kv_load", backend ray)
    c.fault_kill_instance = -1
    c.fault_after_chunks = 0
    c.fault_when = "chunks"
    # emulated step durations: "measured" (wall time of each real step on this host) or
    # "roofline" (sim cost model of `cost_model` on `accelerator` x `chips_per_instance`)
    c.time_model = "measured"
    c.accelerator = "h100"
    c.cost_model = "smollm2-135m"
    c.chips_per_instance = 1
    c.engine = ml_collections.ConfigDict(dict(
        page_size=16, num_pages=0, kv_memory_gib=1.0, max_num_seqs=32,
        max_num_batched_tokens=256, max_prefill_seqs=4,
        impl="auto",  # attention: auto | reference | cpu | tpu | gpu
        layer_weights="auto",  # stacked | per_layer | auto (per_layer on GPUs)
        overlap=True,  # plan step N+1 while step N runs (EngineConfig.overlap)
        # mixture-of-experts models: every response returns, per token and MoE layer, the expert
        # ids the router chose (the JSON's "routed_experts"; not with speculation)
        return_routed_experts=False))
    c.speculation = False  # grouped speculative decoding (one shared group draft service)
    # the draft service of backend "ray" (its shards are Ray actors; every engine actor drafts
    # from a local replica): groups hashed over `shards` actors; a replica pushes its tokens and
    # pulls the others' every `sync_every_steps` steps, and waits for a pull once it is
    # `max_stale_steps` steps old (0 = every step waits: the service on the critical path); a
    # shard that does not answer a pull within `pull_timeout_s` seconds is down (and rebuilt)
    c.draft_service = ml_collections.ConfigDict(dict(shards=1, max_stale_steps=1,
                                                     sync_every_steps=1, pull_timeout_s=30.0))
    # fault injection (backend "ray", speculation): kill the draft-service shard holding the
    # first group after N chunks ended (-1 = off); it is rebuilt from the controller's record
    # and the replicas
    c.fault_kill_draft_service_after_chunks = -1
    c.spec_profile = ""  # step-time profile JSON from `seer-jax bench --profile` ("" = cost model)
    c.trace_out = ""  # write a JSONL length trace (for `seer-jax simulate`)
    return c


def bench_config(mix: str) -> ml_collections.ConfigDict:
    """The rollout benchmark: 32 prompts x G=8, 512 tokens, 4 instances, all policies."""
    c = default_config()
    c.prompts = mix
    c.num_prompts = 32
    c.group_size = 8
    c.max_tokens = 512
    c.temperature = 1.0
    c.num_instances = 4
    c.tp = 1
    c.controller.chunk_size = 128
    c.policies = "group_round_robin,request_fcfs,seer,oracle_lfs"
    # 16 sequences per instance: an instance's groups queue for its slots, as long responses
    # queue for KV memory at scale. With 64 slots every request of an instance runs at once and
    # no order can matter (measured: all four policies within 2.6% of each other).
    c.engine.max_num_seqs = 16
    c.engine.kv_memory_gib = 1.0
    return c


BACKENDS = ("inprocess", "ray")
KV_POOLS = {"inprocess": ("host", "mooncake"), "ray": ("ray", "mooncake")}


def mooncake_config(c: ml_collections.ConfigDict):
    """The `MooncakeConfig` of a rollout config with a master address (ConfigError naming the
    key when it is malformed)."""
    from seer_jax.rollout.backends.mooncake_pool import MooncakeConfig

    try:
        return MooncakeConfig(master=c.mooncake_master, metadata_server=c.mooncake_metadata_server,
                              segment_mb=c.mooncake_segment_mb).validate()
    except ConfigError as e:
        raise ConfigError(f"config.{e}") from None


def draft_sync_config(c: ml_collections.ConfigDict):
    """The `SyncConfig` of `config.draft_service` (ConfigError naming the key when bad)."""
    from seer_jax.drafting.replicated import SyncConfig

    return SyncConfig.from_mapping(c.draft_service.to_dict(), "config.draft_service.")


def ray_backend_config(c: ml_collections.ConfigDict) -> RayBackendConfig:
    """The `RayBackendConfig` of a rollout config's ray_* keys."""
    return RayBackendConfig(address=c.ray_address, resource=c.ray_resource,
                            step_timeout_s=c.ray_step_timeout_s,
                            step_timeout_factor=c.ray_step_timeout_factor,
                            liveness_timeout_s=c.ray_liveness_timeout_s,
                            startup_timeout_s=c.ray_startup_timeout_s,
                            hosts_per_slice=c.ray_hosts_per_slice,
                            pipeline_depth=c.ray_pipeline_depth,
                            coordinator_bind_address=c.ray_coordinator_bind_address)


def validate_config(c: ml_collections.ConfigDict, catalog: PolicyCatalog = CATALOG) -> list[str]:
    """Check a rollout config; returns the list of policies to run. `catalog`: the policies it
    may name (the production ones unless given another)."""
    def bad(key, value, allowed):
        raise ConfigError(f"config.{key}={value!r} is invalid: {allowed}")

    for key in ("num_prompts", "group_size", "max_tokens", "num_instances", "tp"):
        if not isinstance(c[key], int) or c[key] < 1:
            bad(key, c[key], "must be a positive integer")
    try:
        ControllerConfig.from_mapping(c.controller.to_dict())
    except ConfigError as e:
        raise ConfigError(f"config.controller.{e}") from None
    if c.temperature < 0:
        bad("temperature", c.temperature, "must be >= 0")
    if c.clock not in CLOCKS:
        bad("clock", c.clock, f"allowed: {', '.join(CLOCKS)}")
    if c.backend not in BACKENDS:
        bad("backend", c.backend, f"allowed: {', '.join(BACKENDS)}")
    if not isinstance(c.speculation, bool):
        bad("speculation", c.speculation, "allowed: True or False")
    draft_sync_config(c)
    f = c.fault_kill_draft_service_after_chunks
    if not isinstance(f, int) or isinstance(f, bool) or f < -1:
        bad("fault_kill_draft_service_after_chunks", f, "allowed: -1 (off) or an integer >= 0")
    if f >= 0 and not (c.backend == "ray" and c.speculation):
        bad("fault_kill_draft_service_after_chunks", f,
            "allowed: -1 unless backend='ray' and speculation=True (the draft service is Ray actors)")
    if c.backend == "ray":
        if c.time_model != "measured":
            bad("time_model", c.time_model, "allowed: measured with backend='ray'")
        try:
            ray_backend_config(c).validate().check_tp(c.tp)
        except ConfigError as e:
            raise ConfigError(f"config.{e}".replace("ray ", "ray_", 1)) from None
    if not isinstance(c.allow_fewer_slices, bool):
        bad("allow_fewer_slices", c.allow_fewer_slices, "allowed: True or False")
    if not isinstance(c.ray_replace_lost, bool):
        bad("ray_replace_lost", c.ray_replace_lost, "allowed: True or False")
    if c.ray_replace_lost and c.backend != "ray":
        bad("ray_replace_lost", c.ray_replace_lost, "allowed: False unless backend='ray'")
    if c.ray_replace_lost and c.clock != "concurrent":
        bad("clock", c.clock, "allowed: concurrent when ray_replace_lost is set")
    if c.ray_replace_lost and c.ray_hosts_per_slice != 1:
        bad("ray_replace_lost", c.ray_replace_lost,
            f"allowed: False with ray_hosts_per_slice={c.ray_hosts_per_slice!r} (a lost "
            "multi-host slice is not replaced), or set ray_hosts_per_slice=1")
    pool = c.kv_pool or ("ray" if c.backend == "ray" else "host")
    if pool not in KV_POOLS[c.backend]:
        bad("kv_pool", c.kv_pool, f"allowed with backend={c.backend!r}: "
            f"{', '.join(KV_POOLS[c.backend])} (or '' for {KV_POOLS[c.backend][0]})")
    if pool == "mooncake":
        if bool(c.mooncake_master) != bool(c.mooncake_metadata_server):
            bad("mooncake_metadata_server", c.mooncake_metadata_server,
                "set it together with mooncake_master (both empty: a loopback master)")
        if c.mooncake_master:
            mooncake_config(c)
        from seer_jax.rollout.backends.mooncake_pool import require_mooncake

        require_mooncake()
    if not isinstance(c.journal_dir, str):
        bad("journal_dir", c.journal_dir, "a directory path, or '' for no journal")
    if not isinstance(c.journal_fsync, bool):
        bad("journal_fsync", c.journal_fsync, "allowed: True or False")
    if not isinstance(c.carry_over, bool):
        bad("carry_over", c.carry_over, "allowed: True or False")
    t = c.target_groups
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        bad("target_groups", t, "allowed: 0 (every group) or an integer >= 1")
    if t and not c.carry_over:
        bad("target_groups", t, "allowed: 0 unless carry_over=True (the groups left unfinished "
            "would be lost)")
    if c.carry_over and c.journal_dir:
        bad("journal_dir", c.journal_dir, "allowed: '' with carry_over=True (a partial rollout "
            "continues from its carry-over, not from a journal)")
    if c.fault_when not in FAULT_WHEN:
        bad("fault_when", c.fault_when, f"allowed: {', '.join(FAULT_WHEN)}")
    if c.fault_when == "kv_load" and c.fault_kill_instance != -1 and c.backend != "ray":
        bad("fault_when", c.fault_when, "allowed: chunks, kv_put unless backend='ray'")
    if c.fault_kill_instance != -1:
        if not isinstance(c.fault_kill_instance, int) or not 0 <= c.fault_kill_instance < c.num_instances:
            bad("fault_kill_instance", c.fault_kill_instance,
                f"allowed: -1 (off) or 0..{c.num_instances - 1}")
        if c.clock != "concurrent":
            bad("clock", c.clock, "allowed: concurrent when fault_kill_instance is set")
    if not isinstance(c.fault_after_chunks, int) or c.fault_after_chunks < 0:
        bad("fault_after_chunks", c.fault_after_chunks, "allowed: an integer >= 0")
    if c.time_model not in ("measured", "roofline"):
        bad("time_model", c.time_model, "allowed: measured, roofline")
    policies = [p.strip() for p in c.policies.split(",") if p.strip()]
    if not policies:
        bad("policies", c.policies, "give one or more comma-separated policy names")
    for p in policies:
        catalog.check(p, "policies")
        if c.target_groups and not catalog.classes[p].divided:
            bad("target_groups", c.target_groups, f"allowed: 0 with policy {p!r}, which runs each "
                "request whole as one chunk (nothing is left to carry over)")
    catalog.check_options(c.policy.to_dict(), "policy")
    return policies
