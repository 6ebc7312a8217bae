"""The v0.1.x modules that v1 removed, and what to use instead.

``import sakura.lightning`` (and the other names in ``REMOVED_MODULES``) fails with a
``ModuleNotFoundError`` whose message names the replacement and the migration guide,
instead of Python's bare "No module named 'sakura.lightning'". The finder sits at the end
of ``sys.meta_path``, so it is asked only after every real finder has found nothing: a
module of that name that does exist (a plugin that ships one) still imports, and the
cost of an ordinary import is nil.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["MIGRATION_GUIDE", "REMOVED_MODULES", "RemovedModuleFinder", "install"]

MIGRATION_GUIDE = "docs/migration-from-0.1.md"

# v0.1.x module -> what replaces it (one sentence, shown in the error and in the guide).
REMOVED_MODULES: dict[str, str] = {
    "sakura.lightning": (
        "sakura.lightning.SakuraTrainer is replaced by a plain lightning.Trainer with "
        "callbacks=[LightningAdapter(rt)] (from sakura.adapters import LightningAdapter; "
        "pip install sakura-adapters lightning)"
    ),
    "sakura.huggingface": (
        "sakura.huggingface.SakuraHFCallback is replaced by HFAdapter(rt), a "
        "transformers.TrainerCallback (from sakura.adapters import HFAdapter; "
        "pip install sakura-adapters transformers)"
    ),
    "sakura.ddp": (
        "sakura.ddp.DDPAsyncEvalCallback is replaced by DDPAdapter(rt, rank=..., "
        "world_size=...) with the AsyncEval service installed on the runtime "
        "(from sakura.adapters import DDPAdapter; from sakura.services import AsyncEval; "
        "pip install sakura-adapters sakura-async)"
    ),
    "sakura.tensorflow": (
        "Sakura v1 supports PyTorch only and has no TensorFlow integration; "
        "pin sakura-ml<1.0 to keep using it"
    ),
    "sakura.ml": (
        "sakura.ml.* moved to the top level: SakuraRuntime and Telemetry are in sakura, "
        "the services in sakura.services, the dispatchers in sakura.dispatch"
    ),
}


def removed_message(name: str) -> str | None:
    """The error message for ``name`` (a removed module or anything inside one), or None."""
    for module, replacement in REMOVED_MODULES.items():
        if name == module or name.startswith(module + "."):
            return (
                f"{name} was removed in Sakura v1.0: {replacement}. "
                f"See {MIGRATION_GUIDE} in the Sakura repository."
            )
    return None


class RemovedModuleFinder:
    """A meta-path finder that answers the removed module names with a helpful error."""

    @classmethod
    def find_spec(
        cls,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        message = removed_message(fullname)
        if message is None:
            return None
        raise ModuleNotFoundError(message, name=fullname)


def install() -> None:
    """Append the finder to ``sys.meta_path`` once (``import sakura`` does this)."""
    if RemovedModuleFinder not in sys.meta_path:
        sys.meta_path.append(RemovedModuleFinder)
