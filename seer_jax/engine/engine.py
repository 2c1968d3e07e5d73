"""One inference engine on one mesh slice: continuous batching over a paged KV cache.

`add_request` queues a request; each `step()` plans (the `Scheduler` picks running and waiting
requests within a token budget: decodes first, then chunked prefill; drafts; the batch), runs one
jitted forward + sample, and commits (appends the sampled tokens, finishes requests on EOS / stop
ids / max_tokens). A request is just "tokens whose KV is not computed yet": decode is the case of
one such token, prefill (fresh, resumed after preemption, or continuing an imported request) the
case of many. The G requests of a group share their prompt's pages (`KVCacheManager` over
`BlockManager`). When pages run out the most recently admitted request is preempted (recompute,
or swap to host) and resumes later with identical tokens. Request states: `request.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from jax.sharding import Mesh

from seer_jax.drafting.draft_rows import DraftRows
from seer_jax.engine import spec_steps
from seer_jax.engine.batch import RequestRows, StepBatch, build_batch
from seer_jax.engine.block_manager import BlockManager
from seer_jax.engine.kv_cache import KVCacheManager
from seer_jax.engine.model_runner import Launched, ModelRunner
from seer_jax.engine.request import Request, RequestStatus
from seer_jax.engine.scheduler import Scheduler
from seer_jax.engine.types import (  # noqa: F401 (re-exported: the engine's public types)
    EngineConfig,
    KVBlob,
    RequestFinished,
    RequestMetrics,
    RequestOutput,
    StepStats,
)
from seer_jax.errors import ConfigError, InputError, SeerError
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import Params
from seer_jax.model.sampling_params import SamplingParams


@dataclasses.dataclass
class InFlight:
    """A step dispatched and not yet committed (overlap): its plan, the runner's handle, and
    the (request, output row, token position) of every token it samples."""

    step: int
    plan: StepPlan
    launched: Launched
    pending: list[tuple[Request, int, int]]
    stats: StepStats
    t0: float
    # the KV tokens each scheduled request counted into stats.kv_tokens
    kv_counted: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StepPlan:
    """What one step will run: decode sequences, (sequence, tokens) to prefill, the decode
    sequences' drafts (`DraftRows`; None: no speculation) and the batch laid out for the
    runner."""

    decode: list[Request]
    prefill: list[tuple[Request, int]]
    drafts: DraftRows | None
    batch: StepBatch


class Engine:
    def __init__(self, cfg: ModelConfig, params: Params, config: EngineConfig = EngineConfig(),  # noqa: B008
                 mesh: Mesh | None = None, eos_ids: tuple[int, ...] | None = None,
                 clock: Callable[[], float] = time.perf_counter, speculator=None):
        """speculator: a `seer_jax.engine.speculation.Speculator` (shared draft service and
        budget); one is created when config.speculation is on and none is given."""
        config.validate()
        self.cfg = cfg
        self.config = config
        self.clock = clock
        self.eos_ids = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        num_pages = config.kv_pages(cfg.kv_bytes_per_token())
        self.blocks = BlockManager(num_pages, config.page_size)
        if config.return_routed_experts and cfg.moe is None:
            raise ConfigError(f"engine config return_routed_experts=True: {cfg.architecture} has "
                              "no mixture-of-experts layers")
        self.runner = ModelRunner(
            cfg, params, num_pages, config.page_size, mesh, config.impl,
            layer_weights=config.layer_weights, routed_experts=config.return_routed_experts,
            max_seqs=max(config.max_num_seqs, config.max_prefill_seqs),
            pages_per_seq=self.blocks.pages_for(self.max_model_len),
            max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs * 8))
        self.max_pps = self.blocks.pages_for(self.max_model_len)
        rows = RequestRows(max(config.max_num_seqs, config.max_prefill_seqs) + 2, self.max_pps)
        self.kv = KVCacheManager(self.blocks, self.runner, config.prefix_sharing, rows)
        self.scheduler = Scheduler(config, self.kv, clock)
        self.seqs: dict[str, Request] = {}
        self.step_count = 0
        self.step_stats: collections.deque[StepStats] = collections.deque(maxlen=config.max_step_stats)
        if speculator is None and config.speculation:
            from seer_jax.engine.speculation import Speculator

            speculator = Speculator()
        self.spec = speculator
        if speculator is not None:
            speculator.budget.serve(cfg.cost_spec())
        self.overlap = config.overlap
        self._inflight: InFlight | None = None
        self._ready: list[RequestOutput] = []  # finished by a commit outside step()

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                    sampling: SamplingParams = SamplingParams(), output_ids: list[int] = (),
                    kv: KVBlob | None = None, keep_kv: bool = False, group_id: str | None = None,
                    priority: int = 0) -> None:
        """Queue a request. `output_ids`: tokens generated earlier (a continued request); `kv`: its
        KV from another engine (`export_kv`), else it is re-prefilled. `keep_kv`: when the request
        ends on its max_tokens (a chunk of a longer request), return its KV in the output.
        `group_id`: the request's group (shared draft context; default: its own id); `priority`
        1 = the high-priority class of the speculation budget."""
        if request_id in self.seqs:
            raise InputError(f"request id {request_id!r} is already in the engine")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InputError(f"request {request_id!r}: empty prompt")
        bad = [t for t in prompt + list(output_ids) if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise InputError(f"request {request_id!r}: token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        if max_tokens < 1:
            raise InputError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        total = len(prompt) + len(output_ids) + max_tokens
        if total > self.max_model_len:
            raise InputError(
                f"request {request_id!r}: prompt ({len(prompt)}) + earlier output ({len(output_ids)}) + "
                f"max_tokens ({max_tokens}) = {total} exceeds the context of {self.max_model_len}")
        if self.blocks.pages_for(total) > self.blocks.num_pages:
            raise InputError(f"request {request_id!r} needs {self.blocks.pages_for(total)} KV pages; "
                             f"the engine has {self.blocks.num_pages}")
        sampling.validate(self.cfg.vocab_size)
        if sampling.top_logprobs > self.config.max_top_logprobs:
            raise InputError(f"request {request_id!r}: top_logprobs={sampling.top_logprobs} exceeds the "
                             f"engine's max_top_logprobs={self.config.max_top_logprobs}")
        if sampling.return_routed_experts and not self.config.return_routed_experts:
            raise InputError(f"request {request_id!r}: return_routed_experts needs an engine built "
                             "with return_routed_experts=True")
        seq = Request(request_id, prompt, list(output_ids), len(output_ids), max_tokens, sampling,
                   RequestMetrics(arrival_time=self.clock()), keep_kv=keep_kv,
                   group_id=request_id if group_id is None else group_id, priority=priority)
        if kv is not None:
            if kv.prompt_ids != prompt or kv.output_ids != list(output_ids):
                raise InputError(f"request {request_id!r}: KV blob tokens do not match the request")
            if kv.num_computed >= seq.num_tokens:
                raise InputError(f"request {request_id!r}: KV blob covers {kv.num_computed} tokens, "
                                 f"expected fewer than {seq.num_tokens}")
            seq.swapped = kv
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        if self.spec is not None:
            self.spec.on_add(seq.group_id, prompt)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request: its output with the tokens committed so far ("abort"), or, when the
        step drained first finished it, that output (then no later `step()` returns it); None
        for an id this engine does not hold."""
        self.drain()
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return self._take_ready(request_id)
        self.scheduler.finish(seq)
        return self._output(seq, "abort")

    def _take_ready(self, request_id: str) -> RequestOutput | None:
        """Remove and return the drained output of request_id, if one waits for `step()`."""
        for i, out in enumerate(self._ready):
            if out.request_id == request_id:
                return self._ready.pop(i)
        return None

    def has_unfinished(self) -> bool:
        return bool(self.seqs) or self._inflight is not None or bool(self._ready)

    def drain(self) -> None:
        """Commit the step in flight, if any (overlap), so that every request's tokens are on
        the host; what it finishes comes back from the next `step()`."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._ready += self._commit_inflight(inflight)

    def export_kv(self, request_id: str, release: bool = True) -> KVBlob:
        """The request's tokens and the K/V of its computed positions, on the host. With release,
        the request leaves this engine (it continues elsewhere via `add_request(kv=...)`)."""
        self.drain()
        seq = self.seqs.get(request_id)
        if seq is None:
            done = next((o for o in self._ready if o.request_id == request_id), None)
            if done is not None:
                raise RequestFinished(
                    f"request {request_id!r} finished ({done.finish_reason}) in the step just "
                    f"committed; its output comes back from the next step(), it has no KV to export")
            raise InputError(f"unknown request id {request_id!r}")
        blob = seq.swapped if seq.swapped is not None else self.kv.blob(seq)
        if release:
            self.abort(request_id)
        return blob

    @property
    def running(self) -> list[Request]:
        """Running requests, in admission order."""
        return self.scheduler.running

    @property
    def waiting(self) -> collections.deque[Request]:
        """Waiting requests, in admission order (the front goes first)."""
        return self.scheduler.waiting

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One iteration: plan (schedule, drafts, batch), execute (the jitted step), commit
        (append tokens, finish sequences, stats). Returns the requests that finished in it.
        With overlap, the step is planned and dispatched, then the previous step is committed
        while it runs: the requests that finished in the previous step are returned."""
        if self.overlap:
            return self._step_overlapped()
        t0, p0 = self.clock(), time.perf_counter()
        plan = self._plan()
        if plan is None:
            return []
        p1, compile0 = time.perf_counter(), self.runner.compile_s
        emissions = self._execute(plan)
        finished = self._commit(plan, emissions, t0)
        stats, rt = self.step_stats[-1], self.runner.timings
        stats.plan_s, stats.h2d_s, stats.device_s, stats.d2h_s = p1 - p0, rt.h2d_s, rt.device_s, rt.d2h_s
        stats.wait_s = rt.wait_s
        stats.compile_s = self.runner.compile_s - compile0
        stats.commit_s = time.perf_counter() - p1 - rt.h2d_s - rt.device_s - rt.d2h_s - stats.compile_s
        if self.spec is not None:  # a budget fitted to measured steps learns from this one
            self.spec.budget.observe_step(stats.num_tokens,
                                          time.perf_counter() - p0 - stats.compile_s)
        return finished

    def _step_overlapped(self) -> list[RequestOutput]:
        prev = self._inflight
        if prev is not None and self.spec is not None and (
                prev.plan.drafts is not None or self.spec.wants_drafts(self.scheduler.num_running)):
            self.drain()  # the next plan needs its tokens: positions after acceptance, drafts
            prev = None
        t0, p0 = self.clock(), time.perf_counter()
        plan = self._plan(idle_ok=prev is not None)
        launched = None
        if plan is not None:  # (if this raises, prev stays in flight: its tokens are not lost)
            p1, compile0 = time.perf_counter(), self.runner.compile_s
            launched = self._launch(plan, prev, t0)
            stats = launched.stats
            stats.plan_s, stats.compile_s = p1 - p0, self.runner.compile_s - compile0
            stats.h2d_s = launched.launched.h2d_s
        self._inflight = launched
        finished, self._ready = self._ready, []
        if prev is not None:
            finished += self._commit_inflight(prev)
        return finished

    def _launch(self, plan: StepPlan, prev: InFlight | None, t0: float) -> InFlight:
        """Dispatch the step; every request it samples reserves its next token position, and
        its pages and computed length advance as if the step were done (the device runs
        steps in order)."""
        decode, prefill, batch = plan.decode, plan.prefill, plan.batch
        launched = self.runner.launch(batch, self.config.max_top_logprobs,
                                      None if prev is None else prev.launched)
        step = self.step_count
        for seq in decode:
            m = seq.metrics
            m.num_steps += 1
            m.decode_steps += 1
        for seq, _ in prefill:
            seq.metrics.num_steps += 1
        pending = []
        if plan.drafts is None:  # (a verified step's tokens advance at its commit)
            for seq, n in [(s, 1) for s in decode] + prefill:
                seq.num_computed += n
            pending = [(seq, row, seq.reserve_token(row, step)) for seq, row in batch.rows]
            # prompts whose prefill this step completes are offered to their group-mates now:
            # any later step that reads the pages runs after this one on the device
            self._register_prefixes(prefill)
        kv_counted = {s.request_id: s.num_computed for s in decode}
        kv_counted.update((s.request_id, s.num_computed) for s, _ in prefill)
        kv_tokens = sum(s.num_computed for s in decode) + sum(s.num_computed for s, _ in prefill)
        n_pre = sum(n for _, n in prefill)
        n_dec = len(decode) + (plan.drafts.num_nodes if plan.drafts is not None else 0)
        stats = StepStats(step, len(decode) + len(prefill), n_dec + n_pre, n_pre, n_dec, 0.0,
                          kv_tokens, moe_dispatch=self.runner.expert_dispatch(
                              batch.layout.num_tokens))
        self.step_stats.append(stats)
        self.step_count += 1
        return InFlight(step, plan, launched, pending, stats, t0, kv_counted)

    def _commit_inflight(self, inflight: InFlight) -> list[RequestOutput]:
        """Bring a launched step's tokens to the host (one transfer) and commit them: append,
        finish (EOS, stop ids, budget), register completed prompt prefixes. A request that
        ended meanwhile (finished by the step before, or aborted) drops its token."""
        out = self.runner.fetch(inflight.launched)
        c0, now = time.perf_counter(), self.clock()
        plan, stats = inflight.plan, inflight.stats
        if plan.drafts is not None:
            finished = self._emit(plan, self._accept(plan, out), now, inflight.step)
            self._register_prefixes(plan.prefill)
            stats.kv_tokens = sum(s.num_computed for s in plan.decode) + sum(
                s.num_computed for s, _ in plan.prefill)
            return self._close_stats(stats, inflight.t0, c0, finished)
        finished = self._emit(plan, self._sampled(inflight.pending, out), now, inflight.step)
        return self._close_stats(stats, inflight.t0, c0, finished)

    def _close_stats(self, stats: StepStats, t0: float, c0: float, finished: list) -> list:
        """A committed step's device, transfer and commit times; the budget learns from it."""
        rt = self.runner.timings
        stats.device_s, stats.d2h_s, stats.wait_s = rt.device_s, rt.d2h_s, rt.wait_s
        stats.commit_s = time.perf_counter() - c0
        stats.duration_s = self.clock() - t0
        if self.spec is not None:
            self.spec.budget.observe_step(stats.num_tokens, stats.plan_s + stats.h2d_s
                                          + stats.device_s + stats.d2h_s + stats.commit_s)
        return finished

    def _uncount(self, later: InFlight, ended: set[str]) -> None:
        """Requests that ended in the step just committed were also scheduled in the `later`
        step, already dispatched: their rows there compute nothing anyone reads. They are
        taken out of that step's stats (what an emulated clock charges) and out of the
        requests' step counts, so both equal what one step at a time gives."""
        st = later.stats
        for seq in later.plan.decode:
            if seq.request_id in ended:
                seq.metrics.num_steps -= 1
                seq.metrics.decode_steps -= 1
                st.batch_size -= 1
                st.num_tokens -= 1
                st.num_decode_tokens -= 1
                st.kv_tokens -= later.kv_counted.get(seq.request_id, 0)
        for seq, n in later.plan.prefill:
            if seq.request_id in ended:
                seq.metrics.num_steps -= 1
                st.batch_size -= 1
                st.num_tokens -= n
                st.num_prefill_tokens -= n
                st.kv_tokens -= later.kv_counted.get(seq.request_id, 0)

    def _register_prefixes(self, prefill: list[tuple[Request, int]]) -> None:
        """Offer the prompts whose prefill completed in this step to later requests."""
        if not self.config.prefix_sharing:
            return
        for seq, n in prefill:
            if seq.status is RequestStatus.RUNNING and not seq.base_len \
                    and seq.num_computed >= len(seq.prompt) > seq.num_computed - n:
                self.kv.register_prefix(seq)

    def _plan(self, idle_ok: bool = False) -> StepPlan | None:
        """The next step, or None when nothing can run now (an error when nothing ever could,
        unless `idle_ok`: a step in flight will change that)."""
        decode, prefill = self.scheduler.schedule(self.step_count)
        if not decode and not prefill:
            if self.seqs and not self.scheduler.num_running and not idle_ok:
                raise SeerError("no request can be scheduled: the KV pool is too small for the "
                                "smallest waiting request")
            return None
        drafts = None
        if self.spec is not None and decode:
            if any(s.pending_row >= 0 for s in decode):  # tokens on the device: no drafts
                self.spec.skip(len(decode))
            else:
                drafts = spec_steps.propose(self.spec, self.kv, decode, self.max_model_len)
        c = self.config
        batch = build_batch(decode, prefill, drafts, self.kv.rows, page_size=c.page_size,
                            max_num_seqs=c.max_num_seqs, max_prefill_seqs=c.max_prefill_seqs,
                            max_num_batched_tokens=c.max_num_batched_tokens,
                            max_pps=self.max_pps, impl=self.runner.impl)
        return StepPlan(decode, prefill, drafts, batch)

    def _execute(self, plan: StepPlan) -> list[tuple]:
        """Run the step on the device and advance `num_computed`; returns the emissions
        (`_emit`) in emission order."""
        decode, prefill, drafts, batch = plan.decode, plan.prefill, plan.drafts, plan.batch
        if drafts is None:
            out = self.runner.sample(batch, self.config.max_top_logprobs)
            for seq, n in [(s, 1) for s in decode] + prefill:
                seq.num_computed += n
            return self._sampled([(seq, row, -1) for seq, row in batch.rows], out)
        return self._accept(plan, self.runner.verify(batch))

    def _sampled(self, rows: list[tuple[Request, int, int]], out) -> list[tuple]:
        """The emissions of a step without drafts: one token for each (request, output row,
        reserved position: -1 = none) of a request still running."""
        toks, lps, top = out
        toks, lps = toks.tolist(), lps.tolist()
        emissions = []
        for seq, row, pos in rows:
            if seq.status is RequestStatus.FINISHED:  # ended meanwhile (overlap): dropped
                continue
            tops = []
            if seq.sampling.top_logprobs:
                k = seq.sampling.top_logprobs
                tops = [list(zip(top[0][row, :k].tolist(), top[1][row, :k].tolist(), strict=True))]
            if seq.sampling.return_routed_experts:
                seq.routed_experts.append(self.runner.routed_experts[row].tolist())
            emissions.append((seq, [toks[row]], [lps[row]], tops, pos, spec_steps.UNCHECKED))
        return emissions

    def _accept(self, plan: StepPlan, out) -> list[tuple]:
        """The emissions of a verified step (`spec_steps.accept`), its prefill rows after."""
        dec_out, pre = out
        if any(s.sampling.return_routed_experts for s in plan.decode):
            q, (_, _, n_acc, acc_nodes) = plan.batch.layout.q_dec, dec_out
            for i, seq in enumerate(plan.decode):
                if seq.sampling.return_routed_experts:  # token j came from the root, then node j-1
                    rows = [i * q] + [i * q + 1 + n for n in acc_nodes[i, :int(n_acc[i])].tolist()]
                    seq.routed_experts.extend(self.runner.routed_experts[rows].tolist())
        emissions = spec_steps.accept(plan.decode, plan.drafts, dec_out, self.kv, self.runner,
                                      self.spec, self.eos_ids)
        split = plan.batch.layout.n_dec * plan.batch.layout.q_dec
        for seq, n in plan.prefill:
            seq.num_computed += n
        for seq, row in plan.batch.rows:
            if row >= split:
                emissions.append((seq, [int(pre[0][row - split])], [float(pre[1][row - split])], [],
                                  -1, spec_steps.UNCHECKED))
                if seq.sampling.return_routed_experts:
                    seq.routed_experts.append(self.runner.routed_experts[row].tolist())
        return emissions

    def _commit(self, plan: StepPlan, emissions, t0: float) -> list[RequestOutput]:
        """Append emitted tokens, finish sequences (EOS, stop ids, budget), release rejected
        draft pages, register completed prompt prefixes and record the step."""
        decode, prefill, drafts = plan.decode, plan.prefill, plan.drafts
        for seq in decode:
            m = seq.metrics
            m.num_steps += 1
            m.decode_steps += 1
        for seq, _ in prefill:
            seq.metrics.num_steps += 1
        kv_tokens = sum(s.num_computed for s in decode) + sum(s.num_computed for s, _ in prefill)
        finished = self._emit(plan, emissions, self.clock(), self.step_count)
        self._register_prefixes(prefill)
        n_dec = len(decode) + (drafts.num_nodes if drafts is not None else 0)
        n_pre = sum(n for _, n in prefill)
        self.step_stats.append(StepStats(
            self.step_count, len(decode) + len(prefill), n_dec + n_pre, n_pre, n_dec,
            self.clock() - t0, kv_tokens,
            moe_dispatch=self.runner.expert_dispatch(plan.batch.layout.num_tokens)))
        self.step_count += 1
        return finished

    def _emit(self, plan: StepPlan, emissions, now: float, step: int) -> list[RequestOutput]:
        """The one commit path, one step at a time and overlapped: append the emitted tokens
        (a token reserved at launch, pos >= 0, lands in its position; a reserved emission has one
        token), finish requests (EOS,
        stop ids, budget), give back the pages of rejected draft nodes, take requests that
        ended out of a later step already in flight; the draft service gets the tokens.
        emissions: (request, tokens, logprobs, top-logprob rows, reserved position, end
        reason: None, "eos", "stop", "length" when the tokens were cut there already, else
        `spec_steps.UNCHECKED`)."""
        finished, appended, ended = [], [], []
        eos, trim, S = self.eos_ids, plan.drafts is not None, self.config.page_size
        for seq, toks_e, lps_e, tops_e, pos, reason in emissions:
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            if reason is spec_steps.UNCHECKED:
                # the first token that ends the request: EOS, a stop id, or its budget's last
                reason, stop = None, seq.sampling.stop_token_ids
                room = seq.max_tokens - seq.num_committed_new
                for j, tok in enumerate(toks_e):
                    if tok in eos:
                        reason = "eos"
                    elif tok in stop:
                        reason = "stop"
                    elif j + 1 >= room:
                        reason = "length"
                    else:
                        continue
                    toks_e, lps_e, tops_e = toks_e[:j + 1], lps_e[:j + 1], tops_e[:j + 1]
                    break
            if pos >= 0:
                seq.commit_token(pos, toks_e[0], step)
            else:
                seq.append_tokens(toks_e)
            seq.logprobs.extend(lps_e)
            if tops_e:
                seq.tops.extend(tops_e)
            appended.append((seq.group_id, seq.request_id, toks_e))
            if reason is not None:
                ended.append((seq.group_id, seq.request_id))
                finished.append(self._finish(seq, reason, step))
            elif trim and len(seq.pages) * S >= seq.num_tokens + S:
                self.kv.trim(seq, seq.num_tokens)  # roll back pages rejected draft nodes used
        later = self._inflight
        if finished and later is not None and later.step != step:
            self._uncount(later, {o.request_id for o in finished})
        if self.spec is not None:
            self.spec.on_step(appended, ended)
        return finished

    def _finish(self, seq: Request, reason: str, step: int) -> RequestOutput:
        seq.metrics.finish_time = self.clock()
        seq.metrics.finish_step = step
        kv = None
        if seq.keep_kv and reason == "length":
            kv = self.kv.blob(seq)
        del self.seqs[seq.request_id]
        self.scheduler.finish(seq)
        out = self._output(seq, reason)
        out.kv = kv
        return out

    def _output(self, seq: Request, reason: str) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt, seq.output[seq.base_len:], seq.logprobs,
                             seq.tops if seq.sampling.top_logprobs else None, reason, seq.metrics,
                             routed_experts=(seq.routed_experts[:len(seq.output) - seq.base_len]
                                             if seq.sampling.return_routed_experts else None))

    # ------------------------------------------------------------------ conveniences
    def run_until_done(self, max_steps: int = 1_000_000) -> dict[str, RequestOutput]:
        out = {}
        for _ in range(max_steps):
            if not self.has_unfinished():
                return out
            for r in self.step():
                out[r.request_id] = r
        raise SeerError(f"engine did not finish within {max_steps} steps")

    def update_params(self, params: Params) -> None:
        """New weights (e.g. after a trainer step). Cached prompt KV was computed with the old
        weights, so the prefix cache is dropped; refused while requests are in flight."""
        self.drain()
        if self.seqs:
            raise SeerError(f"update_params with {len(self.seqs)} requests in flight; finish or abort them first")
        self.blocks.clear_prefix_cache()
        self.runner.set_params(params)

    def kv_usage(self) -> tuple[int, int]:
        """(free pages, total pages)."""
        return self.blocks.num_free + self.blocks.num_evictable(), self.blocks.num_pages
