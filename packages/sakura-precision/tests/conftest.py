"""Shared fixtures for the sakura-precision tests."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

# The tests import their shared models from precision_helpers.py next to this file (the
# suite runs with --import-mode=importlib, which does not put test directories on the path).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True)
def _quiet_frameworks() -> Any:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    yield


@pytest.fixture(autouse=True)
def _restore_default_dtype() -> Any:
    import torch

    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny models on a shared 2-core machine: intra-op threads only add contention (a
    20-step loop takes 20 ms on one thread and up to a second on two under load)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
