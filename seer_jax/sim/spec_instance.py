"""A faster simulated instance with grouped speculative decoding, for pod-scale simulation.

`FastSimInstance` subclasses `sim.instance.SimulatedInstance` (same admission, paging,
preemption, prefix caching, pool export/import and chunk-end rules) and adds:

- **Macro steps.** When a step would be pure decode (no prefill pending, nothing admissible
  waiting), up to `macro_steps` engine iterations run in one `step()` call: the batch is fixed
  until the first chunk ends, so the number of iterations to that end and the pages they need are
  computed in closed form, and the summed duration integrates the cost model over the growing
  KV (Simpson's rule on the per-iteration step time, exact for the roofline's affine pieces up
  to one kink). A macro step never crosses a chunk end or a page shortage (then the exact
  one-iteration step of the base class runs, with its preemption). `macro_steps` bounds how late
  a chunk submitted to this instance by another instance's event can start (the driver delivers
  events in time order, but an instance already advanced past that time starts it at its clock).
- **Speculative decoding with an acceptance model.** Per-position conditional acceptance rates
  come either from assumed numbers, interpolating between `solo_acceptance` (a request drafting
  from its own text) and `acceptance` (the group's context is rich) by the share of the
  request's siblings that have already generated past its position, or from a measured
  calibration (`seer_jax.drafting.calibration`: the group drafter's rates by how many of the
  request's siblings have finished; the own-context rates for groups of one). `GroupProgress`,
  shared by all instances, is the grouped draft server's view of the group. Each macro step
  runs the adaptive budget of `seer_jax.drafting.budget.SpeculationBudget` (the paper's Alg. 1,
  the same code the engine uses): β = the batch's mean reach c[j] = mean_s Π_{i≤j} rate_s[i],
  γ* = argmin_γ T(B, γ) / (1 + E(γ)) (equivalently argmax (B + Σ_s Σ_{j≤γ} c_s[j]) / T(B, γ)),
  off when γ* = 0, total budget Γ = γ*·B handed out greedily by marginal benefit
  `priority_weight`·c_s[j] (`allocate_expected`); chains only (no trees). Progress per iteration
  is the expected accepted length (deterministic, fractional carry).
- Cheap outputs: tokens are a constant pseudo token (EOS last), logprobs 0.0, so a 100M-token
  rollout fits in memory. (The base class's per-position pseudo tokens remain available with
  `cheap_tokens=False`.)
- A per-instance step timeline (start, end, batch size) for plots.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence

import numpy as np

from seer_jax.drafting.budget import BudgetConfig, SpeculationBudget
from seer_jax.drafting.calibration import SpecCalibration, bucket_of
from seer_jax.rollout.core.types import ChunkResult, StepReport
from seer_jax.sim.instance import (
    EOS_TOKEN_ID,
    FIRST_PSEUDO_TOKEN_ID,
    SimulatedInstance,
    _Seq,
    _SimKV,
)


@dataclasses.dataclass(frozen=True)
class SpecModel:
    """Speculative-decoding settings of a simulated instance."""

    acceptance: tuple[float, ...] = (0.75, 0.65, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3)
    solo_acceptance: tuple[float, ...] = (0.45, 0.35, 0.25, 0.2, 0.15, 0.1, 0.1, 0.1)
    gamma_max: int = 8
    priority_weight: float = 2.0
    draft_overhead_s: float = 2e-4
    # measured rates (replace acceptance / solo_acceptance when set)
    calibration: SpecCalibration | None = None

    def rates(self, which: Sequence[float]) -> np.ndarray:
        """Per-position rates padded (last value repeated) to gamma_max."""
        r = list(which)[: self.gamma_max]
        if len(r) < self.gamma_max:
            r += [r[-1]] * (self.gamma_max - len(r))
        return np.asarray(r, dtype=np.float64)


class GroupProgress:
    """How far each response of each group has generated, as the grouped draft server knows it
    (updated when chunks end; finished responses count as fully known). Shared by instances."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self.known: dict[str, dict[str, int]] = {}
        self.done: dict[str, set[str]] = {}

    def update(self, group_id: str, request_id: str, generated: int,
               finished: bool = False) -> None:
        self.known.setdefault(group_id, {})[request_id] = generated
        if finished:
            self.done.setdefault(group_id, set()).add(request_id)

    def finished_siblings(self, group_id: str, request_id: str) -> int:
        """How many of the other responses of the group have finished."""
        d = self.done.get(group_id)
        return len(d) - (request_id in d) if d else 0

    def siblings_ahead(self, group_id: str, request_id: str, position: int) -> float:
        """Share of the other G-1 responses whose known text extends past `position`."""
        if self.group_size <= 1:
            return 0.0
        g = self.known.get(group_id)
        if not g:
            return 0.0
        n = sum(1 for rid, n_gen in g.items() if n_gen > position and rid != request_id)
        return n / (self.group_size - 1)


class FastSimInstance(SimulatedInstance):
    """See the module docstring. Extra keyword arguments: `macro_steps` (max iterations per
    `step()` call, 1 = exact), `spec` (a SpecModel, None = no speculation), `progress` (a shared
    GroupProgress), `cheap_tokens`, `record_timeline`."""

    def __init__(
        self,
        *args,
        macro_steps: int = 256,
        spec: SpecModel | None = None,
        progress: GroupProgress | None = None,
        cheap_tokens: bool = True,
        record_timeline: bool = True,
        **kw,
    ):
        super().__init__(*args, **kw)
        if macro_steps < 1:
            raise ValueError(f"macro_steps={macro_steps} must be >= 1")
        self.macro_steps = macro_steps
        self.spec = spec
        self.progress = progress
        self.cheap_tokens = cheap_tokens
        self.record_timeline = record_timeline
        self.iterations = 0
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.tl_start = array.array("d")
        self.tl_end = array.array("d")
        self.tl_batch = array.array("d")
        if spec is not None:
            cal = spec.calibration
            self._acc = spec.rates(cal.group if cal else spec.acceptance)
            self._solo = spec.rates(cal.solo if cal else spec.solo_acceptance)
            self._by_finished = (np.stack([spec.rates(r) for r in cal.by_finished]) if cal
                                 else None)
            self._spec_kv = 0
            self._budget = SpeculationBudget(
                self._spec_step_time,
                BudgetConfig(gamma_max=max(1, spec.gamma_max),
                             priority_weight=spec.priority_weight, max_width=1))

    # ---- Instance protocol -------------------------------------------------------------------
    def resident_tokens(self, request_id: str, group_id: str) -> int:
        # O(1): placement asks about buffered requests, which are never running here.
        entry = self._cache.get(request_id)
        if entry is not None:
            return entry[0]
        if self._group_refs.get(group_id, 0) > 0:
            return self._group_prompt_len.get(group_id, 0)
        return 0

    def step(self) -> StepReport:
        start = self._now
        if self._needs_exact_step():
            before = self.steps
            rep = super().step()
            self.iterations += self.steps - before
        else:
            rep = self._macro_step()
            if rep is None:  # out of pages: the exact step preempts
                before = self.steps
                rep = super().step()
                self.iterations += self.steps - before
        if self.record_timeline and rep.batch_size:
            self.tl_start.append(start)
            self.tl_end.append(self._now)
            self.tl_batch.append(rep.batch_size)
        return rep

    # ---- macro steps -------------------------------------------------------------------------
    def _needs_exact_step(self) -> bool:
        if self.fail_at_s is not None or not self._running:
            return True
        if any(s.prefill_remaining > 0 for s in self._running):
            return True
        return self._admissible()

    def _admissible(self) -> bool:
        """Would the base class's `_admit` admit the head of the waiting queue now?"""
        if not self._waiting or len(self._running) >= self.max_batch_size:
            return False
        head = max(self._waiting, key=lambda s: s.chunk.priority)  # stable: first of top class
        if head.chunk.priority == 0:
            head = self._waiting[0]
        resident = self._cache.get(head.chunk.request_id)
        use_resident = resident is not None and resident[0] == head.context and head.fresh
        held = resident[1] if use_resident else 0
        return self._free_pages() + self._cache_pages - held >= self._admit_need(head, held)

    def _macro_step(self) -> StepReport | None:
        run = self._running
        b = len(run)
        ctx = np.fromiter((s.context for s in run), dtype=np.float64, count=b)
        pages = np.fromiter((s.pages + s.shared for s in run), dtype=np.float64, count=b)
        rem = np.fromiter((self._chunk_left(s) for s in run), dtype=np.float64, count=b)
        carry = np.fromiter((getattr(s, "carry", 0.0) for s in run), dtype=np.float64, count=b)
        gammas, rate = self._speculation(run, ctx)
        total_gamma = int(gammas.sum())
        # iterations until the first chunk ends (tokens after k its: floor(carry + k*rate))
        k_end = np.ceil((rem - carry) / rate - 1e-9)
        k = int(max(1.0, min(float(k_end.min()), self.macro_steps)))
        # pages: the largest k whose growth fits in free + evictable pages
        avail = self._free_pages() + self._cache_pages

        def extra_pages(kk: int) -> float:
            tok = np.minimum(np.floor(carry + kk * rate + 1e-9), rem)
            need = np.ceil((ctx + tok) / self.page_size) - pages
            return float(np.maximum(need, 0.0).sum())

        if extra_pages(k) > avail:
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if extra_pages(mid) <= avail:
                    lo = mid
                else:
                    hi = mid - 1
            if lo == 0:
                return None
            k = lo
        # duration: integrate the per-iteration step time over the growing context
        kv0 = float(ctx.sum())
        per_it = float(rate.sum())
        n_tok = b + total_gamma
        overhead = self.spec.draft_overhead_s if (self.spec and total_gamma) else 0.0

        def f(i: float) -> float:
            return self.step_time(b, 0, n_tok, int(kv0 + i * per_it)) + overhead

        if k == 1:
            duration = f(0)
        else:
            duration = k * (f(0) + 4.0 * f((k - 1) / 2.0) + f(k - 1)) / 6.0
        # commit
        tok = np.minimum(np.floor(carry + k * rate + 1e-9), rem)
        new_carry = np.where(tok >= rem, 0.0, carry + k * rate - tok)
        need = np.maximum(np.ceil((ctx + tok) / self.page_size) - pages, 0.0)
        self._evict_cache_until(int(need.sum()))
        ended: list[_Seq] = []
        io_bytes = 0
        for i, s in enumerate(run):
            t = int(tok[i])
            s.new_tokens += t
            s.context += t
            s.carry = float(new_carry[i])
            if need[i]:
                self._alloc(s, int(need[i]))
            if gammas[i]:
                s.spec_proposed = getattr(s, "spec_proposed", 0) + k * int(gammas[i])
                s.spec_accepted = getattr(s, "spec_accepted", 0) + max(0, t - k)
            if t >= rem[i]:
                ended.append(s)
        for s in ended:
            if s.generated < s.true_len and s.generated < s.chunk.original_max_tokens:
                io_bytes += self._export_bytes(s)
        duration += io_bytes / self.pool_bandwidth
        self._now += duration
        self.busy_s += duration
        self.steps += k
        self.iterations += k
        if total_gamma:
            self.spec_proposed += k * total_gamma
        emitted = int(tok.sum())
        self.spec_accepted += max(0, emitted - k * b) if total_gamma else 0
        for s in run:
            if s.first_token_at is None:
                s.first_token_at = self._now
        finished = []
        if ended:
            ended_ids = {id(s) for s in ended}
            self._running = [s for s in run if id(s) not in ended_ids]
            finished = [self._end_chunk(s) for s in ended]
        return StepReport(duration_s=duration, batch_size=b, num_tokens=emitted,
                          finished=finished)

    @staticmethod
    def _chunk_left(s: _Seq) -> int:
        c = s.chunk
        end = min(s.true_len, c.original_max_tokens, len(c.output_ids) + c.max_new_tokens)
        return max(1, end - s.generated)

    def _speculation(self, run: list[_Seq], ctx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Draft tokens per sequence and expected tokens per iteration (Alg. 1, see module doc)."""
        b = len(run)
        if self.spec is None or self.spec.gamma_max == 0:
            return np.zeros(b, dtype=np.int64), np.ones(b)
        sp = self.spec
        if self._by_finished is not None:  # measured rates by finished siblings
            if self.progress is None or self.progress.group_size <= 1:
                beta = np.broadcast_to(self._solo, (b, sp.gamma_max))
            else:
                cal = sp.calibration
                idx = np.fromiter(
                    (bucket_of(self.progress.finished_siblings(s.chunk.group_id,
                                                               s.chunk.request_id), cal.buckets)
                     for s in run), dtype=np.int64, count=b)
                beta = self._by_finished[idx]
        else:
            if self.progress is not None:
                w = np.fromiter(
                    (self.progress.siblings_ahead(s.chunk.group_id, s.chunk.request_id,
                                                  s.generated) for s in run),
                    dtype=np.float64, count=b,
                )
            else:
                w = np.zeros(b)
            beta = self._solo[None, :] + (self._acc - self._solo)[None, :] * w[:, None]
        c = np.cumprod(beta, axis=1)  # [b, g]: P(first j drafts all accepted)
        # the adaptive budget (seer_jax.drafting.budget): β from the batch's mean reach
        self._spec_kv = int(ctx.sum())
        budget = self._budget
        budget.stats.set_reach(c.mean(axis=0))
        plan = budget.plan(b, relax=False)
        if not plan.enabled:
            return np.zeros(b, dtype=np.int64), np.ones(b)
        gam = budget.allocate_expected(c, [s.chunk.priority for s in run], plan)
        cpad = np.concatenate([np.zeros((b, 1)), np.cumsum(c, axis=1)], axis=1)
        rate = 1.0 + cpad[np.arange(b), gam]
        return gam.astype(np.int64), rate

    def _spec_step_time(self, batch_size: int, gamma: int) -> float:
        """T(B, γ) for the budget: B sequences verifying γ draft tokens each (+ drafting)."""
        t = self.step_time(batch_size, 0, batch_size * (1 + gamma), self._spec_kv)
        return t + self.spec.draft_overhead_s if gamma else t

    # ---- outputs -----------------------------------------------------------------------------
    def _end_chunk(self, s: _Seq) -> ChunkResult:
        c = s.chunk
        if self.progress is not None:
            self.progress.update(c.group_id, c.request_id, s.generated,
                                 finished=s.generated >= min(s.true_len, c.original_max_tokens))
        if not self.cheap_tokens:
            res = super()._end_chunk(s)
        else:
            n = s.new_tokens
            g = s.generated
            if g >= c.original_max_tokens:
                toks, reason = [FIRST_PSEUDO_TOKEN_ID] * n, "length"
            elif g >= s.true_len:
                toks, reason = [FIRST_PSEUDO_TOKEN_ID] * (n - 1) + [EOS_TOKEN_ID], "eos"
            else:
                toks, reason = [FIRST_PSEUDO_TOKEN_ID] * n, None
            handle = None
            if reason is None:
                if self.pool is not None:
                    handle = self.pool.put(c.request_id, _SimKV(c.request_id, s.context),
                                           s.context * self.kv_bytes_per_token)
                if self.keep_resident:
                    self._cache[c.request_id] = (s.context, s.pages, c.group_id)
                    self._cache_pages += s.pages
                    self._used_pages -= s.pages
                    s.pages = 0
                else:
                    self._release(s)
            else:
                self._release(s)
            res = ChunkResult(
                request_id=c.request_id,
                instance_id=self.instance_id,
                new_token_ids=toks,
                new_logprobs=[0.0] * n,
                finish_reason=reason,
                kv_handle=handle,
                submitted_at=s.submitted_at,
                started_at=s.started_at if s.started_at is not None else s.submitted_at,
                ended_at=self._now,
                num_steps=n,
                preemptions=s.preemptions,
                kv_bytes_imported=s.bytes_imported,
                kv_bytes_exported=s.bytes_exported,
                reprefill_tokens=s.reprefill_tokens,
            )
        res.spec_proposed = getattr(s, "spec_proposed", 0)
        res.spec_accepted = getattr(s, "spec_accepted", 0)
        return res

    def timeline(self) -> np.ndarray:
        """[num_steps, 3] float64: start, end, batch size of every recorded step."""
        return np.stack([np.frombuffer(self.tl_start), np.frombuffer(self.tl_end),
                         np.frombuffer(self.tl_batch)], axis=1) if len(self.tl_start) else \
            np.zeros((0, 3))
