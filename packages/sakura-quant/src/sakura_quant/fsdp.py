"""A quantized base that FSDP2 (``torch.distributed.fsdp.fully_shard``) shards.

``QuantizedLinear`` keeps its codes, scales, double-quant statistics and LoftQ factors as
*buffers*, and ``fully_shard`` shards parameters only: under FSDP2 every rank would hold the
whole quantized base.  :func:`shardable` (called after ``quantize_model`` / ``get_peft_model``
and before ``fully_shard``) turns each of those tensors into a frozen ``nn.Parameter`` that
FSDP2 shards like any weight: each rank keeps about ``1/N`` of it, and FSDP2 all-gathers a
block's tensors for its forward and backward, as it does for ordinary weights.

Every such tensor is stored as its raw bytes: a flat ``uint8`` parameter (the "storage
dtype" of bitsandbytes' ``quant_storage`` trick, taken all the way).  FSDP2's
``MixedPrecisionPolicy(param_dtype=...)`` never casts a non-floating parameter and
``module.to(dtype)`` leaves it alone, so neither can rewrite an fp32 scale into bf16 or read
FP8 codes as numbers to convert: the failure where a QLoRA run trains to ``loss=0`` /
``grad_norm=nan`` because its quantization state was cast.  A flat byte vector also splits
evenly on any number of ranks, whatever the tensor's shape (FSDP2 pads dim 0).  The layer
reads each tensor back as a view (``uint8`` -> its dtype and shape: no copy) from whatever
FSDP2 has put on the module: the all-gathered tensor inside forward and backward.

The layer becomes a :class:`ShardableQuantizedLinear` (a subclass: same forward, same
arithmetic, so a sharded run equals the unsharded one bit for bit).  Its state dict holds the
byte layout (``weight``, ``weight_scales``, ... as flat ``uint8``); ``torch.distributed.
checkpoint`` saves and loads it sharded and reshards it to another world size.  Loading also
takes a plain ``QuantizedLinear``'s state dict (each tensor in its own dtype and shape) and
refuses a tensor of any other dtype or size instead of casting it.

What would corrupt training is refused before the first product runs, with an error that
says what to do: :func:`check_sharded` (called by the ``quant`` service when it sees an
FSDP2-sharded model, and by a one-shot check on the model's first forward that
``quantize_model`` and :func:`shardable` install) refuses, in a model that ``fully_shard``
wrapped, a quantized layer whose tensors are still replicated buffers, were left out of
every FSDP2 group, or are FSDP2 parameters in a dtype its mixed-precision policy would cast;
:func:`shardable` refuses a model that ``fully_shard`` already wrapped; ``quantize_model``
refuses sharded (DTensor) weights.

This reads two FSDP2 internals to find which module tensors a ``fully_shard`` group manages
(``torch.distributed._composable_state._module_state_mapping`` and the group's
``fsdp_params``); :func:`check_sharded` fails with a clear error if a torch release moves
them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sakura.options import option_error
from sakura_quant.formats import QuantizedWeight
from sakura_quant.formats.checks import check_quantized_weight
from sakura_quant.linear import QuantizedLinear

__all__ = [
    "ShardableQuantizedLinear",
    "check_sharded",
    "install_wrap_check",
    "is_fsdp_sharded",
    "local_quantized_nbytes",
    "shardable",
]

_FACTORS = ("error_a", "error_b")
_HOOK_ATTR = "_sakura_quant_fsdp_check"


def _stored_names(layer: QuantizedLinear) -> list[str]:
    """The attribute names of ``layer``'s quantized tensors (codes, scales, double-quant
    statistics, LoftQ factors), whatever the format."""
    names = [name for name in layer._buffers if name == "weight" or name.startswith("weight_")]
    names += [name for name in _FACTORS if name in layer._buffers]
    return names


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class ShardableQuantizedLinear(QuantizedLinear):
    """A :class:`~sakura_quant.QuantizedLinear` whose quantized tensors are frozen flat
    ``uint8`` parameters (their bytes), so that FSDP2 shards them.  Made by :func:`shardable`
    from an existing layer (never built directly); forward, backward and the arithmetic are
    the parent's: only where the tensors are read from changes."""

    _byte_layout: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def _native(self, name: str) -> torch.Tensor:
        shape, dtype = self._byte_layout[name]
        stored: torch.Tensor = getattr(self, name)
        if _is_dtensor(stored):
            raise RuntimeError(
                f"ShardableQuantizedLinear: {name} is sharded here (FSDP2 gathers it only "
                f"for the forward and backward of the block that holds it); to read the "
                f"whole weight outside them, call unshard() on that block's FSDP module first"
            )
        native: torch.Tensor = stored.view(dtype).view(shape)
        return native

    def quantized_weight(self) -> QuantizedWeight:
        """The stored weight, read back from the byte parameters (views, not copies)."""
        return QuantizedWeight(
            format=self.format,
            shape=(self.out_features, self.in_features),
            dtype=self.compute_dtype,
            block_size=self.block_size,
            tensors={
                name: self._native("weight" if name == "data" else f"weight_{name}")
                for name in self._tensor_names
            },
        )

    @property
    def error_factors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if all(name in self._byte_layout for name in _FACTORS):
            return self._native("error_a"), self._native("error_b")
        return None

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # The byte layout, or a plain QuantizedLinear's (each tensor in its own dtype and
        # shape, taken as its bytes); anything else would be cast or refused late by copy_,
        # so it is refused here, by name (never re-quantized as a weight).
        state_dict = dict(state_dict)
        for name, (shape, dtype) in self._byte_layout.items():
            incoming = state_dict.get(prefix + name)
            if incoming is None:
                continue
            current = getattr(self, name)
            native = (
                not _is_dtensor(incoming)
                and incoming.dtype == dtype
                and tuple(incoming.shape) == shape
                and tuple(incoming.shape) != tuple(current.shape)
            )
            if native:
                incoming = incoming.detach().contiguous().reshape(-1).view(torch.uint8)
                state_dict[prefix + name] = incoming
            if incoming.dtype != torch.uint8 or tuple(incoming.shape) != tuple(current.shape):
                error_msgs.append(
                    f"{prefix}{name}: a shardable quantized layer stores this tensor as "
                    f"{tuple(current.shape)} uint8 bytes (sakura_quant.fsdp.shardable), got "
                    f"{tuple(incoming.shape)} {incoming.dtype} (neither that nor the "
                    f"layer's own {shape} {dtype})"
                )
                return
        nn.Module._load_from_state_dict(
            self,
            state_dict,
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )
        if not any(_is_dtensor(self._parameters[name]) for name in self._byte_layout):
            try:  # a state dict is untrusted: what it loaded is checked where it is whole
                check_quantized_weight(self.quantized_weight(), name=prefix.rstrip(".") or "weight")
            except ValueError as exc:
                error_msgs.append(str(exc))


def _make_shardable(layer: QuantizedLinear, name: str) -> None:
    check_quantized_weight(layer.quantized_weight(), name=name or "weight")
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for attr in _stored_names(layer):
        tensor = getattr(layer, attr)
        del layer._buffers[attr]
        layout[attr] = (tuple(tensor.shape), tensor.dtype)
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        layer.register_parameter(attr, nn.Parameter(flat, requires_grad=False))
    layer.__class__ = ShardableQuantizedLinear
    object.__setattr__(layer, "_byte_layout", layout)


def shardable(model: nn.Module) -> nn.Module:
    """Make ``model``'s quantized layers shardable by FSDP2, in place; returns ``model``.

    Call it after :func:`~sakura_quant.quantize_model` (and ``get_peft_model``, which may
    come before or after) and before ``fully_shard``: each ``QuantizedLinear`` becomes a
    :class:`ShardableQuantizedLinear` whose codes, scales, double-quant statistics and LoftQ
    factors are frozen flat ``uint8`` parameters, which ``fully_shard`` shards and gathers
    per block like the block's other weights.  Without ``fully_shard`` the model computes
    exactly as before.  Layers already shardable are left as they are.  A model that
    ``fully_shard`` already wrapped is refused (its groups were built without these
    tensors).  It also installs the one-shot check of :func:`install_wrap_check`.
    """
    if not isinstance(model, nn.Module):
        raise option_error("model", model, "a torch.nn.Module", owner="shardable")
    if is_fsdp_sharded(model):
        raise ValueError(
            "shardable: this model is already wrapped by fully_shard (it has DTensor "
            "parameters), so its FSDP2 groups do not hold the quantized tensors; call "
            "shardable(model) after quantize_model / get_peft_model and before fully_shard"
        )
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear) and not isinstance(module, ShardableQuantizedLinear):
            _make_shardable(module, name)
    install_wrap_check(model)
    return model


def is_fsdp_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (``fully_shard`` has wrapped it)."""
    return any(_is_dtensor(p) for p in model.parameters())


def _fsdp_groups() -> Iterator[tuple[list[nn.Module], list[Any], torch.dtype | None]]:
    """(the modules a ``fully_shard`` call wrapped, the FSDPParams of its group, the dtype
    its mixed precision casts parameters to) for every live FSDP2 state in this process."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError as exc:  # pragma: no cover - a torch release moved the internals
        raise RuntimeError(
            f"sakura_quant.fsdp cannot read FSDP2's groups in torch {torch.__version__} "
            f"({exc}); please report it"
        ) from exc
    seen: set[int] = set()
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref() if isinstance(state_ref, weakref.ref) else state_ref
        if not isinstance(state, FSDPState) or id(state) in seen:
            continue
        seen.add(id(state))
        group = state._fsdp_param_group
        params = list(group.fsdp_params) if group is not None else []
        param_dtype = group.mp_policy.param_dtype if group is not None else None
        yield list(state._modules), params, param_dtype


def check_sharded(model: nn.Module) -> int:
    """Refuse (``ValueError``) a quantized layer of ``model`` that ``fully_shard`` wrapped
    but that FSDP2 would not shard, or whose storage its mixed precision would cast:

    * a plain ``QuantizedLinear`` (its tensors are buffers: every rank holds all of them;
      or parameters of their own dtype, which ``param_dtype`` would cast);
    * a :class:`ShardableQuantizedLinear` whose tensors are in no FSDP2 group (the module
      that holds them was left out of every ``fully_shard`` call) or are not sharded
      ``uint8`` storage with no cast (its ``param_dtype``).

    Layers outside every ``fully_shard`` call are not checked.  Returns how many layers were
    checked (0: nothing of ``model`` is wrapped).
    """
    wrapped: set[int] = set()
    managed: dict[tuple[int, str], tuple[torch.Tensor, torch.dtype | None]] = {}
    for modules, params, param_dtype in _fsdp_groups():
        for root in modules:
            wrapped.update(id(m) for m in root.modules())
        for fsdp_param in params:
            info = fsdp_param._module_info
            sharded = fsdp_param.sharded_param
            cast = (
                param_dtype
                if param_dtype is not None
                and sharded.dtype.is_floating_point
                and param_dtype != sharded.dtype
                else None
            )
            managed[(id(info.module), info.param_name)] = (sharded, cast)
            for module, param_name in zip(
                info.shared_modules, info.shared_param_names, strict=True
            ):
                managed[(id(module), param_name)] = (sharded, cast)
    if not wrapped:
        return 0
    checked = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantizedLinear) or id(layer) not in wrapped:
            continue
        checked += 1
        where = name or "the model"
        if not isinstance(layer, ShardableQuantizedLinear):
            casts = [
                attr
                for attr in _stored_names(layer) + list(layer._parameters)
                if (id(layer), attr) in managed and managed[(id(layer), attr)][1] is not None
            ]
            raise ValueError(
                f"{where} is a QuantizedLinear inside a fully_shard-wrapped model whose "
                + (
                    f"quantized tensors {casts} are FSDP2 parameters that its "
                    f"MixedPrecisionPolicy.param_dtype would cast, corrupting the weight"
                    if casts
                    else "quantized tensors are buffers, which FSDP2 does not shard: every "
                    "rank would hold the whole quantized base"
                )
                + "; call sakura_quant.fsdp.shardable(model) (or give the quant service "
                "fsdp=True) before fully_shard"
            )
        for attr, (shape, dtype) in layer._byte_layout.items():
            entry = managed.get((id(layer), attr))
            if entry is None:
                raise ValueError(
                    f"{where}.{attr} is in no FSDP2 group although the model is wrapped by "
                    f"fully_shard: it would stay whole on every rank; call fully_shard on "
                    f"a module that contains {where} (or on the root)"
                )
            numel = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            sharded, cast = entry
            if sharded.dtype != torch.uint8 or cast is not None or sharded.shape != (numel,):
                raise ValueError(
                    f"{where}.{attr}: FSDP2 holds it as {tuple(sharded.shape)} {sharded.dtype}"
                    f"{f' cast to {cast}' if cast else ''}; a shardable "
                    f"quantized layer needs ({numel},) uint8 bytes, never cast; do not change "
                    f"its storage after shardable (model.to / a manual cast)"
                )
    return checked


def install_wrap_check(model: nn.Module) -> None:
    """Run :func:`check_sharded` on ``model``'s first forward after ``fully_shard`` wrapped
    it (a forward pre-hook, so before any product runs), then remove the hook.  Until then
    each forward costs one ``torch.distributed.is_initialized()`` call outside distributed
    runs, and one look at FSDP2's live groups inside them.  Installed once per model."""
    if getattr(model, _HOOK_ATTR, None) is not None:
        return
    handle = model.register_forward_pre_hook(_wrap_check)
    object.__setattr__(model, _HOOK_ATTR, handle)


def _wrap_check(module: nn.Module, args: Any) -> None:
    """The hook of :func:`install_wrap_check` (module level: a model that has it pickles)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    from torch.distributed._composable_state import _module_state_mapping

    if not _module_state_mapping:
        return
    if check_sharded(module):
        handle = getattr(module, _HOOK_ATTR, None)
        if isinstance(handle, RemovableHandle):
            handle.remove()
        object.__setattr__(module, _HOOK_ATTR, None)


def local_quantized_nbytes(model: nn.Module) -> int:
    """Bytes of the quantized tensors this rank holds: the local shards of a sharded
    layer's tensors, the whole tensors of an unsharded one."""
    total = 0
    for layer in model.modules():
        if isinstance(layer, ShardableQuantizedLinear):
            for attr in layer._byte_layout:
                tensor = getattr(layer, attr)
                local = tensor.to_local() if _is_dtensor(tensor) else tensor
                total += local.numel() * local.element_size()
        elif isinstance(layer, QuantizedLinear):
            for attr in _stored_names(layer):
                tensor = getattr(layer, attr)
                total += tensor.numel() * tensor.element_size()
    return total
