"""`seer`: context-aware scheduling, Seer paper §4.3.

- Every group has one *probe* request (its sample 0). While the group has no finished request,
  its probe sits in a high-priority queue ordered *shortest generated so far first* (SFS), so
  every group quickly produces a length signal. Probe chunks carry ChunkRequest.priority 1.
- Otherwise requests are picked *longest expected first* (approximate longest-job-first), by one
  of two estimators (`estimator` option):
  - `"posterior"` (default): each request's remaining length is read off a hierarchical
    log-normal length model fitted online to the rollout itself (`length_model`): finished
    siblings are exact lengths, unfinished ones (this request included) are censored at what
    they have generated, and the population's prompt effect and within-group spread are
    refitted as responses finish. The key is the `quantile` (default 0.995) of the request's
    remaining length: a request is deferred only when the evidence says it is short with high
    confidence. That hedges against the outliers that make the tail (a long sibling of a group
    whose first finisher was short), and a request that keeps generating past its siblings
    rises by itself. Where lengths carry no group signal the order falls back to
    first-come-first-served round robin.
  - `"max_finished"` (the paper's rule): L_g = max output length among the group's finished
    requests, the original max_tokens while none has finished (unknown groups are assumed long).
    Our refinement: once known, L_g is raised to the most tokens an unfinished sibling has
    already generated (the group is at least that long). Ties (e.g. all unknown groups at
    max_tokens): the group whose requests have generated most so far, then lower sample index
    (so unknown groups advance one sibling each in turn), then group order.
  The controller updates the group whenever a chunk ends and the policy re-keys the group's
  buffered siblings.
- Starvation guard: a request that has stayed in the buffer while more than `starvation_pops`
  other requests were popped is served next, oldest first (default: the number of requests in
  the batch with `max_finished`, four times that with `posterior`, whose quantile already hedges
  against bad estimates; 0 disables the guard). This bounds the damage of a bad estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from seer_jax.errors import ConfigError
from seer_jax.rollout.policies.base import GroupState, LazyHeap, Policy, RequestState
from seer_jax.rollout.policies.length_model import GroupLengthModel, LengthParams

ESTIMATORS = ("posterior", "max_finished")


class SeerPolicy(Policy):
    name = "seer"
    divided = True
    kv_admission = True
    option_keys = ("estimator", "quantile", "starvation_pops", "length_prior")

    def __init__(self) -> None:
        super().__init__()
        self._probes = LazyHeap()
        self._lfs = LazyHeap()
        self._fifo = LazyHeap()
        self._pops_at_enqueue: dict[str, int] = {}
        self.starvation_pops = 0
        self.starved_pops = 0  # how often the guard fired
        self.estimator = "posterior"
        self.quantile = 0.995
        self.model: GroupLengthModel | None = None
        self._model_version = 0
        self._remaining: dict[str, float] = {}  # request_id -> quantile of remaining tokens
        self._seen: dict[str, int] = {}  # request_id -> tokens generated when last seen
        self._finished = 0
        # tokens generated so far, as observed (not the base class's buffer counter `_tokens`:
        # sharing it made every re-queue count as generated tokens and trigger refits)
        self._observed_tokens = 0
        self._fit_finished = 0
        self._fit_tokens = 0

    def bind(self, groups: Sequence[GroupState], options: dict[str, Any]) -> None:
        super().bind(groups, options)
        est = options.get("estimator") or "posterior"
        if est not in ESTIMATORS:
            raise ConfigError(f"seer estimator={est!r} is unknown; allowed: {list(ESTIMATORS)}")
        limit = options.get("starvation_pops")
        # auto: the number of requests for the paper's estimator; for the posterior, which defers
        # only what it is confident is short, a 4x more patient backstop guard (the quantile is the guard)
        auto = len(self.requests) * (4 if est == "posterior" else 1)
        self.starvation_pops = auto if limit is None or int(limit) < 0 else int(limit)
        self.estimator = est
        q = options.get("quantile")
        self.quantile = 0.995 if q is None else float(q)
        if not 0.0 < self.quantile < 1.0:
            raise ConfigError(f"seer quantile={q!r} is invalid; allowed: a number in (0, 1)")
        for g in groups:
            for r in g.requests:
                r.is_probe = r.sample_index == 0
        if est == "posterior" and groups:
            prior = options.get("length_prior")
            if prior is not None and not isinstance(prior, LengthParams):
                prior = LengthParams(**dict(prior))
            self.model = GroupLengthModel(max(g.max_tokens for g in groups), prior=prior)
            for g in groups:
                self._update_group(g)

    @property
    def length_params(self) -> LengthParams | None:
        """The fitted length model (posterior estimator), None otherwise."""
        return None if self.model is None else self.model.params

    def probe_active(self, req: RequestState) -> bool:
        return req.is_probe and req.group.finished_max_len is None

    def estimate_remaining(self, req: RequestState) -> int | None:
        if self.model is not None:
            return max(1, int(round(self._remaining.get(req.request_id, req.remaining))))
        g = req.group
        if g.finished_max_len is None or g.length_estimate <= req.generated:
            return None
        return g.length_estimate - req.generated

    def priority(self, req: RequestState) -> int:
        return 1 if self.probe_active(req) else 0

    def push(self, req: RequestState, requeue: bool = False) -> None:
        if not requeue:
            self._pops_at_enqueue[req.request_id] = self.pops
        super().push(req, requeue)

    def _push(self, req: RequestState) -> None:
        if self.starvation_pops > 0:
            self._fifo.push((req.enqueue_seq,), req)
        if self.probe_active(req):
            self._probes.push((req.generated, req.enqueue_seq), req)
        else:
            self._push_lfs(req)

    def _push_lfs(self, req: RequestState) -> None:
        g = req.group
        if self.model is not None:
            key = (-self._remaining[req.request_id], req.enqueue_seq)
        else:
            key = (-g.length_estimate, -g.max_generated, req.sample_index, g.index)
        self._lfs.push(key, req, extra=(g.version, self._model_version))

    def _pop(self) -> RequestState | None:
        if self.starvation_pops > 0:
            oldest = self._fifo.peek(lambda r, t, _: self._live(r, t))
            if (
                oldest is not None
                and self.pops - self._pops_at_enqueue[oldest.request_id] > self.starvation_pops
            ):
                self.starved_pops += 1
                return oldest
        probe = self._probes.peek(lambda r, t, _: self._live(r, t) and self.probe_active(r))
        if probe is not None:
            return probe
        return self._lfs.peek(
            lambda r, t, v: self._live(r, t) and v == (r.group.version, self._model_version))

    def on_request_finished(self, req: RequestState) -> None:
        self._finished += 1
        self._observe(req)

    def on_chunk_end(self, req: RequestState) -> None:
        self._observe(req)

    # ---- internals ------------------------------------------------------------------------------
    def _observe(self, req: RequestState) -> None:
        if self.model is not None:
            self._observed_tokens += req.generated - self._seen.get(req.request_id, 0)
            self._seen[req.request_id] = req.generated
            if self._refit_due():
                self._refit()
                return
            self._update_group(req.group)
        self._rekey(req.group)

    def wants_progress(self) -> bool:
        # in-flight progress censors running requests' lengths: without it the early fits see
        # only the responses short enough to have finished
        return self.model is not None and self._refit_due(pending=1)

    def _refit_due(self, pending: int = 0) -> bool:
        """Refit when finishes grew by a third (>= 4) or generated tokens by half since the
        last fit: about log(N) fits per rollout, dense early when the estimate moves most.
        `pending`: a finish about to be reported."""
        df = self._finished + pending - self._fit_finished
        if df >= max(4, self._fit_finished // 3):
            return True
        return self._fit_tokens > 0 and self._observed_tokens >= 1.5 * self._fit_tokens and df >= 1 \
            or self._fit_tokens == 0 and self._observed_tokens >= 4 * len(self.requests)

    def _refit(self) -> None:
        assert self.model is not None
        self.model.fit(self.groups)
        self._fit_finished, self._fit_tokens = self._finished, self._observed_tokens
        self._model_version += 1
        for g in self.groups:
            self._update_group(g)
            self._rekey(g)

    def _update_group(self, g: GroupState) -> None:
        """Recompute the group's posterior and its unfinished requests' remaining quantiles."""
        assert self.model is not None
        post = self.model.posterior(g)
        live = [r for r in g.requests if r.status != "done"]
        if live:
            rem = self.model.remaining_quantile(g, live, self.quantile, posterior=post)
            for r, v in zip(live, rem, strict=True):
                self._remaining[r.request_id] = float(v)

    def _rekey(self, g: GroupState) -> None:
        # the group changed (estimate, progress, version) or the model was refitted: re-key the
        # buffered siblings (a probe whose group now has an estimate leaves the probe class)
        for r in g.requests:
            if r.in_buffer and not self.probe_active(r):
                self._push_lfs(r)
