"""Model files are untrusted: crafted sizes in a quantized checkpoint, a hand-built
``QuantizedWeight`` or a direct kernel call are refused with a ``ValueError``, never a crash
or a read outside a buffer.  The crafted cases run in a child process (``_crafted.py``), so
a SIGSEGV / SIGFPE fails the test instead of killing pytest."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sakura_quant import QuantizedLinear, _kernel, load_model, quantize_weight
from sakura_quant.formats import QuantizedWeight
from sakura_quant.formats.checks import check_quantized_weight
from sakura_quant.formats.nf4 import _dequantize_cpu

CRAFTED = Path(__file__).with_name("_crafted.py")


def _run(mode: str, tmp_path: Path) -> Any:
    done = subprocess.run(
        [sys.executable, str(CRAFTED), mode, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-3000:]}"
    return json.loads(done.stdout.splitlines()[-1])


def test_hand_built_weights_with_crafted_metadata_are_refused(tmp_path: Path) -> None:
    outcomes = _run("hand", tmp_path)
    assert len(outcomes) == 12
    for label, outcome in outcomes.items():
        assert outcome.startswith("ValueError: QuantizedLinear: "), (label, outcome)
    assert "holds 32768 torch.uint8 values; got 2048" in outcomes["shape larger than the codes"]
    assert "holds 64 torch.float32 values; got 1" in outcomes["1-element scales"]
    assert "dtype torch.int8" in outcomes["int8 dtype"]
    assert "block_size=0" in outcomes["block_size 0"]
    assert "block_size=1000000000000" in outcomes["block_size 1e12"]


def test_fuzzed_checkpoints_load_cleanly_or_raise(tmp_path: Path) -> None:
    # 300 seeded mutations of a checkpoint holding every format (LoftQ factors, double
    # quantization, block size 2): each loads and expands to the same bits through the C++
    # kernel and the torch path, or is refused by safetensors, torch's load_state_dict or
    # our ValueError; no crash, no other exception.
    result = _run("fuzz", tmp_path)
    assert result["bad"] == []
    outcomes = result["outcomes"]
    assert sum(outcomes.values()) == 300
    assert set(outcomes) <= {"ok", "ValueError", "SafetensorError", "load_state_dict"}
    assert outcomes["ValueError"] >= 150
    assert outcomes["ok"] >= 5


def test_crafted_pre_quantized_folders_through_from_pretrained(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    outcomes = _run("hf", tmp_path)
    layer = "model.layers.0.self_attn.q_proj"
    for label, outcome in outcomes.items():
        assert outcome.startswith("ValueError: "), (label, outcome)
        assert layer in outcome, (label, outcome)
    assert "holds 2048 torch.uint8 values; got 1" in outcomes["1-byte q_proj.weight"]
    assert "holds 64 torch.float32 values; got 1" in outcomes["1-element scales"]
    assert "got 64 torch.float16" in outcomes["fp16 scales"]
    assert "block_size=0" in outcomes["block_size 0"]
    assert "block_size=-2" in outcomes["block_size -2"]
    assert "block_size=1000000000000" in outcomes["block_size 10**12"]
    # a block size the format takes, but 64 scales where block 4096 has one
    assert "holds 1 torch.float32 values; got 64" in outcomes["block_size 4096"]


def _kernel_or_skip() -> ctypes.CDLL:
    lib = _kernel.LIBRARY.load()
    if lib is None:
        pytest.skip("the C++ NF4 kernel is not available here")
    return lib


@pytest.mark.parametrize(
    ("n", "block", "data_len", "absmax_len", "out_len"),
    [
        (4096, 64, 1, 64, 4096),  # a 1-byte code buffer
        (4096, 64, 2048, 1, 4096),  # one scale for 64 blocks
        (4096, 64, 2048, 64, 16),  # a short output
        (4096, 0, 2048, 64, 4096),  # block 0 (was SIGFPE)
        (4096, -64, 2048, 64, 4096),
        (4096, 63, 2048, 65, 4096),  # odd block
        (4096, 10**12, 2048, 1, 4096),
        (-2, 64, 0, 0, 0),
    ],
)
def test_kernel_entry_points_check_sizes(
    n: int, block: int, data_len: int, absmax_len: int, out_len: int
) -> None:
    lib = _kernel_or_skip()
    data = torch.zeros(max(data_len, 1), dtype=torch.uint8)
    absmax = torch.ones(max(absmax_len, 1))
    out = torch.full((max(out_len, 1),), 7.0)
    code = torch.zeros(16)
    status = lib.sakura_nf4_dequantize_f32(
        data.data_ptr(), data_len, absmax.data_ptr(), absmax_len, n, block,
        code.data_ptr(), out.data_ptr(), out_len, 1,
    )  # fmt: skip
    assert status == _kernel.BAD_ARGUMENTS
    assert torch.all(out == 7.0)  # nothing written
    x = torch.ones(max(out_len, 1))
    status = lib.sakura_nf4_quantize_f32(
        x.data_ptr(), out_len, n, block, code.data_ptr(), absmax.data_ptr(), absmax_len,
        data.data_ptr(), data_len, 1,
    )  # fmt: skip
    assert status == _kernel.BAD_ARGUMENTS
    assert torch.all(data == 0)


def test_kernel_wrapper_raises_on_inconsistent_tensors() -> None:
    _kernel_or_skip()
    q = quantize_weight(torch.randn(64, 64), "nf4")
    with pytest.raises(ValueError, match=r"numel=65536, block_size=64, data=2048, scales=64"):
        _dequantize_cpu(q.tensors["data"], q.tensors["scales"], 65536, 64, torch.float32)


def test_checks_name_the_weight_and_the_sizes() -> None:
    q = quantize_weight(torch.randn(8, 16), "nvfp4")
    check_quantized_weight(q, name="ok")  # the weights quantize_weight makes pass
    bad = QuantizedWeight("nvfp4", (8, 16), torch.float32, 16, dict(q.tensors))
    bad.tensors["global_scale"] = torch.ones(2)
    with pytest.raises(ValueError, match=r"^lm\.w: global_scale .* holds 1 torch\.float32"):
        check_quantized_weight(bad, name="lm.w")
    with pytest.raises(ValueError, match=r"shape \(8, -16\) is not a tuple of ints >= 0"):
        check_quantized_weight(
            QuantizedWeight("nvfp4", (8, -16), torch.float32, 16, q.tensors), name="w"
        )


def test_error_factors_must_fit_the_layer() -> None:
    q = quantize_weight(torch.randn(8, 16), "int8")
    with pytest.raises(ValueError, match=r"error_factors must be floating \(r, 16\)"):
        QuantizedLinear(q, error_factors=(torch.zeros(4, 16), torch.zeros(8, 3)))
    with pytest.raises(ValueError, match=r"error_factors"):
        QuantizedLinear(q, error_factors=(torch.zeros(16), torch.zeros(8, 1)))


def test_a_state_dict_that_swaps_a_dtype_is_refused() -> None:
    layer = QuantizedLinear(quantize_weight(torch.randn(8, 16), "nf4"))
    state = layer.state_dict()
    state["weight_scales"] = state["weight_scales"].half()
    with pytest.raises(RuntimeError, match=r"scales of a nf4 weight .* got 2 torch\.float16"):
        layer.load_state_dict(state, assign=True)


def test_load_model_checks_every_shape_against_the_model(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "m.safetensors"
    for key, wrong in [("0.weight", torch.zeros(1)), ("1.weight", torch.zeros(9))]:
        crafted = dict(state, **{key: wrong})
        safetensors_torch.save_file(crafted, path)
        shape = tuple(wrong.shape)
        with pytest.raises(ValueError, match=rf"stores {key} as \({shape[0]},\) torch\.float32"):
            load_model(path, "nf4", model=nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8)))
