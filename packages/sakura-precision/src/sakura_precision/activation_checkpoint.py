"""``ActivationCheckpoint``: selective, non-reentrant activation checkpointing of the block stack.

A checkpointed block keeps only its inputs during the forward pass; backward runs its
forward again to rebuild the activations it needs (``torch.utils.checkpoint`` with
``use_reentrant=False``).  Memory for activations drops to roughly one block's worth plus
the block inputs, for about one extra forward per step.  A *policy* makes it selective:
ops whose outputs it names are saved in the forward and not recomputed (for example the
matmuls, the expensive part), everything else is recomputed
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``).

The blocks are changed in place: each selected block's ``forward`` is replaced by a
checkpointing wrapper on that instance.  Module structure, ``state_dict`` keys, parameters
and hooks are untouched, which is what Lightning (it drives the module it was given) and
checkpoint files need.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from sakura import Service
from sakura.marks import RECOMPUTED, has_mark, set_mark
from sakura.options import check_bool, check_int
from sakura_torch.blocks import describe_selector, find_blocks, validate_selector

__all__ = ["POLICIES", "ActivationCheckpoint"]

_aten = torch.ops.aten


def _existing(*names: str) -> frozenset[Any]:
    """The aten overload packets among ``names`` that this torch build has."""
    found = []
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is not None:
            found.append(packet)
    return frozenset(found)


POLICIES: dict[str, frozenset[Any]] = {
    "save_matmuls": _existing(
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ),
}
"""Named policies: the aten ops whose outputs are saved (everything else is recomputed).
``"save_matmuls"`` saves matrix products and attention, the compute-heavy ops, so backward
recomputes only the cheap elementwise work (norms, activations, dropout masks' users)."""


def _op_packet(op: Any) -> Any:
    return getattr(op, "overloadpacket", op)


def _resolve_ops(owner: str, ops: Collection[Any]) -> frozenset[Any]:
    resolved = []
    for op in ops:
        if isinstance(op, str):
            name = op.removeprefix("torch.ops.").removeprefix("aten.").split(".")[0]
            packet = getattr(_aten, name, None)
            if packet is None:
                raise ValueError(f"{owner}: policy names {op!r}, which is not an aten op")
            resolved.append(packet)
        elif isinstance(op, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            resolved.append(_op_packet(op))
        else:
            raise ValueError(
                f"{owner}: policy ops must be aten ops (torch.ops.aten.mm) or their names "
                f"('aten.mm'), got {op!r}"
            )
    return frozenset(resolved)


class _SavePolicy:
    """SAC policy: save the outputs of the ops in ``save``, recompute the rest."""

    def __init__(self, save: frozenset[Any]) -> None:
        self.save = save

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if _op_packet(op) in self.save:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


class _CheckpointedForward:
    """What a checkpointed block's ``forward`` becomes (an attribute of the instance).

    It keeps the block, not its bound ``forward``: a bound method pickles as
    ``getattr(block, "forward")``, which after unpickling would find this wrapper again.
    """

    def __init__(
        self,
        module: nn.Module,
        instance_forward: Callable[..., Any] | None,
        context_fn: Callable[[], tuple[Any, Any]] | None,
        preserve_rng_state: bool,
    ) -> None:
        self.module = module
        self.instance_forward = instance_forward  # a forward set on the instance before us
        self.context_fn = context_fn
        self.preserve_rng_state = preserve_rng_state

    def original(self) -> Callable[..., Any]:
        """The block's own forward, bound."""
        if self.instance_forward is not None:
            return self.instance_forward
        return types.MethodType(type(self.module).forward, self.module)

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # for inspect.signature
        return self.original()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if getattr(module, "gradient_checkpointing", False) is True:
            raise RuntimeError(
                f"ActivationCheckpoint: {type(module).__name__} also has the framework's own "
                f"gradient checkpointing enabled (transformers' gradient_checkpointing=True); use "
                f"one: drop gradient_checkpointing from the TrainingArguments / model, or "
                f"uninstall ActivationCheckpoint"
            )
        forward = self.original()
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        options: dict[str, Any] = {
            "use_reentrant": False,
            "preserve_rng_state": self.preserve_rng_state,
        }
        if self.context_fn is not None:
            options["context_fn"] = self.context_fn
        return checkpoint(forward, *args, **options, **kwargs)


class ActivationCheckpoint(Service):
    """Selective, non-reentrant activation checkpointing of a model's repeated blocks.

    Args:
        blocks: which modules to checkpoint: ``None`` auto-detects the repeated block stack
            (e.g. a transformer's layers); or a block class, a tuple of classes, a class
            name, or a callable ``(name, module) -> bool`` (see
            :mod:`sakura_torch.blocks`).
        policy: ``None`` recomputes everything inside a block; ``"save_matmuls"`` saves the
            outputs of matrix products and attention and recomputes the rest; a collection
            of aten ops (``{torch.ops.aten.mm, "aten.addmm"}``) saves those; a callable is
            used as a ``torch.utils.checkpoint`` selective-checkpoint policy
            ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``.
        every: checkpoint every n-th block (1: all; 2: blocks 0, 2, 4...), trading memory
            for less recomputation.
        preserve_rng_state: replay the forward's RNG state in the recomputation, so dropout
            masks are identical (torch's default).

    ``wrap_model`` changes the selected blocks in place and returns the model.
    ``checkpointed`` lists the names of the blocks it changed.  In eval or under
    ``torch.no_grad`` the blocks run normally.
    """

    name = "activation_checkpoint"
    priority = 50

    def __init__(
        self,
        blocks: Any = None,
        *,
        policy: Any = None,
        every: int = 1,
        preserve_rng_state: bool = True,
    ) -> None:
        owner = "ActivationCheckpoint"
        self.blocks = validate_selector(blocks, owner=owner)
        self.every: int = check_int("every", every, minimum=1, owner=owner)
        self.preserve_rng_state = check_bool("preserve_rng_state", preserve_rng_state, owner=owner)
        self.policy = policy
        self._context_fn = self._make_context_fn(owner, policy)
        self.checkpointed: list[str] = []

    @staticmethod
    def _make_context_fn(owner: str, policy: Any) -> Callable[[], tuple[Any, Any]] | None:
        if policy is None:
            return None
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(
                    f"{owner}: policy={policy!r} is not accepted; accepted: None (recompute "
                    f"everything), {', '.join(repr(p) for p in POLICIES)}, a collection of aten "
                    f"ops to save, or a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy"
                )
            policy_fn: Callable[..., Any] = _SavePolicy(POLICIES[policy])
        elif callable(policy) and not isinstance(policy, torch._ops.OpOverloadPacket):
            policy_fn = policy
        elif isinstance(policy, Collection):
            policy_fn = _SavePolicy(_resolve_ops(owner, policy))
        else:
            raise ValueError(
                f"{owner}: policy={policy!r} is not accepted; accepted: None, "
                f"{', '.join(repr(p) for p in POLICIES)}, a collection of aten ops, or a "
                f"callable policy"
            )
        return functools.partial(create_selective_checkpoint_contexts, policy_fn)

    def __repr__(self) -> str:
        policy = self.policy if isinstance(self.policy, (str, type(None))) else "custom"
        return (
            f"ActivationCheckpoint(blocks={describe_selector(self.blocks)}, policy={policy!r}, "
            f"every={self.every})"
        )

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ActivationCheckpoint needs a torch.nn.Module, got {type(model)}")
        found = find_blocks(model, self.blocks, owner="ActivationCheckpoint")
        for index, (name, block) in enumerate(found):
            if index % self.every:
                continue
            if has_mark(block, RECOMPUTED):
                continue  # already recomputed (wrap_model ran twice on this model)
            wrapper = _CheckpointedForward(
                block, block.__dict__.get("forward"), self._context_fn, self.preserve_rng_state
            )
            block.__dict__["forward"] = wrapper
            # Public: a memory planner (sakura-offload's or anyone's) reads it and does not
            # also page this block's activations.
            set_mark(block, RECOMPUTED, self.name)
            self.checkpointed.append(name)
        return model
