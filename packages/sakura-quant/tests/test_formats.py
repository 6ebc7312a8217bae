"""int8, FP8, NVFP4 and double quantization: values against written-out references."""

from __future__ import annotations

import pytest
import torch

from sakura.options import OptionError
from sakura_quant.codec import dequantize_weight, quantize_weight
from sakura_quant.formats.nvfp4 import e2m1_codes


def test_int8_hand_computed() -> None:
    w = torch.tensor([[-4.0, 1.0, 2.0, 0.01]])
    q = quantize_weight(w, "int8", block_size=4)
    # scaled by 127 / 4: -127, 31.75 -> 32, 63.5 -> 64 (half to even), 0.3175 -> 0
    assert q.tensors["data"].tolist() == [-127, 32, 64, 0]
    assert q.tensors["scales"].tolist() == [4.0]
    expected = torch.tensor([[-4.0, 32 / 127 * 4.0, 64 / 127 * 4.0, 0.0]])
    torch.testing.assert_close(dequantize_weight(q), expected, rtol=0, atol=1e-6)


def test_int8_error_is_small() -> None:
    w = torch.randn(256, 256)
    d = dequantize_weight(quantize_weight(w, "int8"))
    # Half a step of absmax/127 at most, per block.
    step = w.view(-1, 64).abs().amax(1, keepdim=True) / 127
    assert torch.all((d - w).view(-1, 64).abs() <= step / 2 + 1e-6)
    assert ((d - w).norm() / w.norm()).item() < 0.008


def test_fp8_is_e4m3_of_the_scaled_block() -> None:
    w = torch.randn(8, 32)
    q = quantize_weight(w, "fp8")
    assert q.tensors["data"].dtype == torch.float8_e4m3fn
    absmax = w.abs().amax(1)
    reference = (w * (1 / absmax)[:, None] * 448).to(torch.float8_e4m3fn).float() / 448
    torch.testing.assert_close(dequantize_weight(q), reference * absmax[:, None], rtol=0, atol=0)


def test_e2m1_rounding_table() -> None:
    values = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75])
    expected = [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 8 | 2]
    assert e2m1_codes(values).tolist() == expected


def test_nvfp4_hand_computed() -> None:
    w = torch.zeros(32)
    w[:4] = torch.tensor([6.0, -3.0, 1.0, 0.2])
    w[16] = 0.06
    q = quantize_weight(w, "nvfp4")
    g = 448 * 6 / 6.0
    assert q.tensors["global_scale"].item() == g
    # block 0: scale e4m3(6 / 6 * 448) = 448 -> decode 1.0: codes 6 -> 7, -3 -> 8|5, 1 -> 2,
    # 0.2 -> 0;  block 1: e4m3(0.01 * 448 = 4.48) = 4.5 -> decode 4.5/448; 0.06 / (4.5/448)
    # = 5.97 -> 6.0 (code 7)
    scales = q.tensors["scales"].float()
    assert scales.tolist() == [448.0, 4.5]
    data = q.tensors["data"]
    assert data[0].item() == 7 | (13 << 4) and data[1].item() == 2
    assert data[8].item() == 7
    out = dequantize_weight(q)
    assert out[:4].tolist() == [6.0, -3.0, 1.0, 0.0]
    assert out[16].item() == pytest.approx(6.0 * 4.5 / 448, rel=1e-6)


@pytest.mark.parametrize(
    ("fmt", "bound"), [("int8", 0.008), ("nf4", 0.11), ("fp8", 0.03), ("nvfp4", 0.12)]
)
def test_relative_error_per_format(fmt: str, bound: float) -> None:
    w = torch.randn(128, 256) * 0.02
    d = dequantize_weight(quantize_weight(w, fmt))
    assert d.shape == w.shape
    assert ((d - w).norm() / w.norm()).item() < bound


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_double_quant_decodes_close_to_fp32_scales(fmt: str) -> None:
    w = torch.randn(512, 128)
    plain = quantize_weight(w, fmt)
    dq = quantize_weight(w, fmt, double_quant=True)
    assert dq.tensors["scales"].dtype == torch.uint8
    assert torch.equal(plain.tensors["data"], dq.tensors["data"])
    assert dq.nbytes < plain.nbytes
    err_plain = (dequantize_weight(plain) - w).norm() / w.norm()
    err_dq = (dequantize_weight(dq) - w).norm() / w.norm()
    assert err_dq.item() < err_plain.item() * 1.1


def test_bf16_weight_comes_back_bf16() -> None:
    w = torch.randn(64, 64).bfloat16()
    assert dequantize_weight(quantize_weight(w, "nf4")).dtype == torch.bfloat16
    assert dequantize_weight(quantize_weight(w, "nf4"), torch.float32).dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"format": "fp4"}, "format"),
        ({"format": "nf4", "block_size": 63}, "block_size"),
        ({"format": "nf4", "block_size": 0}, "block_size"),
        ({"format": "nf4", "block_size": 1}, "block_size"),
        ({"format": "int8", "block_size": True}, "block_size"),
        ({"format": "fp8", "block_size": 64}, "block_size"),
        ({"format": "nvfp4", "block_size": 32}, "block_size"),
        ({"format": "fp8", "double_quant": True}, "double_quant"),
        ({"format": "nf4", "double_quant": 1}, "double_quant"),
    ],
)
def test_bad_options_name_option_value_and_accepted(kwargs: dict[str, object], option: str) -> None:
    with pytest.raises(OptionError) as info:
        quantize_weight(torch.randn(4, 64), **kwargs)  # type: ignore[arg-type]
    assert info.value.option == option
    message = str(info.value)
    assert f"{option}=" in message and "accepted:" in message
    assert message.startswith("quantize_weight:")


def test_non_float_weight_is_refused() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        quantize_weight(torch.ones(4, 64, dtype=torch.int32), "nf4")
