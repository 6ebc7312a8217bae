"""QuantizedLinear and quantize_model: values, gradients, state dicts, errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from sakura.options import OptionError
from sakura_quant import QuantizedLinear, quantize_model


@pytest.mark.parametrize("fmt", ["nf4", "int8", "fp8", "nvfp4"])
def test_forward_equals_linear_on_the_dequantized_weight(fmt: str) -> None:
    layer = nn.Linear(64, 48)
    q = QuantizedLinear.from_linear(layer, fmt)
    x = torch.randn(5, 64)
    # Same expansion, same F.linear: equal bit for bit (tolerance zero).
    expected = F.linear(x, q.dequantize(), layer.bias)
    assert torch.equal(q(x), expected)


def test_gradient_reaches_the_input_and_not_the_weight() -> None:
    layer = nn.Linear(64, 32)
    q = QuantizedLinear.from_linear(layer, "nf4")
    x = torch.randn(3, 64, requires_grad=True)
    q(x).square().sum().backward()
    assert x.grad is not None
    w = q.dequantize().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, w, layer.bias).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    assert all(not b.requires_grad for b in q.buffers())
    assert q.bias is not None and q.bias.grad is not None  # the bias is an ordinary parameter


def test_bf16_input_gives_bf16_output_and_gradient() -> None:
    q = QuantizedLinear.from_linear(nn.Linear(64, 16).bfloat16(), "nf4")
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    out = q(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


def test_matmul_dtype_bf16_under_an_fp32_input() -> None:
    """``matmul_dtype=bf16``: both products run in bf16 on the weight expanded straight to
    bf16 (as bitsandbytes' ``compute_dtype``); output and input gradient come back fp32."""
    layer = nn.Linear(128, 48, bias=False)
    q = QuantizedLinear.from_linear(layer, "nf4", matmul_dtype="bf16")
    assert q.matmul_dtype == torch.bfloat16 and "matmul_dtype=bfloat16" in repr(q)
    x = torch.randn(6, 128, requires_grad=True)
    out = q(x)
    assert out.dtype == torch.float32
    w16 = q.dequantize(torch.bfloat16)
    # The reference: the same bf16 operands through F.linear (tolerance zero), and within
    # bf16 rounding of the fp32 product.
    assert torch.equal(out, F.linear(x.detach().bfloat16(), w16).float())
    fp32 = F.linear(x.detach(), q.dequantize(torch.float32))
    torch.testing.assert_close(out, fp32, rtol=2e-2, atol=2e-2)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert torch.equal(x.grad, (grad.bfloat16() @ w16).float())
    # Switchable per layer at any time (checked); None goes back to the input's dtype.
    q.matmul_dtype = None
    assert torch.equal(q(x.detach()), fp32)
    q.matmul_dtype = "bfloat16"
    assert q.matmul_dtype == torch.bfloat16
    with pytest.raises(OptionError, match=r"QuantizedLinear: matmul_dtype='fp8' is not accepted"):
        q.matmul_dtype = "fp8"
    with pytest.raises(OptionError, match=r"QuantizedLinear: matmul_dtype='int8'.*'bf16'"):
        QuantizedLinear.from_linear(layer, "nf4", matmul_dtype="int8")


def test_quantize_model_matmul_dtype(make_tiny_lm: Callable[[], nn.Module]) -> None:
    model = make_tiny_lm().requires_grad_(False)
    quantize_model(model, "nf4", matmul_dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.matmul_dtype == torch.bfloat16 for m in layers)
    with pytest.raises(OptionError, match=r"quantize_model: matmul_dtype='half'"):
        quantize_model(make_tiny_lm().requires_grad_(False), "nf4", matmul_dtype="half")


def test_is_a_linear_with_what_peft_reads() -> None:
    q = QuantizedLinear.from_linear(nn.Linear(64, 16).bfloat16(), "nf4")
    assert isinstance(q, nn.Linear)
    assert (q.in_features, q.out_features) == (64, 16)
    assert q.compute_dtype == torch.bfloat16
    assert q.weight.dtype == torch.uint8 and q.weight.numel() == 64 * 16 // 2


def test_quantize_model_replaces_linears_but_not_lm_head(
    make_tiny_lm: Callable[[], nn.Module],
) -> None:
    model = make_tiny_lm().requires_grad_(False)
    x = torch.randint(0, 32, (2, 7))
    before = model(x)
    stats = quantize_model(model, "int8")
    names = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert names == [
        "layers.0.q_proj",
        "layers.0.v_proj",
        "layers.1.q_proj",
        "layers.1.v_proj",
    ]
    assert type(model.lm_head) is nn.Linear
    assert stats["tensors"] == 4
    assert stats["bytes_before"] == 4 * 64 * 64 * 4
    # int8: one byte per weight plus one fp32 scale per 64.
    assert stats["bytes_after"] == 4 * (64 * 64 + 64 * 4)
    torch.testing.assert_close(model(x), before, rtol=0.05, atol=0.05)


def test_quantize_model_targets_and_double_quant(make_tiny_lm: Callable[[], nn.Module]) -> None:
    model = make_tiny_lm().requires_grad_(False)
    stats = quantize_model(model, "nf4", targets=["q_proj"], double_quant=True)
    assert stats["tensors"] == 2
    assert isinstance(model.layers[0].q_proj, QuantizedLinear)
    assert not isinstance(model.layers[0].v_proj, QuantizedLinear)
    assert model.layers[0].q_proj.weight_scales.dtype == torch.uint8


def test_state_dict_round_trip_and_full_precision_reload(
    make_tiny_lm: Callable[[], nn.Module],
) -> None:
    model = make_tiny_lm().requires_grad_(False)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_model(model, "nf4")
    saved = model.state_dict()
    assert saved["layers.0.q_proj.weight"].dtype == torch.uint8
    other = make_tiny_lm().requires_grad_(False)
    quantize_model(other, "nf4")
    other.load_state_dict(saved)
    for key, value in saved.items():
        assert torch.equal(other.state_dict()[key], value)
    # A partial, full-precision dict (as PEFT and the HF Trainer load with strict=False):
    # only the weight given is read again and quantized; every other buffer stays.
    fresh = make_tiny_lm().requires_grad_(False)
    quantize_model(fresh, "nf4")
    untouched = fresh.layers[1].q_proj.weight.clone()
    result = fresh.load_state_dict(
        {"layers.0.q_proj.weight": reference["layers.0.q_proj.weight"]}, strict=False
    )
    assert "layers.0.q_proj.weight" not in result.missing_keys
    assert not result.unexpected_keys
    assert torch.equal(fresh.layers[0].q_proj.weight, saved["layers.0.q_proj.weight"])
    assert torch.equal(fresh.layers[0].q_proj.weight_scales, saved["layers.0.q_proj.weight_scales"])
    assert torch.equal(fresh.layers[1].q_proj.weight, untouched)


def test_errors(make_tiny_lm: Callable[[], nn.Module]) -> None:
    model = make_tiny_lm()
    with pytest.raises(
        OptionError, match=r"freeze=False .*layers\.0\.q_proj\.weight requires grad"
    ):
        quantize_model(model, "nf4")
    stats = quantize_model(model, "nf4", freeze=True)
    assert stats["tensors"] == 4
    with pytest.raises(OptionError, match="already a QuantizedLinear"):
        quantize_model(model, "nf4")
    frozen = make_tiny_lm().requires_grad_(False)
    with pytest.raises(OptionError, match=r"targets='norm'.*LayerNorm"):
        quantize_model(frozen, "nf4", targets=["norm"])
    with pytest.raises(OptionError, match=r"targets='nope'"):
        quantize_model(frozen, "nf4", targets=["nope"])
    with pytest.raises(OptionError, match=r"quantize_model: quantize='q4'"):
        quantize_model(frozen, "q4")
    with pytest.raises(OptionError, match=r"block_size=7"):
        quantize_model(frozen, "nf4", block_size=7)
    with pytest.raises(OptionError, match=r"targets='q_proj'"):
        quantize_model(frozen, "nf4", targets="q_proj")
    with pytest.raises(OptionError, match=r"freeze=1"):
        quantize_model(frozen, "nf4", freeze=1)  # type: ignore[arg-type]
    assert not any(isinstance(m, QuantizedLinear) for m in frozen.modules())


def test_keep_precise_stores_the_most_hurt_weights_as_int8(
    make_tiny_lm: Callable[[], nn.Module],
) -> None:
    model = make_tiny_lm().requires_grad_(False)
    # Give one weight heavy outliers: NF4 hurts it most, so it is the one kept in int8.
    with torch.no_grad():
        model.layers[1].v_proj.weight[:, ::7] *= 40.0
    originals = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    # NF4 of a 64x64 weight: 2048 + 256 bytes; int8: 4096 + 256, so 2048 extra. A budget of
    # 0.25 of 4 x 2304 bytes allows one weight.
    stats = quantize_model(model, "nf4", keep_precise=0.25)
    assert stats["kept_precise"] == 1
    assert model.layers[1].v_proj.format == "int8"
    assert [m.format for m in model.modules() if isinstance(m, QuantizedLinear)].count("nf4") == 3
    assert stats["bytes_after"] == 3 * 2304 + 4352
    w = originals["layers.1.v_proj"]
    err_int8 = (model.layers[1].v_proj.dequantize() - w).norm() / w.norm()
    assert err_int8.item() < 0.01
    # "auto" (5 %) has no room for a whole int8 weight here: nothing is kept.
    other = make_tiny_lm().requires_grad_(False)
    assert quantize_model(other, "nf4", keep_precise="auto")["kept_precise"] == 0


@pytest.mark.parametrize(
    ("fmt", "value"), [("int8", 0.1), ("nf4", 0.6), ("nf4", "yes"), ("nf4", -0.1)]
)
def test_keep_precise_rejects(
    fmt: str, value: object, make_tiny_lm: Callable[[], nn.Module]
) -> None:
    with pytest.raises(OptionError, match=r"quantize_model: keep_precise="):
        quantize_model(make_tiny_lm().requires_grad_(False), fmt, keep_precise=value)
