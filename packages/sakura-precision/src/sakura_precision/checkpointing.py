"""Deprecated alias of :mod:`sakura_precision.activation_checkpoint` (renamed in 0.2.0).

The module is about *activation* checkpointing (recomputing activations in backward), not
about saving checkpoints, so it was renamed.  Importing it still works, with a
``DeprecationWarning``; it will be removed in 0.3.0.  Import from
``sakura_precision.activation_checkpoint`` or from ``sakura_precision``.
"""

from __future__ import annotations

import warnings

from sakura_precision.activation_checkpoint import POLICIES, ActivationCheckpoint

__all__ = ["POLICIES", "ActivationCheckpoint"]

warnings.warn(
    "sakura_precision.checkpointing is deprecated and will be removed in sakura-precision "
    "0.3.0; import from sakura_precision.activation_checkpoint (or sakura_precision) instead",
    DeprecationWarning,
    stacklevel=2,
)
