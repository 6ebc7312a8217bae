"""ZeRO-2 gradient reduction: each gradient goes to its owner instead of to every rank.

Two paths, with the same arithmetic as DDP (divide by the world size, then sum):

* :class:`DDPOwnerHook` — a DDP communication hook.  For each DDP bucket, the gradients of
  each owner are reduced to that owner only (``dist.reduce``), in place when they are
  adjacent in the bucket (the contiguous partition makes them so), else packed;
  gradients of parameters no sharded optimizer owns are all-reduced as DDP would.  DDP
  still holds full-size buckets, so this saves communication, not gradient memory.
* :class:`BackwardReducer` — for loops without DDP.  A post-accumulate-grad hook on every
  parameter fills buckets in backward order; a full bucket is reduced to its owners at
  once (asynchronously, overlapping the rest of backward) and the gradients this rank
  does not own are freed right away, so only ``1 / world_size`` of the gradients stay.

gloo has no fast ``reduce_scatter`` (it is slower than ``all_reduce`` on loopback), so
both paths issue one ``reduce`` per owner present in a bucket, which gives exactly the
reduce-scatter semantics without padding the owners' unequal shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sakura_zero.comm import GroupInfo

__all__ = ["BackwardReducer", "DDPOwnerHook"]


@dataclass
class _Segment:
    """The part of a bucket that goes to one owner (``None``: every rank)."""

    owner: int | None
    runs: list[tuple[int, int]]  # (offset, numel) in the bucket buffer, merged when adjacent

    def pack(self, buffer: torch.Tensor) -> torch.Tensor:
        if len(self.runs) == 1:
            offset, numel = self.runs[0]
            return buffer.narrow(0, offset, numel)
        return torch.cat([buffer.narrow(0, o, n) for o, n in self.runs])

    def unpack(self, buffer: torch.Tensor, packed: torch.Tensor) -> None:
        if len(self.runs) == 1:
            return  # packed is a view of buffer: already in place
        start = 0
        for offset, numel in self.runs:
            buffer.narrow(0, offset, numel).copy_(packed.narrow(0, start, numel))
            start += numel


def _segments(offsets: Sequence[tuple[int, int, int | None]], world_size: int) -> list[_Segment]:
    """Group ``(offset, numel, owner)`` entries by owner, merging adjacent runs."""
    runs: dict[int | None, list[tuple[int, int]]] = {}
    for offset, numel, owner in sorted(offsets, key=lambda e: (e[0], e[1])):
        if numel == 0:
            continue
        lst = runs.setdefault(owner, [])
        if lst and lst[-1][0] + lst[-1][1] == offset:
            lst[-1] = (lst[-1][0], lst[-1][1] + numel)
        else:
            lst.append((offset, numel))
    order: list[int | None] = [*range(world_size), None]
    return [_Segment(o, runs[o]) for o in order if o in runs]


def _launch(segment: _Segment, packed: torch.Tensor, info: GroupInfo) -> Any:
    if segment.owner is None:
        return dist.all_reduce(packed, group=info.group, async_op=True)
    return dist.reduce(packed, dst=info.global_rank(segment.owner), group=info.group, async_op=True)


class DDPOwnerHook:
    """A DDP communication hook that reduces each gradient to its owner only.

    ``owner_of(param)`` returns the owning rank or None (then the gradient is
    all-reduced).  ``version()`` changes whenever ownership changes, which drops the cached
    bucket layouts.  DDP rebuilds its buckets after the first iteration; layouts are keyed
    by the bucket's parameters, so that is handled.
    """

    def __init__(
        self,
        info: GroupInfo,
        owner_of: Callable[[torch.Tensor], int | None],
        version: Callable[[], int],
    ) -> None:
        self.info = info
        self.owner_of = owner_of
        self.version = version
        self._layouts: dict[int, tuple[tuple[int, ...], int, list[_Segment]]] = {}
        self.calls = 0

    def _layout(self, bucket: Any, buffer: torch.Tensor) -> list[_Segment]:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        version = self.version()
        cached = self._layouts.get(bucket.index())
        if cached is not None and cached[0] == key and cached[1] == version:
            return cached[2]
        base = buffer.storage_offset()
        entries = []
        for p, grad in zip(params, bucket.gradients(), strict=True):
            entries.append((grad.storage_offset() - base, grad.numel(), self.owner_of(p)))
        segments = _segments(entries, self.info.world_size)
        self._layouts[bucket.index()] = (key, version, segments)
        return segments

    # DDP checks a hook's signature: the parameter must be called ``bucket`` and its
    # annotations must be absent or the real classes (not strings), hence none here.
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """The communication hook: register it as ``ddp.register_comm_hook(None, h.hook)``."""
        self.calls += 1
        buffer: torch.Tensor = bucket.buffer()
        info = self.info
        buffer.div_(info.world_size)
        segments = self._layout(bucket, buffer)
        received: list[tuple[_Segment, torch.Tensor]] = []
        futures = []
        for segment in segments:
            packed = segment.pack(buffer)
            futures.append(_launch(segment, packed, info).get_future())
            if segment.owner is None or segment.owner == info.rank:
                received.append((segment, packed))

        def unpack(_: Any) -> torch.Tensor:
            for segment, packed in received:
                segment.unpack(buffer, packed)
            return buffer

        if not futures:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        return torch.futures.collect_all(futures).then(unpack)


@dataclass
class _GradBucket:
    params: list[torch.Tensor]
    segments: list[tuple[int | None, list[torch.Tensor]]] = field(default_factory=list)
    ready: int = 0
    launched: bool = False


class BackwardReducer:
    """Reduce gradients to their owners during backward, without DDP.

    Buckets hold parameters in reverse order (roughly the order backward produces their
    gradients) up to ``bucket_bytes``; they are launched strictly in order, so every rank
    posts the same collectives in the same sequence.  :meth:`finish` (called before the
    optimizer step) launches what is left, waits, and leaves each owned parameter with its
    averaged gradient and every other parameter with ``grad = None``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        owners: Sequence[int],
        info: GroupInfo,
        bucket_bytes: int,
        who: str,
    ) -> None:
        self.info = info
        self.who = who
        self.paused = False
        self._owner = {id(p): o for p, o in zip(params, owners, strict=True)}
        self._buckets: list[_GradBucket] = []
        self._bucket_of: dict[int, _GradBucket] = {}
        current: list[torch.Tensor] = []
        size = 0
        for p in reversed([p for p in params if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > bucket_bytes:
                self._add_bucket(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self._add_bucket(current)
        self._next = 0
        self._dirty = False  # a gradient arrived since the last finish()
        self._accumulated = False  # ... or arrived inside no_sync()
        self._pending: list[tuple[int | None, list[torch.Tensor], torch.Tensor, Any]] = []
        self._handles = [
            p.register_post_accumulate_grad_hook(self._grad_ready)
            for p in params
            if p.requires_grad
        ]
        self._tracked = {id(p) for p in params if p.requires_grad}
        self._all = list(params)

    def _add_bucket(self, params: list[torch.Tensor]) -> None:
        bucket = _GradBucket(params=params)
        by_key: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            by_key.setdefault((self._owner[id(p)], p.dtype, p.device), []).append(p)
        bucket.segments = [
            (key[0], group) for key, group in sorted(by_key.items(), key=lambda kv: kv[0][0])
        ]
        self._buckets.append(bucket)
        for p in params:
            self._bucket_of[id(p)] = bucket

    def remove(self) -> None:
        """Unregister the gradient hooks (DDP took over the reduction)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no reduction) inside the block, as DDP's
        ``no_sync``: the backward after the block reduces the accumulated sum."""
        previous, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = previous

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self.paused:
            self._accumulated = True
            return
        bucket = self._bucket_of[id(param)]
        self._dirty = True
        if bucket.launched:
            raise RuntimeError(
                f"{self.who}: a gradient arrived for a parameter whose gradient was already "
                f"reduced since the last optimizer step; for gradient accumulation, run the "
                f"backward passes of all micro-batches but the last inside "
                f"`with zero.no_sync():` (as with DDP), then call optimizer.step()"
            )
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: _GradBucket) -> None:
        info = self.info
        bucket.launched = True
        with torch.no_grad():
            for owner, params in bucket.segments:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                if len(grads) == 1 and grads[0].is_contiguous():
                    packed = grads[0].view(-1)
                else:
                    packed = torch.cat([g.reshape(-1) for g in grads])
                packed.div_(info.world_size)
                work = _launch(_Segment(owner, []), packed, info)
                self._pending.append((owner, params, packed, work))
                if owner != info.rank:
                    for p in params:
                        p.grad = None

    def finish(self) -> None:
        """Launch the remaining buckets, wait for every reduction and put the averaged
        gradients of the owned parameters in place.  Idempotent until the next backward."""
        if self.paused:
            raise RuntimeError(
                f"{self.who}: optimizer.step() inside `zero.no_sync()`: the gradients were not "
                f"reduced; leave the block for the last micro-batch's backward"
            )
        if not self._dirty:
            if self._accumulated:
                raise RuntimeError(
                    f"{self.who}: every backward since the last step ran inside "
                    f"`zero.no_sync()`, so no gradient was reduced; run the last micro-batch's "
                    f"backward outside the block"
                )
            return
        stray = [p for p in self._all if p.grad is not None and id(p) not in self._tracked]
        if stray:
            raise RuntimeError(
                f"{self.who}: {len(stray)} parameter(s) have gradients but were frozen "
                f"(requires_grad=False) when the optimizer was sharded, so their gradients "
                f"are not reduced; set requires_grad before sharding the optimizer"
            )
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1
        rank = self.info.rank
        with torch.no_grad():
            for owner, params, packed, work in self._pending:
                work.wait()
                if owner != rank:
                    continue
                start = 0
                for p in params:
                    n = p.numel()
                    view = packed.narrow(0, start, n).view(p.shape)
                    start += n
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
        self._pending = []
        self._next = 0
        self._dirty = self._accumulated = False
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.launched = False
