"""sakura_torch.heap.reuse_freed_memory: a buffer freed and allocated again is served from
the heap without new page faults.  Each check runs in its own interpreter: the setting is
process-wide and must not leak into the test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sakura_torch.heap import reuse_freed_memory

# Minor page faults per round of two 512 x 1536 bf16 products kept alive together, as a
# training step keeps its activations (1.5 MiB each: 768 pages of 4 KiB in all).
PROBE = """
import json, resource, sys
import torch
torch.set_num_threads(1)
from sakura_torch.heap import reuse_freed_memory

result = reuse_freed_memory() if sys.argv[1] == "reuse" else None
x = torch.ones(512, 576, dtype=torch.bfloat16)
weights = [torch.ones(1536, 576, dtype=torch.bfloat16) for _ in range(2)]

def step():
    outputs = [x @ w.t() for w in weights]
    return sum(float(o[-1, -1]) for o in outputs)

faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults, "result": result}))
"""

glibc_only = pytest.mark.skipif(
    not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"), reason="needs glibc"
)


def _probe(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc_only
def test_a_freed_buffer_is_reused_without_page_faults() -> None:
    kept = _probe("reuse")
    assert kept["result"][0] is True and "below 32 MiB" in kept["result"][1]
    # the first rounds fault their pages in (the heap grows to its high-water mark); the
    # next ones reuse them
    assert kept["faults"][0] >= 700
    assert max(kept["faults"][3:]) < 64
    default = _probe("default")
    # glibc's default gives the outputs' pages back round after round (about 740 faults a
    # round here, now and then half of that)
    assert sum(default["faults"][3:]) >= 1000


@pytest.mark.parametrize("bad", [0, (128 << 10) - 1, (1 << 30) + 1, 1.5, "32M", True])
def test_largest_is_validated(bad: object) -> None:
    with pytest.raises((ValueError, TypeError), match="largest"):
        reuse_freed_memory(bad)  # type: ignore[arg-type]
