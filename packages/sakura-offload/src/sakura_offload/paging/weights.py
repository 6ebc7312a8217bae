"""Frozen-weight paging: the frozen tensors of a model's blocks (frozen parameters and
buffers: a quantized base's codes and scales too) live in host RAM, or in memory-mapped
files under ``disk_offload``, and are copied to the compute device only while their block
runs, forward and backward, with the next blocks prefetched (:class:`WeightPaging`).  Each
block whose weights it streams carries the :data:`sakura.marks.WEIGHTS_STREAMED` mark until
:meth:`WeightPaging.remove`.  Which tensors are paged, and where they live:
:mod:`.weight_store`.

How a block's weights come and go, and how it composes with activation paging and
checkpointing: ``docs/offload.md``, "Weight paging: design".

Long file: one per-block state machine (materialise, install, release, prefetch, the
forward, backward and saved-tensor hooks, tokens, the written-tensor check) whose invariant
-- at most ``prefetch + 1`` blocks live, every token resolves to an installed copy -- is
argued over all of its parts; the rule for which tensors are paged and where they live
between uses is :mod:`.weight_store`.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import torch
from torch import nn

from sakura.marks import WEIGHTS_STREAMED, clear_mark, set_mark
from sakura.options import check_choice, check_int, option_error
from sakura_offload.paging.mapped import mapped_empty_like
from sakura_offload.paging.weight_store import (
    FrozenTensor,
    WeightStore,
    frozen_block_bytes,
    frozen_tensors,
)
from sakura_torch.blocks import find_blocks, validate_selector

__all__ = ["WeightPaging", "WeightPagingStats", "frozen_block_bytes"]

_OWNER = "WeightPaging"
MARK_VALUE = "weight_paging"
"""The value of the :data:`sakura.marks.WEIGHTS_STREAMED` mark on each block whose weights
a :class:`WeightPaging` streams (until :meth:`WeightPaging.remove`)."""


@dataclass
class WeightPagingStats:
    """What one :class:`WeightPaging` holds and did (counts are cumulative)."""

    blocks: int = 0
    """Blocks with paged weights."""
    paged_params: int = 0
    """Frozen parameters paged."""
    paged_buffers: int = 0
    """Buffers paged (a quantized layer's codes, scales, ...)."""
    paged_bytes: int = 0
    """Bytes of frozen tensors paged, in host RAM and on disk."""
    disk_blocks: int = 0
    """Of the paged blocks, those whose tensors live in memory-mapped files
    (``disk_offload``)."""
    disk_bytes: int = 0
    """Of ``paged_bytes``, the bytes in memory-mapped files under ``disk_offload`` (in the
    OS's page cache while RAM has room, not in the process's own memory)."""
    written: int = 0
    """Frozen tensors that a forward wrote in place or replaced, taken out of paging (see
    :mod:`.weight_store`)."""
    materialised: int = 0
    """Blocks copied to the device (forward and backward, prefetched or not)."""
    prefetched: int = 0
    """Of those, blocks copied ahead of their use."""
    on_demand: int = 0
    """Blocks materialised because backward needed a weight that was not installed."""
    live_blocks: int = 0
    """Blocks materialised now."""
    max_live_blocks: int = 0
    live_bytes: int = 0
    """Bytes of device copies materialised now."""
    max_live_bytes: int = 0
    """The most bytes of device copies materialised at once (what the device budget needs
    for paged weights)."""
    saved_tokens: int = 0
    """Tensors autograd saved that were paged weights (or views) and became tokens."""
    saved_kept: int = 0
    """Saved tensors inside paged weights that could not become tokens (another dtype)."""
    still_referenced: int = 0
    """Released blocks whose device copy was still alive when checked (see
    :meth:`WeightPaging.check_released`)."""


class _Token:
    """A saved view of a paged weight: which one, and the view's geometry."""

    __slots__ = ("block", "name", "offset", "size", "stride")

    def __init__(self, block: _Block, name: str, t: torch.Tensor) -> None:
        self.block = block
        self.name = name
        self.size = t.shape
        self.stride = t.stride()
        self.offset = t.storage_offset()


class _Outer:
    """A saved tensor packed by the hooks that were active below ours."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Any) -> None:
        self.packed = packed
        self.unpack = unpack


class _Block:
    __slots__ = (
        "__weakref__",
        "event",
        "host",
        "index",
        "installed",
        "live",
        "module",
        "name",
        "nbytes",
        "tensors",
        "tier",
        "versions",
        "warned",
    )

    def __init__(self, index: int, name: str, module: nn.Module) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.tensors: list[FrozenTensor] = []
        self.tier = "host"
        self.versions: list[int] = []
        self.host: dict[str, torch.Tensor] = {}
        self.live: dict[str, torch.Tensor] | None = None
        self.event: Any = None
        self.installed = False
        self.warned = False
        self.nbytes = 0


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def _is_checkpoint(hooks: tuple[Any, Any] | None) -> bool:
    """True for torch.utils.checkpoint's hooks: they keep no tensor (the block is run again
    in backward), and they must see every tensor the recomputation will save again."""
    return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


class WeightPaging:
    """Page the frozen tensors of ``model``'s blocks to host RAM or disk (see the module
    docstring; which tensors: :mod:`.weight_store`).

    Args:
        model: the model (a PEFT model too: its frozen base weights are paged, its
            adapters are not).
        blocks: which modules are blocks: ``None`` auto-detects the repeated block stack;
            or a class, a tuple of classes, a class name, a callable
            ``(qualified_name, module) -> bool``.
        indices: which of those blocks to page, by position (``None``: all).  The memory
            planner passes the blocks it decided to page.
        prefetch: how many blocks ahead (forward) or behind (backward) are copied while
            the current block runs; ``0`` copies each block when it starts.
        device: the compute device.  ``None``: where the model's first parameter is.  The
            rest of the model (parameters not paged, buffers) is moved there.
        pin_memory: page-lock the host store; ``None``: when ``device`` is a CUDA device.
        disk_offload: ``None`` or a directory (created if missing): the blocks that
            ``host_budget`` cannot hold keep their frozen tensors in memory-mapped files in
            a private folder there, written as they are paged out and read through the
            OS's page cache at each use (never page-locked); the folder is removed by
            ``remove()``, at exit, and when setting up fails.
        host_budget: with ``disk_offload``: bytes (an int or a size string such as
            ``"2GiB"``) of frozen tensors kept in host RAM, whole blocks in order, the rest
            on disk; ``None``: the memory planner's host budget (60 % of the available
            RAM, leaving 10 % of physical RAM free); ``0``: every paged block on disk.

    ``remove()`` (or leaving a ``with`` block) puts every weight back on the device,
    removes the hooks and the files.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        blocks: Any = None,
        indices: Sequence[int] | None = None,
        prefetch: int = 1,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        disk_offload: str | os.PathLike[str] | None = None,
        host_budget: int | str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise option_error("model", type(model).__name__, "a torch.nn.Module", owner=_OWNER)
        validate_selector(blocks, owner=_OWNER)
        self.prefetch: int = check_int("prefetch", prefetch, minimum=0, owner=_OWNER)
        check_choice("pin_memory", pin_memory, (None, True, False), owner=_OWNER)
        self.device = self._resolve_device(model, device)
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        if pin_memory and not torch.cuda.is_available():
            raise option_error(
                "pin_memory", True, "None or False (page-locking needs CUDA)", owner=_OWNER
            )
        self.pin_memory: bool = pin_memory
        found = find_blocks(model, blocks, owner=_OWNER)
        chosen = self._check_indices(indices, len(found))
        self._store = WeightStore(
            pin_memory=pin_memory, disk_offload=disk_offload, host_budget=host_budget, owner=_OWNER
        )
        self.host_budget: int | None = self._store.host_budget
        """With ``disk_offload``: the bytes of frozen tensors kept in host RAM."""
        self.model = model
        self.block_names = [name for name, _ in found]
        self.stats = WeightPagingStats()
        self._blocks: list[_Block] = []
        self._by_storage: dict[int, tuple[_Block, str]] = {}
        self._handles: list[Any] = []
        self._saved_hooks: list[Any] = []
        self._callback_queued = False
        self._removed = False
        self._released: list[tuple[_Block, list[weakref.ref[torch.UntypedStorage]]]] = []
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
        paged_ids: set[int] = set()
        for position in chosen:
            name, module = found[position]
            block = _Block(len(self._blocks), name, module)
            block.tensors = frozen_tensors(module, paged_ids)
            if block.tensors:
                self._blocks.append(block)
        self.paged_names = [block.name for block in self._blocks]
        """Qualified names of the blocks whose weights are paged."""
        self.paged_bytes: dict[str, int] = {}
        """Bytes of frozen tensors paged, per paged block."""
        self.tiers: dict[str, str] = {}
        """Where each paged block's tensors live between uses: ``"host"`` or ``"disk"``."""
        self._move_rest(model, paged_ids)
        try:
            for block in self._blocks:
                self._page_out(block)
        except BaseException:  # a full disk: every tensor goes back, no file is kept
            self._put_back()
            raise
        for block in self._blocks:
            self._handles.append(block.module.register_forward_pre_hook(self._make_pre_hook(block)))
            self._handles.append(
                block.module.register_forward_hook(self._make_post_hook(block), always_call=True)
            )
            set_mark(block.module, WEIGHTS_STREAMED, MARK_VALUE)
        self.stats.blocks = len(self._blocks)

    @property
    def disk_root(self) -> Path | None:
        """The folder of the memory-mapped files (``None`` without ``disk_offload``)."""
        root: Path | None = self._store.root
        return root

    # --- setup ------------------------------------------------------------------------

    def _page_out(self, block: _Block) -> None:
        """Move ``block``'s frozen tensors to its tier: ``.data`` becomes the stored copy."""
        block.tier = self._store.tier_for(sum(f.nbytes for f in block.tensors))
        for frozen in block.tensors:
            stored = self._store.put(f"{block.name}.{frozen.key}", frozen.tensor, block.tier)
            block.host[frozen.key] = stored
            block.nbytes += frozen.nbytes
            frozen.tensor.data = stored
            self.stats.paged_buffers += frozen.is_buffer
            self.stats.paged_params += not frozen.is_buffer
        self.paged_bytes[block.name] = block.nbytes
        self.tiers[block.name] = block.tier
        self.stats.paged_bytes += block.nbytes
        if block.tier == "disk":
            self.stats.disk_blocks += 1
            self.stats.disk_bytes += block.nbytes

    def _put_back(self) -> None:
        """Every paged tensor back on the device as a tensor of its own; files removed."""
        for block in self._blocks:
            for frozen in block.tensors:
                host = block.host.get(frozen.key)
                if host is not None:
                    frozen.tensor.data = host.to(self.device, copy=True)
        self._store.close()

    @staticmethod
    def _resolve_device(model: nn.Module, device: Any) -> torch.device:
        if device is None:
            first = next(model.parameters(), None)
            return first.device if first is not None else torch.device("cpu")
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError):
            raise option_error(
                "device", device, "None, a device string or a torch.device", owner=_OWNER
            ) from None
        if resolved.type == "cuda":
            if not torch.cuda.is_available():
                raise option_error("device", device, "a device that exists here", owner=_OWNER)
            if cast(Any, resolved).index is None:  # typed int, None for plain "cuda"
                return torch.device("cuda", torch.cuda.current_device())
        return resolved

    @staticmethod
    def _check_indices(indices: Any, count: int) -> list[int]:
        if indices is None:
            return list(range(count))
        accepted = f"None or distinct block positions, ints in [0, {count})"
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
            raise option_error("indices", indices, accepted, owner=_OWNER)
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
                raise option_error("indices", indices, accepted, owner=_OWNER)
        if len(set(indices)) != len(indices):
            raise option_error("indices", indices, accepted, owner=_OWNER)
        return sorted(indices)

    def _move_rest(self, model: nn.Module, paged: set[int]) -> None:
        for param in model.parameters():
            if id(param) not in paged and param.device != self.device:
                param.data = param.data.to(self.device)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) not in paged and buffer.device != self.device:
                    module._buffers[name] = buffer.to(self.device)

    # --- materialising and releasing ---------------------------------------------------

    def _copy(self, block: _Block, *, ahead: bool) -> dict[str, torch.Tensor]:
        """Make device copies of ``block``'s weights (no-op if it has them); returns them."""
        if block.live is not None:
            return block.live
        live: dict[str, torch.Tensor] = {}
        if self._stream is not None:
            stream = self._stream if ahead else torch.cuda.current_stream(self.device)
            if ahead:  # allocations and copies are ordered after what runs now
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for pname, host in block.host.items():
                    fresh = torch.empty_like(host, device=self.device)
                    fresh.copy_(host, non_blocking=True)
                    live[pname] = fresh
                if ahead:
                    block.event = torch.cuda.Event()
                    block.event.record(stream)
        else:
            for pname, host in block.host.items():  # a map each: the heap stays unsplit
                live[pname] = mapped_empty_like(host).copy_(host)
        block.live = live
        for pname, fresh in live.items():
            self._by_storage[fresh.untyped_storage().data_ptr()] = (block, pname)
        stats = self.stats
        stats.materialised += 1
        stats.prefetched += int(ahead)
        stats.live_blocks += 1
        stats.max_live_blocks = max(stats.max_live_blocks, stats.live_blocks)
        stats.live_bytes += block.nbytes
        stats.max_live_bytes = max(stats.max_live_bytes, stats.live_bytes)
        return live

    def _install(self, block: _Block) -> dict[str, torch.Tensor]:
        live = self._copy(block, ahead=False)
        if block.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(block.event)
            for fresh in live.values():
                fresh.record_stream(current)
            block.event = None
        if not block.installed:
            for frozen in block.tensors:
                frozen.tensor.data = live[frozen.key]
            block.versions = [frozen.tensor._version for frozen in block.tensors]
            block.installed = True
        return live

    def _release(self, block: _Block) -> None:
        if block.live is None:
            return
        if block.event is not None:  # prefetched, never used: the copy must finish first
            torch.cuda.current_stream(self.device).wait_event(block.event)
            for fresh in block.live.values():
                fresh.record_stream(torch.cuda.current_stream(self.device))
            block.event = None
        for frozen in block.tensors:
            frozen.tensor.data = block.host[frozen.key]
        block.installed = False
        self._released.append((block, self._forget(block)))
        self.stats.live_blocks -= 1
        self.stats.live_bytes -= block.nbytes

    def _check_written(self, block: _Block) -> None:
        """Take out of paging the tensors this forward wrote in place (their device copy,
        which holds what was written, stays) or that the module replaced (see
        :mod:`.weight_store`)."""
        changed = [
            frozen
            for frozen, version in zip(block.tensors, block.versions, strict=True)
            if frozen.tensor._version != version or not frozen.registered()
        ]
        for frozen in changed:
            replaced = not frozen.registered()
            if block.live is not None and frozen.key in block.live:
                live = block.live.pop(frozen.key)  # the module keeps it; release leaves it
                self._by_storage.pop(live.untyped_storage().data_ptr(), None)
                self.stats.live_bytes -= frozen.nbytes
            index = block.tensors.index(frozen)
            del block.tensors[index], block.versions[index]
            del block.host[frozen.key]
            self._store.drop(f"{block.name}.{frozen.key}", frozen.nbytes, block.tier)
            block.nbytes -= frozen.nbytes
            self.paged_bytes[block.name] = block.nbytes
            self.stats.paged_bytes -= frozen.nbytes
            if block.tier == "disk":
                self.stats.disk_bytes -= frozen.nbytes
            self.stats.paged_buffers -= frozen.is_buffer
            self.stats.paged_params -= not frozen.is_buffer
            self.stats.written += 1
            warnings.warn(
                f"WeightPaging: block {block.name}'s forward "
                + (
                    f"replaced {frozen.key}: it is left to the module"
                    if replaced
                    else f"wrote {frozen.key} in place: it stays on {self.device}, unpaged"
                ),
                RuntimeWarning,
                stacklevel=3,
            )

    def check_released(self) -> None:
        """Count (and warn once per block about) released device copies still alive.

        Checked when the next block starts, not at release: the graph of a backward pass
        that just ended (a checkpointed block's recomputed tensors, nodes that did not
        run) is freed after the end-of-backward release, and frees its aliases then."""
        released, self._released = self._released, []
        for block, refs in released:
            if not any(ref() is not None for ref in refs):
                continue
            self.stats.still_referenced += 1
            if not block.warned:
                block.warned = True
                warnings.warn(
                    f"WeightPaging: a device copy of block {block.name}'s weights is still "
                    f"referenced after its release, so its memory is not freed (a module "
                    f"that keeps a weight, or saved-tensor hooks entered inside the block "
                    f"that keep what they are given)",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _forget(self, block: _Block) -> list[weakref.ref[torch.UntypedStorage]]:
        """Drop this object's references to the block's device copies; weak ones remain."""
        refs = []
        for fresh in (block.live or {}).values():
            storage = fresh.untyped_storage()
            del self._by_storage[storage.data_ptr()]
            refs.append(weakref.ref(storage))
        block.live = None
        return refs

    def _keep_only(self, lo: int, hi: int) -> None:
        for block in self._blocks:
            if block.live is not None and not lo <= block.index <= hi:
                self._release(block)

    def release_all(self) -> None:
        """Drop every device copy (done automatically after each block and each backward)."""
        self._unwind()
        for block in self._blocks:
            self._release(block)

    def _unwind(self) -> None:
        """Leave the saved-tensor hooks of a block whose forward never reached its forward
        hook: torch runs always-call hooks on an ``Exception``, not on a
        ``KeyboardInterrupt``.  Ours are popped only while they are on top of torch's
        stack; under someone else's they stay, inert (they only turn installed weights
        into tokens and pass everything else on)."""
        while self._saved_hooks:
            hooks = self._saved_hooks.pop()
            if hooks is None:
                continue
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and top[0] is hooks.pack_hook:
                hooks.__exit__(None, None, None)

    # --- hooks ------------------------------------------------------------------------

    def _make_pre_hook(self, block: _Block) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if self._saved_hooks:  # the last forward was interrupted
                self._unwind()
            if _in_backward():  # activation checkpointing recomputes the block
                self._backward_enter(block)
                self._saved_hooks.append(None)
                return
            self.check_released()
            k = block.index
            self._keep_only(k, k + self.prefetch)
            self._install(block)
            for ahead in self._blocks[k + 1 : k + 1 + self.prefetch]:
                self._copy(ahead, ahead=True)
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if torch.is_grad_enabled() and not _is_checkpoint(top):
                hooks = torch.autograd.graph.saved_tensors_hooks(self._make_pack(top), self._unpack)
                hooks.__enter__()
                self._saved_hooks.append(hooks)
            else:
                self._saved_hooks.append(None)

        return pre_hook

    def _make_post_hook(self, block: _Block) -> Any:
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            hooks = self._saved_hooks.pop() if self._saved_hooks else None
            if hooks is not None:
                hooks.__exit__(None, None, None)
            if _in_backward():  # a recomputation: backward still needs the weights
                return
            if block.installed:
                self._check_written(block)
            self._release(block)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._make_backward_hook(block))

        return post_hook

    def _make_backward_hook(self, block: _Block) -> Any:
        ref = weakref.ref(self)

        def backward_hook(grad: torch.Tensor) -> None:
            paging = ref()
            if paging is not None:
                paging._backward_enter(block)

        return backward_hook

    def _backward_enter(self, block: _Block) -> None:
        if self._removed:
            return
        k = block.index
        self._keep_only(k - self.prefetch, k)
        self._install(block)
        for behind in reversed(self._blocks[max(0, k - self.prefetch) : k]):
            self._copy(behind, ahead=True)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        self._callback_queued = False
        self.release_all()

    def _make_pack(self, top: tuple[Any, Any] | None) -> Any:
        def pack(t: torch.Tensor) -> Any:
            if t.layout == torch.strided and t.device == self.device:
                owner = self._by_storage.get(t.untyped_storage().data_ptr())
                if owner is not None:
                    block, pname = owner
                    if t.dtype == block.host[pname].dtype:
                        self.stats.saved_tokens += 1
                        return _Token(block, pname, t)
                    self.stats.saved_kept += 1
            if top is None:
                return t
            return _Outer(top[0](t), top[1])

        return pack

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Outer):
            restored: torch.Tensor = packed.unpack(packed.packed)
            return restored
        block = packed.block
        if self._removed:  # a graph that outlived remove(): the weights are plain again
            weight = block.host[packed.name].to(self.device, copy=True)
            restored = weight.as_strided(packed.size, packed.stride, packed.offset)
            return restored
        if not block.installed:
            self.stats.on_demand += 1
            self._keep_only(block.index - self.prefetch, block.index)
            if _in_backward() and not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        live = self._install(block)
        view: torch.Tensor = live[packed.name].as_strided(packed.size, packed.stride, packed.offset)
        return view

    # --- teardown ---------------------------------------------------------------------

    def remove(self) -> None:
        """Put every paged tensor back on the device (as its ``.data``); remove the hooks
        and the files of ``disk_offload``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.release_all()
        self.check_released()
        for block in self._blocks:
            clear_mark(block.module, WEIGHTS_STREAMED)
        self._put_back()
        self._blocks.clear()
        self._by_storage.clear()
        self._removed = True
        self.stats.blocks = 0

    def __enter__(self) -> WeightPaging:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._removed:
            self.remove()

    def __repr__(self) -> str:
        disk = f" ({self.stats.disk_bytes} on disk)" if self._store.disk is not None else ""
        return (
            f"WeightPaging({len(self._blocks)} of {len(self.block_names)} blocks, "
            f"{self.stats.paged_bytes} bytes paged{disk}, prefetch={self.prefetch}, "
            f"device={self.device})"
        )
