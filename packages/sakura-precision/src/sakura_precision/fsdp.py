"""MixedPrecision under FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 has its own, module-level mixed precision: ``fully_shard(module,
mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...))`` all-gathers each
block's fp32 shards as ``param_dtype`` for forward and backward, reduce-scatters the
gradients in ``reduce_dtype`` and keeps the fp32 shards for the optimizer.  Autocast is
op-level: it casts fp32 weights to bf16 at every matmul.  Under FSDP2 the module-level
policy is the cheaper of the two (the all-gather moves half the bytes and no weight is cast
twice), so:

- :func:`fsdp_mp_policy` turns a Sakura precision mode into the ``MixedPrecisionPolicy`` to
  give ``fully_shard`` (torchtitan's ``mixed_precision_param/_reduce``, the ``mp_policy`` of
  a Lightning ``ModelParallelStrategy``'s ``configure_model``);
- :func:`fsdp_casting` tells the ``MixedPrecision`` service what FSDP2 already does to a
  model it is given: when the policies cast every parameter to the service's dtype, the
  service's ``autocast()`` does nothing (no second cast); when they cast to another dtype it
  is an error (the two would fight over the compute dtype).

Why the service does not apply a policy itself when ``fully_shard`` was called without one:
torch 2.13 has no public way to change a module's ``mp_policy`` after ``fully_shard``
(it is read into FSDP2's private state at wrap time and into the parameter groups at their
lazy init).  Writing those private fields would change the numerics under the user's feet
and break on the next torch release.  Autocast over an FSDP2 model is correct (the
gathered parameters are plain tensors inside forward), so the service keeps autocast there
and says so in ``fsdp_reason``.

Reading a module's policy uses one private accessor, ``FSDPModule._get_fsdp_state()._mp_policy``
(there is no public getter); if a torch release moves it, :func:`fsdp_casting` fails with
a clear error instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sakura.options import check_bool, option_error
from sakura_precision.modes import ACCEPTED, Mode, resolve_mode

__all__ = [
    "FSDPCasting",
    "check_castable",
    "fsdp_casting",
    "fsdp_modules",
    "fsdp_mp_policy",
]

_POLICY_MODES = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "32-true", "64-true")
_ACCEPTED_TEXT = (
    ", ".join(repr(a) for a in ACCEPTED if a != "fp8")
    + ", torch.bfloat16 or torch.float16 (not 'fp8': its Float8Linear layers cast inside "
    "their own forward, which no MixedPrecisionPolicy describes)"
)


def _fsdp_api() -> tuple[Any, Any] | None:
    """``(FSDPModule, MixedPrecisionPolicy)``, or None where torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        try:
            from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined]
                FSDPModule,
                MixedPrecisionPolicy,
            )
        except ImportError:
            return None
    return FSDPModule, MixedPrecisionPolicy


def fsdp_mp_policy(precision: Any = "bf16-mixed", *, cast_forward_inputs: bool = True) -> Any:
    """The ``torch.distributed.fsdp.MixedPrecisionPolicy`` for a Sakura precision mode.

    ==================================  ========================================================
    precision (any spelling of)         policy
    ==================================  ========================================================
    ``"bf16-mixed"``                    ``param_dtype=bfloat16, reduce_dtype=float32``: compute
                                        in bf16, fp32 gradient reduction and fp32 shards for
                                        the optimizer (torchtitan's default)
    ``"16-mixed"``                      ``param_dtype=float16, reduce_dtype=float32``; keep the
                                        ``MixedPrecision("16-mixed")`` service for the loss
                                        scaling (its GradScaler reduces the inf/NaN check
                                        across the ranks' shards)
    ``"bf16-true"``, ``"16-true"``,     ``param_dtype=reduce_dtype=`` that dtype: everything in
    ``"32-true"``, ``"64-true"``        it (cast the model to it before ``fully_shard``, as
                                        ``rt.prepare`` with the service does, so the shards are
                                        stored in it too)
    ==================================  ========================================================

    ``output_dtype`` stays None (outputs in the compute dtype, as under autocast).

    Args:
        precision: a precision value ``MixedPrecision`` accepts, except ``"fp8"``.
        cast_forward_inputs: FSDP2's option of the same name (cast floating forward inputs
            to ``param_dtype``).

    Raises:
        OptionError: ``precision`` is not a mode with an FSDP2 meaning, or
            ``cast_forward_inputs`` is not a bool.
        RuntimeError: this torch has no FSDP2.
    """
    owner = "fsdp_mp_policy"
    try:
        mode = resolve_mode(precision)
    except ValueError:
        raise option_error("precision", precision, _ACCEPTED_TEXT, owner=owner) from None
    if mode.name not in _POLICY_MODES:
        raise option_error("precision", precision, _ACCEPTED_TEXT, owner=owner)
    check_bool("cast_forward_inputs", cast_forward_inputs, owner=owner)
    api = _fsdp_api()
    if api is None:
        raise RuntimeError(
            f"fsdp_mp_policy needs FSDP2 (torch.distributed.fsdp.fully_shard); torch "
            f"{torch.__version__} has none"
        )
    reduce_dtype = torch.float32 if mode.kind == "mixed" else mode.dtype
    return api[1](
        param_dtype=mode.dtype,
        reduce_dtype=reduce_dtype,
        output_dtype=None,
        cast_forward_inputs=cast_forward_inputs,
    )


def fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every FSDP2 (``fully_shard``) module in ``model``, itself
    included (name ``""``)."""
    api = _fsdp_api()
    if api is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, api[0])]


def _policy(name: str, module: nn.Module) -> Any:
    try:
        return module._get_fsdp_state()._mp_policy  # type: ignore[operator]
    except AttributeError as error:
        raise RuntimeError(
            f"sakura_precision cannot read the MixedPrecisionPolicy of FSDP2 module "
            f"{name or '<root>'!r}: torch {torch.__version__} moved "
            f"FSDPModule._get_fsdp_state()._mp_policy ({error}); please report it"
        ) from error


@dataclass(frozen=True)
class FSDPCasting:
    """What FSDP2's policies do to a model's compute dtype, as seen by one precision mode."""

    covers_all: bool
    """Every floating parameter computes in the mode's dtype without autocast: FSDP2 casts
    it there, or it is stored in it."""
    reason: str
    """Why autocast is or is not needed (the service's ``fsdp_reason``)."""


def fsdp_casting(model: Any, mode: Mode, *, owner: str) -> FSDPCasting | None:
    """None when ``model`` has no FSDP2 module; else what its policies cast.

    Raises ValueError when a policy's ``param_dtype`` conflicts with ``mode``: another low
    precision than the mode's (an fp16 policy under ``"bf16-mixed"``), or any cast under a
    ``"-true"`` mode other than to its dtype.  ``owner`` names the service in the error.
    """
    if not isinstance(model, nn.Module):
        return None
    found = fsdp_modules(model)
    if not found:
        return None
    fsdp_ids = {id(m) for _, m in found}
    dtype = mode.dtype
    allowed = {dtype} if mode.kind == "true" else {dtype, torch.float32}
    casts: dict[int, torch.dtype | None] = {}
    for name, module in found:
        param_dtype = _policy(name, module).param_dtype
        if param_dtype is not None and param_dtype not in allowed:
            raise ValueError(
                f"{owner}: FSDP2 module {name or '<root>'!r} has "
                f"mp_policy.param_dtype={param_dtype}, which conflicts with the service's "
                f"{mode.name!r} ({dtype}); build fully_shard with "
                f"mp_policy=sakura_precision.fsdp_mp_policy({mode.name!r}), or give the "
                f"service the policy's precision"
            )
        casts[id(module)] = param_dtype
    # Each parameter belongs to the nearest fully_shard module above it (FSDP2's rule).
    nearest: dict[str, nn.Module | None] = {}
    uncast: list[str] = []
    total = 0
    for name, module in model.named_modules():
        parent = nearest.get(name.rpartition(".")[0]) if name else None
        owner_module = module if id(module) in fsdp_ids else parent
        nearest[name] = owner_module
        for pname, p in module.named_parameters(recurse=False):
            if not p.is_floating_point():
                continue
            total += 1
            cast = casts.get(id(owner_module)) if owner_module is not None else None
            sharded = type(p).__name__ == "DTensor"
            if p.dtype != dtype and not (sharded and cast == dtype):
                uncast.append(f"{name}.{pname}" if name else pname)
    if not uncast:
        return FSDPCasting(
            True,
            f"FSDP2's mp_policy computes every parameter in {dtype}: the service does not "
            f"autocast on top of it",
        )
    return FSDPCasting(
        False,
        f"FSDP2 leaves {len(uncast)} of {total} floating parameters outside {dtype} (e.g. "
        f"{uncast[0]!r}); the service autocasts them op by op (a fully_shard mp_policy "
        f"of sakura_precision.fsdp_mp_policy({mode.name!r}) would cast them per module)",
    )


def check_castable(model: nn.Module, dtype: torch.dtype, *, owner: str) -> None:
    """Raise ValueError when casting ``model`` to ``dtype`` would break FSDP2: some of its
    sharded parameters are in another dtype and FSDP2 has already run (its lazy init,
    at the first forward, sized the all-gather buffers for their dtype; a later cast fails
    inside the next all-gather with "Expected out tensor to have dtype ...").  Before the
    first forward FSDP2's own ``_apply`` re-registers the cast shards, which is fine.
    The lazy-init flag is private (``FSDPState._is_root``); when it is missing the cast is
    refused, never guessed."""
    for name, module in fsdp_modules(model):
        if all(p.dtype == dtype for p in module.parameters() if p.is_floating_point()):
            continue
        state = module._get_fsdp_state()  # type: ignore[operator]
        if getattr(state, "_is_root", True) is not None:
            raise ValueError(
                f"{owner} casts the weights to {dtype}, but FSDP2 module "
                f"{name or '<root>'!r} has already run with other dtypes; call "
                f"rt.prepare(model) (or rt.wrap_model) before fully_shard, or at least "
                f"before the first forward"
            )
