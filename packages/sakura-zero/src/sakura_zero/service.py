"""The ZeRO1 and ZeRO2 services.

An optimizer is sharded (in place, see :mod:`sakura_zero.sharding`) as soon as the
service sees it:

* ``rt.prepare(model, optimizer)`` / ``rt.wrap_optimizer(optimizer)`` — raw loops that
  let the runtime prepare them, and Lightning (``LightningAdapter``'s precision plugin
  wraps every optimizer of the Trainer);
* ``OnTrainBegin`` — the reference quickstart's loop, which never calls ``rt.prepare``:
  ``adapter.on_train_begin(model, optimizer, train_loader)`` hands the service the loop's
  own optimizer.

Sharding the same optimizer twice is a no-op, so both flows together still step and
broadcast exactly once per ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from sakura import Service
from sakura.loop import LoopContext
from sakura_zero.comm import resolve_group
from sakura_zero.grads import DDPOwnerHook
from sakura_zero.partition import PARTITION_STRATEGIES
from sakura_zero.sharding import OptimizerSharding, check_optimizer

__all__ = ["ZeRO1", "ZeRO2"]

STATE_FORMAT = "sakura-zero/1"
_CHECKPOINT_MODES = ("consolidated", "none")


def _positive(option: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{option} must be a positive number (megabytes), got {value!r}")
    return float(value)


def _find_ddp(model: Any, loop: LoopContext | None = None) -> Any:
    """The DistributedDataParallel module driving ``model``: the model itself, or the
    module the loop runs forward on (``LoopContext.wrapped_model``: Lightning's DDP
    strategy wraps the LightningModule after the services saw it)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model
    wrapped = None
    if loop is not None and loop.wrapped_model is not None:
        wrapped = loop.wrapped_model()
    return wrapped if isinstance(wrapped, DistributedDataParallel) else None


def _first_dtensor(params: Iterable[Any]) -> str | None:
    """A description of the first DTensor among ``params`` (FSDP2's ``fully_shard`` turns
    every parameter it manages into one), or None."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without DTensor has no FSDP2
        return None
    for param in params:
        if isinstance(param, DTensor):
            return f"{tuple(param.shape)} {param.dtype} placed {list(param.placements)}"
    return None


def _refuse_fsdp2(who: str, what: str, params: Iterable[Any]) -> None:
    found = _first_dtensor(params)
    if found is not None:
        raise ValueError(
            f"{who} cannot shard {what} sharded by FSDP2 (fully_shard): its parameters are "
            f"DTensors (one is {found}), and FSDP2 already shards the parameters, the "
            f"gradients and the optimizer state across the ranks; remove the "
            f"{who.lower()} service and let FSDP2 shard alone, or use {who} with "
            f"DistributedDataParallel instead of fully_shard"
        )


class _ZeRO(Service):
    stage: ClassVar[int] = 1
    priority: float = 90

    def __init__(
        self,
        *,
        bucket_mb: float = 16.0,
        overlap_mb: float = 8.0,
        partition: str = "greedy",
        checkpoint: str | None = "consolidated",
        process_group: Any = None,
        priority: float | None = None,
    ) -> None:
        self.bucket_mb = _positive("bucket_mb", bucket_mb)
        if partition not in PARTITION_STRATEGIES:
            raise ValueError(
                f"partition must be one of {', '.join(map(repr, PARTITION_STRATEGIES))}, "
                f"got {partition!r}"
            )
        self.partition = partition
        if (
            isinstance(overlap_mb, bool)
            or not isinstance(overlap_mb, (int, float))
            or not math.isfinite(overlap_mb)
            or overlap_mb < 0
        ):
            raise ValueError(
                f"overlap_mb must be a number >= 0 (megabytes per run; 0 turns overlap off), "
                f"got {overlap_mb!r}"
            )
        self.overlap_mb = float(overlap_mb)
        if checkpoint is None:  # a spec string's "none" arrives as None
            checkpoint = "none"
        if checkpoint not in _CHECKPOINT_MODES:
            raise ValueError(
                f"checkpoint must be one of {', '.join(map(repr, _CHECKPOINT_MODES))} (or None), "
                f"got {checkpoint!r}"
            )
        self.checkpoint: str = checkpoint
        if process_group is not None and not isinstance(
            process_group, torch.distributed.ProcessGroup
        ):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None (the default "
                f"group), got {type(process_group).__name__}"
            )
        self.process_group = process_group
        if priority is not None:
            if (
                isinstance(priority, bool)
                or not isinstance(priority, (int, float))
                or not math.isfinite(priority)
            ):
                raise ValueError(f"priority must be a finite number, got {priority!r}")
            self.priority = priority
        self._shardings: list[OptimizerSharding] = []
        self._pending: list[Any] = []
        self._names: dict[int, str] = {}
        self._grad_bucket_mb = 25.0

    @property
    def _who(self) -> str:
        return type(self).__name__

    # --- public API -------------------------------------------------------------------

    @property
    def shardings(self) -> tuple[OptimizerSharding, ...]:
        """The optimizers sharded so far, in the order they were seen."""
        return tuple(self._shardings)

    def sharding(self, optimizer: Any) -> OptimizerSharding:
        """The sharding of ``optimizer`` (KeyError if this service has not sharded it)."""
        for sharding in self._shardings:
            if sharding.optimizer is optimizer:
                return sharding
        raise KeyError(
            f"{self._who}: this optimizer ({type(optimizer).__name__}) is not sharded by this "
            f"service; it is sharded by rt.prepare / rt.wrap_optimizer or at OnTrainBegin"
        )

    def shard(self, optimizer: Any) -> Any:
        """Shard ``optimizer`` in place (idempotent) and return it."""
        for sharding in self._shardings:
            if sharding.optimizer is optimizer:
                return optimizer
        check_optimizer(optimizer, self._who)
        _refuse_fsdp2(
            self._who,
            "an optimizer over a model",
            (p for group in optimizer.param_groups for p in group["params"]),
        )
        info = resolve_group(self.process_group, self._who)
        sharding = OptimizerSharding(
            optimizer,
            info,
            stage=self.stage,
            bucket_bytes=int(self.bucket_mb * 2**20),
            grad_bucket_bytes=int(self._grad_bucket_mb * 2**20),
            run_bytes=int(self.overlap_mb * 2**20),
            partition=self.partition,
            names=self._names,
            who=self._who,
        )
        self._shardings.append(sharding)
        self._on_new_sharding(sharding)
        index = len(self._shardings) - 1
        if index < len(self._pending) and self._pending[index] is not None:
            optimizer.load_state_dict(self._pending[index])
            self._pending[index] = None
        return optimizer

    def _on_new_sharding(self, sharding: OptimizerSharding) -> None:
        pass

    def save_sharded(self, directory: str | os.PathLike[str]) -> list[str]:
        """Every rank writes its shard of every sharded optimizer to ``directory``
        (``optimizer<i>.rankRRRRR-of-WWWWW.pt``); no communication.  Returns the paths."""
        return [
            s.save_sharded(directory, name=f"optimizer{i}") for i, s in enumerate(self._shardings)
        ]

    def load_sharded(self, directory: str | os.PathLike[str]) -> None:
        """Load shards written by :meth:`save_sharded` on any world size into the
        optimizers sharded so far (in the same order)."""
        if not self._shardings:
            raise RuntimeError(
                f"{self._who}: no optimizer is sharded yet; load after rt.prepare / "
                f"adapter.on_train_begin"
            )
        for i, sharding in enumerate(self._shardings):
            sharding.load_sharded(directory, name=f"optimizer{i}")

    def clip_grad_norm_(self, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip ``optimizer``'s gradients by their global norm across ranks (see
        :meth:`OptimizerSharding.clip_grad_norm_`); returns the total norm."""
        return self.sharding(optimizer).clip_grad_norm_(max_norm, norm_type)

    # --- coordinated calls -----------------------------------------------------------

    def _learn(self, model: Any) -> None:
        named = getattr(model, "named_parameters", None)
        if named is None:
            return
        _refuse_fsdp2(self._who, "a model", (p for _, p in named()))
        for name, p in named():
            self._names.setdefault(id(p), name)

    def wrap_model(self, model: Any) -> Any:
        self._learn(model)
        return model

    def wrap_optimizer(self, optimizer: Any) -> Any:
        return self.shard(optimizer)

    def on_train_begin(self, event: Any) -> None:
        if event.model is not None:
            self._learn(event.model)
        if event.optimizer is not None:
            self.shard(event.optimizer)

    # --- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """With ``checkpoint="consolidated"`` (the default) a collective: every sharded
        optimizer's full state, in the optimizer's own format, on rank 0 (``None`` on
        the other ranks).  Call ``rt.state_dict()`` on every rank and save rank 0's."""
        state: dict[str, Any] = {"format": STATE_FORMAT, "checkpoint": self.checkpoint}
        if self.checkpoint == "consolidated":
            optimizers: list[Any] = [s.consolidated_state_dict(0) for s in self._shardings]
            optimizers += self._pending[len(optimizers) :]
            state["optimizers"] = optimizers
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore optimizer states saved by :meth:`state_dict` on any world size; for
        optimizers not sharded yet, the state is applied when they are."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"{self._who}: not a sakura-zero service state (expected a mapping with "
                f"format={STATE_FORMAT!r}), got {type(state).__name__}"
            )
        optimizers = state.get("optimizers")
        if optimizers is None:
            return  # saved with checkpoint="none": the optimizer state lives elsewhere
        if any(entry is None for entry in optimizers):
            raise ValueError(
                f"{self._who}: this service state was saved on a rank other than 0 and has no "
                f"optimizer state; load the checkpoint written by rank 0"
            )
        pending: list[Any] = []
        for i, entry in enumerate(optimizers):
            if i < len(self._shardings):
                self._shardings[i].optimizer.load_state_dict(entry)
                pending.append(None)
            else:
                pending.append(entry)
        self._pending = pending


class ZeRO1(_ZeRO):
    """Optimizer-state sharding (ZeRO stage 1).

    Each rank keeps optimizer state for, and steps, only the parameters it owns (a
    partition balanced by size); every ``optimizer.step()`` then broadcasts the updated
    parameters from their owners, bucketed.  Gradients are left to DDP (all-reduced).
    Any per-parameter ``torch.optim`` optimizer works; results are bit-identical to the
    unsharded optimizer on the same gradients.

    Args:
        bucket_mb: small parameters are coalesced into buckets of at most this many
            megabytes for the broadcast; tensors of 256 KiB or more are sent in place.
        overlap_mb: step the shard in runs of about this many megabytes (at most 8 runs)
            and broadcast each run while the next one is stepped; the arithmetic is the
            same, so is the result.  0: step everything, then broadcast.
        partition: ``"greedy"`` (default for ZeRO1) — largest parameters first, each to
            the least loaded rank: the most even split; ``"contiguous"`` (default for
            ZeRO2) — consecutive runs of parameters: a little less even, but each owner's
            gradients are neighbours in DDP's buckets and are reduced without packing.
        checkpoint: ``"consolidated"`` — :meth:`state_dict` gathers every optimizer's full
            state on rank 0 (a collective); ``"none"`` (or None) — the service's state
            holds no optimizer state (Lightning already saves it, consolidated, through
            ``consolidate_state_dict``).
        process_group: the group to shard over (default: the default group).
        priority: service priority (default 90).
    """

    name = "zero1"
    stage = 1


class ZeRO2(_ZeRO):
    """Optimizer-state and gradient sharding (ZeRO stage 2).

    As :class:`ZeRO1`, and each gradient is reduced to its owner instead of all-reduced:
    under DDP through a communication hook (registered when the service sees the DDP
    module: ``rt.prepare``/``wrap_model``, ``OnTrainBegin``, or Lightning's DDP strategy);
    without DDP through gradient hooks that reduce in buckets during backward and free the
    gradients this rank does not own.  After the reduction a rank holds only its own
    gradients: clip with :meth:`clip_grad_norm_`, and accumulate micro-batches inside
    :meth:`no_sync` (without DDP).

    Args:
        grad_bucket_mb: bucket size, in megabytes, for the reduction during backward
            (without DDP; under DDP, DDP's ``bucket_cap_mb`` applies).
        bucket_mb, overlap_mb, partition, checkpoint, process_group, priority: as for
            :class:`ZeRO1` (``partition`` defaults to ``"contiguous"`` here).
    """

    name = "zero2"
    stage = 2

    def __init__(
        self,
        *,
        bucket_mb: float = 16.0,
        grad_bucket_mb: float = 25.0,
        overlap_mb: float = 8.0,
        partition: str = "contiguous",
        checkpoint: str | None = "consolidated",
        process_group: Any = None,
        priority: float | None = None,
    ) -> None:
        super().__init__(
            bucket_mb=bucket_mb,
            overlap_mb=overlap_mb,
            partition=partition,
            checkpoint=checkpoint,
            process_group=process_group,
            priority=priority,
        )
        self._grad_bucket_mb = _positive("grad_bucket_mb", grad_bucket_mb)
        self._ddp: Any = None
        self._hook: DDPOwnerHook | None = None

    @property
    def ddp_hook(self) -> DDPOwnerHook | None:
        """The communication hook registered on the DDP module, if any."""
        return self._hook

    def _owner_of(self, param: torch.Tensor) -> int | None:
        for sharding in self._shardings:
            owner = sharding.owner_of(param)
            if owner is not None:
                return owner
        return None

    def _version(self) -> int:
        return len(self._shardings) + sum(s.version for s in self._shardings)

    def _attach_ddp(self, ddp: Any) -> None:
        if self._ddp is ddp:
            return
        if self._ddp is not None:
            raise RuntimeError(
                f"{self._who}: already reducing gradients for another DistributedDataParallel "
                f"module; use one ZeRO2 service per DDP model"
            )
        info = resolve_group(self.process_group, self._who)
        ddp_group = getattr(ddp, "process_group", None)
        if ddp_group is not None:
            ddp_size = torch.distributed.get_world_size(ddp_group)
            if ddp_size != info.world_size:
                raise ValueError(
                    f"{self._who}: the DDP module communicates over {ddp_size} ranks but the "
                    f"service shards over {info.world_size}; pass process_group= to match"
                )
        hook = DDPOwnerHook(info, self._owner_of, self._version)
        try:
            ddp.register_comm_hook(None, hook.hook)
        except RuntimeError as exc:
            raise RuntimeError(
                f"{self._who} could not register its gradient communication hook on the DDP "
                f"module ({exc}); remove any other DDP comm hook (e.g. Lightning's "
                f"DDPStrategy(ddp_comm_hook=...))"
            ) from exc
        self._ddp, self._hook = ddp, hook
        for sharding in self._shardings:
            sharding.use_ddp()

    def _on_new_sharding(self, sharding: OptimizerSharding) -> None:
        if self._ddp is not None:
            sharding.use_ddp()

    def wrap_model(self, model: Any) -> Any:
        self._learn(model)
        ddp = _find_ddp(model)
        if ddp is not None:
            self._attach_ddp(ddp)
        return model

    def on_train_begin(self, event: Any) -> None:
        super().on_train_begin(event)
        if event.model is None:
            return
        ddp = _find_ddp(event.model, event.loop)
        if ddp is not None:
            self._attach_ddp(ddp)
        # Clipping the loop does itself, outside rt.clip_grad_norm_ (Lightning's
        # Trainer-level clipping, as its adapter publishes it).
        clip = event.loop.gradient_clipping if event.loop is not None else None
        if clip:
            # The loop clips over every parameter's gradient; under ZeRO-2 a rank holds
            # only its own, so the norm would be wrong on every rank.  An event handler's
            # exception is only logged, so the step refuses instead.
            message = (
                f"{self._who}: {clip} clips by a norm over all "
                f"gradients, but under ZeRO2 each rank holds only the gradients it owns, so "
                f"that norm would be wrong; use ZeRO1, or turn that clipping off and clip "
                f"with zero.clip_grad_norm_(optimizer, max_norm) before the optimizer step "
                f"(Lightning: in on_before_optimizer_step)"
            )
            for sharding in self._shardings:
                sharding.step_error = message

    def reduce_gradients(self, optimizer: Any = None) -> None:
        """Finish the gradient reduction now (owned gradients averaged, others None), for
        ``optimizer`` or every sharded optimizer; ``step`` does it anyway."""
        targets = self._shardings if optimizer is None else [self.sharding(optimizer)]
        for sharding in targets:
            sharding.reduce_gradients()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the gradient reduction in the block (gradient accumulation without DDP;
        under DDP use ``ddp_model.no_sync()``)."""
        with contextlib.ExitStack() as stack:
            for sharding in self._shardings:
                stack.enter_context(sharding.no_sync())
            yield
