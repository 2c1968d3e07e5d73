"""Reading safetensors files with every dtype checkpoints use, and FP8 block-quantized weights.

`safetensors.numpy` maps a dtype by its numpy attribute name, so it cannot read float8 tensors
(and reads bfloat16 only once `ml_dtypes` has registered it with numpy). The format is simple (an 8-byte little-endian header length, a
JSON header naming each tensor's dtype, shape and byte range, then the bytes), so we read it
directly into numpy arrays over a memory map, with `ml_dtypes` (a jax dependency) for bfloat16
and float8.

DeepSeek-V3 and Kimi-K2 store most linear weights in float8 e4m3 with one float32 scale per
128 x 128 block (`<name>.weight_scale_inv`, `quantization_config.weight_block_size`): the weight
is fp8 * scale, block by block. We dequantize on load to the model's dtype: a weight then takes
2 bytes per parameter in bfloat16 (4 in float32) where the checkpoint holds 1 (plus 4 bytes per
16,384 for the scales). Other quantization methods are refused, naming the method.
"""

from __future__ import annotations

import json
import mmap
import pathlib
import struct
from typing import Any

import ml_dtypes
import numpy as np

from seer_jax.errors import SeerError

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
SCALE_SUFFIX = "_scale_inv"  # "<...>.weight" has its block scales in "<...>.weight_scale_inv"


def read_safetensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, as read-only arrays over a memory map."""
    path = pathlib.Path(path)
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 8:
            raise SeerError(f"{path} is not a safetensors file (only {size} bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > size:
        raise SeerError(f"{path} is not a safetensors file (header of {n} bytes in {size})")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except ValueError as e:
        raise SeerError(f"{path}: unreadable safetensors header ({e})") from None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(meta["dtype"])
        if dtype is None:
            raise SeerError(f"{path}: tensor {name!r} has dtype {meta['dtype']}; supported: "
                            f"{', '.join(DTYPES)}")
        start, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * np.dtype(dtype).itemsize or 8 + n + end > size:
            raise SeerError(f"{path}: tensor {name!r} byte range {start}..{end} does not hold "
                            f"{shape} {meta['dtype']}")
        out[name] = np.frombuffer(buf, dtype, count, 8 + n + start).reshape(shape)
    return out


def fp8_block_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) block of a checkpoint's FP8 weights, None when it is not quantized;
    a quantization we do not load is refused, naming it."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    arch = (hf_config.get("architectures") or ["this checkpoint"])[0]
    method = q.get("quant_method")
    if method != "fp8":
        raise SeerError(f"{arch}: quantization_config.quant_method={method!r} is not supported; "
                        f"allowed: 'fp8' with block scales (or an unquantized checkpoint)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise SeerError(f"{arch}: quantization_config.fmt={q.get('fmt')!r}: only 'e4m3' is supported")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise SeerError(f"{arch}: quantization_config.activation_scheme="
                        f"{q.get('activation_scheme')!r}: only 'dynamic' is supported")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise SeerError(f"{arch}: quantization_config.weight_block_size={block!r}: a "
                        f"[rows, cols] block is needed (per-tensor FP8 scales are not supported)")
    return int(block[0]), int(block[1])


def dequantize_blocks(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
                      dtype=np.float32) -> np.ndarray:
    """w [rows, cols] (fp8) times its block scales scale_inv [ceil(rows/br), ceil(cols/bc)]."""
    rows, cols = w.shape
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if scale_inv.shape != want:
        raise SeerError(f"block scales of shape {scale_inv.shape} for a {w.shape} weight in "
                        f"{block} blocks; expected {want}")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), br, axis=0), bc, axis=1)[:rows, :cols]
    return (w.astype(np.float32) * s).astype(dtype)


def dequantize_checkpoint(tensors: dict[str, np.ndarray], block: tuple[int, int] | None,
                          dtype=np.float32) -> dict[str, np.ndarray]:
    """The tensors with every FP8 weight dequantized (its scale tensor consumed). An FP8
    tensor without scales, or scales without their weight, is an error."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            if name[:-len(SCALE_SUFFIX)] not in tensors:
                raise SeerError(f"block scales {name!r} have no weight {name[:-len(SCALE_SUFFIX)]!r}")
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if t.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
            if scale is None or block is None:
                raise SeerError(f"FP8 tensor {name!r} has no block scales ({name + SCALE_SUFFIX}) "
                                f"or the config declares no fp8 quantization_config")
            out[name] = dequantize_blocks(t, scale, block, dtype)
        elif scale is not None:
            raise SeerError(f"{name!r} has block scales but is stored as {t.dtype}, not FP8")
        else:
            out[name] = t
    return out
