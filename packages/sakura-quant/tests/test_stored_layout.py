"""Every stored tensor of a quantized weight owns exactly its storage (no view of a larger
temporary), so that moving a layer's buffers by swapping ``.data`` -- as weight paging does
to put them in a host store -- frees the originals.

Before this was checked, int8 and FP8 codes were views of the padded block matrix they were
cast from: a swapped ``.data`` left the old codes alive through the view's ``_base``, and a
paged int8 base sat in RAM twice (``benchmarks/fit.py``: 15-18 MiB more anonymous RSS,
every int8 plan over its budget)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from sakura_quant import QuantizedLinear, quantize_model
from sakura_quant.codec import dequantize_weight, quantize_weight

CASES = [
    ("int8", False),
    ("int8", True),
    ("nf4", False),
    ("nf4", True),
    ("fp8", False),
    ("nvfp4", False),
]
SHAPES = [(64, 128), (33, 70)]  # whole blocks; a partial last block (padding cut off)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("fmt", "double_quant"), CASES)
def test_every_stored_tensor_owns_exactly_its_storage(
    fmt: str, double_quant: bool, shape: tuple[int, int]
) -> None:
    q = quantize_weight(torch.randn(*shape), fmt, double_quant=double_quant)
    for name, t in q.tensors.items():
        assert t._base is None, f"{fmt} {name} is a view of a {tuple(t._base.shape)} tensor"
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (fmt, name)


def test_int8_and_fp8_codes_are_the_rounded_scaled_values() -> None:
    """The codes (values, not only the layout) with a partial last block, against the
    formulas written out: int8 ``round(x / absmax * 127)``, FP8 ``e4m3(x / absmax * 448)``."""
    w = torch.randn(33, 70) * 3
    flat = w.reshape(-1)
    for fmt, block, top, dtype in (
        ("int8", 64, 127.0, torch.int8),
        ("fp8", 32, 448.0, torch.float8_e4m3fn),
    ):
        q = quantize_weight(w, fmt)
        padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)
        absmax = padded.abs().amax(1)
        scaled = (padded * (1 / absmax)[:, None]).clamp(-1, 1) * top
        expected = (scaled.round() if fmt == "int8" else scaled).to(dtype).view(-1)[: w.numel()]
        assert q.tensors["data"].dtype == dtype
        assert torch.equal(q.tensors["data"].view(torch.uint8), expected.view(torch.uint8)), fmt
        assert torch.equal(q.tensors["scales"], absmax)


@pytest.mark.parametrize(("fmt", "double_quant"), CASES)
def test_swapping_a_layers_buffers_frees_the_originals(fmt: str, double_quant: bool) -> None:
    """What paging does to a quantized layer (``buffer.data = host_copy``): the original
    storages die, and the layer computes the same product from the copies."""
    model = nn.Sequential(nn.Linear(96, 128, bias=False))
    model.requires_grad_(False)
    quantize_model(model, fmt, double_quant=double_quant)
    layer = model[0]
    assert isinstance(layer, QuantizedLinear)
    x = torch.randn(3, 96)
    expected = x @ dequantize_weight(layer.quantized_weight()).T
    originals = []
    for name, buffer in layer.named_buffers():
        originals.append((name, StorageWeakRef(buffer.untyped_storage())))
        buffer.data = buffer.detach().clone()
    gc.collect()
    alive = [name for name, ref in originals if not ref.expired()]
    assert alive == [], f"{fmt}: still alive after the swap: {alive}"
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
