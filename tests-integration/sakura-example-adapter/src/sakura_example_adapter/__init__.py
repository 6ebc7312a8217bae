"""An example third-party Sakura adapter for a toy trainer (see README.md)."""

from __future__ import annotations

from sakura_example_adapter.adapter import ToyAdapter
from sakura_example_adapter.toy import CHECKPOINT_FORMAT, ToyOptimizer, ToyTrainer

__version__ = "0.1.0"
__all__ = ["CHECKPOINT_FORMAT", "ToyAdapter", "ToyOptimizer", "ToyTrainer"]
