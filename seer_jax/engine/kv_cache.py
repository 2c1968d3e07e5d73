"""The engine's KV cache per request: pages (over `BlockManager`) and the device copies that go
with them (over the `ModelRunner`): growth, release, roll-back of draft pages, swap to and from
the host, prompt-prefix sharing. Every change to a request's pages is mirrored, entry by entry,
into its row of the persistent step rows (`batch.RequestRows`), which the batch gathers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from seer_jax.engine.batch import RequestRows
from seer_jax.engine.block_manager import BlockManager, OutOfPages
from seer_jax.engine.types import KVBlob  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from seer_jax.engine.model_runner import ModelRunner
    from seer_jax.engine.request import Request


class KVCacheManager:
    def __init__(self, blocks: BlockManager, runner: ModelRunner, prefix_sharing: bool,
                 rows: RequestRows):
        self.blocks = blocks
        self.runner = runner
        self.prefix_sharing = prefix_sharing
        self.page_size = blocks.page_size
        self.rows = rows

    def pages_for(self, num_tokens: int) -> int:
        return self.blocks.pages_for(num_tokens)

    def grow(self, req: Request, num_tokens: int) -> None:
        """Extend req's pages to hold num_tokens (OutOfPages when the pool is short)."""
        if len(req.pages) * self.page_size >= num_tokens:
            return
        start = len(req.pages)
        self.blocks.grow(req.pages, num_tokens)
        if req.row < 0:
            self.rows.acquire(req)
        else:
            self.rows.set_pages(req, start)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back req's pages beyond those num_tokens need (rejected draft nodes)."""
        keep = self.pages_for(num_tokens)
        if len(req.pages) > keep:
            self.blocks.release(req.pages[keep:])
            self.rows.clear_pages(req, keep, len(req.pages))
            del req.pages[keep:]

    def free(self, req: Request) -> None:
        """Give back all of req's pages; its computed KV is gone."""
        self.blocks.release(req.pages)
        self.rows.release(req, len(req.pages))
        req.pages, req.num_computed = [], 0

    def blob(self, req: Request) -> KVBlob:
        """Host copy of the K/V of req's computed positions, with its tokens."""
        k, v = self.runner.read_kv(req.pages, req.num_computed)
        return KVBlob(list(req.prompt), list(req.output), k, v)

    def swap_out(self, req: Request) -> None:
        """Free req's pages, keeping its computed KV on the host (`req.swapped`)."""
        if req.num_computed:
            req.swapped = self.blob(req)
        self.free(req)

    def start(self, req: Request) -> bool:
        """Starting pages for a request about to run: its host KV swapped in, or the shared
        pages of its prompt's cached prefix, or none (it prefills from scratch). False when the
        pool cannot hold them now."""
        blob = req.swapped
        if blob is not None:
            need = self.pages_for(blob.num_computed)
            if not self.blocks.can_allocate(need):
                return False
            req.pages = self.blocks.allocate(need)
            self.runner.write_kv(req.pages, blob.k, blob.v)
            req.num_computed, req.swapped = blob.num_computed, None
        elif self.prefix_sharing and not req.output:
            entry = self.blocks.lookup_prefix(req.prompt_key)
            if entry is not None:
                try:
                    table, copy, valid = self.blocks.share_prefix(entry)
                except OutOfPages:
                    return False
                if copy is not None:
                    self.runner.copy_pages([copy])
                req.pages, req.num_computed = table, valid
        if req.pages:
            self.rows.acquire(req)
        return True

    def register_prefix(self, req: Request) -> None:
        """Offer req's prompt pages (prefilled) to later requests with the same prompt."""
        self.blocks.register_prefix(req.prompt_key, req.pages)

    def slot(self, req: Request, pos: int) -> int:
        """Flat cache slot of req's position pos."""
        S = self.page_size
        return req.pages[pos // S] * S + pos % S
