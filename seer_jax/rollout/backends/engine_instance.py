"""A real JAX engine on a mesh slice as a controller `Instance`, and mesh slicing.

Chunks run on `Engine` with `keep_kv=True`: when a chunk ends on its budget the request's KV is
read back to the host and put into the global pool, and the engine's pages are freed; the next
chunk (here or on any other instance) imports it from the pool, or re-prefills when the pool has
evicted it. The group's prompt stays in the engine's prefix cache, which is the affinity signal
(`resident_tokens`).

Clock: the instance owns a virtual clock advanced by each step's duration, either the measured
wall time of the step (`step_time=None`: emulated cluster of real engines on one host) or a cost
model `step_time(batch_size, num_prefill_tokens, num_decode_tokens, kv_tokens_read)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from seer_jax.engine.engine import Engine, EngineConfig, KVBlob
from seer_jax.errors import ConfigError, SeerError
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import Params
from seer_jax.rollout.core.instance import KVPool
from seer_jax.rollout.core.types import ChunkRequest, ChunkResult, InstanceLoad, StepReport

StepTimeFn = Callable[[int, int, int, int], float]


def slice_devices(num_instances: int, tp: int, devices: Sequence | None = None) -> list[list]:
    """Split devices into num_instances slices of tp devices each."""
    devices = list(jax.devices() if devices is None else devices)
    if num_instances < 1 or tp < 1:
        raise ConfigError(f"num_instances={num_instances} and tp={tp} must be >= 1")
    if num_instances * tp != len(devices):
        raise ConfigError(
            f"num_instances ({num_instances}) x tp ({tp}) = {num_instances * tp} must equal the "
            f"number of devices ({len(devices)}); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={num_instances * tp}")
    return [devices[i * tp:(i + 1) * tp] for i in range(num_instances)]


class EngineInstance:
    def __init__(self, instance_id: int, engine: Engine, pool: KVPool,
                 step_time: StepTimeFn | None = None, record_steps: bool = False):
        self.instance_id = instance_id
        self.engine = engine
        self.pool = pool
        self.step_time = step_time
        if step_time is None and engine.spec is not None:
            # measured steps are the clock: the speculation budget (when no profile or step time
            # was given) weighs draft tokens by what this hardware's steps cost
            engine.spec.budget.measure_steps()
        self._now = 0.0
        self._chunks: dict[str, tuple[ChunkRequest, float, float | None]] = {}
        self._started: dict[str, float] = {}
        self._first_token: dict[str, float] = {}
        self._imported: dict[str, int] = {}
        self._reprefill: dict[str, int] = {}
        self._prompts: dict[str, tuple[int, ...]] = {}
        # when the engine's recent steps ended on this instance's clock: with overlap, the
        # requests a step finishes come back from the next step() call, and end with their step
        self._step_end: dict[int, float] = {}
        # record_steps: one row per executed step (batch size, prefill tokens, decode tokens, KV
        # tokens read, duration s on this instance's clock: what calibrates the simulator to a
        # run); off by default so long-lived engines (trainer adapters) do not grow a log
        self.step_log: list[tuple[int, int, int, int, float]] | None = [] if record_steps else None

    def now(self) -> float:
        return self._now

    def set_now(self, t: float) -> None:
        self._now = max(self._now, t)

    def submit(self, chunk: ChunkRequest) -> None:
        blob = None
        imported = 0
        if chunk.kv_handle is not None:
            got = self.pool.get(chunk.kv_handle)
            if isinstance(got, KVBlob) and got.output_ids == list(chunk.output_ids):
                blob, imported = got, got.nbytes
        context = len(chunk.prompt_ids) + len(chunk.output_ids)
        self.engine.add_request(chunk.request_id, list(chunk.prompt_ids), chunk.max_new_tokens,
                                chunk.sampling, output_ids=list(chunk.output_ids), kv=blob,
                                keep_kv=True, group_id=chunk.group_id, priority=chunk.priority)
        self._chunks[chunk.request_id] = (chunk, self._now, None)
        self._imported[chunk.request_id] = imported
        self._reprefill[chunk.request_id] = 0 if blob is not None or not chunk.output_ids else context
        self._prompts[chunk.group_id] = tuple(chunk.prompt_ids)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def load(self) -> InstanceLoad:
        free, total = self.engine.kv_usage()
        return InstanceLoad(running=len(self.engine.running), waiting=len(self.engine.waiting),
                            free_kv_pages=free, total_kv_pages=total,
                            page_size=self.engine.config.page_size,
                            max_running=self.engine.config.max_num_seqs)

    def resident_tokens(self, request_id: str, group_id: str) -> int:
        prompt = self._prompts.get(group_id)
        if prompt is not None and prompt in self.engine.blocks.prefix:
            return len(prompt) - 1
        return 0

    def running_progress(self) -> dict[str, int]:
        return {s.request_id: len(s.output) for s in self.engine.running}

    def close_group(self, group_id: str) -> None:
        """Every request of the group has finished: forget it (its draft context too)."""
        self._prompts.pop(group_id, None)
        if self.engine.spec is not None:
            self.engine.spec.close_group(group_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._chunks.pop(request_id, None)

    def step(self) -> StepReport:
        start = self._now
        running_before = {s.request_id for s in self.engine.running}
        steps_before = self.engine.step_count
        compile_before = self.engine.runner.compile_s
        t0 = time.perf_counter()
        outs = self.engine.step()
        # compiling a new step shape is a one-off cost of this process, not of the accelerator
        # being emulated: it is left out of the step's duration
        wall = time.perf_counter() - t0 - (self.engine.runner.compile_s - compile_before)
        if self.engine.step_count == steps_before:
            # no new step; with overlap, the last one in flight may have been committed
            return StepReport(0.0, 0, 0, [self._result(o, start) for o in outs])
        stats = self.engine.step_stats[-1]
        if self.step_time is None:
            duration = wall
        elif stats.batch_size == 0:
            # overlap dispatched it for requests the previous step ended: it computes nothing
            duration = 0.0
        else:
            duration = self.step_time(stats.batch_size, stats.num_prefill_tokens,
                                      stats.num_decode_tokens, stats.kv_tokens)
        self._now = start + duration
        self._step_end[stats.step] = self._now
        for old in [k for k in self._step_end if k < stats.step - 2]:
            del self._step_end[old]
        if self.step_log is not None:
            self.step_log.append((stats.batch_size, stats.num_prefill_tokens,
                                  stats.num_decode_tokens, stats.kv_tokens, duration))
        for s in self.engine.running:
            if s.request_id not in running_before:
                self._started.setdefault(s.request_id, start)
            if s.num_new > 0:
                self._first_token.setdefault(s.request_id, self._now)
        finished = [self._result(o, start) for o in outs]
        return StepReport(duration, stats.batch_size, stats.num_tokens, finished)

    def _result(self, out, step_start: float) -> ChunkResult:
        chunk, submitted, _ = self._chunks.pop(out.request_id)
        total = len(chunk.output_ids) + len(out.token_ids)
        done = out.finish_reason in ("eos", "stop") or total >= chunk.original_max_tokens
        handle, exported = None, 0
        if not done:
            if out.kv is None:
                raise SeerError(f"chunk of {out.request_id} ended without its KV")
            handle = self.pool.put(out.request_id, out.kv, out.kv.nbytes)
            exported = out.kv.nbytes
        return ChunkResult(
            request_id=out.request_id, instance_id=self.instance_id,
            new_token_ids=list(out.token_ids), new_logprobs=list(out.logprobs),
            finish_reason=(out.finish_reason if done else None), kv_handle=handle,
            submitted_at=submitted, started_at=self._started.pop(out.request_id, step_start),
            ended_at=self._step_end.get(out.metrics.finish_step, self._now),
            num_steps=out.metrics.num_steps,
            preemptions=out.metrics.num_preemptions, decode_steps=out.metrics.decode_steps,
            spec_proposed=out.metrics.spec_proposed, spec_accepted=out.metrics.spec_accepted,
            kv_bytes_imported=self._imported.pop(out.request_id, 0), kv_bytes_exported=exported,
            reprefill_tokens=self._reprefill.pop(out.request_id, 0),
            first_token_at=self._first_token.pop(out.request_id, self._now),
            new_routed_experts=out.routed_experts,
        )


def make_engine_instances(cfg: ModelConfig, params: Params, *, num_instances: int, tp: int,
                          engine_config: EngineConfig, pool: KVPool,
                          devices: Sequence | None = None, step_time: StepTimeFn | None = None,
                          eos_ids: tuple[int, ...] | None = None,
                          speculators: Sequence | None = None,
                          record_steps: bool = False) -> list[EngineInstance]:
    """One engine per mesh slice of tp devices (params and KV cache placed on that slice).
    speculators: one `Speculator` per instance (sharing one draft service = the paper's grouped
    draft server) when engine_config.speculation is on."""
    slices = slice_devices(num_instances, tp, devices)
    out = []
    for i, devs in enumerate(slices):
        mesh = Mesh(np.array(devs), ("tp",))
        engine = Engine(cfg, params, engine_config, mesh=mesh, eos_ids=eos_ids,
                        speculator=speculators[i] if speculators else None)
        out.append(EngineInstance(i, engine, pool, step_time, record_steps=record_steps))
    return out
