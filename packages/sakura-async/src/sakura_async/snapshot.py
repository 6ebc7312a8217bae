"""Snapshots: a consistent host copy of a state tree, taken on the training thread.

The copy is the only part of an asynchronous evaluation or checkpoint that blocks training,
and it is what makes the result exact: the background work reads the copy, never the live
tensors the next step is changing.  A :class:`SnapshotPool` keeps the host buffers of
earlier snapshots and copies into them again (``copy_`` into preallocated memory instead
of allocating ~the model's size per save), so memory stays bounded by the number of
snapshots in flight.  Buffers for CUDA tensors are pinned and filled with non-blocking
copies followed by one synchronisation.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["Snapshot", "SnapshotPool", "iter_tensors", "map_tensors"]

_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None))


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def map_tensors(tree: Any, fn: Callable[[Any], Any], *, copy_leaves: bool = False) -> Any:
    """Rebuild ``tree`` (dicts, lists, tuples) with ``fn`` applied to every tensor.

    Containers are rebuilt (never shared with the input); other leaves are kept, or
    deep-copied when ``copy_leaves`` (so later changes by the training loop cannot leak in).
    """
    if _is_tensor(tree):
        return fn(tree)
    if isinstance(tree, Mapping):
        items = [(k, map_tensors(v, fn, copy_leaves=copy_leaves)) for k, v in tree.items()]
        if type(tree) is dict:
            return dict(items)
        if isinstance(tree, OrderedDict):
            out = OrderedDict(items)
            if hasattr(tree, "_metadata"):  # nn.Module.state_dict() carries version metadata
                out._metadata = copy.deepcopy(tree._metadata)  # type: ignore[attr-defined]
            return out
        try:
            return type(tree)(items)  # type: ignore[call-arg]
        except Exception:
            return dict(items)
    if isinstance(tree, list):
        return [map_tensors(v, fn, copy_leaves=copy_leaves) for v in tree]
    if isinstance(tree, tuple):
        values = [map_tensors(v, fn, copy_leaves=copy_leaves) for v in tree]
        if hasattr(tree, "_fields"):  # namedtuple
            return type(tree)(*values)
        return tuple(values) if type(tree) is tuple else type(tree)(values)
    if copy_leaves and not isinstance(tree, _IMMUTABLE):
        return copy.deepcopy(tree)
    return tree


def iter_tensors(tree: Any) -> Iterator[Any]:
    """Every tensor in ``tree``, in the order :func:`map_tensors` visits them."""
    if _is_tensor(tree):
        yield tree
    elif isinstance(tree, Mapping):
        for v in tree.values():
            yield from iter_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from iter_tensors(v)


class Snapshot:
    """A copied state tree whose tensors live in a pool's buffers.

    Valid until :meth:`release` (or the pool reuses the buffers after release).
    """

    __slots__ = ("_pool", "_slot", "deferred", "nbytes", "tree")

    def __init__(self, tree: Any, nbytes: int, pool: SnapshotPool | None, slot: int) -> None:
        self.tree = tree
        self.nbytes = nbytes
        self._pool = pool
        self._slot = slot
        self.deferred: list[tuple[Any, Any]] = []
        """``(buffer, source)`` pairs still to copy (see ``SnapshotPool.take(defer=...)``)."""

    def finish(self, stream: Any = None) -> None:
        """Copy the deferred tensors (on another thread, while the loop computes).

        For CUDA sources the copies run on a side stream that first waits for ``stream``
        (the training thread's stream), and this returns once they have landed.
        """
        import torch

        pairs, self.deferred = self.deferred, []
        cuda = [(dst, src) for dst, src in pairs if src.is_cuda]
        with torch.no_grad():
            for dst, src in pairs:
                if not src.is_cuda:
                    dst.copy_(src)
            if cuda:
                side = torch.cuda.Stream(device=cuda[0][1].device)
                if stream is not None:
                    side.wait_stream(stream)
                with torch.cuda.stream(side):
                    for dst, src in cuda:
                        dst.copy_(src, non_blocking=True)
                side.synchronize()

    def release(self) -> None:
        """Give the buffers back to the pool (idempotent)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._release(self._slot)

    def __repr__(self) -> str:
        return f"<Snapshot {self.nbytes / 2**20:.1f} MiB slot={self._slot}>"


Allocator = Callable[..., Any]


class _BufferSet:
    __slots__ = ("flat", "layout", "views")

    def __init__(self) -> None:
        self.layout: tuple[Any, ...] | None = None
        self.flat: Any = None
        self.views: list[Any] = []


def _plain(t: Any) -> bool:
    import torch

    return t.layout == torch.strided and not t.is_quantized


class SnapshotPool:
    """Reusable host buffer sets for snapshots of (usually) the same state tree.

    Each set is one flat allocation per dtype carved into per-tensor views (so a local
    worker gets a handful of shared-memory segments, however many tensors the state has);
    it is reused as long as the tree's tensor shapes and dtypes stay the same.

    Args:
        allocate: ``allocate(shape, dtype, pin_memory=bool) -> tensor`` (a dispatcher's
            :meth:`~sakura_async.dispatch.base.Dispatcher.empty`, or ``torch.empty``).
        max_sets: how many snapshots may be held at once; :meth:`take` raises when all are
            taken, which a service prevents by bounding its work in flight.
    """

    def __init__(self, allocate: Allocator | None = None, *, max_sets: int = 2) -> None:
        if allocate is None:
            import torch

            def allocate(shape: Any, dtype: Any, pin_memory: bool = False) -> Any:
                return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)

        self._allocate = allocate
        self.max_sets = max_sets
        self._sets: list[_BufferSet] = []
        self._free: list[int] = []
        self._lock = threading.Lock()
        self.allocations = 0
        """How many flat buffers were ever allocated (constant once shapes are stable)."""
        self.allocated_bytes = 0

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._sets) - len(self._free)

    def take(self, tree: Any, *, defer: Callable[[Any], bool] | None = None) -> Snapshot:
        """Copy every tensor of ``tree`` into a free buffer set; return the snapshot.

        The copy is complete (CUDA copies synchronised) when this returns, except for the
        tensors ``defer(tensor)`` selects: they are left in ``snapshot.deferred`` for
        :meth:`Snapshot.finish` to copy later.
        """
        import torch

        with self._lock:
            if self._free:
                slot = self._free.pop()
            elif len(self._sets) < self.max_sets:
                slot = len(self._sets)
                self._sets.append(_BufferSet())
            else:
                raise RuntimeError(
                    f"all {self.max_sets} snapshot buffer sets are in use; release a snapshot "
                    f"first (the service bounds its work in flight so this cannot happen)"
                )
        try:
            buffers = self._sets[slot]
            sources = [t for t in iter_tensors(tree) if _plain(t)]
            layout = tuple((tuple(t.shape), t.dtype, t.is_cuda) for t in sources)
            if buffers.layout != layout:
                self._layout(buffers, layout)
            cuda = any(t.is_cuda for t in sources)
            index = 0
            nbytes = 0
            deferred: list[tuple[Any, Any]] = []

            def copy_one(src: Any) -> Any:
                nonlocal index, nbytes
                if _plain(src):
                    out = buffers.views[index]
                    index += 1
                    if defer is not None and defer(src):
                        deferred.append((out, src.detach()))
                    else:
                        out.copy_(src.detach(), non_blocking=src.is_cuda)
                else:
                    out = src.detach().to("cpu", copy=True)
                nbytes += out.numel() * out.element_size()
                return out

            with torch.no_grad():
                copied = map_tensors(tree, copy_one, copy_leaves=True)
            if cuda:
                torch.cuda.synchronize()
        except BaseException:
            self._release(slot)
            raise
        snapshot = Snapshot(copied, nbytes, self, slot)
        snapshot.deferred = deferred
        return snapshot

    def _layout(self, buffers: _BufferSet, layout: tuple[Any, ...]) -> None:
        """One flat buffer per dtype, carved into views without gaps.

        Grouping by dtype keeps ``torch.save`` happy (it refuses views of one storage under
        different dtypes) and leaves no uninitialised padding in what it writes.
        """
        totals: dict[Any, int] = {}
        pinned: dict[Any, bool] = {}
        offsets = []
        for shape, dtype, cuda in layout:
            offsets.append(totals.get(dtype, 0))
            totals[dtype] = totals.get(dtype, 0) + math.prod(shape)
            pinned[dtype] = pinned.get(dtype, False) or cuda
        buffers.flat = None
        buffers.views = []
        flats = {}
        for dtype, numel in totals.items():
            flat = self._allocate((numel,), dtype, pin_memory=pinned[dtype])
            self.allocations += 1
            self.allocated_bytes += flat.numel() * flat.element_size()
            flats[dtype] = flat
        views = []
        for (shape, dtype, _), off in zip(layout, offsets, strict=True):
            views.append(flats[dtype][off : off + math.prod(shape)].view(shape))
        buffers.flat, buffers.views, buffers.layout = flats, views, layout

    def _release(self, slot: int) -> None:
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    def clear(self) -> None:
        """Drop every free buffer set (those in use are kept until released)."""
        with self._lock:
            for slot in self._free:
                self._sets[slot] = _BufferSet()
