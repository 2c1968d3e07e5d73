"""Safetensors of every dtype checkpoints use (bfloat16, float8 included) read exactly, and
FP8 weights with 128x128 block scales dequantized as DeepSeek-V3 defines them."""

import numpy as np
import pytest

from seer_jax.errors import SeerError
from seer_jax.model.safetensors_io import (
    dequantize_blocks,
    dequantize_checkpoint,
    fp8_block_size,
    read_safetensors,
)

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

FP8_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"],
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}


def test_every_dtype_reads_back_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    ts = {"bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
          "f16": torch.randn(7, generator=g).half(), "f32": torch.randn(2, 2, 2, generator=g),
          "fp8": torch.randn(4, 6, generator=g).to(torch.float8_e4m3fn),
          "e5m2": torch.randn(4, generator=g).to(torch.float8_e5m2),
          "i64": torch.arange(5), "b": torch.tensor([True, False]), "scalar": torch.tensor(3.0)}
    st.save_file(ts, tmp_path / "m.safetensors")
    got = read_safetensors(tmp_path / "m.safetensors")
    assert set(got) == set(ts)
    for k, t in ts.items():
        assert got[k].shape == tuple(t.shape), k
        want = t.view(torch.uint8) if t.dtype.itemsize == 1 and t.is_floating_point() else t
        have = got[k].view(np.uint8) if t.dtype.itemsize == 1 and t.is_floating_point() else got[k]
        if t.dtype == torch.bfloat16:
            want, have = t.view(torch.int16), got[k].view(np.int16)
        np.testing.assert_array_equal(np.asarray(have), want.numpy(), err_msg=k)


def test_fp8_block_weights_dequantize_to_weight_times_block_scale(tmp_path):
    rows, cols = 300, 200  # partial blocks at both edges
    g = torch.Generator().manual_seed(1)
    w = torch.randn(rows, cols, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) + 0.5
    st.save_file({"layer.weight": w, "layer.weight_scale_inv": s, "norm.weight": torch.ones(4)},
                 tmp_path / "q.safetensors")
    block = fp8_block_size(FP8_CONFIG)
    out = dequantize_checkpoint(read_safetensors(tmp_path / "q.safetensors"), block)
    assert set(out) == {"layer.weight", "norm.weight"}
    want = w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    np.testing.assert_array_equal(out["layer.weight"], want.numpy())
    bf = dequantize_blocks(np.asarray(read_safetensors(tmp_path / "q.safetensors")["layer.weight"]),
                           s.numpy(), block, dtype=np.float16)
    assert bf.dtype == np.float16


def test_what_is_not_supported_is_refused_by_name(tmp_path):
    assert fp8_block_size({"architectures": ["X"]}) is None
    for q, match in [({"quant_method": "mxfp4"}, "quant_method='mxfp4'"),
                     ({**FP8_CONFIG["quantization_config"], "activation_scheme": "static"},
                      "activation_scheme='static'"),
                     ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size")]:
        with pytest.raises(SeerError, match=match):
            fp8_block_size({"architectures": ["GptOssForCausalLM"], "quantization_config": q})
    w = np.zeros((4, 4), np.float32)
    with pytest.raises(SeerError, match="block scales"):
        dequantize_checkpoint({"a.weight": w, "a.weight_scale_inv": np.ones((1, 1), np.float32)},
                              (128, 128))
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(SeerError, match="header"):
        read_safetensors(tmp_path / "bad.safetensors")
