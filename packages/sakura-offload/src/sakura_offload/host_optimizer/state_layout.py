"""OffloadAdamW's state in :class:`torch.optim.AdamW`'s layout: the export of the packed
moments (fp32, bf16, int8) to fp32 tensors in the parameter's shape, and the import back
into the optimizer's moment format.  The state-dict plumbing (hooks) is in
:mod:`.optimizer`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from sakura_offload.host_optimizer import moments as fmt
from sakura_offload.host_optimizer.options import check_group
from sakura_offload.host_optimizer.shards import as_like, is_sharded, local

__all__ = [
    "IMPORT_STREAM",
    "INT8_KEYS",
    "MOMENT_KEYS",
    "export_hook",
    "export_state",
    "import_state",
    "is_direct",
    "match_saved",
    "new_state",
]

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
INT8_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_sqrt_codes", "exp_avg_sq_sqrt_absmax")
IMPORT_STREAM = 0x5EED5EED  # distinguishes the rounding stream of a state import


def is_direct(p: torch.Tensor) -> bool:
    """True when the update can run on the parameter itself (no master copy)."""
    return p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()


def _zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype)


def new_state(
    p: torch.Tensor,
    moment_dtype: str,
    *,
    master: bool,
    zeros: Callable[[int, torch.dtype], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """A fresh state for ``p``: step 0, zero moments in ``moment_dtype`` and, when
    ``master``, an fp32 master copy of ``p`` in host RAM.  ``zeros(numel, dtype)`` allocates
    each flat host tensor (the C++ backend's puts them on huge pages); torch.zeros if None."""
    alloc = zeros if zeros is not None else _zeros
    state: dict[str, Any] = {"step": torch.tensor(0.0, dtype=torch.float32)}
    if master:
        state["master"] = alloc(p.numel(), torch.float32).view(p.shape).copy_(p.detach())
    if moment_dtype == "int8":
        size = fmt.blocks_for(p.numel())
        state["exp_avg_codes"] = alloc(size * fmt.BLOCK, torch.uint8)
        state["exp_avg_absmax"] = torch.zeros(size, dtype=torch.float32)
        state["exp_avg_sq_sqrt_codes"] = alloc(size * fmt.BLOCK, torch.uint8)
        state["exp_avg_sq_sqrt_absmax"] = torch.zeros(size, dtype=torch.float32)
    else:
        dtype = torch.float32 if moment_dtype == "float32" else torch.bfloat16
        for key in MOMENT_KEYS:
            state[key] = alloc(p.numel(), dtype).view(p.shape)
    return state


def export_hook(optimizer: Any, packed: dict[str, Any]) -> dict[str, Any]:
    """OffloadAdamW's first state-dict post-hook: every packed state exported."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    packed["state"] = {
        index: export_state(params[index], state, optimizer.moment_dtype)
        for index, state in packed["state"].items()
    }
    return packed


def export_state(p: torch.Tensor, state: Mapping[str, Any], moment_dtype: str) -> dict[str, Any]:
    """``p``'s packed state in :class:`torch.optim.AdamW`'s layout: ``step``, fp32
    ``exp_avg`` and ``exp_avg_sq`` in the parameter's shape, ``master`` where there is one."""
    out: dict[str, Any] = {"step": state["step"]}
    shard = local(p)
    if moment_dtype == "int8":
        n = shard.numel()
        codes, absmax, s_codes, s_absmax = (state[k] for k in INT8_KEYS)
        out["exp_avg"] = fmt.decode_signed(codes, absmax, n).reshape(shard.shape)
        root = fmt.decode_unsigned(s_codes, s_absmax, n).reshape(shard.shape)
        out["exp_avg_sq"] = root * root
    else:
        for key in MOMENT_KEYS:
            out[key] = state[key].float()
    if "master" in state:
        out["master"] = state["master"].view(shard.shape)
    if is_sharded(p):  # laid out like the FSDP2 parameter, as torch's AdamW state is
        for key in (*MOMENT_KEYS, "master"):
            if key in out:
                out[key] = as_like(out[key], p)
    return out


def match_saved(
    param_groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]
) -> dict[Any, torch.Tensor]:
    """The saved parameter ids -> the parameters, checking the groups' sizes; the saved
    hyper-parameters are validated and taken into ``param_groups``."""
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"OffloadAdamW.load_state_dict: the state has {len(saved_groups)} param "
            f"group(s), the optimizer {len(param_groups)}"
        )
    by_id: dict[Any, torch.Tensor] = {}
    for group, saved in zip(param_groups, saved_groups, strict=True):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                "OffloadAdamW.load_state_dict: a param group's size differs from the "
                f"state's ({len(group['params'])} against {len(saved['params'])})"
            )
        by_id.update(zip(saved["params"], group["params"], strict=True))
    for group, saved in zip(param_groups, saved_groups, strict=True):
        update = {
            k: v
            for k, v in saved.items()
            if k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "initial_lr")
        }
        candidate = {**group, **update}
        check_group(candidate)
        group.update({k: candidate[k] for k in update})
    return by_id


def import_state(
    p: torch.Tensor, saved: Mapping[str, Any], *, moment_dtype: str, seed: int, index: int
) -> dict[str, Any]:
    """``p``'s state packed in ``moment_dtype`` from ``saved`` (:class:`torch.optim.AdamW`'s
    layout, moments of any float dtype; the master from the parameter when none is saved);
    empty when ``saved`` has no moments.  ``index``: the parameter's stream index."""
    state: dict[str, Any] = {}
    if "exp_avg" not in saved or "exp_avg_sq" not in saved:
        return state
    saved = {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
    p = local(p)  # an FSDP2 parameter's state is its local shard's
    step = saved.get("step", 0)
    step_value = float(step.item() if isinstance(step, torch.Tensor) else step)
    state["step"] = torch.tensor(step_value, dtype=torch.float32)
    master = saved.get("master")
    if master is not None:
        state["master"] = master.detach().to("cpu", torch.float32, copy=True).contiguous()
    elif not is_direct(p):
        state["master"] = p.detach().to("cpu", torch.float32, copy=True).contiguous()
    if "master" in state and state["master"].numel() != p.numel():
        raise ValueError("OffloadAdamW.load_state_dict: a master weight has the wrong size")
    moments = [
        cast(torch.Tensor, saved[k]).detach().to("cpu", torch.float32).reshape(p.shape)
        for k in MOMENT_KEYS
    ]
    if moment_dtype == "int8":
        flat_m, flat_v = (t.reshape(-1) for t in moments)
        codes, absmax = fmt.quantize_blocks(flat_m, signed=True)
        key = fmt.stream_key(seed ^ IMPORT_STREAM, int(step_value), index)
        bits = fmt.pair_bits(key, absmax.numel())
        s_codes, s_absmax = fmt.quantize_blocks(flat_v.clamp(min=0).sqrt(), signed=False, bits=bits)
        state.update(zip(INT8_KEYS, (codes, absmax, s_codes, s_absmax), strict=True))
    else:
        dtype = torch.float32 if moment_dtype == "float32" else torch.bfloat16
        for k, t in zip(MOMENT_KEYS, moments, strict=True):
            state[k] = t.to(dtype, copy=True).contiguous()
    return state
