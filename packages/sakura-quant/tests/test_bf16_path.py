"""The bf16 path of QuantizedLinear: expansion into a reused buffer (``dequantize_into``),
bf16 end to end without dtype copies, autocast, and a QLoRA step on a tiny Llama against the
fp32 path (bf16 tolerances stated per test)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from sakura_quant import QuantizedLinear, quantize_model
from sakura_quant.codec import dequantize_into, dequantize_weight, quantize_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("fmt", "double_quant"), [("nf4", False), ("nf4", True), ("int8", False), ("nvfp4", False)]
)
def test_dequantize_into_equals_dequantize_weight(
    fmt: str, double_quant: bool, dtype: torch.dtype
) -> None:
    """Bit for bit (the C++ kernel for NF4 with fp32 scales, the copy path for the rest)."""
    q = quantize_weight(torch.randn(48, 70), fmt, double_quant=double_quant)
    out = torch.full((48, 70), float("nan"), dtype=dtype)
    assert dequantize_into(q, out) is out
    assert torch.equal(out, dequantize_weight(q, dtype))


def test_dequantize_into_refuses_a_wrong_shape() -> None:
    q = quantize_weight(torch.randn(8, 16), "nf4")
    with pytest.raises(ValueError, match=r"out must be a floating tensor of shape \(8, 16\)"):
        dequantize_into(q, torch.empty(16, 8))
    with pytest.raises(ValueError, match="floating"):
        dequantize_into(q, torch.empty(8, 16, dtype=torch.int32))


def _layers() -> list[QuantizedLinear]:
    # Two shapes, two layers of one shape: they share the thread's expansion buffer.
    return [
        QuantizedLinear.from_linear(nn.Linear(64, 96).bfloat16(), "nf4", matmul_dtype="bf16"),
        QuantizedLinear.from_linear(nn.Linear(96, 64).bfloat16(), "nf4", matmul_dtype="bf16"),
        QuantizedLinear.from_linear(nn.Linear(64, 96).bfloat16(), "nf4", matmul_dtype="bf16"),
    ]


def test_bf16_chain_equals_fresh_expansions_bit_for_bit() -> None:
    """A chain of layers expanding into one shared buffer (forward, then every backward after
    the others' forwards) gives the values and gradients of ``F.linear`` on fresh expansions:
    tolerance zero, and no dtype change anywhere (bf16 in, bf16 out, bf16 gradient)."""
    torch.manual_seed(0)
    a, b, c = _layers()
    x = torch.randn(5, 64, dtype=torch.bfloat16, requires_grad=True)
    out = c(torch.relu(b(torch.relu(a(x)))))
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()

    x_ref = x.detach().clone().requires_grad_(True)
    h = x_ref
    for layer in (a, b, c):
        h = F.linear(h, layer.dequantize(torch.bfloat16)) + layer.bias  # as the layer adds it
        if layer is not c:
            h = torch.relu(h)
    h.float().square().sum().backward()
    assert torch.equal(out, h)
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, x_ref.grad)


def test_autocast_runs_the_products_in_bf16_and_matches_fp32() -> None:
    """Under ``torch.autocast("cpu", bf16)`` a layer with no ``matmul_dtype`` behaves as
    ``nn.Linear`` there: bf16 products and output, the input's gradient in the input's
    dtype; values within bf16 rounding of the fp32 path (rtol 2e-2, atol 2e-2)."""
    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(nn.Linear(128, 64), "nf4")
    x = torch.randn(7, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = q(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(
        out,
        F.linear(x.detach().bfloat16(), q.dequantize(torch.bfloat16)) + q.bias.bfloat16(),
    )
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    x32 = x.detach().clone().requires_grad_(True)
    ref = q(x32)
    ref.sum().backward()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad, x32.grad, rtol=2e-2, atol=2e-2)


def test_double_backward_does_not_read_the_shared_buffer() -> None:
    """With ``create_graph`` the backward keeps its expansion: a fresh tensor, so a later
    product into the shared buffer leaves the second-order graph intact."""
    torch.manual_seed(0)
    a, _, c = _layers()
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    (grad,) = torch.autograd.grad(a(x).float().square().sum(), x, create_graph=True)
    c(torch.randn(3, 64, dtype=torch.bfloat16))  # overwrites the shared buffer
    (second,) = torch.autograd.grad(grad.float().sum(), x)
    x_ref = x.detach().clone().requires_grad_(True)
    w = a.dequantize(torch.bfloat16)
    (g_ref,) = torch.autograd.grad(
        (F.linear(x_ref, w) + a.bias).float().square().sum(), x_ref, create_graph=True
    )
    (second_ref,) = torch.autograd.grad(g_ref.float().sum(), x_ref)
    assert torch.equal(grad, g_ref) and torch.equal(second, second_ref)


def _tiny_llama(dtype: torch.dtype) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    torch.manual_seed(0)
    # Weights bf16-exact in both models: both quantize the same values to the same codes.
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).to(dtype)
    model.requires_grad_(False)
    quantize_model(model, "nf4", matmul_dtype="bf16")
    return model


def test_qlora_step_bf16_end_to_end_matches_the_fp32_path() -> None:
    """A bf16 model (NF4 base, bf16 products) with fp32 PEFT adapters under autocast and
    PEFT's input casting off, against the fp32 model with the same codes: loss within 1 %
    and adapter gradients within 5 % (relative norm of the difference); the adapters, their
    gradients and AdamW's moments stay fp32."""
    peft = pytest.importorskip("peft")
    from peft.helpers import disable_input_dtype_casting

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model = _tiny_llama(dtype)
        torch.manual_seed(0)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]
        )
        lora = peft.get_peft_model(model, config)
        for module in lora.modules():  # B starts at zero: give it values so A gets a gradient
            if hasattr(module, "lora_B"):
                nn.init.normal_(module.lora_B["default"].weight, std=0.02)
        params = {n: p for n, p in lora.named_parameters() if p.requires_grad}
        assert all(p.dtype == torch.float32 for p in params.values())
        opt = torch.optim.AdamW(params.values(), lr=1e-3)
        bf16 = dtype == torch.bfloat16
        with disable_input_dtype_casting(lora, active=bf16):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = lora(input_ids=ids, labels=ids).loss
            loss.backward()
        grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        opt.step()
        moments = [t for state in opt.state.values() for t in state.values() if t.dim()]
        assert moments and all(t.dtype == torch.float32 for t in moments)
        results.append((float(loss), grads))
    (loss32, grads32), (loss16, grads16) = results
    assert abs(loss16 - loss32) <= 0.01 * abs(loss32)
    assert grads32.keys() == grads16.keys() and len(grads32) == 2 * 4 * 2
    for name, g in grads32.items():
        assert grads16[name].dtype == torch.float32
        rel = float((grads16[name] - g).norm() / g.norm())
        assert rel < 0.05, (name, rel)


@pytest.mark.parametrize(
    ("dtype", "chunk", "shape", "most"),
    [
        (torch.float32, 1024, (64, 256), 1024),
        (torch.bfloat16, 1024, (64, 256), 1024),  # several chunks
        (torch.bfloat16, 1 << 17, (8, 64), 8 * 64),  # a weight smaller than one chunk
    ],
)
def test_int8_expands_in_place_with_no_weight_sized_temporary(
    dtype: torch.dtype,
    chunk: int,
    shape: tuple[int, int],
    most: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whole blocks: int8 expands into ``out`` itself (fp32) or through a fixed chunk (bf16),
    bit for bit as dequantize_weight, and never allocates a weight-sized tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sakura_quant import codec

    monkeypatch.setattr(codec, "INT8_CHUNK", chunk)
    q = quantize_weight(torch.randn(*shape), "int8")
    assert q.numel % q.block_size == 0
    out = torch.full(shape, float("nan"), dtype=dtype)

    known = {t.untyped_storage().data_ptr() for t in (out, *q.tensors.values())}

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else [result]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                    Largest.largest = max(Largest.largest, t.untyped_storage().nbytes() // 4)
            return result

    with Largest():
        assert dequantize_into(q, out) is out
    assert torch.equal(out, dequantize_weight(q, dtype))
    # new storage (fp32 elements): at most one chunk, and never more than the weight (a
    # fixed chunk for a small weight made the memory planner's measured peaks jump)
    assert Largest.largest <= most
