"""Process-group checks and the bucketed parameter broadcast that follows every step.

After each rank stepped the parameters it owns, every owner sends them to the other
ranks.  The collectives are posted in the same order on every rank (owner by owner, bucket
by bucket) and asynchronously, so the transfers of different owners run at the same time
and the rank waits once.  Small tensors are coalesced into flat buckets (one collective
instead of one per tensor); a large tensor is sent on its own, in place, without a copy.
On gloo this uses ``broadcast``: on loopback it moves data several times faster than
gloo's ``all_gather`` (see ``docs/zero.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GroupInfo", "ParamBroadcast", "check_devices", "resolve_group"]


@dataclass(frozen=True)
class GroupInfo:
    """The process group a sharding communicates over, and this process's place in it."""

    group: Any
    rank: int
    world_size: int
    backend: str

    def global_rank(self, group_rank: int) -> int:
        """The default-group rank of ``group_rank`` (collectives take global ranks)."""
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return int(dist.get_global_rank(self.group, group_rank))


def resolve_group(process_group: Any, who: str) -> GroupInfo:
    """Check that torch.distributed is initialised and describe ``process_group``
    (``None``: the default group)."""
    if not dist.is_available():
        raise RuntimeError(f"{who} needs torch.distributed, which this build of torch lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who} needs an initialised torch.distributed process group and none is "
            f"initialised: call torch.distributed.init_process_group(...) before training "
            f"(torchrun sets the environment it reads; Lightning does it with strategy='ddp')"
        )
    group = dist.group.WORLD if process_group is None else process_group
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{who}: this process is not a member of process_group {group!r}")
    return GroupInfo(
        group=group,
        rank=rank,
        world_size=dist.get_world_size(group),
        backend=str(dist.get_backend(group)),
    )


def check_devices(
    params: Sequence[torch.Tensor], names: Sequence[str], info: GroupInfo, who: str
) -> None:
    """Every parameter must be on the one device the backend communicates from: the
    current CUDA device for NCCL, the CPU for gloo, one common device otherwise."""
    if not params:
        return
    backend = info.backend.lower()
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{who}: the process group uses NCCL but CUDA is not available")
        expected = torch.device("cuda", torch.cuda.current_device())
        why = "the NCCL backend communicates from the current CUDA device"
    elif backend == "gloo":
        expected = torch.device("cpu")
        why = "the gloo backend is used for CPU training here; use NCCL for CUDA tensors"
    else:
        expected = params[0].device
        why = f"all parameters must be on one device for the {info.backend!r} backend"
    index: int | None = expected.index  # None for a bare "cuda" device
    if expected.type == "cuda" and index is None:
        expected = torch.device("cuda", torch.cuda.current_device())
    wrong = [
        (name, p.device) for name, p in zip(names, params, strict=True) if p.device != expected
    ]
    if wrong:
        shown = ", ".join(f"{name} on {device}" for name, device in wrong[:5])
        more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        raise ValueError(
            f"{who}: parameters are not on the expected device {expected} ({why}): "
            f"{shown}{more}; move the model there before creating the optimizer"
        )


@dataclass
class _Bucket:
    src: int
    params: list[torch.Tensor]
    flat: torch.Tensor | None = None  # None: one contiguous tensor sent in place
    views: list[torch.Tensor] = field(default_factory=list)


def split_by_bytes(params: Sequence[torch.Tensor], chunks: int) -> list[list[torch.Tensor]]:
    """Split ``params`` (kept in order) into ``chunks`` runs of about equal bytes; some
    runs may be empty when there are fewer parameters than chunks."""
    total = sum(p.numel() * p.element_size() for p in params)
    out: list[list[torch.Tensor]] = [[] for _ in range(chunks)]
    done = 0
    for p in params:
        k = min(chunks - 1, (done * chunks) // total) if total else 0
        out[k].append(p)
        done += p.numel() * p.element_size()
    return out


class ParamBroadcast:
    """Send every owner's parameters to the other ranks, bucketed, in ``chunks`` stages.

    ``params`` are the parameters in global order and ``owners`` their ranks; only
    parameters for which ``mask`` is true are sent (frozen ones never change).  Each
    owner's parameters are split into ``chunks`` runs of about equal bytes; stage ``k``
    sends run ``k`` of every owner, so a rank can post stage ``k`` as soon as it has
    stepped its run ``k`` and step run ``k + 1`` while it travels.  Tensors of at least
    ``inplace_bytes`` go in place; smaller ones are coalesced up to ``bucket_bytes``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        owners: Sequence[int],
        mask: Sequence[bool],
        info: GroupInfo,
        *,
        bucket_bytes: int,
        inplace_bytes: int,
        chunks: int = 1,
    ) -> None:
        self.info = info
        self.chunks = chunks
        self.runs: list[list[list[torch.Tensor]]] = []  # [src][k] -> parameters
        self.stages: list[list[_Bucket]] = [[] for _ in range(chunks)]
        for src in range(info.world_size):
            mine = [p for p, o, m in zip(params, owners, mask, strict=True) if o == src and m]
            runs = split_by_bytes(mine, chunks)
            self.runs.append(runs)
            for k, run in enumerate(runs):
                self._plan(self.stages[k], src, run, bucket_bytes, inplace_bytes)
        self._works: list[Any] = []

    def _plan(
        self,
        stage: list[_Bucket],
        src: int,
        params: list[torch.Tensor],
        bucket_bytes: int,
        inplace_bytes: int,
    ) -> None:
        pending: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for p in params:
            nbytes = p.numel() * p.element_size()
            if nbytes >= inplace_bytes and p.is_contiguous():
                stage.append(_Bucket(src=src, params=[p]))
                continue
            key = (p.dtype, p.device)
            if sizes.get(key, 0) + nbytes > bucket_bytes and pending.get(key):
                self._coalesce(stage, src, pending.pop(key))
                sizes[key] = 0
            pending.setdefault(key, []).append(p)
            sizes[key] = sizes.get(key, 0) + nbytes
        for group in pending.values():
            self._coalesce(stage, src, group)

    @staticmethod
    def _coalesce(stage: list[_Bucket], src: int, params: list[torch.Tensor]) -> None:
        if len(params) == 1 and params[0].is_contiguous():
            stage.append(_Bucket(src=src, params=params))
            return
        total = sum(p.numel() for p in params)
        flat = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
        sizes = [p.numel() for p in params]
        views = [v.view(p.shape) for v, p in zip(flat.split(sizes), params, strict=True)]
        stage.append(_Bucket(src=src, params=params, flat=flat, views=views))

    @property
    def num_collectives(self) -> int:
        return sum(len(stage) for stage in self.stages)

    def post(self, k: int) -> None:
        """Post the broadcasts of stage ``k`` (this rank's run ``k`` must be stepped)."""
        info = self.info
        if info.world_size == 1:
            return
        with torch.no_grad():
            for bucket in self.stages[k]:
                if bucket.flat is None:
                    tensor = bucket.params[0].detach()
                else:
                    tensor = bucket.flat
                    if bucket.src == info.rank:
                        torch._foreach_copy_(bucket.views, [p.detach() for p in bucket.params])
                self._works.append(
                    dist.broadcast(
                        tensor, src=info.global_rank(bucket.src), group=info.group, async_op=True
                    )
                )

    def wait(self) -> None:
        """Wait for every posted broadcast and unpack the coalesced ones received."""
        works, self._works = self._works, []
        for work in works:
            work.wait()
        rank = self.info.rank
        with torch.no_grad():
            for stage in self.stages:
                for bucket in stage:
                    if bucket.flat is not None and bucket.src != rank:
                        torch._foreach_copy_([p.detach() for p in bucket.params], bucket.views)

    def run(self) -> None:
        """Every stage at once (when the step was not pipelined)."""
        for k in range(self.chunks):
            self.post(k)
        self.wait()
