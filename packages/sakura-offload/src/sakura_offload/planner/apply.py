"""Applying a plan: each planned block's ``forward`` keeps, pages (saved-tensor hooks) or
recomputes (``torch.utils.checkpoint``, non-reentrant, RNG state preserved) its saved
activations; with ``track=True`` the live bytes of saved activations are counted, including
what backward brings back.  The host-RAM floor is held at run time (:func:`hold_ram_floor`,
once per forward pass of the model).  See ``docs/offload.md``, "The memory planner: design"."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sakura_offload.paging.activations import ActivationPaging
from sakura_offload.planner.measure import (
    _CountMaterialised,
    _Delegated,
    _Key,
    _pageable,
    _pass_on,
    _restore,
    _storage,
    _tensor_leaves,
    _weights_of,
    measure_call,
    order,
)
from sakura_offload.planner.plan import MemoryPlan, RamSwitch
from sakura_torch.host_memory import host_ram

if TYPE_CHECKING:
    from sakura_offload.planner import MemoryPlanner

__all__ = ["apply_plan", "hold_ram_floor", "keep_pack", "run_plain", "tracked_call"]

_LOG = logging.getLogger("sakura_offload.planner")


class _SimulatedHostPage:
    __slots__ = ("host",)

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host


class _Pager:
    """Pages saved tensors of one tier: ``ActivationPaging`` on an accelerator and for disk;
    a copy to a separate buffer (and back) for "host" on a CPU, the simulated device."""

    def __init__(self, tier: str, device: torch.device, paging: ActivationPaging | None) -> None:
        self.tier = tier
        self.simulated = tier == "host" and device.type == "cpu"
        self.paging = paging

    def pack(self, t: torch.Tensor) -> Any:
        if self.simulated:
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            host.copy_(t)
            return _SimulatedHostPage(host)
        if self.paging is None:  # pragma: no cover - built with one
            raise RuntimeError("MemoryPlanner: pager without ActivationPaging")
        return self.paging._pack(t)

    def unpack(self, page: Any) -> torch.Tensor:
        if isinstance(page, _SimulatedHostPage):
            host = page.host
            out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device="cpu")
            return out.copy_(host)
        if self.paging is None:  # pragma: no cover
            raise RuntimeError("MemoryPlanner: pager without ActivationPaging")
        return self.paging._unpack(page)


# --- live accounting under a plan (track=True) ----------------------------------------------


class _Meter:
    """Live bytes of saved activations on the device (a storage counts once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refs: dict[_Key, int] = {}
        self.sizes: dict[_Key, int] = {}
        self.live = 0
        self.peak = 0

    def hold(self, key: _Key, nbytes: int) -> None:
        with self.lock:
            count = self.refs.get(key, 0)
            if count == 0:
                self.sizes[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            self.refs[key] = count + 1

    def drop(self, key: _Key) -> None:
        with self.lock:
            count = self.refs.get(key, 0) - 1
            if count > 0:
                self.refs[key] = count
            elif count == 0:
                del self.refs[key]
                self.live -= self.sizes.pop(key)

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        with self.lock:
            self.live -= nbytes


class _Held:
    """A saved tensor the meter counts while autograd holds this object."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _PagedRef:
    __slots__ = ("call", "nbytes", "page")

    def __init__(self, page: Any, call: _Call, nbytes: int) -> None:
        self.page = page
        self.call = call
        self.nbytes = nbytes


class _Call:
    """One tracked call of a block: what it holds until its backward is done."""

    def __init__(self, meter: _Meter) -> None:
        self.meter = meter
        self.keys: list[_Key] = []
        self.transient = 0
        self.released = False
        self.handle: Any = None
        self.lock = threading.Lock()

    def hold(self, key: _Key, nbytes: int) -> None:
        self.keys.append(key)
        self.meter.hold(key, nbytes)

    def add(self, nbytes: int) -> None:
        with self.lock:
            if self.released:
                return
            self.transient += nbytes
        self.meter.add(nbytes)

    def release(self, *_: Any) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
            keys, self.keys = self.keys, []
            transient, self.transient = self.transient, 0
        for key in keys:
            self.meter.drop(key)
        self.meter.sub(transient)
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


# --- the block wrapper -----------------------------------------------------------------------


class _PlannedForward:
    """What a planned block's ``forward`` becomes (an attribute of the instance; it keeps
    the module, not its bound forward, so the model still pickles)."""

    def __init__(
        self, planner: MemoryPlanner, index: int, module: nn.Module, instance_forward: Any
    ) -> None:
        self.planner = planner
        self.index = index
        self.module = module
        self.instance_forward = instance_forward
        self.choice = "measure"

    def original(self) -> Callable[..., Any]:
        if self.instance_forward is not None:
            return self.instance_forward  # type: ignore[no-any-return]
        return types.MethodType(type(self.module).forward, self.module)

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # for inspect.signature
        return self.original()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.original()
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        planner = self.planner
        if self.choice == "measure":
            return measure_call(planner, self.index, forward, args, kwargs)
        if self.index == planner._first_block:  # once per forward pass of the model
            hold_ram_floor(planner)
        if not planner.track:
            return run_plain(
                planner,
                self.choice,
                self.module,
                forward,
                args,
                kwargs,
                planner._pagers.get(self.choice),
            )
        return tracked_call(planner, self.choice, self.module, forward, args, kwargs)


# --- the hooks and calls of a planned block -------------------------------------------------


def keep_pack(
    planner: MemoryPlanner, call: _Call | None, module: nn.Module | None = None
) -> Callable[[torch.Tensor], Any]:
    """Keeps (and counts) what a block or the root saves; a weight is passed on."""
    meter = planner._meter
    params = planner._param_keys
    weights = _weights_of(module)
    pass_on = _pass_on()

    def pack(t: torch.Tensor) -> Any:
        key, nbytes = _storage(t)
        if key in params:
            return t
        if key in weights:
            return pass_on(t)
        held = _Held(t)
        meter.hold(key, nbytes)
        weakref.finalize(held, meter.drop, key)
        return held

    return pack


def page_pack(
    planner: MemoryPlanner, pager: _Pager, call: _Call | None, module: nn.Module | None = None
) -> Callable[[torch.Tensor], Any]:
    """Pages what a block saves; small or shared tensors are kept, weights passed on."""
    params = planner._param_keys
    weights = _weights_of(module)
    pass_on = _pass_on()
    min_bytes = planner.min_bytes
    keep = keep_pack(planner, call, module) if call is not None else None

    def pack(t: torch.Tensor) -> Any:
        key, _ = _storage(t)
        if key in weights and key not in params:
            return pass_on(t)
        if key in params or not _pageable(t, min_bytes):
            return keep(t) if keep is not None else t
        page = pager.pack(t)
        if call is None:
            return page
        return _PagedRef(page, call, t.numel() * t.element_size())

    return pack


def page_unpack(pager: _Pager) -> Callable[[Any], torch.Tensor]:
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Held):
            return packed.tensor
        if isinstance(packed, _Delegated):
            return _restore(packed)  # type: ignore[no-any-return]
        if isinstance(packed, _PagedRef):
            packed.call.add(packed.nbytes)
            return pager.unpack(packed.page)
        return pager.unpack(packed)

    return unpack


def run_plain(
    planner: MemoryPlanner,
    choice: str,
    module: nn.Module,
    forward: Callable[..., Any],
    args: Any,
    kwargs: Any,
    pager: _Pager | None,
) -> Any:
    """One call of a block's ``forward`` under ``choice``, without tracking."""
    if choice == "keep":
        return forward(*args, **kwargs)
    if choice == "recompute":
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    if pager is None:  # pragma: no cover - apply_plan builds one per paging choice
        raise RuntimeError(f"MemoryPlanner: no pager for {choice}")
    with torch.autograd.graph.saved_tensors_hooks(
        page_pack(planner, pager, None, module), page_unpack(pager)
    ):
        return forward(*args, **kwargs)


def tracked_call(
    planner: MemoryPlanner,
    choice: str,
    module: nn.Module,
    forward: Callable[..., Any],
    args: Any,
    kwargs: Any,
) -> Any:
    """One call of a block's ``forward`` under ``choice``, its saved bytes counted."""
    call = _Call(planner._meter)
    inputs = [t for t in _tensor_leaves(args, kwargs) if t.requires_grad]
    watch = inputs or [p for p in module.parameters() if p.requires_grad]
    if choice == "recompute":
        seen: set[_Key] = set()
        for t in _tensor_leaves(args, kwargs):
            key, nbytes = _storage(t)
            if key not in seen and key not in planner._param_keys:
                seen.add(key)
                call.hold(key, nbytes)

        def contexts() -> tuple[Any, Any]:
            return contextlib.nullcontext(), _CountMaterialised(
                call.add, planner._param_keys, module
            )

        out = checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    elif choice == "keep":
        with torch.autograd.graph.saved_tensors_hooks(
            keep_pack(planner, call, module), _unpack_held
        ):
            out = forward(*args, **kwargs)
    else:
        pager = planner._pagers[choice]
        with torch.autograd.graph.saved_tensors_hooks(
            page_pack(planner, pager, call, module), page_unpack(pager)
        ):
            out = forward(*args, **kwargs)
    if watch:
        call.handle = torch.autograd.graph.register_multi_grad_hook(watch, call.release)
    return out


def _unpack_held(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Held):
        return packed.tensor
    return _restore(packed)  # type: ignore[no-any-return]


def hold_ram_floor(planner: MemoryPlanner) -> None:
    """If host RAM available is under the planner's floor, half (rounded up) of the blocks
    still paged to host RAM recompute instead, from this forward on: those with the most
    pageable bytes.  The applied plan records the switch (:class:`RamSwitch`) and a warning
    names it.  One reading of ``/proc/meminfo`` per call; nothing when no block pages to
    host RAM.  Switching back when RAM frees up is not done."""
    plan = planner.applied
    if plan is None:
        return
    planner._forwards += 1
    paged = [i for i, d in enumerate(plan.decisions) if d.choice == "page_host"]
    if not paged:
        return
    available, total = host_ram()
    floor = planner.floor(total)
    if available >= floor:
        return
    paged.sort(key=lambda i: -plan.decisions[i].pageable_bytes)
    chosen = sorted(paged[: (len(paged) + 1) // 2])
    decisions = list(plan.decisions)
    for i in chosen:
        d = decisions[i]
        decisions[i] = dataclasses.replace(
            d, choice="recompute", cost_seconds=dict(d.costs).get("recompute", d.forward_seconds)
        )
    switch = RamSwitch(
        forward=planner._forwards,
        blocks=tuple(decisions[i].name for i in chosen),
        available=available,
        floor=floor,
    )
    new = dataclasses.replace(
        plan,
        decisions=tuple(decisions),
        ram_switches=(*plan.ram_switches, switch),
    )
    for i in chosen:
        planner.wrappers[i].choice = "recompute"
    planner.applied = new
    _LOG.warning("%s", switch.describe())
    if planner.on_switched is not None:
        planner.on_switched(new)


def apply_plan(planner: MemoryPlanner, plan: MemoryPlan) -> None:
    """Make ``plan`` the one the planner's blocks run under."""
    planner._refresh_param_keys()
    planner._pagers = {
        c: planner._pager(c) for c in ("page_host", "page_disk") if c in plan.choices.values()
    }
    for wrapper, decision in zip(planner.wrappers, plan.decisions, strict=True):
        wrapper.choice = decision.choice
    planner._first_block = order(planner)[0] if planner.wrappers else -1
    planner._forwards = 0
    planner.applied = plan
    if not planner.track:
        for handle in planner._hooks:
            handle.remove()
        planner._hooks = []
    elif not planner._hooks and planner.model is not None:  # tracking turned on after planning
        planner._register_root_hooks()
    _LOG.info("%s", plan.table())
