"""Measuring: the saved-tensor hooks of the memory planner's measuring passes.

On real forward passes, per block: the bytes of the storages autograd saves (each storage
counted once, by the first block that saves it; parameters and buffers are not
activations), how many of them paging could move, the bytes of the block's tensor inputs,
the bytes its forward materialises (what recomputation creates again), its forward time,
and the inputs it got (a :class:`BlockSample`, for timing the choices).  The storage keys
and the hand-over of weights to the saved-tensor hooks below the planner's
(``WeightPaging``'s) are shared with :mod:`~sakura_offload.planner.apply`.  See
``docs/offload.md``, "The memory planner: design"."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from sakura_offload.paging.activations import is_broadcast, is_dense
from sakura_offload.planner.plan import BlockDecision

if TYPE_CHECKING:
    from sakura_offload.planner import MemoryPlanner

__all__ = ["BlockSample", "capture_sample", "measure_call", "measurements", "order", "run_sample"]

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)

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
    """The storages of ``module``'s parameters and buffers as they are now.  In a block
    whose weights are streamed (the :data:`sakura.marks.WEIGHTS_STREAMED` mark, e.g.
    ``WeightPaging``), inside the block's call, these are the device copies it installed
    for this call (a quantized base's codes and scales are buffers): new storages that the
    planner's parameter keys (taken when the weights were in their store) do not know."""
    if module is None:
        return set()
    return {_storage(t)[0] for t in (*module.parameters(), *module.buffers())}


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
    its output and its temporaries while they live), reported to ``sink`` as increases.

    ``skip``: storages that are not created by the forward (parameters and buffers).  An
    op's output that is a view of one (``weight.t()`` in a linear layer) shares its storage
    and is skipped too.  ``module``: the block whose weights may be streamed; the storages
    of its parameters and buffers *when the mode is entered* are skipped as well, since
    ``WeightPaging`` installs new device copies for each forward and again for the
    backward that recomputes it (they are weights, counted by whoever streams them)."""

    def __init__(
        self, sink: Callable[[int], None], skip: set[_Key], module: nn.Module | None = None
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sink = sink
        self.skip = skip
        self.module = module
        self.tracked: dict[_Key, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __enter__(self) -> _CountMaterialised:
        if self.module is not None:
            self.skip = self.skip | _weights_of(self.module)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

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


@dataclass
class BlockSample:
    """What a block got in the measured forward: its inputs and autocast state."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    autocast: tuple[str, bool, torch.dtype]


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.requires_grad)


def capture_sample(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> BlockSample | None:
    """The block's inputs as new leaves of autograd (the same storages, no copy), or None
    when an argument is an object a forward could change (a KV cache object, which every
    forward would append to)."""
    everything = tree_leaves((args, kwargs))
    if not all(isinstance(x, (torch.Tensor, *_PLAIN)) for x in everything):
        return None
    leaves = [x for x in everything if isinstance(x, torch.Tensor)]
    device_type = leaves[0].device.type if leaves else "cpu"
    autocast = (
        device_type,
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
    )
    return BlockSample(
        module,
        tree_map_only(torch.Tensor, _detached, args),
        tree_map_only(torch.Tensor, _detached, kwargs),
        autocast,
    )


# --- the measuring passes -------------------------------------------------------------------


def measure_call(
    planner: MemoryPlanner, index: int, forward: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """One measured call of block ``index``'s ``forward``."""
    recorder = planner._recorder
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
        if key not in seen and key not in planner._param_keys:
            seen.add(key)
            block.input_bytes += nbytes
    count_now = planner._count_materialised
    materialised = [0]

    def sink(n: int) -> None:
        materialised[0] += n

    mode: Any = (
        _CountMaterialised(sink, planner._param_keys, planner.wrappers[index].module)
        if count_now
        else contextlib.nullcontext()
    )
    previous = recorder.current, recorder.weights, recorder.pass_on
    recorder.current = index
    recorder.weights = _weights_of(planner.wrappers[index].module)
    recorder.pass_on = _pass_on()
    try:
        _sync(planner.device)
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack), mode:
            out = forward(*args, **kwargs)
        _sync(planner.device)
        elapsed = time.perf_counter() - start
    finally:
        recorder.current, recorder.weights, recorder.pass_on = previous
    if count_now:  # the counting mode slows every op: its time is the fallback
        block.recompute_bytes = max(block.recompute_bytes, materialised[0])
        block.counted_seconds.append(elapsed)
    else:
        block.forward_seconds.append(elapsed)
    if planner.cost_trials:
        block.sample = capture_sample(planner.wrappers[index].module, args, kwargs)
    return out


def run_sample(planner: MemoryPlanner, sample: Any) -> None:
    """One measuring forward pass of the planner's model on ``sample``."""
    model = planner.model
    if model is None:  # pragma: no cover - plan() attaches first
        raise RuntimeError("MemoryPlanner: not attached")
    recorder = planner._recorder
    if recorder is None:  # pragma: no cover
        raise RuntimeError("MemoryPlanner: not attached")
    recorder.begin_forward()
    planner._in_sample = True  # the model's own root hooks nest inside this pass
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
        planner._in_sample = False
    recorder.end_forward()


def measurements(planner: MemoryPlanner) -> list[BlockDecision]:
    """A :class:`BlockDecision` (kept) per block, from what was measured."""
    recorder = planner._recorder
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
                parameter_bytes=planner._param_bytes[index],
                forward_seconds=seconds,
                choice="keep",
                cost_seconds=0.0,
            )
        )
    return out


def order(planner: MemoryPlanner) -> list[int]:
    """Block indices in the order their forwards first ran."""
    recorder = planner._recorder
    if recorder is None:  # pragma: no cover
        return list(range(len(planner.names)))
    return sorted(range(len(recorder.blocks)), key=lambda i: recorder.blocks[i].order)
