from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The shared helpers (_offload_models.py) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    # The machine is shared; the kernel's results do not depend on the thread count.
    torch.set_num_threads(1)
