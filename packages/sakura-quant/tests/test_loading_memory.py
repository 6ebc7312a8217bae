"""load_model's peak memory, measured in a fresh process: the anonymous memory it adds while
it loads stays within the largest tensor plus the loaded model, with 64 MiB of slack (the
skeleton's Python objects, the float32 working copies of one weight, the allocator's
rounding), far below the full-precision checkpoint it reads.

A memory measurement, not a timing: ``RssAnon`` is sampled by a thread, so a peak can only be
missed (the assertion then holds more easily), never invented.  The figures at a larger size
are ``benchmarks/quant_load_peak.py``'s, in docs/quant.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("accelerate")

if not Path("/proc/self/status").is_file():  # pragma: no cover - not Linux
    pytest.skip("reads RssAnon from /proc/self/status (Linux)", allow_module_level=True)

_CHILD = r"""
import json, sys, threading
import torch, accelerate, transformers
import transformers.models.llama.modeling_llama
from sakura_quant import load_model

def anon():
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")

torch.set_num_threads(1)
base = anon()
peak = [base]
done = threading.Event()
def sample():
    while not done.wait(0.001):
        peak[0] = max(peak[0], anon())
thread = threading.Thread(target=sample, daemon=True)
thread.start()
options = json.loads(sys.argv[2])
if "dtype" in options:
    options["dtype"] = getattr(torch, options["dtype"])
model = load_model(sys.argv[1], **options)
done.set()
thread.join(timeout=5)
peak[0] = max(peak[0], anon())
store = model.sakura_disk_offload
on_disk = set() if store is None else set(store.keys())
kept = sum(
    t.numel() * t.element_size() for k, t in model.state_dict().items() if k not in on_disk
)
print(json.dumps({"peak": peak[0] - base, "model_bytes": kept, "on_disk": len(on_disk)}))
"""

MIB = 2**20


def _measure(tmp_path: Path, options: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
    """(the child's row, the checkpoint's bytes, its largest tensor's bytes)."""
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)  # fp32: 135 MiB of weights
    model.save_pretrained(tmp_path / "ckpt")
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    checkpoint, largest = sum(sizes), max(sizes)
    del model
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "ckpt"), json.dumps(options)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row, checkpoint, largest


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_peak_is_the_largest_tensor_plus_the_quantized_model(tmp_path: Path, fmt: str) -> None:
    row, checkpoint, largest = _measure(tmp_path, {"quantize": fmt})
    bound = largest + row["model_bytes"]
    assert row["model_bytes"] < checkpoint / 2.5  # what the bound is about: quantized
    assert row["peak"] <= bound + 64 * MIB, (row, bound, checkpoint)
    assert row["peak"] < checkpoint - 16 * MIB  # never the full-precision model


def test_disk_offload_keeps_the_layers_out_of_ram(tmp_path: Path) -> None:
    """Unquantized and cast to bf16 (so no tensor can stay a view of the checkpoint's
    pages), the layers' matrices go to disk_offload's files as they are read: what stays in
    anonymous memory is the rest of the model plus one tensor, not the 67 MiB of layers."""
    options = {"quantize": None, "dtype": "bfloat16", "disk_offload": str(tmp_path / "disk")}
    row, checkpoint, largest = _measure(tmp_path, options)
    assert row["on_disk"] == 8 * 7
    assert row["model_bytes"] < checkpoint / 30  # embeddings, head and norms only
    assert row["peak"] <= largest + row["model_bytes"] + 64 * MIB, (row, largest)
    in_ram, _, _ = _measure(tmp_path, {"quantize": None, "dtype": "bfloat16"})
    assert in_ram["peak"] > checkpoint / 2 - 8 * MIB  # without it, the bf16 model is in RAM
