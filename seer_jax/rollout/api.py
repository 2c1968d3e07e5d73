"""The rollout API on real engines: prompts -> groups of responses through the controller.

`run_rollout(cfg)` takes a rollout config (see `configs/rollout/*.py`), loads the model, builds
one engine per mesh slice and runs one or more policies on the same prompts and seeds.
`rollout_groups(...)` is the programmatic entry point for trainers (prompts as token ids).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pathlib
import sys
from collections.abc import Callable, Sequence

import ml_collections

from seer_jax.errors import ConfigError
from seer_jax.rollout.concurrent_driver import FAULT_WHEN
from seer_jax.rollout.controller import ControllerConfig
from seer_jax.rollout.driver import CLOCKS
from seer_jax.rollout.policies import CATALOG, Hindsight, PolicyCatalog, default_policy_options
from seer_jax.rollout.policies.base import options_for
from seer_jax.rollout.ray_cluster import RayBackendConfig
from seer_jax.rollout.types import SamplingParams


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
    # Controller settings: every field of seer_jax.rollout.controller.ControllerConfig.
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
    c.ray_step_timeout_s = 600.0  # an actor silent this long in a step is killed and lost
    # hosts one slice spans: one actor and bundle per host, tp / hosts devices each, joined
    # under jax.distributed
    c.ray_hosts_per_slice = 1
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
        impl="auto"))  # attention: auto | reference | cpu | tpu | gpu
    c.speculation = False  # grouped speculative decoding (one shared group draft service)
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
    from seer_jax.rollout.mooncake_pool import MooncakeConfig

    try:
        return MooncakeConfig(master=c.mooncake_master, metadata_server=c.mooncake_metadata_server,
                              segment_mb=c.mooncake_segment_mb).validate()
    except ConfigError as e:
        raise ConfigError(f"config.{e}") from None


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
    if c.backend == "ray":
        if c.speculation:
            bad("speculation", c.speculation, "allowed: False with backend='ray'")
        if c.time_model != "measured":
            bad("time_model", c.time_model, "allowed: measured with backend='ray'")
        try:
            RayBackendConfig(address=c.ray_address, resource=c.ray_resource,
                             step_timeout_s=c.ray_step_timeout_s,
                             hosts_per_slice=c.ray_hosts_per_slice,
                             pipeline_depth=c.ray_pipeline_depth).validate().check_tp(c.tp)
        except ConfigError as e:
            raise ConfigError(f"config.{e}".replace("ray ", "ray_", 1)) from None
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
        from seer_jax.rollout.mooncake_pool import require_mooncake

        require_mooncake()
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
    catalog.check_options(c.policy.to_dict(), "policy")
    return policies


def ensure_cpu_devices(n: int) -> None:
    """Ask for n fake CPU devices when running on CPU (must happen before jax is imported)."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


@dataclasses.dataclass
class RolloutRun:
    prompts: list[list[int]]
    outputs: dict  # policy -> controller.RolloutOutput
    summary: dict
    # policy -> every executed engine step (batch, prefill tokens, decode tokens, KV tokens read,
    # duration s), over all instances; and the KV capacity of one instance in tokens
    step_logs: dict = dataclasses.field(default_factory=dict)
    kv_capacity_tokens: int = 0


def build_prompts(c, tokenizer) -> tuple[list[list[int]], list[str]]:
    from seer_jax.rollout.prompts import load_jsonl, prompt_set

    items = load_jsonl(c.prompts) if str(c.prompts).endswith(".jsonl") else prompt_set(c.prompts)
    if len(items) < c.num_prompts:
        raise ConfigError(f"config.num_prompts={c.num_prompts}: prompt set {c.prompts!r} has only {len(items)}")
    items = items[: c.num_prompts]
    if c.chat:
        ids = [tokenizer.encode_chat(it.messages or [{"role": "user", "content": it.text}]) for it in items]
    else:
        ids = [tokenizer.encode(it.text) for it in items]
    return ids, [it.text for it in items]


def run_rollout(c: ml_collections.ConfigDict,
                progress: Callable[[str], Callable] | None = None,
                catalog: PolicyCatalog = CATALOG) -> RolloutRun:
    """Run every policy of `c.policies` on the same prompts and seeds. A policy that needs true
    lengths (an analysis oracle, from `catalog`) gets those of the first run."""
    policies = validate_config(c, catalog)
    if c.backend == "inprocess":
        ensure_cpu_devices(c.num_instances * c.tp)
    from seer_jax.engine.engine import EngineConfig
    from seer_jax.model import load
    from seer_jax.rollout.engine_instance import make_engine_instances
    from seer_jax.rollout.report import compare_summary
    from seer_jax.rollout.run import rollout

    cfg, params, tok = load(c.model, c.dtype)
    prompts, _ = build_prompts(c, tok)
    sampling = SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, seed=c.seed)
    engine_cfg = EngineConfig(**c.engine.to_dict())
    eos = tuple(cfg.eos_token_ids) or ((tok.eos_id,) if tok.eos_id is not None else ())
    step_time = None
    if c.time_model == "roofline":
        from seer_jax.costs import RooflineCostModel, get_accelerator, get_model

        step_time = RooflineCostModel(model=get_model(c.cost_model), accelerator=get_accelerator(c.accelerator),
                                      chips=c.chips_per_instance, page_size=engine_cfg.page_size)
    outputs = {}
    step_logs = {}
    kv_capacity = 0
    hindsight = Hindsight()
    fault = None
    if c.fault_kill_instance >= 0:
        from seer_jax.rollout.concurrent_driver import FaultPlan

        fault = FaultPlan(c.fault_kill_instance, c.fault_after_chunks, c.fault_when)
    ray_group = None
    pools = _KVPools(c)
    for policy in policies:
        if outputs and hindsight.true_lengths is None:
            first = next(iter(outputs.values()))
            hindsight = Hindsight(true_lengths={r.request_id: len(r.token_ids) for r in first.results})
        pol = catalog.make(policy, hindsight)
        if c.backend == "ray":
            ray_group = _ray_group(c, cfg, engine_cfg, eos, ray_group, pools.ray_factory())
            out = rollout(
                prompts, group_size=c.group_size, max_tokens=c.max_tokens,
                instances=ray_group.instances, sampling=sampling, policy=pol, pool=ray_group.pool,
                clock=c.clock, config=c.controller.to_dict(),
                policy_options=options_for(pol, c.policy.to_dict()),
                progress=progress(policy) if progress else None, detokenize=tok.decode,
                fault=dataclasses.replace(fault) if fault else None,
                replacer=ray_group.replacer())
            outputs[policy] = out
            step_logs[policy] = ray_group.step_logs()
            load = ray_group.instances[0].load()
            kv_capacity = load.total_kv_pages * load.page_size
            continue
        pool = pools.inprocess_pool()
        speculators = None
        if c.speculation:
            from seer_jax.drafting.budget import SpeculationBudget
            from seer_jax.drafting.service import InProcessDraftService
            from seer_jax.engine.speculation import Speculator

            service = InProcessDraftService()
            speculators = [Speculator(service, SpeculationBudget.from_profile_json(c.spec_profile or None))
                           for _ in range(c.num_instances)]
        instances = make_engine_instances(cfg, params, num_instances=c.num_instances, tp=c.tp,
                                          engine_config=dataclasses.replace(engine_cfg, speculation=c.speculation),
                                          pool=pool, eos_ids=eos, step_time=step_time,
                                          speculators=speculators, record_steps=True)
        outputs[policy] = rollout(
            prompts, group_size=c.group_size, max_tokens=c.max_tokens, instances=instances,
            sampling=sampling, policy=pol, pool=pool, clock=c.clock,
            config=c.controller.to_dict(), policy_options=options_for(pol, c.policy.to_dict()),
            progress=progress(policy) if progress else None, detokenize=tok.decode,
            fault=dataclasses.replace(fault) if fault else None)
        step_logs[policy] = [row for inst in instances for row in inst.step_log]
        load = instances[0].load()
        kv_capacity = load.total_kv_pages * load.page_size
        if hasattr(pool, "shutdown"):
            pool.shutdown()
        # release this policy's engines (KV caches, executables) before the next are built:
        # otherwise two sets are alive at once and the peak memory doubles
        del instances, pool, speculators
        gc.collect()
    if ray_group is not None:
        ray_group.shutdown()
    pools.close()
    reports = {p: o.report for p, o in outputs.items()}
    baseline = c.baseline if c.baseline in reports else policies[0]
    summary = {"policies": compare_summary(reports, baseline), "baseline": baseline,
               "num_responses": len(prompts) * c.group_size, "model": c.model}
    if c.trace_out:
        write_trace(c.trace_out, next(iter(outputs.values())).results)
    return RolloutRun(prompts, outputs, summary, step_logs, kv_capacity)


class _KVPools:
    """The KV pools of a run's rollouts, per `config.kv_pool` (and a loopback Mooncake master
    when kv_pool='mooncake' names none)."""

    def __init__(self, c: ml_collections.ConfigDict):
        self.kind = c.kv_pool or ("ray" if c.backend == "ray" else "host")
        self.master = None
        self.mooncake = None
        if self.kind == "mooncake":
            if c.mooncake_master:
                self.mooncake = mooncake_config(c)
            else:
                from seer_jax.rollout.mooncake_pool import LoopbackMaster

                self.master = LoopbackMaster()
                self.mooncake = dataclasses.replace(self.master.config,
                                                    segment_mb=c.mooncake_segment_mb)

    def inprocess_pool(self):
        from seer_jax.rollout.kv_pool import HostKVPool
        from seer_jax.rollout.mooncake_pool import MooncakeKVPool

        return MooncakeKVPool(self.mooncake) if self.mooncake else HostKVPool()

    def ray_factory(self):
        """`make_ray_instances(pool_factory=)`: None for the object-store pool."""
        if self.mooncake is None:
            return None
        from seer_jax.rollout.mooncake_pool import MooncakeKVPool

        cfg = self.mooncake
        return lambda capacity: MooncakeKVPool.create(cfg, capacity, shared=True)

    def close(self) -> None:
        if self.master is not None:
            self.master.stop()


def _ray_group(c, cfg, engine_cfg, eos, group, pool_factory=None):
    """Ray actors for the next policy's rollout: the previous ones reset (fresh engines and KV
    pool), or new ones when there were none or fewer than num_instances are alive."""
    from seer_jax.rollout.ray_instance import make_ray_instances

    live = None if group is None else (
        len(group.instances) - len(group.lost) + group.pending_replacements())
    if live == c.num_instances:  # replacements still starting join in reset()
        group.reset()
        return group
    if group is not None:
        group.shutdown()
    backend = RayBackendConfig(address=c.ray_address, resource=c.ray_resource,
                               step_timeout_s=c.ray_step_timeout_s,
                               hosts_per_slice=c.ray_hosts_per_slice,
                               pipeline_depth=c.ray_pipeline_depth)
    # each actor loads the weights itself from the model name/path (no copy in the object store)
    return make_ray_instances(cfg, c.model, num_instances=c.num_instances, tp=c.tp,
                              engine_config=engine_cfg, backend=backend, dtype=c.dtype,
                              eos_ids=eos, record_steps=True, replace_lost=c.ray_replace_lost,
                              pool_factory=pool_factory)


def write_trace(path: str | pathlib.Path, results) -> None:
    """JSONL trace (one line per response: group_id, prompt_len, output_len, finish_reason)."""
    with open(path, "w") as f:
        for r in results:
            f.write(json.dumps({"group_id": r.group_id, "prompt_len": len(r.prompt_ids),
                                "output_len": len(r.token_ids), "finish_reason": r.finish_reason}) + "\n")


def rollout_groups(engines: Sequence, prompts: list[list[int]], group_size: int, max_tokens: int,
                   sampling: SamplingParams, policy: str = "seer",
                   config: dict | None = None, policy_options: dict | None = None):
    """Run groups through existing `EngineInstance`s (e.g. kept alive by a trainer adapter).
    config: ControllerConfig fields (default chunk: the whole budget); policy_options: the
    policy's own options."""
    from seer_jax.rollout.run import rollout

    pool = engines[0].pool
    return rollout(prompts, group_size=group_size, max_tokens=max_tokens, instances=list(engines),
                   sampling=sampling, policy=policy, pool=pool,
                   config=config or {"chunk_size": max_tokens}, policy_options=policy_options)
