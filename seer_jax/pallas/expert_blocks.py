"""The checks and cost-estimate counts the expert GEMM kernels (`expert_gemm_gpu`,
`expert_gemm_tpu`) share: one call over rows in `grouped_matmul.block_layout`'s blocks."""

from __future__ import annotations

from seer_jax.errors import InputError


def check_block_call(kernel: str, problem: str | None, *, num_rows: int, block_rows: int,
                     hidden: int, block_expert_shape: tuple[int, ...], w_gate_shape,
                     w_up_shape, w_down_shape, expected_blocks: float | None,
                     expected_rows: float | None) -> tuple[int, float, float]:
    """Refuse a call the `kernel` ("GPU" / "TPU") cannot run, naming what is wrong (`problem`:
    the kernel's own reason, None if it can tile the shapes); else (blocks, the blocks and the
    real rows its cost estimate assumes: `expected_*`, capped by the blocks there are, default
    every block and row)."""
    if problem:
        raise InputError(f"{kernel} expert GEMM kernel cannot lower: {problem}")
    if num_rows % block_rows:
        raise InputError(f"rows={num_rows} is not a multiple of block_rows={block_rows}")
    E, _, f = w_gate_shape
    if tuple(w_up_shape) != (E, hidden, f) or tuple(w_down_shape) != (E, f, hidden):
        raise InputError(f"expert weights disagree: gate {tuple(w_gate_shape)}, up "
                         f"{tuple(w_up_shape)}, down {tuple(w_down_shape)} (want [E, d, f], "
                         "[E, d, f], [E, f, d])")
    nb = num_rows // block_rows
    if tuple(block_expert_shape) != (nb,):
        raise InputError(f"block_expert has shape {tuple(block_expert_shape)}, want ({nb},)")
    blocks = nb if expected_blocks is None else min(float(expected_blocks), nb)
    rows = (blocks * block_rows if expected_rows is None
            else min(float(expected_rows), blocks * block_rows))
    return nb, blocks, rows
