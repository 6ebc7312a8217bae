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
model = load_model(sys.argv[1], sys.argv[2])
done.set()
thread.join(timeout=5)
peak[0] = max(peak[0], anon())
kept = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps({"peak": peak[0] - base, "model_bytes": kept}))
"""

MIB = 2**20


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_peak_is_the_largest_tensor_plus_the_quantized_model(tmp_path: Path, fmt: str) -> None:
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
    model.save_pretrained(tmp_path)
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    checkpoint, largest = sum(sizes), max(sizes)
    del model
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), fmt],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = largest + row["model_bytes"]
    assert row["model_bytes"] < checkpoint / 2.5  # what the bound is about: quantized
    assert row["peak"] <= bound + 64 * MIB, (row, bound, checkpoint)
    assert row["peak"] < checkpoint - 16 * MIB  # never the full-precision model
