"""In-place ZeRO sharding of one ``torch.optim`` optimizer.

The user's optimizer object stays the one everybody holds (the training loop, LR
schedulers, Lightning, a GradScaler); sharding only attaches hooks to it:

* step pre-hook: run the closure if one was passed (with every parameter visible, so
  clipping inside it sees all of them), finish ZeRO-2 gradient reduction, then point each
  param group's ``"params"`` at the parameters this rank owns;
* the optimizer's own ``step`` runs: it updates, and allocates state for, owned
  parameters only;
* step post-hook: put the full parameter lists back and broadcast the updated parameters
  from their owners (exactly once per ``optimizer.step()``, whichever flow called it);
* ``state_dict`` / ``load_state_dict`` hooks: consolidated state in the optimizer's own
  format; state of parameters another rank owns is dropped after a load.

Outside ``step`` the param groups are the user's: same dict objects, same lists, same
hyper-parameters, so schedulers, ``zero_grad`` and gradient clipping work unchanged.

Long file: one class whose hooks share a single invariant (the param groups hold the
full lists everywhere except between the step pre- and post-hook); split across files, a
reader would have to hold them all at once to check it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from sakura_zero.checkpoint import SHARD_FORMAT, atomic_save, find_shards, shard_path, to_cpu
from sakura_zero.comm import GroupInfo, ParamBroadcast, check_devices
from sakura_zero.grads import BackwardReducer
from sakura_zero.partition import PARTITION_STRATEGIES, Partition, contiguous_partition

__all__ = ["OptimizerSharding"]

_GLOBAL_STATE_OPTIMIZERS = ("LBFGS",)
_INPLACE_BYTES = 256 * 1024  # tensors at least this big are broadcast in place, not copied
_MAX_RUNS = 8  # overlap: at most this many runs per step


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return _nbytes(value)
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def check_optimizer(optimizer: Any, who: str) -> None:
    """Raise when ``optimizer`` cannot be sharded, saying why."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{who} shards torch.optim.Optimizer instances; got {type(optimizer).__name__}"
        )
    kind = type(optimizer).__name__
    if kind in _GLOBAL_STATE_OPTIMIZERS:
        raise ValueError(
            f"{who} cannot shard {kind}: it keeps one state for all parameters together "
            f"(a history of flattened updates) and re-evaluates its closure inside step; "
            f"ZeRO shards per-parameter optimizers (SGD, Adam, AdamW, RMSprop, ...)"
        )
    if hasattr(optimizer, "consolidate_state_dict"):
        raise ValueError(
            f"{who} cannot shard {kind}: it is already a sharded optimizer "
            f"(it has consolidate_state_dict); pass the plain torch.optim optimizer"
        )
    if not getattr(type(optimizer).step, "hooked", False):
        raise ValueError(
            f"{who} cannot shard {kind}: its step() is not wrapped by torch.optim.Optimizer "
            f"(did its __init__ skip super().__init__?), so step hooks would not run"
        )


def _take_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the closure passed to ``step`` now, and pass ``step`` one that returns its
    result: gradients then exist before the param groups are narrowed, and ``step`` still
    returns the loss."""
    if "closure" in kwargs:
        closure = kwargs["closure"]
    elif len(args) > 1:
        closure = args[1]
    else:
        return None
    if closure is None:
        return None
    with torch.enable_grad():
        loss = closure()

    def replay() -> Any:
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": replay}
    return (args[0], replay, *args[2:]), kwargs


class OptimizerSharding:
    """The ZeRO sharding of one optimizer (created by the ZeRO services).

    Each rank keeps optimizer state only for the parameters it owns (a size-balanced
    partition, :attr:`partition`) and steps only those; ``optimizer.step()`` then
    broadcasts them to every rank.  With ``stage=2`` gradients are also reduced to their
    owners only.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        info: GroupInfo,
        *,
        stage: int,
        bucket_bytes: int,
        grad_bucket_bytes: int,
        run_bytes: int = 8 * 2**20,
        partition: str = "greedy",
        names: Mapping[int, str] | None = None,
        who: str = "ZeRO",
    ) -> None:
        check_optimizer(optimizer, who)
        self.optimizer = optimizer
        self.info = info
        self.stage = stage
        self.who = who
        self._bucket_bytes = bucket_bytes
        self._grad_bucket_bytes = grad_bucket_bytes
        # Stepping the shard in runs, each broadcast while the next is stepped, needs the
        # optimizer's step without torch's hook wrapper around it.
        self._raw_step = getattr(type(optimizer).step, "__wrapped__", None)
        self._wrapper_code = getattr(type(optimizer).step, "__code__", None)
        self.run_bytes = run_bytes if self._raw_step is not None else 0
        """Overlap: the shard is stepped in runs of about this many bytes, each broadcast
        while the next is stepped (0: step everything, then broadcast)."""
        self._name_of = dict(names or {})
        if partition not in PARTITION_STRATEGIES:
            raise ValueError(
                f"partition must be one of {', '.join(map(repr, PARTITION_STRATEGIES))}, "
                f"got {partition!r}"
            )
        self._strategy = partition
        self._full: list[list[torch.Tensor]] = []
        self._lengths: list[int] = []
        self.params: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self.partition = Partition(owners=(), loads=(0,) * info.world_size)
        self._owned_lists: list[list[torch.Tensor]] = []
        self._add_groups([g["params"] for g in optimizer.param_groups])
        self._restricted = False
        self._internal = 0
        self._consolidated: dict[str, Any] | None = None
        self._consolidated_to: int | None = None
        self._state_checked = False
        self._broadcast: ParamBroadcast | None = None
        self._runs: list[list[list[torch.Tensor]]] = []  # [k][group] -> params stepped in run k
        self._mask: tuple[bool, ...] = ()
        self.version = 0
        self.steps = 0
        """How many ``optimizer.step()`` calls stepped and synchronised the shard."""
        self.step_error: str | None = None
        """When set, ``step`` raises RuntimeError with this message (a configuration the
        service found to be wrong, e.g. framework clipping over ZeRO-2 shards)."""
        self.grad_mode: str | None = None
        """ZeRO-2 only: ``"hooks"`` (this package reduces gradients during backward) or
        ``"ddp"`` (a DDP communication hook does)."""
        self._reducer: BackwardReducer | None = None
        if stage == 2:
            self._use_backward_hooks()
        self._drop_foreign_state()
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_state_dict_pre_hook(self._before_state_dict),
            optimizer.register_state_dict_post_hook(self._after_state_dict),
            optimizer.register_load_state_dict_pre_hook(self._before_load),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]
        # Lightning's strategies (and anything that supports ZeroRedundancyOptimizer)
        # call this on every rank before asking rank 0 for the state dict.
        optimizer.consolidate_state_dict = self.consolidate_state_dict  # type: ignore[attr-defined]

    # --- structure --------------------------------------------------------------------

    def _add_groups(self, lists: Sequence[list[torch.Tensor]]) -> None:
        new = [p for lst in lists for p in lst]
        start = len(self.params)
        names = [self._name_of.get(id(p), f"param[{start + i}]") for i, p in enumerate(new)]
        check_devices(new, names, self.info, self.who)
        for lst in lists:
            self._full.append(lst)
            self._lengths.append(len(lst))
        for i, p in enumerate(new):
            self._index[id(p)] = start + i
        sizes = [_nbytes(p) for p in new]
        if not self.params and self._strategy == "contiguous":
            self.partition = contiguous_partition(sizes, self.info.world_size)
        else:  # the first groups with "greedy", and groups added later with either
            self.partition = self.partition.extended(sizes)
        self.params.extend(new)
        rank = self.info.rank
        owners = self.partition.owners
        self._owned_lists = [
            [p for p in lst if owners[self._index[id(p)]] == rank] for lst in self._full
        ]

    def _refresh(self) -> None:
        """Notice param groups added since sharding (``add_param_group``)."""
        groups = self.optimizer.param_groups
        n = len(self._full)
        same = len(groups) >= n and all(
            groups[i]["params"] is self._full[i] and len(self._full[i]) == self._lengths[i]
            for i in range(n)
        )
        if not same:
            raise RuntimeError(
                f"{self.who}: the optimizer's param groups changed after it was sharded "
                f"(a group was removed, or a group's 'params' list was replaced or edited); "
                f"only optimizer.add_param_group() is supported"
            )
        if len(groups) == n:
            return
        self._add_groups([g["params"] for g in groups[n:]])
        self._broadcast = None
        self.version += 1
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None
            self._use_backward_hooks()

    def owner(self, param: torch.Tensor) -> int:
        """The rank that owns ``param`` (KeyError if the optimizer does not hold it)."""
        return self.partition.owners[self._index[id(param)]]

    def owner_of(self, param: torch.Tensor) -> int | None:
        index = self._index.get(id(param))
        return None if index is None else self.partition.owners[index]

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank steps and keeps state for."""
        return [p for lst in self._owned_lists for p in lst]

    @property
    def imbalance(self) -> float:
        """See :attr:`Partition.imbalance`."""
        return self.partition.imbalance

    def state_bytes(self) -> int:
        """Bytes of optimizer-state tensors held on this rank."""
        return sum(_tensor_bytes(s) for s in self.optimizer.state.values())

    # --- step -------------------------------------------------------------------------

    def _narrow(self, lists: Sequence[list[torch.Tensor]]) -> None:
        for group, params in zip(self.optimizer.param_groups, lists, strict=True):
            group["params"] = params
        self._restricted = True

    def _restore(self) -> None:
        if not self._restricted:
            return
        for group, full in zip(self.optimizer.param_groups, self._full, strict=True):
            group["params"] = full
        self._restricted = False

    def _plan(self) -> ParamBroadcast:
        """The broadcast plan and the runs this rank steps, rebuilt when parameters were
        added or their ``requires_grad`` changed."""
        mask = tuple(p.requires_grad for p in self.params)
        if self._broadcast is not None and mask == self._mask:
            return self._broadcast
        chunks = 1
        if self.run_bytes > 0 and self.info.world_size > 1:
            chunks = max(1, min(_MAX_RUNS, max(self.partition.loads) // self.run_bytes))
        plan = ParamBroadcast(
            self.params,
            self.partition.owners,
            mask,
            self.info,
            bucket_bytes=self._bucket_bytes,
            inplace_bytes=min(self._bucket_bytes, _INPLACE_BYTES),
            chunks=chunks,
        )
        mine = plan.runs[self.info.rank]
        run_of = {id(p): k for k, run in enumerate(mine) for p in run}
        last = chunks - 1
        self._runs = [
            [[p for p in owned if run_of.get(id(p), last) == k] for owned in self._owned_lists]
            for k in range(chunks)
        ]
        self._broadcast, self._mask = plan, mask
        return plan

    def _nested(self) -> bool:
        """True inside a step called from within this optimizer's own step.

        torch wraps every optimizer class's ``step`` with the hook runner, so a subclass
        whose ``step`` calls ``super().step()`` runs the hooks twice; only the outermost
        call may narrow, step and broadcast.  Found by counting the hook-runner frames of
        this optimizer on the stack (robust to a previous step that raised, unlike a flag).
        """
        code = self._wrapper_code
        depth = 0
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_code is code and frame.f_locals.get("self") is self.optimizer:
                depth += 1
                if depth > 1:
                    return True
            frame = frame.f_back
        return False

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if self._nested():
            return None
        self._restore()  # a previous step that raised may have left them narrowed
        if self.step_error is not None:
            raise RuntimeError(self.step_error)
        replaced = _take_closure(args, kwargs)
        self._refresh()
        if self.stage == 2:
            self.reduce_gradients()
        plan = self._plan()
        if plan.chunks > 1:
            step_args, step_kwargs = replaced if replaced is not None else (args, kwargs)
            for k in range(plan.chunks - 1):
                self._narrow(self._runs[k])
                self._raw_step(*step_args, **step_kwargs)  # type: ignore[misc]
                plan.post(k)
        self._narrow(self._runs[-1])
        return replaced

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._nested():
            return
        self._restore()
        self._consolidated = self._consolidated_to = None
        plan = self._broadcast if self._broadcast is not None else self._plan()
        plan.post(plan.chunks - 1)
        plan.wait()
        self.steps += 1
        if not self._state_checked:
            self._check_state()

    def _check_state(self) -> None:
        """After the first step: the optimizer must have touched only the parameters it
        was given.  Agreed across ranks (one tiny all-reduce, once), so every rank raises
        together instead of one rank leaving the others waiting in a collective."""
        rank = self.info.rank
        foreign = sum(1 for p in self.optimizer.state if self.owner_of(p) != rank)
        if self.info.world_size > 1:
            count = torch.tensor([foreign], dtype=torch.long, device=self._comm_device())
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.info.group)
            foreign = int(count.item())
        if foreign:
            raise TypeError(
                f"{self.who}: {type(self.optimizer).__name__} kept state for {foreign} "
                f"entr{'y' if foreign == 1 else 'ies'} outside the parameters it was asked to "
                f"step, so its update is not per-parameter and it cannot be sharded"
            )
        self._state_checked = True

    def _comm_device(self) -> torch.device:
        if self.info.backend.lower() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _drop_foreign_state(self) -> None:
        rank = self.info.rank
        for p in list(self.optimizer.state):
            if self.owner_of(p) != rank:
                del self.optimizer.state[p]

    # --- ZeRO-2 gradients ---------------------------------------------------------------

    def _use_backward_hooks(self) -> None:
        self.grad_mode = "hooks"
        self._reducer = BackwardReducer(
            self.params, self.partition.owners, self.info, self._grad_bucket_bytes, self.who
        )

    def use_ddp(self) -> None:
        """Gradients are reduced by a DDP communication hook: drop the backward hooks."""
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None
        self.grad_mode = "ddp"

    def reduce_gradients(self) -> None:
        """ZeRO-2: make the gradients final: owned parameters hold their averaged
        gradient, the others ``None``.  Called by ``step``; call it yourself before
        reading gradients between backward and step.  A no-op for ZeRO-1."""
        if self.stage != 2:
            return
        if self._reducer is not None:
            self._reducer.finish()
            return
        rank = self.info.rank
        owners = self.partition.owners
        for i, p in enumerate(self.params):
            if owners[i] != rank:
                p.grad = None  # DDP left this rank's unreduced share here

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """ZeRO-2 without DDP: accumulate gradients locally inside the block."""
        if self._reducer is None:
            yield
            return
        with self._reducer.no_sync():
            yield

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip gradients by their global norm, computed across ranks from the owned
        shards (each gradient counted once).  Needed with ZeRO-2, where a rank only holds
        its own gradients; with ZeRO-1 ``torch.nn.utils.clip_grad_norm_`` over all
        parameters works as well (every rank holds every gradient)."""
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        norm_type = float(norm_type)
        if not (norm_type > 0):
            raise ValueError(f"norm_type must be positive or inf, got {norm_type!r}")
        self.reduce_gradients()
        owned = [p.grad for p in self.owned_parameters() if p.grad is not None]
        device = self.params[0].device if self.params else torch.device("cpu")
        if owned:
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type).float() for g in owned])
            local = norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()
        else:
            local = torch.zeros((), device=device)
        local = local.to(device=device, dtype=torch.float32)
        if self.info.world_size > 1:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(local, op=op, group=self.info.group)
        total = local if math.isinf(norm_type) else local ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total gradient norm is not finite: {float(total)}")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    # --- state dicts ------------------------------------------------------------------

    def _local_state_dict(self) -> dict[str, Any]:
        self._internal += 1
        try:
            return self.optimizer.state_dict()
        finally:
            self._internal -= 1

    def _before_state_dict(self, optimizer: Any) -> None:
        self._restore()

    def _after_state_dict(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any] | None:
        if self._internal or self.info.world_size == 1:
            return None
        if self._consolidated is not None:
            return self._consolidated
        where = (
            f"it was consolidated on rank {self._consolidated_to}, not on this rank "
            f"{self.info.rank}"
            if self._consolidated_to is not None
            else "it has not been consolidated since the last step"
        )
        raise RuntimeError(
            f"{self.who}: this optimizer is sharded, so its state_dict() would hold only "
            f"this rank's shard, and {where}. Call optimizer.consolidate_state_dict(to=0) on "
            f"every rank first (then state_dict() on rank 0), or use the ZeRO service's "
            f"state_dict() / save_sharded()"
        )

    def _before_load(self, optimizer: Any, state: Any) -> None:
        self._restore()
        if isinstance(state, Mapping) and state.get("format") == SHARD_FORMAT:
            raise ValueError(
                f"{self.who}: this is one rank's shard (rank {state.get('rank')} of "
                f"{state.get('world_size')}), not a full optimizer state; load every shard "
                f"with load_sharded(directory) or load_sharded_state_dicts([...])"
            )

    def _after_load(self, optimizer: Any) -> None:
        self._refresh()
        self._drop_foreign_state()
        self._consolidated = self._consolidated_to = None
        self._state_checked = False

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on rank ``to`` (a collective: call it on every
        rank).  Afterwards ``optimizer.state_dict()`` on rank ``to`` returns it, in the
        optimizer's own format, until the next step."""
        info = self.info
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < info.world_size:
            raise ValueError(f"to must be a rank in [0, {info.world_size}), got {to!r}")
        local = self._local_state_dict()
        if info.world_size == 1:
            self._consolidated, self._consolidated_to = local, to
            return
        parts: list[Any] | None = [None] * info.world_size if info.rank == to else None
        dist.gather_object(
            to_cpu(local["state"]), parts, dst=info.global_rank(to), group=info.group
        )
        self._consolidated_to = to
        if parts is None:
            self._consolidated = None
            return
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(part)
        self._consolidated = {
            "state": {k: merged[k] for k in sorted(merged)},
            "param_groups": local["param_groups"],
        }

    def consolidated_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """Collective: the full state dict on rank ``to`` (the optimizer's own format,
        loadable by the unsharded optimizer or by a sharding on any world size), None on
        the other ranks.  Reuses a consolidation made since the last step (Lightning
        consolidates before it asks the callbacks for their state)."""
        if self._consolidated_to != to:
            self.consolidate_state_dict(to)
        return self._consolidated if self.info.rank == to else None

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard: its entries of the full state dict (under ``"shard_state"``,
        so that a plain optimizer refuses it instead of loading a fraction) plus a header.
        Not a collective.  Every rank's shard together loads on any world size."""
        local = self._local_state_dict()
        return {
            "format": SHARD_FORMAT,
            "rank": self.info.rank,
            "world_size": self.info.world_size,
            "optimizer": type(self.optimizer).__name__,
            "group_sizes": list(self._lengths),
            "shard_state": local["state"],
            "param_groups": local["param_groups"],
        }

    def load_sharded_state_dicts(self, shards: Sequence[Mapping[str, Any]]) -> None:
        """Load the shards of every rank of a previous run (any world size): this rank
        keeps the entries of the parameters it owns now."""
        if not shards:
            raise ValueError("load_sharded_state_dicts needs at least one shard")
        world = shards[0].get("world_size")
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"{self.who}: shard header has no valid world_size ({world!r})")
        for shard in shards:
            if not isinstance(shard, Mapping) or shard.get("format") != SHARD_FORMAT:
                raise ValueError(
                    f"{self.who}: not a sakura-zero shard (format {SHARD_FORMAT!r} expected)"
                )
            if shard.get("world_size") != world:
                raise ValueError(f"{self.who}: shards from different world sizes")
            if list(shard.get("group_sizes", [])) != self._lengths:
                raise ValueError(
                    f"{self.who}: the shards describe param groups of sizes "
                    f"{shard.get('group_sizes')} but this optimizer has {self._lengths}"
                )
            if shard.get("optimizer") != type(self.optimizer).__name__:
                raise ValueError(
                    f"{self.who}: the shards were saved from {shard.get('optimizer')}, this "
                    f"optimizer is {type(self.optimizer).__name__}"
                )
        ranks = sorted(int(s["rank"]) for s in shards)
        if ranks != list(range(world)):
            raise ValueError(f"{self.who}: need the shards of ranks 0..{world - 1}, got {ranks}")
        rank = self.info.rank
        owners = self.partition.owners
        state: dict[int, Any] = {}
        for shard in shards:
            for index, entry in shard["shard_state"].items():
                if owners[int(index)] == rank:
                    state[int(index)] = {
                        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()
                    }
        self.optimizer.load_state_dict(
            {"state": state, "param_groups": list(shards[0]["param_groups"])}
        )

    def save_sharded(self, directory: str | os.PathLike[str], name: str = "optimizer") -> str:
        """Write this rank's shard to ``directory/<name>.rankRRRRR-of-WWWWW.pt`` atomically
        (every rank calls it; no communication).  Returns the path."""
        path = shard_path(directory, name, self.info.rank, self.info.world_size)
        atomic_save(to_cpu(self.sharded_state_dict()), path)
        return str(path)

    def load_sharded(self, directory: str | os.PathLike[str], name: str = "optimizer") -> None:
        """Load a complete set of shards written by :meth:`save_sharded` on any world
        size; each file is memory-mapped, and only owned entries are copied."""
        shards = [torch.load(p, weights_only=True, mmap=True) for p in find_shards(directory, name)]
        self.load_sharded_state_dicts(shards)

    # --- teardown ---------------------------------------------------------------------

    def detach(self) -> None:
        """Remove every hook (the optimizer then steps all parameters again, with state
        only for the ones this rank owned)."""
        self._restore()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None
        with contextlib.suppress(AttributeError):
            del self.optimizer.consolidate_state_dict  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return (
            f"<OptimizerSharding {type(self.optimizer).__name__} stage={self.stage} "
            f"rank={self.info.rank}/{self.info.world_size} params={len(self.params)} "
            f"owned={len(self.owned_parameters())} imbalance={self.imbalance:.3f}>"
        )
