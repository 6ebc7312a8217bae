"""Non-finite weights are refused when quantized (every format, every path: C++ kernel,
pure torch, quantize_model, load_model, from_pretrained), and double quantization stays
finite for finite weights near fp32's largest value."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sakura_quant import _kernel, load_model, quantize_model
from sakura_quant.codec import dequantize_weight, quantize_weight
from sakura_quant.formats.nf4 import _midpoints

SPECS = [("nf4", False), ("nf4", True), ("int8", False), ("int8", True), ("fp8", False), ("nvfp4", False)]  # fmt: skip
FP32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("kernel", ["0", "1"], ids=["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "dq"), SPECS)
def test_a_nan_or_inf_weight_is_refused_with_its_count(
    monkeypatch: pytest.MonkeyPatch, kernel: str, dtype: torch.dtype, fmt: str, dq: bool
) -> None:
    monkeypatch.setenv(_kernel.NO_KERNEL_ENV, "1" if kernel == "1" else "0")
    w = torch.randn(64, 64)
    w[3, 5] = float("nan")
    with pytest.raises(
        ValueError, match=r"cannot quantize q\.weight: it holds 1 non-finite value \(NaN"
    ):
        quantize_weight(w.to(dtype), fmt, double_quant=dq, name="q.weight")
    w[0, 0], w[63, 63] = float("inf"), float("-inf")
    with pytest.raises(ValueError, match=r"holds 3 non-finite values \(NaN or ±Inf\) among 4096"):
        quantize_weight(w.to(dtype), fmt, double_quant=dq)


def test_the_kernel_itself_refuses_non_finite_input() -> None:
    lib = _kernel.LIBRARY.load()
    if lib is None:
        pytest.skip("the C++ NF4 kernel is not available here")
    x = torch.randn(128)
    x[[1, 70]] = torch.tensor([float("nan"), float("inf")])
    absmax, out = torch.zeros(2), torch.zeros(64, dtype=torch.uint8)
    mid = _midpoints(torch.device("cpu"))
    status = lib.sakura_nf4_quantize_f32(
        x.data_ptr(), 128, 128, 64, mid.data_ptr(), absmax.data_ptr(), 2, out.data_ptr(), 64, 1
    )
    assert status == 2  # the count; nothing written (the NaN used to become code 0, -absmax)
    assert torch.all(out == 0) and torch.all(absmax == 0)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)


def test_quantize_model_names_the_layer_and_changes_nothing() -> None:
    model = _Two().requires_grad_(False)
    with torch.no_grad():
        model.down.weight[0, :4] = float("inf")
    with pytest.raises(ValueError, match=r"cannot quantize down\.weight: it holds 4 non-finite"):
        quantize_model(model, "nvfp4")
    assert type(model.up) is nn.Linear  # checked before any layer changed


def test_load_model_streaming_names_the_layer(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {k: v.clone() for k, v in _Two().state_dict().items()}
    state["up.weight"][1, 1] = float("nan")
    safetensors_torch.save_file(state, tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match=r"cannot quantize up\.weight: it holds 1 non-finite"):
        load_model(tmp_path / "m.safetensors", "int8", model=_Two(), double_quant=True)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text += logging.Formatter().format(record) + "\n"


def test_from_pretrained_names_the_layer(tmp_path: Path) -> None:
    # transformers catches a quantizer's error, shows it in its load report and then raises
    # its own RuntimeError: the layer is never left randomly initialised.
    transformers = pytest.importorskip("transformers")
    from sakura_quant import SakuraQuantConfig

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[2, :2] = float("nan")
    model.save_pretrained(tmp_path)
    collect = _Collect()
    logger = logging.getLogger("transformers")
    logger.addHandler(collect)
    # Another test may have turned transformers' logging down (set_verbosity_error): the
    # load report is a warning, so this test sets the level it reads at.
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with pytest.raises(RuntimeError, match="issues during automatic conversion"):
            transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path, quantization_config=SakuraQuantConfig("nf4", double_quant=True)
            )
    finally:
        logger.removeHandler(collect)
        logger.setLevel(level)
    assert (
        "cannot quantize model.layers.0.mlp.up_proj.weight: it holds 2 non-finite" in collect.text
    )


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize(
    "fill",
    [
        lambda w: w.mul_(FP32_MAX / 4.5),  # every block near fp32's max: the fp32 mean overflows
        lambda w: w.abs_().clamp_(max=1).mul_(FP32_MAX)[:16].fill_(1.0),  # max and small mixed
    ],
    ids=["all-large", "mixed"],
)
def test_double_quant_near_fp32_max_stays_finite(fmt: str, fill: Any) -> None:
    w = torch.randn(64, 512)
    fill(w)
    assert torch.isfinite(w).all()
    q = quantize_weight(w, fmt, double_quant=True)
    assert (
        torch.isfinite(q.tensors["scales_offset"])
        and torch.isfinite(q.tensors["scales_scale"]).all()
    )
    for dtype in (torch.float32, torch.float64):
        out = dequantize_weight(q, dtype)
        assert torch.isfinite(out).all()
    w64, out64 = w.double(), dequantize_weight(q, torch.float64)
    plain = dequantize_weight(quantize_weight(w, fmt), torch.float64)
    # the one-byte scales cost little beside the format's own rounding (measured: < 0.12 / 0.01)
    error = ((out64 - w64).norm() / w64.norm()).item()
    assert error < ((plain - w64).norm() / w64.norm()).item() + 0.05
