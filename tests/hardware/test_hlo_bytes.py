"""Per-instruction byte attribution over optimized HLO (no accelerator compiler needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.errors import InputError
from seer_jax.hardware.hlo_bytes import attribute_bytes, parse_module, shape_bytes

# A module whose bytes are known by hand: an embedding gather of 8 rows out of 1000, a 4-layer
# loop whose body dynamic-slices one layer of stacked weights into a matmul, an in-place KV
# write and a Mosaic call carrying its cost estimate.
MODULE = """\
HloModule known, entry_computation_layout={(f32[1000,64]{1,0}, s32[8,1]{1,0})->f32[8,64]{1,0}}

%fused_gather (p0: f32[1000,64], p1: s32[8,1]) -> f32[8,64] {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %p1 = s32[8,1]{1,0} parameter(1)
  ROOT %g = f32[8,64]{1,0} gather(%p0, %p1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
}

%fused_layer (w: f32[4,64,64], i: s32[], x: f32[8,64]) -> f32[8,64] {
  %w = f32[4,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[1,64,64]{2,1,0} dynamic-slice(%w, %i, %zero, %zero), dynamic_slice_sizes={1,64,64}
  %wl = f32[64,64]{1,0} bitcast(%ds)
  %x = f32[8,64]{1,0} parameter(2)
  ROOT %y = f32[8,64]{1,0} dot(%x, %wl), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[8,64], f32[4,64,64])) -> (s32[], f32[8,64], f32[4,64,64]) {
  %t = (s32[], f32[8,64]{1,0}, f32[4,64,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,64]{1,0} get-tuple-element(%t), index=1
  %w = f32[4,64,64]{2,1,0} get-tuple-element(%t), index=2
  %y = f32[8,64]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%fused_layer, metadata={op_name="jit(f)/layer/dot_general"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,64]{1,0}, f32[4,64,64]{2,1,0}) tuple(%next, %y, %w)
}

%cond (t: (s32[], f32[8,64], f32[4,64,64])) -> pred[] {
  %t = (s32[], f32[8,64]{1,0}, f32[4,64,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%fused_write (cache: f32[1000,64], new: f32[8,64], at: s32[]) -> f32[1000,64] {
  %cache = f32[1000,64]{1,0} parameter(0)
  %new = f32[8,64]{1,0} parameter(1)
  %at = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[1000,64]{1,0} dynamic-update-slice(%cache, %new, %at, %zero)
}

ENTRY %main (table: f32[1000,64], ids: s32[8,1], w: f32[4,64,64], cache: f32[1000,64], at: s32[]) -> f32[8,64] {
  %table = f32[1000,64]{1,0} parameter(0)
  %ids = s32[8,1]{1,0} parameter(1)
  %w = f32[4,64,64]{2,1,0} parameter(2)
  %cache = f32[1000,64]{1,0} parameter(3)
  %at = s32[] parameter(4)
  %emb = f32[8,64]{1,0} fusion(%table, %ids), kind=kLoop, calls=%fused_gather
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,64]{1,0}, f32[4,64,64]{2,1,0}) tuple(%zero, %emb, %w)
  %loop = (s32[], f32[8,64]{1,0}, f32[4,64,64]{2,1,0}) while(%init), condition=%cond, body=%body
  %h = f32[8,64]{1,0} get-tuple-element(%loop), index=1
  %written = f32[1000,64]{1,0} fusion(%cache, %h, %at), kind=kLoop, calls=%fused_write
  %attn = f32[8,64]{1,0} custom-call(%h, %written), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "TUxJUgA=", "cost_estimate": {"flops": 10, "transcendentals": 0, "bytes_accessed": 7777, "remote_bytes_transferred": 0}}}
  ROOT %r = f32[8,64]{1,0} add(%attn, %h)
}
"""

ROW = 64 * 4  # one f32 row of 64
H = 8 * ROW  # an [8, 64] f32 activation


def test_shape_bytes_sums_tuples_and_ignores_layouts():
    assert shape_bytes("bf16[32,4096]{1,0:T(8,128)(2,1)}") == 32 * 4096 * 2
    assert shape_bytes("(s32[], f32[2,3]{1,0}, pred[4])") == 4 + 24 + 4


def test_known_module():
    a = attribute_bytes(MODULE)
    assert not a.unknown_trip_counts
    got = {(r.name, r.count): r.bytes for r in a.rows}
    # the gather reads 8 of the table's 1000 rows, plus its indices, and writes 8 rows
    assert got[("emb", 1)] == 8 * ROW + 8 * 4 + H
    # each of the 4 layers reads one [64, 64] slice of the stacked weights, not the stack
    assert got[("y", 4)] == 64 * 64 * 4 + 4 + H + H
    assert got[("next", 4)] == 12 and got[("lt", 5)] == 9
    # the in-place write reads and writes the 8 new rows (and its offset), not the cache
    assert got[("written", 1)] == 2 * H + 4
    # the Mosaic call counts its own estimate
    assert got[("attn", 1)] == 7777
    assert got[("r", 1)] == 3 * H
    assert a.total == sum(got[k] * k[1] for k in got)
    assert {r.name for r in a.top(1)} == {"y"}


def test_triton_calls_need_their_estimates():
    text = MODULE.replace('custom_call_target="tpu_custom_call"',
                          'custom_call_target="__gpu$xla.gpu.triton"')
    with pytest.raises(InputError, match="triton_call_bytes"):
        attribute_bytes(text)
    assert {r.name: r.bytes for r in attribute_bytes(text, 500.0).rows}["attn"] == 500.0
    # per kernel, matched by the pallas_call name in the call's op_name
    named = text.replace('custom_call_target="__gpu$xla.gpu.triton"',
                         'custom_call_target="__gpu$xla.gpu.triton", '
                         'metadata={op_name="jit(f)/shard_map/seer_attn/pallas_call"}')
    by_kernel = {"seer_attn": 300.0, "seer_write": 7.0}
    assert {r.name: r.bytes for r in attribute_bytes(named, by_kernel).rows}["attn"] == 300.0
    with pytest.raises(InputError, match="matches"):
        attribute_bytes(named, {"seer_write": 7.0})


def test_parse_module_reads_computations_and_parameters():
    comps = parse_module(MODULE)
    assert comps["main"].entry and comps["fused_layer"].params == {0: "w", 1: "i", 2: "x"}
    assert comps["body"].root == "out"


def test_compiled_cpu_gather_counts_rows_not_the_table():
    """On a module XLA compiled: XLA's cost analysis counts the whole [4096, 256] table of a
    gather of 16 rows; the attribution counts the rows."""
    table = jnp.zeros((4096, 256), jnp.float32)
    ids = jnp.arange(16, dtype=jnp.int32) * 7
    w = jnp.zeros((256, 128), jnp.float32)
    compiled = jax.jit(lambda t, i, w: jnp.take(t, i, axis=0) @ w).lower(table, ids, w).compile()
    a = attribute_bytes(compiled.as_text())
    rows, table_bytes = 16 * 256 * 4, 4096 * 256 * 4
    assert a.total < table_bytes / 4
    # at least: the gathered rows, the weights and the output
    assert a.total >= rows + w.size * 4 + 16 * 128 * 4
    raw = compiled.cost_analysis()
    raw = raw[0] if isinstance(raw, list | tuple) else raw
    assert raw["bytes accessed"] > table_bytes > a.total
    np.testing.assert_array_equal(compiled(table, ids, w), np.zeros((16, 128), np.float32))
