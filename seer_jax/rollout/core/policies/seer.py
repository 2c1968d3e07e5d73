"""`seer`: context-aware scheduling, Seer paper §4.3.

Four ordering rules (`estimator` option):

- `"hedged"` (default): first-come-first-served over the request buffer, as `request_fcfs` (a
  request whose chunk ended goes to the back of the line), except that a request with strong
  evidence of being a lone long sibling is served first (ties: lower enqueue number first): at
  least half of its group has finished (`HEDGE_MIN_FINISHED`), the finished responses agree
  (the longest at most `HEDGE_SPREAD` (3) times the shortest), and it has generated more than
  `HEDGE_OUTLIVE` (6) times the longest. No probes, no length model. Why: a synchronous RL
  iteration waits for its last response, so the makespan is what counts, and every rule that
  reorders on weaker evidence lost makespan to FCFS somewhere. On the memory-bound Moonlight
  preset (KV for ~230K tokens per instance) serving the longest-looking requests first fills
  the KV budget with long contexts, so the posterior's ranking, a 2x-of-the-shortest outlive
  rule, and this rule without the agreement condition all made the makespan longer than
  FCFS's on some seeds (so did 4x instead of 6x); probes (one high-priority sample per group) moved the small preset's
  makespan a few percent either way. What pays is the lone long sibling of a bimodal group on
  real reasoning traces (six responses stop at 1-2K tokens, one loops towards the cap): FCFS
  sends it to the back of the line after each chunk, so it finishes last. Where the evidence
  never gets that strong (the synthetic presets' log-normal groups, whose G samples spread
  wider), the order is exactly FCFS's.
- `"posterior"`: each request's remaining length is read off a hierarchical
  log-normal length model fitted online to the rollout itself (`length_model`): finished
  siblings are exact lengths, unfinished ones (this request included) are censored at what they
  have generated. The key is the `quantile` (default 0.995) of the request's remaining length,
  longest first (ties: lower enqueue number first). A request that has generated more than
  twice its group's shortest finished response has *outlived* its group: its key is raised to
  at least `max_tokens - generated`, as if its group were unknown. Why: on a real reasoning
  trace (AIME, configs/sim/r1_aime.py) groups are often bimodal (six responses at 1-2K tokens
  and two that loop towards the cap), the fitted log-normal is far too thin-tailed for that, and
  without the exit the model deferred those lone long siblings to the end of the rollout (0.89x
  FCFS); with it seer is on par with FCFS there (the first finisher's information is only
  worth something when exact: see the analysis bounds `oracle_first_finish` and
  `oracle_conditional_max`), and on the synthetic presets, whose within-group spread is
  log-normal, the model's ranking cuts the tail by three quarters. Probes: while a group has no
  finished request its sample 0 sits in a high-priority queue ordered shortest generated first
  (ChunkRequest.priority 1), so each group reveals a length early.
- `"first_finisher"`: first-come-first-served over the request buffer, with two offsets
  on a request's place in line (its enqueue number; units: requests dispatched, "pops"):
  - progress: + N * generated / (2 * max_tokens) (N = requests in the rollout): a request that
    has generated more lets fresher ones pass, by at most half a round at the cap;
  - deferral: + `defer` * N (default 0.375, about one chunk round) for a request of a *known
    short* group, one whose shortest finished response stopped under `short_fraction` *
    max_tokens (default 0.1875), while the request itself has generated at most twice that
    shortest length (the same outlive exit), and only while the pooled within-group log sd of
    finished lengths stays under 0.5. A group without a finished response is never deferred.
  Ties (same offset sum): lower enqueue number first. Nothing is deferred without bound, so no
  starvation guard is needed; no probes. It stays within ~1% of FCFS everywhere (it never
  cuts the tail).
- `"max_finished"` (the paper's rule, probes as above): L_g = max output length among the
  group's finished requests, raised to the most tokens an unfinished sibling has generated;
  the original max_tokens while none has finished. Ties: the group whose requests have generated
  most, then lower sample index, then group order.
The controller updates the group whenever a chunk ends and the policy re-keys the group's
buffered siblings.
- Starvation guard: a request that has stayed in the buffer while more than `starvation_pops`
  other requests were popped is served next, oldest first (auto: N with `max_finished`, 4N with
  `posterior`, 0 = off with `first_finisher`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from seer_jax.errors import ConfigError
from seer_jax.rollout.core.policies.base import GroupState, LazyHeap, Policy, RequestState
from seer_jax.rollout.core.policies.length_model import GroupLengthModel, LengthParams

ESTIMATORS = ("hedged", "first_finisher", "posterior", "max_finished")
DEFER = 0.375  # first_finisher: deferral, in rollouts' request counts
SHORT_FRACTION = 0.1875  # first_finisher: "short" first finisher, as a share of max_tokens
SPREAD_GATE = 0.5  # first_finisher: no deferral once the within-group log sd exceeds this
SPREAD_MIN_DF = 20  # ... measured on at least this many degrees of freedom
HEDGE_OUTLIVE = 6  # hedged: served first past this many times the longest finished sibling
HEDGE_MIN_FINISHED = 0.5  # ... once at least this share of its group has finished
HEDGE_SPREAD = 3  # ... and its longest finished response is at most this many x the shortest
OUTLIVE = 2  # a request past OUTLIVE x its group's shortest finished response has outlived it
# (hedged: served first; posterior: ranked as unknown; first_finisher: never deferred)


def posterior_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the posterior estimator where they name none, hedged or first_finisher
    (for analysis variants that replace the posterior's estimates)."""
    out = dict(options)
    if out.get("estimator") in (None, "hedged", "first_finisher"):
        out["estimator"] = "posterior"
    return out


class SeerPolicy(Policy):
    name = "seer"
    divided = True
    kv_admission = True
    option_keys = ("estimator", "quantile", "starvation_pops", "length_prior", "defer",
                   "short_fraction")

    def __init__(self) -> None:
        super().__init__()
        self._probes = LazyHeap()
        self._lfs = LazyHeap()
        self._fifo = LazyHeap()
        self._pops_at_enqueue: dict[str, int] = {}
        self.starvation_pops = 0
        self.starved_pops = 0  # how often the guard fired
        self.estimator = "hedged"
        self.defer = DEFER
        self.short_fraction = SHORT_FRACTION
        self._defer_pops = 0.0
        self._pops_per_token = 0.0
        self._shortest: dict[str, int] = {}  # group_id -> shortest finished response
        self._gstats: dict[str, tuple[int, float, float]] = {}  # n, sum, sum sq of log lengths
        self._ss = 0.0  # pooled within-group sum of squares of finished log lengths
        self._df = 0
        self._gate = True
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
        est = options.get("estimator") or "hedged"
        if est not in ESTIMATORS:
            raise ConfigError(f"seer estimator={est!r} is unknown; allowed: {list(ESTIMATORS)}")
        limit = options.get("starvation_pops")
        # auto: the number of requests for the paper's estimator; for the posterior, which defers
        # only what it is confident is short, a 4x more patient backstop guard (the quantile is the
        # guard); none for first_finisher and hedged, whose delays are bounded by construction
        auto = len(self.requests) * {"posterior": 4, "max_finished": 1}.get(est, 0)
        self.starvation_pops = auto if limit is None or int(limit) < 0 else int(limit)
        self.estimator = est
        q = options.get("quantile")
        self.quantile = 0.995 if q is None else float(q)
        if not 0.0 < self.quantile < 1.0:
            raise ConfigError(f"seer quantile={q!r} is invalid; allowed: a number in (0, 1)")
        for key, default in (("defer", DEFER), ("short_fraction", SHORT_FRACTION)):
            v = options.get(key)
            v = default if v is None else float(v)
            if not 0.0 <= v <= (1.0 if key == "short_fraction" else 1e9):
                raise ConfigError(f"seer {key}={options.get(key)!r} is invalid; allowed: a number "
                                  f"in [0, {'1' if key == 'short_fraction' else 'inf'})")
            setattr(self, key, v)
        n = len(self.requests)
        self._defer_pops = self.defer * n
        self._pops_per_token = n / (2.0 * max((g.max_tokens for g in groups), default=1))
        for g in groups:
            for r in g.requests:
                r.is_probe = r.sample_index == 0 and est in ("posterior", "max_finished")
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

    def deferred(self, req: RequestState) -> bool:
        """first_finisher: `req` is in a known short group and has not outlived it."""
        m = self._shortest.get(req.group_id)
        return (self._gate and m is not None and m < self.short_fraction * req.group.max_tokens
                and req.generated <= OUTLIVE * m)

    def outlived(self, req: RequestState) -> bool:
        """`req` has generated more than OUTLIVE x its group's shortest finished response."""
        m = self._shortest.get(req.group_id)
        return m is not None and req.generated > OUTLIVE * m

    def lone_long(self, req: RequestState) -> bool:
        """hedged: `req`'s group has mostly finished, its finished responses agree (longest <=
        HEDGE_SPREAD x shortest) and `req` has generated more than HEDGE_OUTLIVE x the longest."""
        g = req.group
        m = g.finished_max_len
        return (m is not None and g.num_finished >= HEDGE_MIN_FINISHED * len(g.requests)
                and m <= HEDGE_SPREAD * self._shortest.get(req.group_id, m)
                and req.generated > HEDGE_OUTLIVE * m)

    def place(self, req: RequestState) -> float:
        """first_finisher: `req`'s place in line (lower first; ties by enqueue number)."""
        return (req.enqueue_seq + self._pops_per_token * req.generated
                + (self._defer_pops if self.deferred(req) else 0.0))

    def _note_spread(self, req: RequestState) -> None:
        """Pooled within-group sd of finished log lengths; deferral is on while it is below
        SPREAD_GATE (a first finisher predicts its siblings only when they are close)."""
        y = math.log(max(1, req.generated))
        n, s1, s2 = self._gstats.get(req.group_id, (0, 0.0, 0.0))
        if n:
            self._ss -= s2 - s1 * s1 / n
            self._df -= n - 1
        n, s1, s2 = n + 1, s1 + y, s2 + y * y
        self._gstats[req.group_id] = (n, s1, s2)
        self._ss += s2 - s1 * s1 / n
        self._df += n - 1
        gate = not (self._df >= SPREAD_MIN_DF and self._ss / self._df > SPREAD_GATE**2)
        if gate != self._gate:
            self._gate = gate
            self._model_version += 1
            for g in self.groups:
                self._rekey(g)

    def estimate_remaining(self, req: RequestState) -> int | None:
        if self.estimator in ("hedged", "first_finisher"):
            return None
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
        if self.estimator == "hedged":
            key = (0 if self.lone_long(req) else 1, req.enqueue_seq)
        elif self.estimator == "first_finisher":
            key = (self.place(req), req.enqueue_seq)
        elif self.model is not None:
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
        m = self._shortest.get(req.group_id)
        self._shortest[req.group_id] = req.generated if m is None else min(m, req.generated)
        if self.estimator == "first_finisher":
            self._note_spread(req)
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
                if self.outlived(r):
                    # outlived its group: the fitted model no longer speaks for it (a lone long
                    # sibling, often a response looping to the cap); rank it as unknown
                    v = max(float(v), r.max_tokens - r.generated)
                self._remaining[r.request_id] = float(v)

    def _rekey(self, g: GroupState) -> None:
        # the group changed (estimate, progress, version) or the model was refitted: re-key the
        # buffered siblings (a probe whose group now has an estimate leaves the probe class)
        for r in g.requests:
            if r.in_buffer and not self.probe_active(r):
                self._push_lfs(r)
