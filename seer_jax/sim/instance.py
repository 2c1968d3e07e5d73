"""A simulated inference instance implementing `seer_jax.rollout.core.instance.Instance`.

It behaves like a continuous-batching engine (vLLM / our JAX engine) without a model:
- KV capacity in pages of `page_size` tokens; a running request holds ceil(context / page_size)
  pages, context = prompt + tokens generated so far;
- admission (FIFO, probes first) by free pages: a waiting chunk is admitted when the pages for its
  current context plus one token are free (evicting cached KV of finished chunks, LRU); it is *not*
  reserved for its whole chunk, so an instance that is given too much work overcommits and then
  preempts (the most recently admitted request is dropped and recomputed later, like vLLM's
  recompute preemption). The controller's KV-budget admission avoids that;
- chunked prefill: at most `max_prefill_tokens` prompt/context tokens per step; the step that
  completes a prefill also emits the first token; group prompt prefix caching (a sibling's prompt
  resident here makes the prompt free to prefill);
- output lengths are predetermined per request (`lengths`, from the workload): the request emits
  EOS as its `length`-th token (finish "eos"); at or beyond `original_max_tokens` it is truncated
  there (finish "length", no EOS), the convention of `sim.workloads`;
- tokens are pseudo tokens derived from (request_id, position) (`pseudo_tokens`), logprobs
  likewise, so tests can check that chunking and migration preserve the token sequence;
- KV of an unfinished chunk is exported to the global pool (`KVPool.put`) and kept resident as
  evictable cache (affinity); a chunk arriving with a pool handle imports it when not resident,
  else it re-prefills prompt + output. Pool transfers cost nbytes / `pool_bandwidth_bytes_per_s`,
  added to the step in which they happen;
- step duration = `step_time(batch_size, num_prefill_tokens, num_decode_tokens, kv_tokens_read)`
  (a pluggable cost model; `RooflineStepTime` by default) plus pool transfer time;
- `fail_at_s`: the instance is lost at that time (step/submit raise `InstanceLostError`).

The clock is virtual: `step()` advances it by the modelled duration. Sampling params are ignored
(lengths are given). Pure Python; cost per step is O(batch size).
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from collections.abc import Callable, Mapping

import numpy as np

from seer_jax.errors import ConfigError, SeerError
from seer_jax.rollout.core.instance import InstanceLostError, KVPool
from seer_jax.rollout.core.types import ChunkRequest, ChunkResult, InstanceLoad, StepReport

StepTimeFn = Callable[[int, int, int, int], float]

EOS_TOKEN_ID = 2
FIRST_PSEUDO_TOKEN_ID = 3


@dataclasses.dataclass(frozen=True)
class RooflineStepTime:
    """Default step cost: fixed overhead + max(memory time, compute time).

    memory = weights read once per step + KV read (tokens attended over, summed over the batch);
    compute = tokens processed (prefill + decode) x per-token FLOP time. Defaults are roughly a 7B
    dense model on one H800-class accelerator: 14 GB weights at ~3 TB/s, ~128 KiB KV per token,
    ~14 GFLOP per token at ~450 TFLOP/s effective.
    """

    overhead_s: float = 0.002
    weights_s: float = 0.0047
    kv_s_per_token: float = 4.4e-8
    compute_s_per_token: float = 3.1e-5

    def __call__(
        self, batch_size: int, num_prefill_tokens: int, num_decode_tokens: int, kv_tokens_read: int
    ) -> float:
        if batch_size == 0:
            return 0.0
        memory = self.weights_s + kv_tokens_read * self.kv_s_per_token
        compute = (num_prefill_tokens + num_decode_tokens) * self.compute_s_per_token
        return self.overhead_s + max(memory, compute)


def pseudo_tokens(request_id: str, start: int, n: int, vocab_size: int = 49152) -> list[int]:
    """Deterministic pseudo tokens for positions [start, start+n) of a request's output, never EOS."""
    if n <= 0:
        return []
    base = np.uint64(zlib.crc32(request_id.encode()))
    pos = np.arange(start, start + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = (pos * np.uint64(0x9E3779B97F4A7C15)) ^ (base * np.uint64(0xBF58476D1CE4E5B9))
        h ^= h >> np.uint64(31)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(29)
    span = np.uint64(vocab_size - FIRST_PSEUDO_TOKEN_ID)
    return (h % span + np.uint64(FIRST_PSEUDO_TOKEN_ID)).astype(np.int64).tolist()


def pseudo_logprobs(request_id: str, start: int, n: int) -> list[float]:
    """Deterministic pseudo logprobs in (-5, 0] for positions [start, start+n)."""
    toks = np.asarray(pseudo_tokens(request_id, start, n, vocab_size=1 << 20), dtype=np.float64)
    return (-(toks % 5000) / 1000.0).tolist()


def expected_output(
    request_id: str, length: int, max_tokens: int, vocab_size: int = 49152
) -> tuple[list[int], str]:
    """The full output a SimulatedInstance produces for a request of true `length`, and its finish
    reason ("eos" when length < max_tokens, else "length": a response at the cap is truncated)."""
    if length < max_tokens:
        return pseudo_tokens(request_id, 0, length - 1, vocab_size) + [EOS_TOKEN_ID], "eos"
    return pseudo_tokens(request_id, 0, max_tokens, vocab_size), "length"


@dataclasses.dataclass
class _SimKV:
    """The blob the simulated instance stores in the pool: which request, how many tokens."""

    request_id: str
    num_tokens: int


@dataclasses.dataclass
class _Seq:
    chunk: ChunkRequest
    true_len: int
    submitted_at: float
    context: int  # tokens whose KV this request holds (or will, once prefilled)
    new_tokens: int = 0
    prefill_remaining: int = 0
    pages: int = 0
    started_at: float | None = None
    first_token_at: float | None = None
    preemptions: int = 0
    reprefill_tokens: int = 0
    bytes_imported: int = 0
    bytes_exported: int = 0
    fresh: bool = True  # not yet admitted once (decides KV source on admission)
    shared: int = 0  # full prompt pages shared with the group's other holders here (prefix cache)

    @property
    def generated(self) -> int:
        return len(self.chunk.output_ids) + self.new_tokens


class SimulatedInstance:
    """See the module docstring. `lengths` maps request_id -> true output length (tokens incl. EOS),
    or is a callable(ChunkRequest) -> length."""

    def __init__(
        self,
        instance_id: int,
        lengths: Mapping[str, int] | Callable[[ChunkRequest], int],
        *,
        pool: KVPool | None = None,
        kv_capacity_pages: int = 4096,
        page_size: int = 16,
        max_batch_size: int = 256,
        max_prefill_tokens: int = 8192,
        step_time: StepTimeFn | None = None,
        kv_bytes_per_token: int = 131072,
        pool_bandwidth_bytes_per_s: float = 25e9,
        keep_resident: bool = True,
        prefix_caching: bool = True,
        vocab_size: int = 49152,
        fail_at_s: float | None = None,
        start_time: float = 0.0,
    ):
        for key, value, ok in (
            ("kv_capacity_pages", kv_capacity_pages, kv_capacity_pages > 0),
            ("page_size", page_size, page_size > 0),
            ("max_batch_size", max_batch_size, max_batch_size > 0),
            ("max_prefill_tokens", max_prefill_tokens, max_prefill_tokens > 0),
            ("kv_bytes_per_token", kv_bytes_per_token, kv_bytes_per_token >= 0),
            ("pool_bandwidth_bytes_per_s", pool_bandwidth_bytes_per_s, pool_bandwidth_bytes_per_s > 0),
        ):
            if not ok:
                raise ConfigError(f"SimulatedInstance {key}={value} is invalid; allowed: > 0")
        self.instance_id = instance_id
        self.lengths = lengths
        self.pool = pool
        self.total_pages = kv_capacity_pages
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.step_time = step_time or RooflineStepTime()
        self.kv_bytes_per_token = kv_bytes_per_token
        self.pool_bandwidth = pool_bandwidth_bytes_per_s
        self.keep_resident = keep_resident
        self.prefix_caching = prefix_caching
        self.vocab_size = vocab_size
        self.fail_at_s = fail_at_s
        self.lost = False

        self._now = start_time
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._used_pages = 0  # pages held by running requests
        # request_id -> (context tokens, pages, group_id); evictable, LRU order
        self._cache: collections.OrderedDict[str, tuple[int, int, str]] = collections.OrderedDict()
        self._cache_pages = 0
        self._group_refs: collections.Counter[str] = collections.Counter()
        self._group_prompt_len: dict[str, int] = {}
        # the full pages of a group's prompt are held once while any request of the group (running
        # or cached) is here, like the engine's prefix cache; each request holds the rest
        self._shared_total = 0
        # statistics
        self.peak_used_pages = 0
        self.total_preemptions = 0
        self.busy_s = 0.0
        self.steps = 0

    # ---- Instance protocol -------------------------------------------------------------------
    def now(self) -> float:
        return self._now

    def set_now(self, t: float) -> None:
        if t > self._now:
            self._now = t

    def submit(self, chunk: ChunkRequest) -> None:
        self._check_alive()
        ctx = len(chunk.prompt_ids) + len(chunk.output_ids)
        if self._pages(ctx + chunk.max_new_tokens) > self.total_pages:
            raise SeerError(
                f"instance {self.instance_id}: chunk of {chunk.request_id} needs "
                f"{self._pages(ctx + chunk.max_new_tokens)} KV pages, capacity is {self.total_pages}"
            )
        if chunk.max_new_tokens <= 0:
            raise SeerError(f"chunk of {chunk.request_id} has max_new_tokens={chunk.max_new_tokens}")
        true_len = self._true_len(chunk)
        seq = _Seq(chunk=chunk, true_len=true_len, submitted_at=self._now, context=ctx)
        self._waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def load(self) -> InstanceLoad:
        return InstanceLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            free_kv_pages=self.total_pages - self._used_pages - self._shared_total,
            total_kv_pages=self.total_pages,
            page_size=self.page_size,
            max_running=self.max_batch_size,
        )

    def resident_tokens(self, request_id: str, group_id: str) -> int:
        entry = self._cache.get(request_id)
        if entry is not None:
            return entry[0]
        for s in self._running:
            if s.chunk.request_id == request_id:
                return s.context
        if self._group_refs.get(group_id, 0) > 0:
            return self._group_prompt_len.get(group_id, 0)
        return 0

    def running_progress(self) -> dict[str, int]:
        return {s.chunk.request_id: s.generated for s in self._running}

    def abort(self, request_id: str) -> None:
        for s in list(self._waiting):
            if s.chunk.request_id == request_id:
                self._waiting.remove(s)
        for s in list(self._running):
            if s.chunk.request_id == request_id:
                self._release(s)
                self._running.remove(s)

    def step(self) -> StepReport:
        self._check_alive()
        if self.fail_at_s is not None and self._now >= self.fail_at_s:
            self.lost = True
            raise InstanceLostError(f"simulated instance {self.instance_id} lost at t={self._now:.3f}s")
        step_start = self._now
        io_bytes = self._admit(step_start)
        # Reserve a page slot for every token emitted this step; preempt when out of pages.
        self._grow_pages()
        prefill_tokens = 0
        decode_tokens = 0
        kv_read = 0
        budget = self.max_prefill_tokens
        emitters: list[_Seq] = []
        for s in self._running:
            if s.prefill_remaining > 0:
                take = min(s.prefill_remaining, budget)
                budget -= take
                prefill_tokens += take
                kv_read += s.context - s.prefill_remaining + take
                s.prefill_remaining -= take
                if s.prefill_remaining == 0:
                    emitters.append(s)
            else:
                decode_tokens += 1
                kv_read += s.context
                emitters.append(s)
        batch = len(self._running)
        finished: list[ChunkResult] = []
        # emit tokens, then decide chunk ends (export costs land in this step)
        ended: list[_Seq] = []
        for s in emitters:
            s.new_tokens += 1
            s.context += 1
            if s.first_token_at is None:
                s.first_token_at = -1.0  # filled with the step end below
            g = s.generated
            if g >= s.true_len or g >= s.chunk.original_max_tokens or s.new_tokens >= s.chunk.max_new_tokens:
                ended.append(s)
        for s in ended:
            if s.generated < s.true_len and s.generated < s.chunk.original_max_tokens:
                io_bytes += self._export_bytes(s)
        duration = self.step_time(batch, prefill_tokens, decode_tokens, kv_read)
        duration += io_bytes / self.pool_bandwidth
        self._now = step_start + duration
        if batch:
            self.busy_s += duration
        self.steps += 1
        for s in emitters:
            if s.first_token_at == -1.0:
                s.first_token_at = self._now
        for s in ended:
            self._running.remove(s)
            finished.append(self._end_chunk(s))
        return StepReport(
            duration_s=duration,
            batch_size=batch,
            num_tokens=prefill_tokens + decode_tokens,
            finished=finished,
        )

    # ---- internals ---------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.lost:
            raise InstanceLostError(f"simulated instance {self.instance_id} is lost")

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _true_len(self, chunk: ChunkRequest) -> int:
        if callable(self.lengths):
            n = int(self.lengths(chunk))
        else:
            if chunk.request_id not in self.lengths:
                raise SeerError(f"SimulatedInstance has no output length for {chunk.request_id!r}")
            n = int(self.lengths[chunk.request_id])
        if n < 1:
            raise SeerError(f"output length of {chunk.request_id!r} must be >= 1, got {n}")
        return n

    def _free_pages(self) -> int:
        return self.total_pages - self._used_pages - self._cache_pages - self._shared_total

    def _prompt_pages(self, prompt_len: int) -> int:
        return prompt_len // self.page_size if self.prefix_caching else 0

    def _own_pages(self, s: _Seq, tokens: int) -> int:
        return max(0, self._pages(tokens) - s.shared)

    def _admit_need(self, s: _Seq, held: int) -> int:
        """Pages admitting `s` takes now: its own pages for context + 1 beyond `held`, plus the
        group's shared prompt pages when no request of the group is here."""
        sp = self._prompt_pages(len(s.chunk.prompt_ids))
        first = self._group_refs.get(s.chunk.group_id, 0) == 0
        return max(0, self._pages(s.context + 1) - sp) - held + (sp if first else 0)

    def _ref(self, gid: str) -> None:
        if self._group_refs[gid] == 0:
            self._shared_total += self._prompt_pages(self._group_prompt_len[gid])
        self._group_refs[gid] += 1

    def _unref(self, gid: str) -> None:
        self._group_refs[gid] -= 1
        if self._group_refs[gid] == 0:
            self._shared_total -= self._prompt_pages(self._group_prompt_len[gid])

    def _evict_cache_until(self, need, keep: str | None = None) -> bool:
        """Evict cached KV (LRU) until `need` pages are free; `need` may be a callable (what is
        needed can change as evictions release a group's shared prompt pages)."""
        want = need if callable(need) else (lambda: need)
        for rid in list(self._cache):
            if self._free_pages() >= want():
                break
            if rid == keep:
                continue
            self._drop_cache(rid)
        return self._free_pages() >= want()

    def _drop_cache(self, rid: str) -> None:
        _, pages, gid = self._cache.pop(rid)
        self._cache_pages -= pages
        self._unref(gid)

    def _admit(self, now: float) -> int:
        io_bytes = 0
        # probes (priority 1) first, FIFO within a class
        if any(s.chunk.priority for s in self._waiting):
            self._waiting = collections.deque(
                sorted(self._waiting, key=lambda s: -s.chunk.priority)
            )
        while self._waiting and len(self._running) < self.max_batch_size:
            s = self._waiting[0]
            rid, gid = s.chunk.request_id, s.chunk.group_id
            plen = len(s.chunk.prompt_ids)
            resident = self._cache.get(rid)
            use_resident = resident is not None and resident[0] == s.context and s.fresh
            held = resident[1] if use_resident else 0
            if not self._evict_cache_until(lambda s=s, held=held: self._admit_need(s, held),
                                           keep=rid if use_resident else None):
                break
            self._waiting.popleft()
            group_prompt_here = self.prefix_caching and self._group_refs.get(gid, 0) > 0
            if use_resident:
                self._drop_cache(rid)
                s.prefill_remaining = 0
            elif s.fresh and s.chunk.kv_handle is not None and self._import(s):
                io_bytes += s.bytes_imported
                s.prefill_remaining = 0
            else:
                # first chunk: prefill the prompt; continuation or preempted: recompute context
                cached = plen if group_prompt_here else 0
                s.prefill_remaining = max(1, s.context - cached)
                if s.generated > 0:
                    s.reprefill_tokens += s.context
            if not use_resident and rid in self._cache:
                self._drop_cache(rid)  # stale copy
            s.fresh = False
            s.shared = self._prompt_pages(plen)
            s.pages = held
            self._used_pages += held
            self._group_prompt_len[gid] = plen
            self._ref(gid)
            self._alloc(s, self._own_pages(s, s.context) - s.pages)
            if s.started_at is None:
                s.started_at = now
            self._running.append(s)
        return io_bytes

    def _import(self, s: _Seq) -> bool:
        if self.pool is None:
            return False
        blob = self.pool.get(s.chunk.kv_handle)
        if not isinstance(blob, _SimKV) or blob.num_tokens != s.context:
            return False
        s.bytes_imported += s.context * self.kv_bytes_per_token
        return True

    def _alloc(self, s: _Seq, pages: int) -> None:
        if pages <= 0:
            return
        s.pages += pages
        self._used_pages += pages
        if self._used_pages + self._cache_pages + self._shared_total > self.total_pages:
            raise AssertionError("simulated instance overcommitted its KV pages")  # internal bug
        self.peak_used_pages = max(self.peak_used_pages, self._used_pages + self._shared_total)

    def _grow_pages(self) -> None:
        i = 0
        while i < len(self._running):
            s = self._running[i]
            # a request that may emit a token this step needs room for context + 1
            need = self._own_pages(s, s.context + 1) - s.pages
            if need <= 0 or self._evict_cache_until(need):
                self._alloc(s, max(0, need))
                i += 1
                continue
            # out of pages: preempt the most recently admitted running request (recompute)
            victim = self._running[-1]
            self._running.pop()
            self._release(victim)
            victim.preemptions += 1
            self.total_preemptions += 1
            victim.prefill_remaining = 0
            victim.fresh = False
            self._waiting.appendleft(victim)
            # victim goes back to waiting; when re-admitted it recomputes its whole context

    def _release(self, s: _Seq) -> None:
        self._used_pages -= s.pages
        s.pages = 0
        self._unref(s.chunk.group_id)

    def _export_bytes(self, s: _Seq) -> int:
        nbytes = s.context * self.kv_bytes_per_token
        s.bytes_exported += nbytes
        return nbytes

    def _end_chunk(self, s: _Seq) -> ChunkResult:
        c = s.chunk
        start = len(c.output_ids)
        n = s.new_tokens
        g = s.generated
        if g >= c.original_max_tokens:
            toks = pseudo_tokens(c.request_id, start, n, self.vocab_size)
            reason = "length"
        elif g >= s.true_len:
            toks = pseudo_tokens(c.request_id, start, n - 1, self.vocab_size) + [EOS_TOKEN_ID]
            reason = "eos"
        else:
            toks = pseudo_tokens(c.request_id, start, n, self.vocab_size)
            reason = None
        handle = None
        gid = c.group_id
        if reason is None:
            if self.pool is not None:
                handle = self.pool.put(
                    c.request_id, _SimKV(c.request_id, s.context), s.context * self.kv_bytes_per_token
                )
            if self.keep_resident:
                self._cache[c.request_id] = (s.context, s.pages, gid)
                self._cache_pages += s.pages
                self._used_pages -= s.pages
                s.pages = 0
                # group ref moves from the running request to the cache entry
            else:
                self._release(s)
        else:
            self._release(s)
        return ChunkResult(
            request_id=c.request_id,
            instance_id=self.instance_id,
            new_token_ids=toks,
            new_logprobs=pseudo_logprobs(c.request_id, start, n),
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
            first_token_at=s.first_token_at,
        )


def make_sim_instances(
    n: int, lengths: Mapping[str, int] | Callable[[ChunkRequest], int], pool: KVPool | None = None, **kw
) -> list[SimulatedInstance]:
    """`n` identical simulated instances with ids 0..n-1 sharing one pool."""
    return [SimulatedInstance(i, lengths, pool=pool, **kw) for i in range(n)]

