"""KV page accounting for one engine: free list, reference counts, prompt-prefix sharing.

Pages are shared by reference count. The G requests of a group share the full pages of their
common prompt (registered in a prefix cache once the first request has prefilled it); the page
holding the prompt's last token is copied (copy-on-write) because each request writes its own
tokens after it. Prefix-cache entries hold a reference of their own and are evicted LRU when
pages run short.
"""

from __future__ import annotations

import collections
import dataclasses

from seer_jax.errors import SeerError


class OutOfPages(SeerError):
    """No free page is left (the engine preempts or waits)."""


@dataclasses.dataclass
class PrefixEntry:
    prompt: tuple[int, ...]
    pages: list[int]  # pages covering positions [0, len(prompt)), the last possibly partial


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise SeerError(f"need num_pages >= 2 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref = [0] * num_pages
        self.free: collections.deque[int] = collections.deque(range(num_pages))
        self.prefix: collections.OrderedDict[tuple[int, ...], PrefixEntry] = collections.OrderedDict()

    # ------------------------------------------------------------------ basics
    @property
    def num_free(self) -> int:
        return len(self.free)

    def num_evictable(self) -> int:
        """Pages that evicting every prefix entry would free."""
        held = collections.Counter(p for e in self.prefix.values() for p in e.pages)
        return sum(1 for p, n in held.items() if self.ref[p] == n)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        while len(self.free) < n and self.prefix:
            self._evict_one()
        if len(self.free) < n:
            raise OutOfPages(f"need {n} pages, {len(self.free)} free")
        out = [self.free.popleft() for _ in range(n)]
        for p in out:
            self.ref[p] = 1
        return out

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free) + self.num_evictable()

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.ref[p] <= 0:
                raise SeerError(f"page {p} is not allocated")
            self.ref[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self.ref[p] <= 0:
                raise SeerError(f"double free of page {p}")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self.free.append(p)

    def grow(self, pages: list[int], num_tokens: int) -> list[int]:
        """Extend a page table in place to hold num_tokens; returns the new pages."""
        need = self.pages_for(num_tokens) - len(pages)
        new = self.allocate(need) if need > 0 else []
        pages.extend(new)
        return new

    # ------------------------------------------------------------------ prefix sharing
    def register_prefix(self, prompt: tuple[int, ...], pages: list[int]) -> None:
        n = self.pages_for(len(prompt))
        if prompt in self.prefix or n == 0:
            return
        entry = PrefixEntry(prompt, list(pages[:n]))
        self.incref(entry.pages)
        self.prefix[prompt] = entry

    def lookup_prefix(self, prompt: tuple[int, ...]) -> PrefixEntry | None:
        entry = self.prefix.get(prompt)
        if entry is not None:
            self.prefix.move_to_end(prompt)
        return entry

    def share_prefix(self, entry: PrefixEntry) -> tuple[list[int], tuple[int, int] | None, int]:
        """Pages for a new request with this prompt: (page table, copy (src, dst) or None,
        number of tokens whose KV is valid). The prompt's last token is left to recompute so its
        logits are available for the first sample."""
        valid = len(entry.prompt) - 1
        n_full = valid // self.page_size
        shared = entry.pages[:n_full]
        self.incref(shared)
        table = list(shared)
        copy = None
        if valid % self.page_size:
            try:
                (dst,) = self.allocate(1)
            except OutOfPages:
                self.release(shared)
                raise
            copy = (entry.pages[n_full], dst)
            table.append(dst)
        return table, copy, valid

    def _evict_one(self) -> None:
        _, entry = self.prefix.popitem(last=False)
        self.release(entry.pages)

    def clear_prefix_cache(self) -> None:
        while self.prefix:
            self._evict_one()

    def check(self) -> None:
        """Invariants (used by tests): free pages have ref 0, every other page ref > 0."""
        free = set(self.free)
        if len(free) != len(self.free):
            raise SeerError("a page is on the free list twice")
        for p in range(self.num_pages):
            if (p in free) != (self.ref[p] == 0):
                raise SeerError(f"page {p}: ref {self.ref[p]}, on free list: {p in free}")
