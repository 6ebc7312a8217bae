"""What the Hugging Face Trainer can and cannot honour: the checks made before training.

A service is never silently ignored: a coordinated call that a ``TrainerCallback`` cannot
carry out on the stock Trainer is :class:`SakuraTrainerRequiredError`; two things that both
control precision, or both compile the model, are a ``ValueError`` naming both.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from sakura.errors import SakuraError
from sakura.runtime import SakuraRuntime

__all__ = [
    "USE_SAKURA_TRAINER",
    "SakuraTrainerRequiredError",
    "check_runtime",
    "check_services",
    "check_single_compiler",
    "is_compiled",
    "warn_if_fsdp_fell_back",
]

logger = logging.getLogger("sakura.adapters.hf")

# Coordinated calls a TrainerCallback cannot carry out on the stock Trainer.
TRAINER_ONLY_CALLS = ("wrap_loss", "unscale_gradients", "optimizer_step")
# Calls that control precision: they conflict with the Trainer's own fp16/bf16.
PRECISION_CALLS = ("autocast", "wrap_loss")

USE_SAKURA_TRAINER = (
    "use sakura_adapters.hf.SakuraTrainer, a drop-in replacement of transformers.Trainer "
    "(SakuraTrainer(model=..., args=..., runtime=rt), or keep callbacks=[HFAdapter(rt)] and "
    "only change the class)"
)


class SakuraTrainerRequiredError(SakuraError, RuntimeError):
    """An installed service needs :class:`SakuraTrainer`; the stock Trainer cannot honour it."""


def check_runtime(rt: Any, option: str) -> SakuraRuntime:
    if not isinstance(rt, SakuraRuntime):
        raise TypeError(f"{option} must be a sakura.SakuraRuntime, got {type(rt).__name__}")
    return rt


def by_service(rt: SakuraRuntime, calls: Iterable[str]) -> dict[str, list[str]]:
    """Service name -> the ``calls`` it implements (services implementing none left out)."""
    found: dict[str, list[str]] = {}
    for call in calls:
        for name in rt.implements(call):
            found.setdefault(name, []).append(call)
    return found


def describe(found: Mapping[str, list[str]]) -> str:
    return "; ".join(f"{name!r} implements {', '.join(calls)}" for name, calls in found.items())


def is_compiled(model: Any) -> bool:
    """Whether ``model`` is a ``torch.compile()``'d module or was compiled in place
    (``nn.Module.compile()`` and sakura's Compile set ``_compiled_call_impl``)."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or (
        isinstance(model, nn.Module) and model.__dict__.get("_compiled_call_impl") is not None
    )


def check_single_compiler(args: Any, names: tuple[str, ...], was: bool, model: Any) -> None:
    """``TrainingArguments(torch_compile=True)`` makes accelerate compile the model that a
    sakura ``wrap_model`` service has just compiled: a nested compile (two graphs, twice
    the compile time, recompiles) with no benefit.  One compiler at a time."""
    if getattr(args, "torch_compile", False) and not was and is_compiled(model):
        raise ValueError(
            f"TrainingArguments(torch_compile=True) and the sakura service(s) {list(names)} "
            f"both compile the model (the services' wrap_model compiled it); use one of them: "
            f"drop torch_compile from the TrainingArguments (sakura's Compile takes mode, "
            f"backend, per-block compilation and a compile cache) or uninstall the service(s)"
        )


def hf_mixed_precision(args: Any, trainer: Any) -> str | None:
    """How the Trainer itself was told to use mixed precision, or None."""
    for flag in ("fp16", "bf16"):
        if getattr(args, flag, False):
            return f"TrainingArguments({flag}=True)"
    accelerator = getattr(trainer, "accelerator", None) if trainer is not None else None
    mode = getattr(accelerator, "mixed_precision", None)
    if mode not in (None, "no"):
        return f"accelerate's mixed_precision={mode!r}"
    return None


def check_services(rt: SakuraRuntime, args: Any, trainer: Any) -> None:
    """Raise unless every installed service can take effect in this Trainer (``trainer`` is
    the SakuraTrainer, or None under the stock Trainer)."""
    hf_precision = hf_mixed_precision(args, trainer)
    if hf_precision is not None:
        precision = by_service(rt, PRECISION_CALLS)
        if precision:
            raise ValueError(
                f"{hf_precision} and the sakura service(s) {sorted(precision)} both control "
                f"mixed precision ({describe(precision)}); use one of them: drop fp16/bf16 "
                f"from the TrainingArguments (sakura's MixedPrecision accepts 'bf16-mixed' "
                f"and '16-mixed') or uninstall the service(s)"
            )
    if trainer is None:
        needs = by_service(rt, TRAINER_ONLY_CALLS)
        if needs:
            raise SakuraTrainerRequiredError(
                f"the sakura service(s) {sorted(needs)} cannot take effect under the stock "
                f"transformers.Trainer with only the HFAdapter callback ({describe(needs)}): "
                f"a TrainerCallback cannot change the loss given to backward, unscale "
                f"gradients before clipping or take over the optimizer step. Training was "
                f"not started; {USE_SAKURA_TRAINER}"
            )


def _is_sharded(model: Any) -> bool:
    """Whether ``model`` (or what it wraps) is sharded by FSDP2 (DTensor parameters) or
    wrapped by FSDP1."""
    if type(model).__name__ == "FullyShardedDataParallel":
        return True
    inner = getattr(model, "module", model)
    if not isinstance(inner, nn.Module):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor has no FSDP2 either
        return False
    return any(isinstance(p, DTensor) for p in inner.parameters())


def warn_if_fsdp_fell_back(args: Any, model: Any) -> bool:
    """Log a warning when ``TrainingArguments.fsdp`` asked for FSDP but the model the
    Trainer trains is not sharded (returns whether it warned).

    accelerate turns FSDP on only for GPU-like devices: on a CPU the Trainer silently trains
    the whole model on every rank under DDP instead (accelerate 1.16), which is correct but
    holds N copies of the weights and optimizer state.  A user who asked for sharding
    should hear that it did not happen.
    """
    requested = getattr(args, "fsdp", None)
    if not requested or model is None or _is_sharded(model):
        return False
    if isinstance(requested, (list, tuple)):  # older transformers: a list of FSDPOption
        options = " ".join(str(getattr(o, "value", o)) for o in requested)
    else:  # transformers 5: True, the options moved into fsdp_config
        options = str(requested)
    logger.warning(
        "TrainingArguments.fsdp=%s asked for FSDP, but the model is not sharded: accelerate "
        "enables FSDP only on GPU-like devices, so on %s the Trainer trains the whole model "
        "on every rank (DDP). Every rank holds all weights and optimizer state; sakura's "
        "services run as under DDP. On a CPU, shard with a raw loop or Lightning's "
        "ModelParallelStrategy (docs/scaling.md).",
        options,
        getattr(args, "device", "this device"),
    )
    return True
