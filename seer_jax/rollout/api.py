"""The rollout API on real engines: prompts -> groups of responses through the controller.

`run_rollout(cfg)` takes a rollout config (`seer_jax.rollout.config`; see `configs/rollout/*.py`),
loads the model, builds one engine per mesh slice (in process or as Ray actors) and runs one or
more policies on the same prompts and seeds.
`rollout_groups(...)` is the programmatic entry point for trainers (prompts as token ids).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from seer_jax.errors import ConfigError
from seer_jax.rollout.config import (  # noqa: F401 (bench_config, default_config: re-exported)
    bench_config,
    default_config,
    draft_sync_config,
    mooncake_config,
    ray_backend_config,
    validate_config,
)
from seer_jax.rollout.core.policies import CATALOG, Hindsight, PolicyCatalog
from seer_jax.rollout.core.policies.base import options_for
from seer_jax.rollout.core.types import SamplingParams

log = logging.getLogger(__name__)


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
    # with a journal: its path, records and bytes written by this run, seconds spent writing
    journal: dict | None = None
    # with carry_over: policy -> the `CarryOver` holding the groups its rollout left unfinished
    # (pass it as `run_rollout(config, carry=run.carry)` to continue them)
    carry: dict | None = None


def build_prompts(c, tokenizer) -> tuple[list[list[int]], list[str]]:
    from seer_jax.rollout.core.prompts import load_jsonl, prompt_set

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
                catalog: PolicyCatalog = CATALOG,
                resume: str | os.PathLike | None = None,
                carry: Mapping[str, Any] | None = None) -> RolloutRun:
    """Run every policy of `c.policies` on the same prompts and seeds. A policy that needs true
    lengths (an analysis oracle, from `catalog`) gets those of the first run.

    With `c.journal_dir` the rollout is journaled there (`seer_jax.rollout.core.journal`);
    `resume`: the directory of a journal to continue (its fingerprint must match this config's):
    finished responses are returned as recorded, unfinished ones continue after their recorded
    tokens, and when every policy is recorded done no model or engine is loaded at all.

    With `c.carry_over` (partial rollout) each policy's rollout returns once `c.target_groups`
    groups are complete, its own groups and the carried ones; the others are in `RolloutRun.carry`.
    `carry`: that dict from an earlier run of the same policies: its groups run too, continuing
    after their tokens (by re-prefill: the earlier run's KV pools are gone)."""
    policies = validate_config(c, catalog)
    carries = _carries(c, policies, carry)
    if c.backend == "inprocess":
        ensure_cpu_devices(c.num_instances * c.tp)
    journal, state, prompts, tok = _open_journal(c, resume)
    if state is not None and all(state.policy(p).done for p in policies):
        journal.close()
        return _restored_run(c, policies, prompts, state, tok)
    from seer_jax.engine.engine import EngineConfig
    from seer_jax.model import load

    try:
        cfg, params, tok = load(c.model, c.dtype)
    except BaseException:
        if journal is not None:
            journal.close()  # and its directory's lock
        raise
    if prompts is None:
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
    fault = None
    if c.fault_kill_instance >= 0:
        from seer_jax.rollout.core.concurrent_driver import FaultPlan

        fault = FaultPlan(c.fault_kill_instance, c.fault_after_chunks, c.fault_when)
    res = _Resources()
    res.journal, res.state, res.carry = journal, state, carries
    try:
        res.pools = _KVPools(c)
        _run_policies(c, policies, catalog, progress, res, prompts, sampling, cfg, params, tok,
                      engine_cfg, eos, step_time, fault, outputs, step_logs)
    except BaseException:  # no actor, pool, store or journal lock outlives a failed run
        res.close(quiet=True)
        if journal is not None:
            journal.close()
        raise
    res.close()
    run = _finish_run(c, policies, prompts, outputs, step_logs, res.kv_capacity)
    if carries is not None:
        run.carry = carries
        run.summary["carried_groups"] = {p: len(k) for p, k in carries.items()}
    if journal is not None:
        journal.close()
        run.journal = {"path": str(journal.path), "records": journal.records,
                       "bytes": journal.bytes, "write_s": journal.write_s}
    return run


def _carries(c: ml_collections.ConfigDict, policies: list[str],
             carry: Mapping[str, Any] | None) -> dict | None:
    """policy -> the `CarryOver` its rollout continues (None without carry_over)."""
    from seer_jax.rollout.core.carry import CarryOver

    if not c.carry_over:
        if carry:
            raise ConfigError("run_rollout(carry=...) with config.carry_over=False is invalid: "
                              "the carried groups would be dropped; allowed: carry_over=True")
        return None
    carry = dict(carry or {})
    unknown = sorted(set(carry) - set(policies))
    if unknown:
        raise ConfigError(f"run_rollout(carry=...) holds policies {unknown} that config.policies="
                          f"{c.policies!r} does not run; allowed: {policies}")
    out = {}
    for p in policies:
        k = carry.get(p)
        if k is None:
            k = CarryOver()
        if not isinstance(k, CarryOver):
            raise ConfigError(f"run_rollout(carry={{{p!r}: {type(k).__name__}}}) is invalid; "
                              "allowed: the CarryOver of an earlier run (RolloutRun.carry)")
        k.forget_kv()  # the pools of the run that filled it are closed
        out[p] = k
    return out


class _Resources:
    """What a run holds (Ray actors, KV pools, a Mooncake master), released by `close()`."""

    def __init__(self):
        self.pools: _KVPools | None = None
        self.ray_group = None
        self.inprocess_pool = None
        self.kv_capacity = 0
        self.journal = self.state = None  # the run's journal writer, and the state it resumes
        self.carry = None  # policy -> CarryOver (carry_over)

    def close(self, quiet: bool = False) -> None:
        """Release everything; the first error of a release is raised after all were tried
        (logged instead with `quiet`, while another error is on its way)."""
        errors = []
        for release in (lambda: self.ray_group and self.ray_group.shutdown(),
                        lambda: hasattr(self.inprocess_pool, "shutdown")
                        and self.inprocess_pool.shutdown(),
                        lambda: self.pools and self.pools.close()):
            try:
                release()
            except Exception as e:  # release the rest; the first error is re-raised below
                errors.append(e)
        self.ray_group = self.inprocess_pool = self.pools = None
        for e in errors if quiet else errors[1:]:
            log.warning("releasing the rollout's resources: %s: %s", type(e).__name__, e)
        if errors and not quiet:
            raise errors[0]


def _run_policies(c, policies, catalog, progress, run, prompts, sampling, cfg, params, tok,
                  engine_cfg, eos, step_time, fault, outputs, step_logs) -> None:
    from seer_jax.rollout.backends.engine_instance import make_engine_instances
    from seer_jax.rollout.core.run import rollout
    from seer_jax.rollout.resume import records_to_restore, restored_output

    pools, journal, state = run.pools, run.journal, run.state
    hindsight = Hindsight()
    for policy in policies:
        if outputs and hindsight.true_lengths is None:
            first = next(iter(outputs.values()))
            hindsight = Hindsight(true_lengths={r.request_id: len(r.token_ids) for r in first.results})
        if state is not None and state.policy(policy).done:
            outputs[policy] = restored_output(state, policy, prompts, c.group_size, tok.decode)
            step_logs[policy] = []
            continue
        pol = catalog.make(policy, hindsight)
        journaled = {} if journal is None else {
            "journal": journal.for_policy(policy), "restore": records_to_restore(state, policy)}
        if run.carry is not None:
            journaled.update(carry=run.carry[policy], target_groups=c.target_groups or None)
        if c.backend == "ray":
            ray_group = run.ray_group = _ray_group(c, cfg, engine_cfg, eos, run.ray_group,
                                                   pools.ray_factory())
            out = rollout(
                prompts, group_size=c.group_size, max_tokens=c.max_tokens,
                instances=ray_group.instances, sampling=sampling, policy=pol, pool=ray_group.pool,
                clock=c.clock, config=c.controller.to_dict(),
                policy_options=options_for(pol, c.policy.to_dict()),
                progress=progress(policy) if progress else None, detokenize=tok.decode,
                fault=dataclasses.replace(fault) if fault else None,
                replacer=ray_group.replacer(), configured_instances=c.num_instances,
                **journaled)
            out.report.draft_service = ray_group.draft_stats()
            if journal is not None:
                journal.policy_done(out.report.to_json()["report"])
            outputs[policy] = out
            step_logs[policy] = ray_group.step_logs()
            load = ray_group.instances[0].load()
            run.kv_capacity = load.total_kv_pages * load.page_size
            continue
        pool = run.inprocess_pool = pools.inprocess_pool()
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
            fault=dataclasses.replace(fault) if fault else None, **journaled)
        if journal is not None:
            journal.policy_done(outputs[policy].report.to_json()["report"])
        step_logs[policy] = [row for inst in instances for row in inst.step_log]
        load = instances[0].load()
        run.kv_capacity = load.total_kv_pages * load.page_size
        run.inprocess_pool = None
        if hasattr(pool, "shutdown"):
            pool.shutdown()
        # release this policy's engines (KV caches, executables) before the next are built:
        # otherwise two sets are alive at once and the peak memory doubles
        del instances, pool, speculators
        gc.collect()


def _finish_run(c, policies, prompts, outputs, step_logs, kv_capacity) -> RolloutRun:
    from seer_jax.rollout.core.report import compare_summary

    reports = {p: o.report for p, o in outputs.items()}
    baseline = c.baseline if c.baseline in reports else policies[0]
    summary = {"policies": compare_summary(reports, baseline), "baseline": baseline,
               "num_responses": len(prompts) * c.group_size, "model": c.model}
    if c.trace_out:
        write_trace(c.trace_out, next(iter(outputs.values())).results)
    return RolloutRun(prompts, outputs, summary, step_logs, kv_capacity)


def _open_journal(c: ml_collections.ConfigDict, resume):
    """(journal writer, journal state being resumed, prompts, tokenizer) of a journaled run;
    Nones for a run without a journal. The prompts are built with the tokenizer alone (no
    weights), so a finished journal is returned without loading the model."""
    directory = resume or c.journal_dir
    if not directory:
        return None, None, None, None
    from seer_jax.model.hub import resolve_model
    from seer_jax.model.tokenizer import Tokenizer
    from seer_jax.rollout.core.journal import (
        JournalError,
        JournalLock,
        JournalWriter,
        check_fingerprint,
        read_journal,
    )
    from seer_jax.rollout.resume import rollout_fingerprint

    if resume and not os.path.isdir(resume):
        raise JournalError(f"no rollout journal in {os.fspath(resume)!r} (no such directory)")
    lock = JournalLock(directory)  # before anything is read: one rollout per journal at a time
    try:
        path = resolve_model(c.model)
        tok = Tokenizer.load(path)
        prompts, _ = build_prompts(c, tok)
        fingerprint = rollout_fingerprint(c, prompts, path)
        if not resume:
            return (JournalWriter(directory, fingerprint, fsync=c.journal_fsync, lock=lock), None,
                    prompts, tok)
        state = read_journal(directory)
        check_fingerprint(state.fingerprint, fingerprint, state.path)
        return (JournalWriter(directory, resume=state, fsync=c.journal_fsync, lock=lock), state,
                prompts, tok)
    except BaseException:
        lock.release()
        raise


def _restored_run(c, policies, prompts, state, tok) -> RolloutRun:
    """A rollout whose every policy the journal holds finished: its responses and reports."""
    from seer_jax.rollout.resume import restored_output

    outputs = {p: restored_output(state, p, prompts, c.group_size, tok.decode) for p in policies}
    return _finish_run(c, policies, prompts, outputs, {p: [] for p in policies}, 0)


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
                from seer_jax.rollout.backends.mooncake_pool import LoopbackMaster

                self.master = LoopbackMaster()
                self.mooncake = dataclasses.replace(self.master.config,
                                                    segment_mb=c.mooncake_segment_mb)

    def inprocess_pool(self):
        from seer_jax.rollout.backends.kv_pool import HostKVPool
        from seer_jax.rollout.backends.mooncake_pool import MooncakeKVPool

        return MooncakeKVPool(self.mooncake) if self.mooncake else HostKVPool()

    def ray_factory(self):
        """`make_ray_instances(pool_factory=)`: None for the object-store pool."""
        if self.mooncake is None:
            return None
        from seer_jax.rollout.backends.mooncake_pool import MooncakeKVPool

        cfg = self.mooncake
        return lambda capacity: MooncakeKVPool.create(cfg, capacity, shared=True)

    def close(self) -> None:
        if self.master is not None:
            self.master.stop()


def _ray_group(c, cfg, engine_cfg, eos, group, pool_factory=None):
    """Ray actors for the next policy's rollout: the previous ones reset (fresh engines and KV
    pool), or new ones when there were none, or when fewer than num_instances are alive and
    `allow_fewer_slices` is off."""
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    if group is not None and (c.allow_fewer_slices or group.live_slices() == c.num_instances):
        group.reset()  # replacements still starting join in reset()
        return group
    if group is not None:
        group.shutdown()
    budget = None
    if c.speculation:
        import functools

        from seer_jax.drafting.budget import SpeculationBudget

        # built on each actor: the speculation budget works per actor
        budget = functools.partial(SpeculationBudget.from_profile_json, c.spec_profile or None)
    # each actor loads the weights itself from the model name/path (no copy in the object store)
    return make_ray_instances(cfg, c.model, num_instances=c.num_instances, tp=c.tp,
                              engine_config=dataclasses.replace(engine_cfg, speculation=c.speculation),
                              backend=ray_backend_config(c), dtype=c.dtype,
                              eos_ids=eos, record_steps=True, replace_lost=c.ray_replace_lost,
                              pool_factory=pool_factory, draft_service=draft_sync_config(c),
                              spec_budget=budget,
                              fault_kill_draft_service_after_chunks=(
                                  c.fault_kill_draft_service_after_chunks),
                              allow_fewer_slices=c.allow_fewer_slices)


def write_trace(path: str | pathlib.Path, results) -> None:
    """JSONL trace (one line per response: group_id, prompt_len, output_len, finish_reason)."""
    with open(path, "w") as f:
        for r in results:
            f.write(json.dumps({"group_id": r.group_id, "prompt_len": len(r.prompt_ids),
                                "output_len": len(r.token_ids), "finish_reason": r.finish_reason}) + "\n")


def rollout_groups(engines: Sequence, prompts: list[list[int]], group_size: int, max_tokens: int,
                   sampling: SamplingParams, policy: str = "seer",
                   config: dict | None = None, policy_options: dict | None = None,
                   carry=None, target_groups: int | None = None, weight_version: int = 0):
    """Run groups through existing `EngineInstance`s (e.g. kept alive by a trainer adapter).
    config: ControllerConfig fields (default chunk: the whole budget); policy_options: the
    policy's own options. carry, target_groups: partial rollout across calls
    (`seer_jax.rollout.core.carry.CarryOver`); weight_version: recorded with every token."""
    from seer_jax.rollout.core.run import rollout

    pool = engines[0].pool
    return rollout(prompts, group_size=group_size, max_tokens=max_tokens, instances=list(engines),
                   sampling=sampling, policy=policy, pool=pool,
                   config=config or {"chunk_size": max_tokens}, policy_options=policy_options,
                   carry=carry, target_groups=target_groups, weight_version=weight_version)
