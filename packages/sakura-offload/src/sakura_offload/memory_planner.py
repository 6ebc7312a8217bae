"""The memory planner: per block of a model's stack, keep its saved activations, page them
(to host RAM, or to disk when host RAM would lose its margin) or recompute them in backward,
so that the saved activations fit a memory budget at the least estimated extra time.

How it works:

1. *Measure.*  The blocks are found as sakura-precision's ``ActivationCheckpoint`` finds
   them (:mod:`sakura.blocks`) and each block's ``forward`` is wrapped.  On one or
   more real forward passes (a sample batch given to :meth:`MemoryPlanner.plan`, or the
   first training steps under the ``memory_plan`` service) saved-tensor hooks record, per
   block: the bytes of the storages autograd saves (each storage counted once, by the
   first block that saves it; parameters and buffers are not activations), how many of
   those bytes could be paged (:class:`~sakura_offload.paging.ActivationPaging`'s rules),
   the bytes of the block's tensor inputs (what recomputation keeps), the bytes its forward
   materialises (what recomputation creates again in backward), its parameter bytes and
   its forward time.  On a GPU the measuring pass pages every pageable tensor to host RAM,
   so it fits where the unplanned model would not.
2. *Time.*  The extra time of each choice is measured (:mod:`sakura_offload._plan_costs`):
   one block of each shape (the same class and measured bytes) runs forward + backward on
   the inputs it got, under keep, each paging tier and recomputation, ``cost_trials``
   rounds; a choice costs the median of its difference to keep.  Where that cannot run (a
   block given objects a forward could change, ``cost_trials=0``) or a tier's bandwidth is
   given, paging costs its bytes over the round-trip bandwidth (given, or probed with
   tensors of one block's sizes) and recomputing the block's forward time.
3. *Decide.*  The peak of saved activation bytes is estimated for a choice per block: at
   the end of the forward (everything outside the blocks + what each block leaves resident)
   and during each block's backward (the blocks before it + the block's activations brought
   back, by copy or recomputation).  Starting from "keep
   everything", the move that lowers the peak most per second of extra time is taken until
   the budget is met; then moves back to cheaper choices are taken where the budget still
   holds.  Host paging is limited to a host budget (by default what leaves 10 % of
   physical RAM, at least 4 GiB, free and uses at most 60 % of the RAM available), disk
   paging to the free space of its directory.  A budget below what the model can reach
   raises :class:`MemoryBudgetError` with the least reachable peak.
4. *Apply.*  Each block's wrapper then keeps, pages (saved-tensor hooks) or recomputes
   (``torch.utils.checkpoint``, non-reentrant, RNG state preserved).  Gradients are
   bit-identical to the unplanned model's for every choice.  With ``track=True`` the
   wrappers also count the live bytes of saved activations (``measured_peak``), including
   what backward brings back; without it the kept blocks run with no hooks at all.

On a CPU there is no device memory to save: the budget is a *simulated* device.  Paging
to "host" there copies each saved tensor to a separate buffer and back (the copy a GPU
would make, at CPU memory speed) and frees the original as a GPU would; the process's
RAM does not shrink.  Disk paging and recomputation free real memory on a CPU too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from sakura import Service
from sakura.blocks import find_blocks, validate_selector
from sakura.options import check_bool, check_choice, check_int, check_number, option_error
from sakura_offload._plan_costs import BlockSample, capture_sample, time_choices
from sakura_offload.paging import ActivationPaging, is_broadcast, is_dense

__all__ = [
    "CHOICES",
    "BlockDecision",
    "MemoryBudgetError",
    "MemoryPlan",
    "MemoryPlanService",
    "MemoryPlanner",
    "parse_bytes",
    "plan_memory",
]

_PROBE_CAP = 256 * 2**20
"""Most bytes a bandwidth probe copies (one block's pageable tensors, largest first)."""
_OWNER = "MemoryPlanner"
_LOG = logging.getLogger("sakura_offload.planner")

CHOICES = ("keep", "page_host", "page_disk", "recompute")
"""What a block's saved activations can become."""

_LABELS = {
    "keep": "keep",
    "page_host": "page (host)",
    "page_disk": "page (disk)",
    "recompute": "recompute",
}
_COLUMN = len("+ms page (host)")
_MARK = "_sakura_memory_plan"
_CHECKPOINT_MARK = "_sakura_activation_checkpoint"  # sakura-precision's ActivationCheckpoint

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*\Z")
_SIZE_ACCEPTED = (
    "a number of bytes: an int, or a string such as '2GB' or '512MiB' "
    "(KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024)"
)


def parse_bytes(
    option: str,
    value: Any,
    *,
    minimum: int = 0,
    allow_none: bool = False,
    owner: str | None = _OWNER,
) -> int | None:
    """``value`` (an int, an integral float, or a size string like ``"2GB"``) in bytes;
    an :class:`~sakura.options.OptionError` naming ``option`` otherwise."""
    accepted = _SIZE_ACCEPTED + (f", >= {minimum}" if minimum else "")
    if allow_none:
        accepted = "None or " + accepted
    if value is None and allow_none:
        return None
    result: int | None = None
    if isinstance(value, bool):
        result = None
    elif isinstance(value, int):
        result = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        result = int(value)
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            result = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if result is None or result < minimum:
        raise option_error(option, value, accepted, owner=owner)
    return result


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class MemoryBudgetError(ValueError):
    """The budget is below the least peak any plan reaches (``minimum``, in bytes)."""

    def __init__(self, message: str, *, budget: int, minimum: int) -> None:
        super().__init__(message)
        self.budget = budget
        self.minimum = minimum


@dataclass(frozen=True)
class BlockDecision:
    """What the planner measured for one block and what it chose."""

    name: str
    activation_bytes: int
    """Bytes of the storages autograd saved in the block's forward."""
    pageable_bytes: int
    """Of those, the bytes paging moves off the device."""
    copy_bytes: int
    """Bytes paging copies out (and back in backward): each pageable saved tensor once,
    also when several share a storage."""
    input_bytes: int
    """Bytes of the block's tensor inputs (recomputation keeps them)."""
    recompute_bytes: int
    """The most bytes the block's forward had live at once of the storages it created
    (recomputation creates them again in backward)."""
    parameter_bytes: int
    forward_seconds: float
    choice: str
    """One of :data:`CHOICES`."""
    cost_seconds: float
    """Extra time per step of this choice (measured, or estimated: see ``costs_measured``)."""
    costs: tuple[tuple[str, float], ...] = ()
    """Extra seconds per step of each choice the planner could make, as it weighed them."""
    costs_measured: bool = False
    """Whether those costs were timed on the block (else estimated from copy bandwidth and
    forward time)."""

    @property
    def resident_bytes(self) -> int:
        """Saved bytes this block leaves on the device until its backward."""
        return _resident(self, self.choice)

    @property
    def label(self) -> str:
        return _LABELS[self.choice]


def _resident(d: BlockDecision, choice: str) -> int:
    if choice == "keep":
        return d.activation_bytes
    if choice == "recompute":
        return d.input_bytes
    return d.activation_bytes - d.pageable_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """A decision per block (``decisions``), with the estimates it was made from."""

    decisions: tuple[BlockDecision, ...]
    budget: int | None
    """The budget planned for (None: choices given, not planned)."""
    estimated_peak: int
    keep_peak: int
    """The estimated peak with every block kept."""
    least_peak: int
    """The least estimated peak of any plan (the lowest budget that can be met)."""
    outside_bytes: int
    """Saved bytes outside the blocks (embeddings, head, loss)."""
    host_bandwidth: float
    """Round-trip bytes/s of host paging: given, probed, or (when its costs were measured)
    the effective figure, copy bytes over the measured extra time."""
    disk_bandwidth: float
    device: str
    cost_trials: int = 0
    """Timed rounds per choice the costs were measured with (0: estimated)."""

    @property
    def choices(self) -> dict[str, str]:
        return {d.name: d.choice for d in self.decisions}

    @property
    def estimated_cost_seconds(self) -> float:
        return sum(d.cost_seconds for d in self.decisions)

    def table(self) -> str:
        """The decision as a text table."""
        budget = "choices given" if self.budget is None else f"budget {_mb(self.budget)}"
        lines = [
            f"memory plan ({self.device}): {budget}, estimated peak of saved activations "
            f"{_mb(self.estimated_peak)} (everything kept: {_mb(self.keep_peak)}, least "
            f"reachable: {_mb(self.least_peak)}; outside the blocks: {_mb(self.outside_bytes)})",
            (
                f"costs measured ({self.cost_trials} timed forward + backward per choice and "
                "block shape); effective copy round trip"
                if any(d.costs_measured for d in self.decisions)
                else "costs estimated; copy round trip"
            )
            + f": host {self.host_bandwidth / 1e9:.2f} GB/s, disk "
            + (f"{self.disk_bandwidth / 1e9:.2f} GB/s" if self.disk_bandwidth else "not used")
            + "; extra time per step "
            f"{self.estimated_cost_seconds * 1e3:.2f} ms",
        ]
        width = max(len("block"), *(len(d.name) for d in self.decisions))
        options = [c for c, _ in self.decisions[0].costs if c != "keep"] if self.decisions else []
        header = (
            f"{'block':<{width}}  {'activation MB':>13}  {'params MB':>9}  {'forward ms':>10}"
            + "".join(f"  {'+ms ' + _LABELS[c]:>{_COLUMN}}" for c in options)
            + f"  {'choice':<11}  {'+ms chosen':>10}"
        )
        lines += [header, "-" * len(header)]
        for d in self.decisions:
            costs = dict(d.costs)
            lines.append(
                f"{d.name:<{width}}  {d.activation_bytes / 1e6:>13.2f}  "
                f"{d.parameter_bytes / 1e6:>9.2f}  {d.forward_seconds * 1e3:>10.2f}"
                + "".join(f"  {costs.get(c, math.nan) * 1e3:>{_COLUMN}.2f}" for c in options)
                + f"  {d.label:<11}  {d.cost_seconds * 1e3:>10.2f}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# --- bookkeeping of saved tensors ------------------------------------------------------------

_Key = tuple[str, int, int]


def _storage(t: torch.Tensor) -> tuple[_Key, int]:
    """A key for ``t``'s storage and the storage's bytes."""
    try:
        storage = t.untyped_storage()
        return (t.device.type, t.device.index or 0, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return ("object", 0, id(t)), t.numel() * t.element_size()


def _pageable(t: torch.Tensor, min_bytes: int) -> bool:
    """Whether :class:`ActivationPaging` would move ``t`` off its device."""
    nbytes = t.numel() * t.element_size()
    return not (
        nbytes < min_bytes
        or t.numel() == 0
        or (t.requires_grad and t.is_leaf)
        or t.layout != torch.strided
        or t.is_sparse
        or is_broadcast(t)
        or not is_dense(t)
    )


def _tensor_leaves(*values: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(values) if isinstance(x, torch.Tensor)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Delegated:
    """A block's weight that the planner's hooks passed on to the saved-tensor hooks that
    were active when the block started (``WeightPaging``'s, which save a token for it)."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]) -> None:
        self.packed = packed
        self.unpack = unpack


def _weights_of(module: nn.Module | None) -> set[_Key]:
    """The storages of ``module``'s parameters as they are now: under ``WeightPaging``,
    inside the block's call, the device copies it installed."""
    return set() if module is None else {_storage(p)[0] for p in module.parameters()}


def _pass_on() -> Callable[[torch.Tensor], Any]:
    """How to save a weight: through the saved-tensor hooks active now (call it before
    entering the planner's own), or as it is.  A weight is never an activation."""
    top: Any = torch._C._autograd._top_saved_tensors_default_hooks(False)  # None: no hooks
    if top is None:
        return lambda t: t
    pack, unpack = top
    return lambda t: _Delegated(pack(t), unpack)


def _restore(packed: Any) -> Any:
    """The tensor of a :class:`_Delegated`; anything else as it is."""
    if isinstance(packed, _Delegated):
        return packed.unpack(packed.packed)
    return packed


@dataclass
class _Measured:
    """One block's measurements (summed over its calls in one forward)."""

    name: str
    order: int = -1
    saved: dict[_Key, list[Any]] = field(default_factory=dict)  # key -> [bytes, pageable]
    input_bytes: int = 0
    copy_bytes: int = 0
    recompute_bytes: int = 0
    forward_seconds: list[float] = field(default_factory=list)
    counted_seconds: list[float] = field(default_factory=list)
    calls: int = 0
    sample: BlockSample | None = None  # the last call's inputs, for timing the choices


class _Recorder:
    """Saved-tensor hooks of the measuring passes."""

    def __init__(self, planner: MemoryPlanner, names: Sequence[str]) -> None:
        self.planner = planner
        self.blocks = [_Measured(name) for name in names]
        self.owner: dict[_Key, int] = {}  # key -> block index, or -1 / -2 outside (pre / post)
        self.outside: dict[_Key, int] = {}
        self.outside_pre = 0
        self.current: int | None = None
        self.weights: set[_Key] = set()  # the current block's weights
        self.pass_on: Callable[[torch.Tensor], Any] = lambda t: t
        self.started = 0
        self.forwards = 0

    def begin_forward(self) -> None:
        self.owner.clear()
        self.outside.clear()
        self.outside_pre = 0
        self.started = 0
        for block in self.blocks:
            block.saved.clear()
            block.input_bytes = 0
            block.copy_bytes = 0
            block.order = -1
            block.calls = 0
            block.sample = None

    def end_forward(self) -> None:
        self.forwards += 1

    def pack(self, t: torch.Tensor) -> Any:
        key, nbytes = _storage(t)
        if key in self.planner._param_keys:
            return t
        if key in self.weights:
            return self.pass_on(t)
        pageable = _pageable(t, self.planner.min_bytes)
        where = self.current
        if where is not None and pageable:
            self.blocks[where].copy_bytes += t.numel() * t.element_size()
        owner = self.owner.get(key)
        if owner is None:
            if where is None:
                self.owner[key] = -1 if self.started == 0 else -2
                self.outside[key] = nbytes
                if self.started == 0:
                    self.outside_pre += nbytes
            else:
                self.owner[key] = where
                self.blocks[where].saved[key] = [nbytes, pageable]
        elif owner >= 0:
            entry = self.blocks[owner].saved[key]
            if owner != where or not pageable:
                entry[1] = False  # shared with another block, or kept: not freed by paging
        if pageable and self.planner._measure_pager is not None:
            return self.planner._measure_pager.pack(t)
        return t

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Delegated):
            return _restore(packed)  # type: ignore[no-any-return]
        pager = self.planner._measure_pager
        if pager is None:  # pragma: no cover - only pages when a pager exists
            raise RuntimeError("MemoryPlanner: a measuring page without a pager")
        return pager.unpack(packed)


class _CountMaterialised(TorchDispatchMode):
    """The peak of live bytes of the storages a forward creates (its saved activations,
    its output and its temporaries while they live), reported to ``sink`` as increases."""

    def __init__(self, sink: Callable[[int], None], skip: set[_Key]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sink = sink
        self.skip = skip
        self.tracked: dict[_Key, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in _tensor_leaves(out):
            key, nbytes = _storage(t)
            if key in self.skip or key[0] == "object":
                continue
            known = self.tracked.get(key)
            if known is None or known[0].expired():
                self.tracked[key] = (StorageWeakRef(t.untyped_storage()), nbytes)
        live = 0
        for key, (ref, nbytes) in list(self.tracked.items()):
            if ref.expired():
                del self.tracked[key]
            else:
                live += nbytes
        if live > self.peak:
            self.sink(live - self.peak)
            self.peak = live
        return out


# --- the pagers the plan uses ----------------------------------------------------------------


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
            return planner._measure_call(self.index, forward, args, kwargs)
        if not planner.track:
            return planner._run_plain(
                self.choice, self.module, forward, args, kwargs, planner._pagers.get(self.choice)
            )
        return planner._tracked_call(self.choice, self.module, forward, args, kwargs)


# --- the planner -----------------------------------------------------------------------------


def _host_ram() -> tuple[int, int]:
    """(available, total) bytes of host RAM."""
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def default_host_budget() -> int:
    """Host RAM that paging may use: at most 60 % of what is available, always leaving
    10 % of physical RAM (at least 4 GiB) free."""
    available, total = _host_ram()
    margin = max(total // 10, 4 * 2**30)
    return max(0, min(int(available * 0.6), available - margin))


class MemoryPlanner:
    """Measure a model's blocks, choose keep / page / recompute per block for a budget of
    saved-activation bytes, and apply the choice (see the module docstring).

    Args:
        budget: device bytes for saved activations (an int or ``"2GB"``-style string).
            ``None``: on CUDA, 90 % of the free device memory when planning starts, less
            the gradients still to be allocated; on a CPU a budget is required.
        blocks: which modules form the stack (``None``: auto-detect; a class, class name,
            tuple of classes, or a callable ``(name, module) -> bool``).
        host_budget: bytes of host RAM paging may take (default
            :func:`default_host_budget`); beyond it blocks page to disk.
        disk: whether disk paging may be chosen.
        directory: where disk pages go (default: the system's temporary directory).
        min_bytes: saved tensors smaller than this are never paged (as ActivationPaging).
        host_bandwidth, disk_bandwidth: round-trip bytes per second of each tier: paging
            there then costs its copy bytes over this figure.  ``None``: timed (see
            ``cost_trials``).
        cost_trials: timed rounds per choice that measure each block shape's extra time
            for every choice (its forward + backward on the inputs of the measured pass,
            after one untimed round; the median counts).  ``0``: estimate instead, paging
            as copy bytes over a probed bandwidth and recomputation as the block's forward
            time.
        track: count the live bytes of saved activations under the plan
            (``measured_peak``); costs a hook per saved tensor.
    """

    def __init__(
        self,
        budget: Any = None,
        *,
        blocks: Any = None,
        host_budget: Any = None,
        disk: bool = True,
        directory: str | os.PathLike[str] | None = None,
        min_bytes: int = 1 << 16,
        host_bandwidth: float | None = None,
        disk_bandwidth: float | None = None,
        cost_trials: int = 3,
        track: bool = False,
    ) -> None:
        self.budget = parse_bytes("budget", budget, minimum=1, allow_none=True)
        self.blocks_selector = validate_selector(blocks, owner=_OWNER)
        self.host_budget = parse_bytes("host_budget", host_budget, allow_none=True)
        self.disk = check_bool("disk", disk, owner=_OWNER)
        if directory is not None and not Path(directory).is_dir():
            raise option_error("directory", str(directory), "an existing directory", owner=_OWNER)
        self.directory = directory
        self.min_bytes: int = check_int("min_bytes", min_bytes, minimum=0, owner=_OWNER)
        self.host_bandwidth = check_number(
            "host_bandwidth", host_bandwidth, minimum=0.0, min_inclusive=False, allow_none=True,
            owner=_OWNER,
        )  # fmt: skip
        self.disk_bandwidth = check_number(
            "disk_bandwidth", disk_bandwidth, minimum=0.0, min_inclusive=False, allow_none=True,
            owner=_OWNER,
        )  # fmt: skip
        self.cost_trials: int = check_int("cost_trials", cost_trials, minimum=0, owner=_OWNER)
        self.track = check_bool("track", track, owner=_OWNER)
        self.model: nn.Module | None = None
        self.device = torch.device("cpu")
        self.names: list[str] = []
        self.wrappers: list[_PlannedForward] = []
        self.applied: MemoryPlan | None = None
        self._param_keys: set[_Key] = set()
        self._param_bytes: list[int] = []
        self._recorder: _Recorder | None = None
        self._measure_pager: _Pager | None = None
        self._pagers: dict[str, _Pager] = {}
        self._paging: dict[str, ActivationPaging] = {}
        self._meter = _Meter()
        self._hooks: list[Any] = []
        self._root_stack: list[Any] = []
        self._count_materialised = True
        self._in_sample = False
        self._auto_budget: int | None = None
        self.on_planned: Callable[[MemoryPlan], None] | None = None
        self.measure_forwards = 1
        self._timed: tuple[int, dict[int, dict[str, float]]] | None = None

    # --- attaching ---------------------------------------------------------------------

    def attach(self, model: nn.Module) -> MemoryPlanner:
        """Wrap ``model``'s blocks for measuring (forward passes under grad measure them)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"MemoryPlanner needs a torch.nn.Module, got {type(model).__name__}")
        if self.model is not None:
            raise RuntimeError("MemoryPlanner: already attached to a model; call remove() first")
        found = find_blocks(model, self.blocks_selector, owner=_OWNER)
        for name, block in found:
            if block.__dict__.get(_MARK) is not None:
                raise ValueError(f"MemoryPlanner: block {name} is already planned")
            if block.__dict__.get(_CHECKPOINT_MARK) is not None:
                raise ValueError(
                    f"MemoryPlanner: block {name} is already checkpointed by "
                    f"ActivationCheckpoint; the planner chooses recomputation itself, use one"
                )
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        if self.budget is None:
            if self.device.type != "cuda":
                raise option_error(
                    "budget",
                    None,
                    "a number of bytes on a CPU (a simulated device budget; None measures "
                    "the free memory of a CUDA device)",
                    owner=_OWNER,
                )
            free, _total = torch.cuda.mem_get_info(self.device)
            grads = sum(
                p.numel() * p.element_size()
                for p in model.parameters()
                if p.requires_grad and p.grad is None
            )
            self._auto_budget = max(1, int(free * 0.9) - grads)
        self.model = model
        self.names = [name for name, _ in found]
        self._refresh_param_keys()
        self._param_bytes = [
            sum(p.numel() * p.element_size() for p in block.parameters()) for _, block in found
        ]
        for index, (_name, block) in enumerate(found):
            wrapper = _PlannedForward(self, index, block, block.__dict__.get("forward"))
            block.__dict__["forward"] = wrapper
            block.__dict__[_MARK] = True
            self.wrappers.append(wrapper)
        self._recorder = _Recorder(self, self.names)
        if self.device.type != "cpu":
            self._measure_pager = _Pager("host", self.device, self._activation_paging("host"))
        self._register_root_hooks()
        return self

    def _register_root_hooks(self) -> None:
        """Hooks on the model and on every module between it and the blocks: the
        outermost of them that runs marks a forward pass and counts what is saved outside
        the blocks.  (A LightningModule's own forward often never runs: its
        ``training_step`` calls the network inside it.)"""
        model = self.model
        if model is None:
            return
        containers: dict[int, nn.Module] = {id(model): model}
        for name in self.names:
            parts = name.split(".")
            for depth in range(1, len(parts)):
                module = model.get_submodule(".".join(parts[:depth]))
                containers.setdefault(id(module), module)
        self._hooks = []
        for module in containers.values():
            self._hooks.append(module.register_forward_pre_hook(self._root_pre))
            self._hooks.append(module.register_forward_hook(self._root_post, always_call=True))

    def remove(self) -> None:
        """Restore the blocks' forwards and remove the planner's hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for wrapper in self.wrappers:
            block = wrapper.module
            if wrapper.instance_forward is not None:
                block.__dict__["forward"] = wrapper.instance_forward
            else:
                block.__dict__.pop("forward", None)
            block.__dict__.pop(_MARK, None)
        self.wrappers = []
        self.model = None

    def _refresh_param_keys(self) -> None:
        if self.model is None:
            return
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self._param_keys = {_storage(t)[0] for t in tensors}

    def _activation_paging(self, tier: str) -> ActivationPaging:
        paging = self._paging.get(tier)
        if paging is None:
            directory = self.directory if tier == "disk" else None
            paging = ActivationPaging(tier, directory=directory, min_bytes=self.min_bytes)
            self._paging[tier] = paging
        return paging

    def _pager(self, choice: str) -> _Pager:
        tier = "host" if choice == "page_host" else "disk"
        simulated = tier == "host" and self.device.type == "cpu"
        paging = None if simulated else self._activation_paging(tier)
        return _Pager(tier, self.device, paging)

    # --- root-level hooks: saved tensors outside the blocks ----------------------------

    def _outermost(self) -> bool:
        return not self._in_sample and all(c is None for c in self._root_stack)

    def _root_active(self) -> bool:
        return self.model is not None and (self.applied is None or self.track)

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or not self._root_active():
            self._root_stack.append(None)
            return
        self._root_stack.append(self._enter_root())

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self._root_stack.pop() if self._root_stack else None
        if ctx is not None:
            self._exit_root(ctx)

    def _enter_root(self) -> Any:
        if self.applied is None:
            recorder = self._recorder
            if recorder is None:  # pragma: no cover - set by attach
                raise RuntimeError("MemoryPlanner: not attached")
            if self._outermost():
                self._count_materialised = recorder.forwards == 0
                recorder.begin_forward()
            ctx: Any = torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack)
        else:
            ctx = torch.autograd.graph.saved_tensors_hooks(self._keep_pack(None), _unpack_held)
        ctx.__enter__()
        return ctx

    def _exit_root(self, ctx: Any) -> None:
        ctx.__exit__(None, None, None)
        if self.applied is None and self._outermost():
            recorder = self._recorder
            if recorder is not None:
                recorder.end_forward()
                if recorder.forwards >= self.measure_forwards and self.on_planned is not None:
                    plan = self.decide()
                    self.on_planned(plan)

    # --- measuring ---------------------------------------------------------------------

    def _measure_call(self, index: int, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        recorder = self._recorder
        if recorder is None:  # pragma: no cover - set by attach
            raise RuntimeError("MemoryPlanner: not attached")
        block = recorder.blocks[index]
        if block.order < 0:
            block.order = recorder.started
        recorder.started += 1
        block.calls += 1
        seen: set[_Key] = set()
        for t in _tensor_leaves(args, kwargs):
            key, nbytes = _storage(t)
            if key not in seen and key not in self._param_keys:
                seen.add(key)
                block.input_bytes += nbytes
        count_now = self._count_materialised
        materialised = [0]

        def sink(n: int) -> None:
            materialised[0] += n

        mode: Any = (
            _CountMaterialised(sink, self._param_keys) if count_now else contextlib.nullcontext()
        )
        previous = recorder.current, recorder.weights, recorder.pass_on
        recorder.current = index
        recorder.weights = _weights_of(self.wrappers[index].module)
        recorder.pass_on = _pass_on()
        try:
            _sync(self.device)
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack), mode:
                out = forward(*args, **kwargs)
            _sync(self.device)
            elapsed = time.perf_counter() - start
        finally:
            recorder.current, recorder.weights, recorder.pass_on = previous
        if count_now:  # the counting mode slows every op: its time is the fallback
            block.recompute_bytes = max(block.recompute_bytes, materialised[0])
            block.counted_seconds.append(elapsed)
        else:
            block.forward_seconds.append(elapsed)
        if self.cost_trials:
            block.sample = capture_sample(self.wrappers[index].module, args, kwargs)
        return out

    def _run_sample(self, sample: Any) -> None:
        model = self.model
        if model is None:  # pragma: no cover - plan() attaches first
            raise RuntimeError("MemoryPlanner: not attached")
        recorder = self._recorder
        if recorder is None:  # pragma: no cover
            raise RuntimeError("MemoryPlanner: not attached")
        recorder.begin_forward()
        self._in_sample = True  # the model's own root hooks nest inside this pass
        try:
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack),
            ):
                if callable(sample):
                    out = sample()
                elif isinstance(sample, Mapping):
                    out = model(**sample)
                elif isinstance(sample, (tuple, list)):
                    out = model(*sample)
                else:
                    out = model(sample)
            del out
        finally:
            self._in_sample = False
        recorder.end_forward()

    def _probe_sizes(self) -> list[int]:
        """Byte sizes of the pageable saved tensors of the block that pages the most (at
        most ``_PROBE_CAP`` bytes in all): what a bandwidth probe copies, so that the
        estimate carries the real tensors' sizes and per-tensor costs, not one cached
        buffer's."""
        recorder = self._recorder
        blocks = recorder.blocks if recorder is not None else []
        if not blocks:
            return [1 << 22]
        widest = max(blocks, key=lambda b: b.copy_bytes)
        sizes, total = [], 0
        for nbytes, pageable in sorted(widest.saved.values(), key=lambda e: -e[0]):
            if pageable and nbytes > 0 and total + nbytes <= _PROBE_CAP:
                sizes.append(nbytes)
                total += nbytes
        return sizes or [1 << 22]

    def _bandwidth(self, tier: str) -> float:
        """Round-trip bytes per second of ``tier``: as given, else measured by paging out
        tensors of the sizes one block saves (all packed, then all unpacked, as forward and
        backward do), the best of five rounds (the first ones also pay for fresh pages)."""
        given = self.host_bandwidth if tier == "host" else self.disk_bandwidth
        if given is not None:
            return float(given)
        pager = self._pager("page_host" if tier == "host" else "page_disk")
        # filled, not random: the probe must not draw from the training's RNG
        probes = [
            torch.full((max(1, n // 4),), 1.5, device=self.device) for n in self._probe_sizes()
        ]
        nbytes = sum(p.numel() * p.element_size() for p in probes)
        best = math.inf
        for _ in range(5):
            _sync(self.device)
            start = time.perf_counter()
            pages = [pager.pack(p) for p in probes]
            back = [pager.unpack(page) for page in pages]
            _sync(self.device)
            best = min(best, time.perf_counter() - start)
            del pages, back
        return nbytes / max(best, 1e-9)

    def plan(self, model: nn.Module, sample: Any, *, trials: int = 2) -> MemoryPlan:
        """Measure ``model`` on ``sample`` and apply the plan for the budget.

        ``sample``: a callable run as ``sample()`` (it calls the model, and may compute the
        loss: that counts as outside the blocks), or a batch given to the model as
        ``model(**batch)`` (a mapping), ``model(*batch)`` (a tuple or list) or
        ``model(batch)``.  The model runs forward only (``trials`` times: the first counts
        what recomputation materialises, the others time the blocks; the smallest time
        counts); then one block of each shape runs forward and backward per choice
        (``cost_trials``).  No ``.grad`` is touched.
        """
        trials = check_int("trials", trials, minimum=1, owner=_OWNER)
        self.attach(model)
        try:
            for trial in range(trials):
                self._count_materialised = trial == 0
                self._run_sample(sample)
            return self.decide()
        except BaseException:
            self.remove()
            raise

    # --- deciding ----------------------------------------------------------------------

    def _measurements(self) -> list[BlockDecision]:
        recorder = self._recorder
        if recorder is None or recorder.forwards == 0:
            raise RuntimeError(
                "MemoryPlanner: nothing measured yet (run a forward pass under grad first)"
            )
        out = []
        for index, block in enumerate(recorder.blocks):
            if block.calls == 0:
                raise RuntimeError(
                    f"MemoryPlanner: block {block.name} did not run in the measured forward "
                    f"pass; select the blocks that run (blocks=)"
                )
            activation = sum(entry[0] for entry in block.saved.values())
            pageable = sum(entry[0] for entry in block.saved.values() if entry[1])
            seconds = min(block.forward_seconds or block.counted_seconds)
            out.append(
                BlockDecision(
                    name=block.name,
                    activation_bytes=activation,
                    pageable_bytes=pageable,
                    copy_bytes=block.copy_bytes,
                    input_bytes=block.input_bytes,
                    recompute_bytes=max(block.recompute_bytes, activation),
                    parameter_bytes=self._param_bytes[index],
                    forward_seconds=seconds,
                    choice="keep",
                    cost_seconds=0.0,
                )
            )
        return out

    def _cached_costs(self) -> dict[int, dict[str, float]] | None:
        """The costs timed on the current measurement, or None when not timed yet."""
        recorder = self._recorder
        if self._timed is None or recorder is None or self._timed[0] != recorder.forwards:
            return None
        return self._timed[1]

    def _timed_costs(
        self, measured: Sequence[BlockDecision], allowed: Sequence[str]
    ) -> dict[int, dict[str, float]]:
        """Block index -> extra seconds per step of each choice, timed on one block of each
        shape (blocks with the same measured bytes and class) through the code the plan
        runs; blocks that could not be timed are missing (their costs are estimated).  A
        tier with a given bandwidth is not timed.  Done once per measurement."""
        recorder = self._recorder
        if recorder is None or self.cost_trials == 0:
            return {}
        cached = self._cached_costs()
        if cached is not None:
            return cached
        given = {"page_host": self.host_bandwidth, "page_disk": self.disk_bandwidth}
        choices = [c for c in allowed if given.get(c) is None]
        pagers = {c: self._pager(c) for c in choices if c in given}
        shapes: dict[tuple[Any, ...], list[int]] = {}
        for i in self._order():
            d, block = measured[i], recorder.blocks[i]
            key = (
                type(self.wrappers[i].module),
                block.calls,
                d.activation_bytes,
                d.pageable_bytes,
                d.copy_bytes,
                d.input_bytes,
                d.recompute_bytes,
                d.parameter_bytes,
            )
            shapes.setdefault(key, []).append(i)

        timed: dict[int, dict[str, float]] = {}
        # untracked: the trials' backward goes through autograd.grad, and tracking's
        # gradient hooks on parameters cannot run there (nor should trials count)
        saved = self._pagers, self.track
        self._pagers, self.track = pagers, False
        try:
            for indices in shapes.values():
                found = [(i, recorder.blocks[i].sample) for i in indices]
                index, sample = next(((i, s) for i, s in found if s is not None), (-1, None))
                if sample is None:
                    continue
                costs = time_choices(sample, choices, self._trial_call(index), self.cost_trials)
                if costs is not None:
                    for i in indices:
                        calls = recorder.blocks[i].calls
                        timed[i] = {c: seconds * calls for c, seconds in costs.items()}
        finally:
            self._pagers, self.track = saved
            for block in recorder.blocks:
                block.sample = None  # the inputs' storages are not held beyond this
        self._timed = (recorder.forwards, timed)
        return timed

    def _trial_call(self, index: int) -> Callable[[str, Any, Any], Any]:
        """Calls block ``index`` (module hooks and all) with a choice applied to it."""
        wrapper = self.wrappers[index]

        def run(choice: str, args: Any, kwargs: Any) -> Any:
            previous, wrapper.choice = wrapper.choice, choice
            try:
                return wrapper.module(*args, **kwargs)
            finally:
                wrapper.choice = previous

        return run

    def _tier_bandwidth(
        self,
        choice: str,
        measured: Sequence[BlockDecision],
        timed: Mapping[int, Mapping[str, float]],
    ) -> float:
        """The round-trip bandwidth shown for a paging tier and used for blocks whose cost
        was not timed: given, or probed when some block needs it, else the effective one."""
        tier = "host" if choice == "page_host" else "disk"
        given = self.host_bandwidth if tier == "host" else self.disk_bandwidth
        if given is not None or any(choice not in timed.get(i, {}) for i in range(len(measured))):
            return self._bandwidth(tier)
        finite = [i for i in range(len(measured)) if math.isfinite(timed[i][choice])]
        copied = sum(measured[i].copy_bytes for i in finite)
        seconds = sum(timed[i][choice] for i in finite)
        return copied / max(seconds, 1e-9) if finite else 0.0

    def _order(self) -> list[int]:
        recorder = self._recorder
        if recorder is None:  # pragma: no cover
            return list(range(len(self.names)))
        return sorted(range(len(recorder.blocks)), key=lambda i: recorder.blocks[i].order)

    def decide(self, choices: str | Mapping[str, str] | None = None) -> MemoryPlan:
        """Choose (or take ``choices``: one choice for every block, or a mapping block name
        -> choice, the others kept) and apply the plan; returns it."""
        measured = self._measurements()
        recorder = self._recorder
        if recorder is None:  # pragma: no cover
            raise RuntimeError("MemoryPlanner: not attached")
        order = self._order()
        pre = recorder.outside_pre
        outside = sum(recorder.outside.values())
        given = self._given_choices(choices) if choices is not None else None
        use_disk = self.disk or (given is not None and "page_disk" in given)
        allowed = ["keep", "page_host", "recompute"] + (["page_disk"] if use_disk else [])
        timed = (
            self._timed_costs(measured, allowed) if given is None else (self._cached_costs() or {})
        )
        host_bw = self._tier_bandwidth("page_host", measured, timed)
        disk_bw = self._tier_bandwidth("page_disk", measured, timed) if use_disk else 0.0
        host_cap = self.host_budget if self.host_budget is not None else default_host_budget()
        disk_cap = 0
        if self.disk:
            base = (
                Path(self.directory) if self.directory is not None else Path(tempfile.gettempdir())
            )
            free = shutil.disk_usage(base).free
            disk_cap = max(0, free - max(free // 20, 2**30))

        def cost(i: int, choice: str) -> float:
            d = measured[i]
            if choice == "keep":
                return 0.0
            seconds = timed.get(i, {}).get(choice)
            if seconds is not None:
                return seconds
            if choice == "recompute":
                return d.forward_seconds
            bandwidth = host_bw if choice == "page_host" else disk_bw
            return d.copy_bytes / bandwidth if bandwidth > 0 else math.inf

        def peak(plan: Sequence[str]) -> int:
            resident = [_resident(measured[i], plan[i]) for i in range(len(plan))]
            worst = outside + sum(resident)
            running = pre
            for i in order:
                d = measured[i]
                if plan[i] == "recompute":
                    worst = max(worst, running + d.input_bytes + d.recompute_bytes)
                elif plan[i] != "keep":  # what stayed, and every copy brought back
                    worst = max(worst, running + resident[i] + d.copy_bytes)
                running += resident[i]
            return worst

        def fits(plan: Sequence[str]) -> bool:
            host = sum(measured[i].copy_bytes for i, c in enumerate(plan) if c == "page_host")
            disk = sum(measured[i].copy_bytes for i, c in enumerate(plan) if c == "page_disk")
            return host <= host_cap and disk <= disk_cap

        n = len(measured)

        def descend(target: int) -> list[str]:
            plan = ["keep"] * n
            current = peak(plan)
            while current > target:
                best: tuple[float, int, int, str] | None = None
                for i in range(n):
                    for choice in allowed:
                        if choice == plan[i] or math.isinf(cost(i, choice)):
                            continue  # an infinite cost: the block cannot run that way
                        trial = [*plan[:i], choice, *plan[i + 1 :]]
                        if not fits(trial):
                            continue
                        gain = current - peak(trial)
                        if gain <= 0:
                            continue
                        extra = cost(i, choice) - cost(i, plan[i])
                        score = gain / max(extra, 1e-12)
                        candidate = (score, gain, -i, choice)
                        if best is None or candidate[:3] > best[:3]:
                            best = candidate
                if best is None:
                    break
                plan[-best[2]] = best[3]
                current = peak(plan)
            return plan

        keep_peak = peak(["keep"] * n)
        lowest = descend(0)
        recompute_all = ["recompute"] * n
        can_recompute_all = all(math.isfinite(cost(i, "recompute")) for i in range(n))
        least = min(peak(lowest), peak(recompute_all) if can_recompute_all else peak(lowest))
        budget = self.budget if self.budget is not None else self._auto_budget
        if given is not None:
            plan = given
            planned_for = None
        else:
            if budget is None:  # pragma: no cover - attach() requires or computes one
                raise RuntimeError("MemoryPlanner: no budget")
            if least > budget:
                everything = _mb(peak(recompute_all)) if can_recompute_all else "not possible here"
                raise MemoryBudgetError(
                    f"MemoryPlanner: the saved activations cannot fit budget={budget} bytes "
                    f"({_mb(budget)}): the least reachable peak is {least} bytes ({_mb(least)}; "
                    f"every block recomputed: {everything}, everything kept: "
                    f"{_mb(keep_peak)}, outside the blocks: {_mb(outside)}); raise the budget "
                    f"to at least {least} or make the batch smaller",
                    budget=budget,
                    minimum=least,
                )
            plan = descend(budget)
            if peak(plan) > budget:  # the greedy path got stuck; start from the lowest plan
                plan = list(lowest) if peak(lowest) <= budget else recompute_all
            improved = True
            while improved:  # take back the dearest extra time the budget allows
                improved = False
                best_saving, best_move = 0.0, None
                for i in range(n):
                    for choice in allowed:
                        saving = cost(i, plan[i]) - cost(i, choice)
                        if saving <= best_saving:
                            continue
                        trial = [*plan[:i], choice, *plan[i + 1 :]]
                        if fits(trial) and peak(trial) <= budget:
                            best_saving, best_move = saving, (i, choice)
                if best_move is not None:
                    plan[best_move[0]] = best_move[1]
                    improved = True
            planned_for = budget
        decisions = tuple(
            dataclasses.replace(
                d,
                choice=plan[i],
                cost_seconds=cost(i, plan[i]),
                costs=tuple((c, cost(i, c)) for c in allowed),
                costs_measured=i in timed,
            )
            for i, d in enumerate(measured)
        )
        result = MemoryPlan(
            decisions=decisions,
            budget=planned_for,
            estimated_peak=peak(plan),
            keep_peak=keep_peak,
            least_peak=least,
            outside_bytes=outside,
            host_bandwidth=host_bw,
            disk_bandwidth=disk_bw,
            device=str(self.device),
            cost_trials=self.cost_trials if timed else 0,
        )
        self._apply(result)
        return result

    def _given_choices(self, choices: str | Mapping[str, str]) -> list[str]:
        if isinstance(choices, str):
            check_choice("choices", choices, CHOICES, owner=_OWNER)
            return [choices] * len(self.names)
        if not isinstance(choices, Mapping):
            raise option_error(
                "choices", choices, f"one of {CHOICES} or a mapping block name -> choice",
                owner=_OWNER,
            )  # fmt: skip
        unknown = sorted(set(choices) - set(self.names))
        if unknown:
            raise option_error(
                "choices", dict(choices), f"block names among {self.names}", owner=_OWNER
            )
        for value in choices.values():
            check_choice("choices", value, CHOICES, owner=_OWNER)
        return [choices.get(name, "keep") for name in self.names]

    def _apply(self, plan: MemoryPlan) -> None:
        self._refresh_param_keys()
        self._pagers = {
            c: self._pager(c) for c in ("page_host", "page_disk") if c in plan.choices.values()
        }
        for wrapper, decision in zip(self.wrappers, plan.decisions, strict=True):
            wrapper.choice = decision.choice
        self.applied = plan
        if not self.track:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
        elif not self._hooks and self.model is not None:  # tracking turned on after planning
            self._register_root_hooks()
        _LOG.info("%s", plan.table())

    # --- running under a plan ----------------------------------------------------------

    @property
    def measured_peak(self) -> int:
        """With ``track=True``: the most bytes of saved activations live at once since the
        plan was applied (or since :meth:`reset_peak`)."""
        return self._meter.peak

    @property
    def live_bytes(self) -> int:
        return self._meter.live

    def reset_peak(self) -> None:
        self._meter.peak = self._meter.live

    def _keep_pack(
        self, call: _Call | None, module: nn.Module | None = None
    ) -> Callable[[torch.Tensor], Any]:
        """Keeps (and counts) what a block or the root saves; a weight is passed on."""
        meter = self._meter
        params = self._param_keys
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

    def _page_pack(
        self, pager: _Pager, call: _Call | None, module: nn.Module | None = None
    ) -> Callable[[torch.Tensor], Any]:
        """Pages what a block saves; small or shared tensors are kept, weights passed on."""
        params = self._param_keys
        weights = _weights_of(module)
        pass_on = _pass_on()
        min_bytes = self.min_bytes
        keep = self._keep_pack(call, module) if call is not None else None

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

    def _page_unpack(self, pager: _Pager) -> Callable[[Any], torch.Tensor]:
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

    def _run_plain(
        self,
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
        if pager is None:  # pragma: no cover - _apply builds one per paging choice
            raise RuntimeError(f"MemoryPlanner: no pager for {choice}")
        with torch.autograd.graph.saved_tensors_hooks(
            self._page_pack(pager, None, module), self._page_unpack(pager)
        ):
            return forward(*args, **kwargs)

    def _tracked_call(
        self, choice: str, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        call = _Call(self._meter)
        inputs = [t for t in _tensor_leaves(args, kwargs) if t.requires_grad]
        watch = inputs or [p for p in module.parameters() if p.requires_grad]
        if choice == "recompute":
            seen: set[_Key] = set()
            for t in _tensor_leaves(args, kwargs):
                key, nbytes = _storage(t)
                if key not in seen and key not in self._param_keys:
                    seen.add(key)
                    call.hold(key, nbytes)

            def contexts() -> tuple[Any, Any]:
                return contextlib.nullcontext(), _CountMaterialised(call.add, self._param_keys)

            out = checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        elif choice == "keep":
            with torch.autograd.graph.saved_tensors_hooks(
                self._keep_pack(call, module), _unpack_held
            ):
                out = forward(*args, **kwargs)
        else:
            pager = self._pagers[choice]
            with torch.autograd.graph.saved_tensors_hooks(
                self._page_pack(pager, call, module), self._page_unpack(pager)
            ):
                out = forward(*args, **kwargs)
        if watch:
            call.handle = torch.autograd.graph.register_multi_grad_hook(watch, call.release)
        return out


def _unpack_held(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Held):
        return packed.tensor
    return _restore(packed)  # type: ignore[no-any-return]


def plan_memory(model: nn.Module, sample: Any, budget: Any = None, **options: Any) -> MemoryPlan:
    """``MemoryPlanner(budget, **options).plan(model, sample, trials=...)``: measure,
    decide and apply in one call (see :class:`MemoryPlanner` for the options; keep a
    planner of your own to read ``measured_peak`` or to ``remove()`` the plan)."""
    trials = options.pop("trials", 2)
    return MemoryPlanner(budget, **options).plan(model, sample, trials=trials)


class MemoryPlanService(Service):
    """Spec ``memory_plan[:budget][,key=value...]``, e.g. ``memory_plan:budget=2GB``.

    ``wrap_model`` attaches a :class:`MemoryPlanner` (its options are the planner's); the
    first ``measure_steps`` training forward passes (under grad) measure the blocks with
    everything kept (paged to host RAM on a GPU), and the plan is applied from the next
    one.  ``report=True`` prints the plan's table when it is made; ``plan`` holds it.
    """

    name = "memory_plan"
    priority: float = 60

    def __init__(
        self,
        budget: Any = None,
        *,
        blocks: Any = None,
        host_budget: Any = None,
        disk: bool = True,
        directory: str | None = None,
        min_bytes: int = 1 << 16,
        host_bandwidth: float | None = None,
        disk_bandwidth: float | None = None,
        cost_trials: int = 3,
        track: bool = False,
        measure_steps: int = 2,
        report: bool = True,
        priority: float | None = None,
    ) -> None:
        owner = "MemoryPlanService"
        self.measure_steps: int = check_int("measure_steps", measure_steps, minimum=1, owner=owner)
        self.report = check_bool("report", report, owner=owner)
        if priority is not None:
            self.priority = check_number("priority", priority, owner=owner)
        self.planner = MemoryPlanner(
            budget,
            blocks=blocks,
            host_budget=host_budget,
            disk=disk,
            directory=directory,
            min_bytes=min_bytes,
            host_bandwidth=host_bandwidth,
            disk_bandwidth=disk_bandwidth,
            cost_trials=cost_trials,
            track=track,
        )
        self.planner.measure_forwards = self.measure_steps
        self.planner.on_planned = self._planned
        self.plan: MemoryPlan | None = None

    def _planned(self, plan: MemoryPlan) -> None:
        self.plan = plan
        if self.report:
            print(plan.table(), flush=True)

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"MemoryPlanService needs a torch.nn.Module, got {type(model)}")
        if self.planner.model is None:
            self.planner.attach(model)
        return model
