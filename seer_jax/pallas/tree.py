"""Token trees over the packed query axis: parent pointers -> ancestor tests and kernel masks.

Representation (public, used by `ragged_paged_attention(tree_parents=...)`):
  `tree_parents: [num_tokens] int32`. For query token t, the index of its parent *relative to the
  first query token of t's sequence*, or -1 when its parent is the sequence's last committed token
  (the context that is already in the cache, positions [0, kv_len - q_len)). A parent must precede
  its child (`-1 <= tree_parents[t] < t - seq_start`); values outside that range are treated as -1.
  An ordinary chain (decode, prefill, linear draft) is `[-1, 0, 1, 2, ...]` per sequence, so decode
  and prefill tokens sit in the same call as draft trees. Query token i of a sequence attends to the
  committed context and to the query tokens on its own root path (itself and its ancestors).

The KV slot of query token i is `kv_len - q_len + i` (node order = cache order), exactly as without
a tree; the caller gives every node its RoPE position by depth, that is no concern of attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Query tokens further back than this (in packed order) that are *not* ancestors cannot be
# represented by the kernels' per-token mask; see `kernel_tree_mask`.
KERNEL_TREE_WINDOW = 32


def token_seq_ids(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int) -> jax.Array:
    """[num_tokens] int32: the sequence of each packed query token, -1 for padding tokens."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    max_seqs = cu_q_lens.shape[0] - 1
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, max_seqs - 1)
    total = cu_q_lens[jnp.minimum(num_seqs, max_seqs)]
    return jnp.where(t < total, seq, -1)


def _log2_ceil(n: int) -> int:
    return max(1, (max(n, 1) - 1).bit_length())


class TokenForest:
    """Parent pointers over the packed tokens, with depth and binary-lifting tables.

    `parent[t]` is the global token index of t's parent, or t itself for a root (parent -1).
    """

    def __init__(self, tree_parents: jax.Array, seq_start: jax.Array):
        # tree_parents: [T] relative parents; seq_start: [T] first token of each token's sequence.
        num_tokens = tree_parents.shape[0]
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        rel = t - seq_start
        p = tree_parents.astype(jnp.int32)
        ok = (p >= 0) & (p < rel)
        parent = jnp.where(ok, seq_start + p, t)
        levels = _log2_ceil(num_tokens + 1)
        # Wyllie pointer jumping: depth = number of edges to the root.
        depth = (parent != t).astype(jnp.int32)
        ptr = parent
        for _ in range(levels):
            depth = depth + depth[ptr]
            ptr = ptr[ptr]
        up = [parent]
        for _ in range(levels - 1):
            up.append(up[-1][up[-1]])
        self.parent = parent
        self.depth = depth
        self.up = up  # up[k][t] = ancestor 2^k levels above t (saturating at the root)

    def lift(self, t: jax.Array, steps: jax.Array) -> jax.Array:
        """Ancestor `steps` levels above t (elementwise; steps >= 0)."""
        for k, table in enumerate(self.up):
            t = jnp.where((steps >> k) & 1 == 1, table[t], t)
        return t

    def is_ancestor_or_self(self, t: jax.Array, u: jax.Array) -> jax.Array:
        """Whether token u is t or an ancestor of t (elementwise over broadcast shapes)."""
        dd = self.depth[t] - self.depth[u]
        return (dd >= 0) & (self.lift(t, jnp.maximum(dd, 0)) == u)


def kernel_tree_mask(
    tree_parents: jax.Array | None,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token mask data for the kernels: (vis_len, window_bits, exact), each [num_tokens].

    Query token t at relative index i (query position ctx + i) sees key position k iff
    `k < ctx + vis_len[t]` or (`0 <= ctx + i - k < 32` and bit `ctx + i - k` of `window_bits[t]`).
    `vis_len` is the length of the longest run of leading query tokens that are all ancestors
    (or t itself). `exact[t]` is False when t has an ancestor that neither run nor window covers;
    the kernels then return NaN for t rather than a wrong answer (true only for trees spanning
    more than 32 packed tokens). Without a tree: vis_len = i + 1 (causal).
    """
    seq = token_seq_ids(cu_q_lens, num_seqs, num_tokens)
    seq_c = jnp.maximum(seq, 0)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    start = cu_q_lens[seq_c]
    rel = t - start
    if tree_parents is None:
        return rel + 1, jnp.ones_like(rel), jnp.ones(num_tokens, dtype=bool)
    forest = TokenForest(tree_parents, start)
    bits = jnp.zeros_like(rel)
    for w in range(KERNEL_TREE_WINDOW):
        u = t - w
        inside = u >= start
        anc = forest.is_ancestor_or_self(t, jnp.maximum(u, 0)) & inside
        bits = bits | (anc.astype(jnp.int32) << w)
    # Leading chain: the largest m with (ancestor of t at depth m) == start + m.
    depth = forest.depth[t]

    def on_prefix(m):
        return forest.lift(t, jnp.maximum(depth - m, 0)) == start + m

    lo = jnp.full_like(rel, -1)  # invariant: on_prefix(lo) holds (or lo == -1)
    hi = depth + 1  # invariant: on_prefix(hi) fails (or hi == depth + 1)
    for _ in range(_log2_ceil(num_tokens + 2) + 1):
        mid = (lo + hi) // 2
        go = (hi - lo > 1) & on_prefix(jnp.maximum(mid, 0)) & (mid >= 0)
        lo = jnp.where(go, mid, lo)
        hi = jnp.where((hi - lo > 1) & ~go, mid, hi)
    vis_len = lo + 1
    # First ancestor not on the leading chain must be inside the window.
    nxt = forest.lift(t, jnp.maximum(depth - (lo + 1), 0))
    exact = (lo + 1 > depth) | (t - nxt < KERNEL_TREE_WINDOW)
    return vis_len, bits, exact
