"""Framework adapters for sakura: Lightning, the Hugging Face Trainer, raw DDP loops.

Each adapter lives in its own module and imports its framework only when used::

    from sakura_adapters.lightning import LightningAdapter
    from sakura_adapters.hf import HFAdapter, SakuraTrainer
    from sakura_adapters.ddp import DDPAdapter

or, through the core facade, ``from sakura.adapters import LightningAdapter``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LightningAdapter": "sakura_adapters.lightning",
    "SakuraPrecision": "sakura_adapters.lightning",
    "HFAdapter": "sakura_adapters.hf",
    "SakuraTrainer": "sakura_adapters.hf",
    "DDPAdapter": "sakura_adapters.ddp",
    "UnemittedEventWarning": "sakura_adapters.emitted",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_adapters' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
