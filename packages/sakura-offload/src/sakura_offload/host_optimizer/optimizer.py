"""OffloadAdamW: AdamW with its moments and fp32 master weights in host RAM, updated by the
C++ kernel, pure torch or the CUDA kernel (see :mod:`.backends`).

Design (master copies, where a CUDA parameter's update runs, the backward-pass count):
``docs/offload.md``, "Host AdamW: design".

Long file: one torch.optim.Optimizer subclass whose step, backward-time bookkeeping (eager
updates, accumulation), batched host updates, device paths and state-dict plumbing share
its state; the parts that stand alone are already in the sibling modules.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch

from sakura.options import check_int
from sakura_offload.host_optimizer import moments as fmt
from sakura_offload.host_optimizer.backends import (
    Backend,
    CudaBackend,
    Hyper,
    Update,
    resolve_backend,
)
from sakura_offload.host_optimizer.device_stream import CudaTransfer, DeviceTransfer, HostPipeline
from sakura_offload.host_optimizer.event_wait import EventWait
from sakura_offload.host_optimizer.options import check_group, check_optimizer_options
from sakura_offload.host_optimizer.placement import distributed, place, state_bytes
from sakura_offload.host_optimizer.shards import local, total_norm
from sakura_offload.host_optimizer.state_layout import INT8_KEYS as _INT8_KEYS
from sakura_offload.host_optimizer.state_layout import (
    export_hook,
    import_state,
    is_direct,
    match_saved,
    new_state,
)

__all__ = ["OffloadAdamW", "resolve_backend"]

_LOG = logging.getLogger("sakura_offload.host_optimizer")

BATCH_COPY_BYTES = 64 << 20
"""A step's gathered host updates run once the fp32 copies of their gradients (made for
gradients that are not already fp32 host tensors, e.g. bf16 or on a GPU) reach this many
bytes: batching must not hold a copy of every gradient at once."""


def _pinned(state: dict[str, Any]) -> list[torch.Tensor]:
    """Page-lock the state's host tensors in place (the CUDA kernel reads and writes them
    through their host addresses; a new state, or one loaded from a state dict, is
    pageable); the tensors it pinned."""
    pinned = []
    for key, value in state.items():
        if key != "step" and isinstance(value, torch.Tensor) and not value.is_pinned():
            state[key] = value.pin_memory()
            pinned.append(state[key])
    return pinned


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one dimension (a view; ``t`` itself when it has one already, which saves a
    call per tensor per step)."""
    return t if t.dim() == 1 else t.view(-1)


def _update_of(flat: torch.Tensor, g: torch.Tensor, state: dict[str, Any], h: Hyper) -> Update:
    """The flat tensors of one update (weights or master ``flat``, gradient ``g``)."""
    if "exp_avg_codes" in state:
        codes, absmax, s_codes, s_absmax = (state[k] for k in _INT8_KEYS)
        return Update(flat, g, codes, s_codes, h, absmax, s_absmax)
    return Update(flat, g, _flat(state["exp_avg"]), _flat(state["exp_avg_sq"]), h)


def _grad_hook(ref: weakref.ReferenceType[OffloadAdamW]) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._grad_landed(param)

    return hook


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as :class:`torch.optim.AdamW`) whose moments and fp32
    master weights live in host RAM and whose update runs in a vectorised, multi-threaded
    C++ kernel.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr, betas, eps, weight_decay: as :class:`torch.optim.AdamW` (per group).
        moment_dtype: ``"float32"``/``"fp32"``/``torch.float32`` (exact AdamW),
            ``"bfloat16"``/``"bf16"``/``torch.bfloat16`` (stochastic rounding; 4 bytes per
            parameter instead of 8) or ``"int8"``/``"8bit"`` (blockwise 8-bit, 2 bytes per
            parameter plus one fp32 absmax per 256 values; see :mod:`sakura_offload.host_optimizer.moments`),
            or ``"auto"``: float32 unless the moments and master weights would not fit in
            ``host_budget``, then bfloat16, then int8 (``moment_dtype_reason`` says why;
            logged once).
        max_grad_norm: clip the total 2-norm of all gradients to this (the result of
            ``torch.nn.utils.clip_grad_norm_`` followed by AdamW; the gradients themselves are
            left unchanged); ``last_grad_norm`` holds the norm measured.
        accumulation_steps: backward passes per ``step()``; one more before ``step()``,
            ``zero_grad()`` or ``skip_step()`` raises (see :meth:`set_accumulation_steps`).
        eager: update each tensor during backward as soon as its last gradient of the step
            lands.  ``None``: on unless ``max_grad_norm`` is set or a process group of
            several ranks averages the gradients after backward (``eager_reason`` says
            which).  A loop that changes a gradient after its eager update (clipping it
            itself, unscaling a loss scaler's gradients) gets an error at ``step()``: pass
            ``max_grad_norm`` here, or ``eager=False``; a skipped step (``skip_step()``)
            after eager updates is an error too (they cannot be taken back).
        backend: ``"auto"`` (C++ kernel, pure torch if it cannot be built), ``"cpp"``,
            ``"torch"``, or ``"cuda"``: parameters on a CUDA device are updated there by the
            CUDA kernel, their moments and master weights staying in page-locked host RAM
            (compiled with nvcc on first use; untested on a GPU so far).
        seed: seed of the stochastic-rounding streams (bf16 and int8 moments).
        pin_moments: page-lock the moments and master weights in host RAM (faster copies
            to and from a GPU).  ``None``: pinned unless that would lock more than 40 % of
            RAM; without CUDA nothing can be pinned, so ``None`` means unpinned and
            ``True`` raises.  Parameters the CUDA kernel updates are always pinned.
        host_budget: bytes (or a size string, ``"8GiB"``) of host RAM the moments and
            master weights may take, for ``moment_dtype="auto"``; default: the RAM
            available less a floor of 10 % of physical RAM (at least 4 GiB).

    :meth:`stats` reports where the state lives and what the optimizer did;
    :meth:`synchronize` waits for every queued update.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        moment_dtype: Any = "float32",
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        eager: bool | None = None,
        backend: str = "auto",
        seed: int = 0,
        pin_moments: bool | None = None,
        host_budget: int | str | None = None,
    ) -> None:
        options = check_optimizer_options(
            moment_dtype=moment_dtype,
            max_grad_norm=max_grad_norm,
            accumulation_steps=accumulation_steps,
            eager=eager,
            backend=backend,
            seed=seed,
            pin_moments=pin_moments,
            host_budget=host_budget,
        )
        self.moment_dtype: str = options["moment_dtype"]
        """The moment format in use (``"auto"`` is resolved when the optimizer is built)."""
        self.moment_dtype_reason: str = f"moment_dtype={moment_dtype!r}"
        """Why that format: the option as given, or ``"auto"``'s decision."""
        self.max_grad_norm: float | None = options["max_grad_norm"]
        self.accumulation_steps: int = options["accumulation_steps"]
        self._accumulation_advice = (
            "create the optimizer with accumulation_steps=<backward passes per step>"
        )
        self.seed: int = options["seed"]
        self.last_grad_norm: float | None = None
        self._hooks: list[Any] = []
        self._index: dict[torch.Tensor, int] = {}
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        self._counts: dict[torch.Tensor, int] = {}
        self._updated: set[torch.Tensor] = set()
        self._replaced: list[weakref.ReferenceType[torch.optim.Optimizer]] = []
        self._eager_grads: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}
        self._steps = 0
        self._kernel_s = 0.0
        self._kernel_lock = threading.Lock()
        self._moved = [0, 0]  # bytes device -> host, host -> device since the last step()
        self._last_moved = (0, 0)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "maximize": False,
        }
        check_group(dict(defaults))
        super().__init__(params, defaults)
        self.backend: Backend = resolve_backend(options["backend"])
        self._place(options, eager)
        self._devices: set[torch.device] = set()  # with CUDA updates not yet waited for
        # Host updates of CUDA parameters: side-stream copies, a worker thread, event waits
        # (SAKURA_OFFLOAD_EVENT_*, read and checked now).
        self.event_wait = EventWait.from_env()
        self._transfer: DeviceTransfer | None = (
            CudaTransfer() if torch.cuda.is_available() else None
        )
        self._pipeline: HostPipeline | None = None
        self._grad_buffers: dict[torch.Tensor, torch.Tensor] = {}
        # The export to torch.optim.AdamW's layout is the first state-dict post-hook, so
        # hooks registered later (sakura-zero's consolidation, which may hand back the whole
        # gathered state instead) see AdamW's layout, never the packed moments.
        self.register_state_dict_post_hook(export_hook, prepend=True)

    # --- construction -------------------------------------------------------------------

    def _place(self, options: dict[str, Any], eager: bool | None) -> None:
        """Decide the moment format (``"auto"``), the pinning and eager updates (see
        :mod:`sakura_offload.host_optimizer.placement`)."""
        params = self._params()
        masters = sum(4 * p.numel() for p in params if self._needs_master(p))
        placed = place(
            sum(p.numel() for p in params),
            masters,
            moment_dtype=self.moment_dtype,
            host_budget=options["host_budget"],
            pin_moments=options["pin_moments"],
            eager=eager,
            max_grad_norm=self.max_grad_norm,
            distributed=distributed(),
        )
        self.host_budget: int = placed.host_budget
        """The host-RAM budget ``moment_dtype="auto"`` decided against, in bytes."""
        if self.moment_dtype == "auto":  # (otherwise the reason is the option as given)
            self.moment_dtype, self.moment_dtype_reason = placed.moment_dtype.astuple()
            _LOG.info("OffloadAdamW: moment_dtype=%s (%s)", *placed.moment_dtype.astuple())
        self.pin_moments: bool = placed.pin.value
        """Whether the moments and master weights are page-locked."""
        self.pin_reason: str = placed.pin.reason
        self.eager: bool = placed.eager.value
        """Whether tensors are updated during backward, as their last gradient lands."""
        self.eager_reason: str = placed.eager.reason

    def _needs_master(self, p: torch.Tensor) -> bool:
        """True when ``p``'s update runs on an fp32 master copy in host RAM."""
        if self._on_device(p):
            return not (p.dtype == torch.float32 and p.is_contiguous())
        return not is_direct(p)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **options: Any) -> OffloadAdamW:
        """An OffloadAdamW that takes over ``optimizer`` (a :class:`torch.optim.AdamW`, or a
        :class:`torch.optim.Adam` without weight decay): the same param-group dicts (so LR
        schedulers built on ``optimizer`` keep working), its hyper-parameters and its state
        (moved to host RAM, in ``moment_dtype``).  ``optimizer``'s own state is released."""
        if isinstance(optimizer, OffloadAdamW):
            return optimizer
        decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
            g.get("decoupled_weight_decay", False) for g in optimizer.param_groups
        )
        if not isinstance(optimizer, torch.optim.Adam) or (
            not decoupled and any(g.get("weight_decay", 0) for g in optimizer.param_groups)
        ):
            raise TypeError(
                "OffloadAdamW.from_optimizer takes a torch.optim.AdamW (or an Adam without "
                f"weight decay, which is the same update); got {type(optimizer).__name__}"
            )
        saved = optimizer.state_dict()
        groups = optimizer.param_groups
        offload = cls(groups, **options)
        offload.load_state_dict(saved)
        optimizer.state.clear()
        offload._replaced.append(weakref.ref(optimizer))
        return offload

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_group(group)
        for p in group["params"]:
            if p.is_complex():
                raise TypeError("OffloadAdamW does not support complex parameters")
            if not p.is_floating_point():
                raise TypeError(f"OffloadAdamW needs floating-point parameters, got {p.dtype}")
            self._index[p] = len(self._index)
            self._group_of[p] = group
            if p.requires_grad:
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(_grad_hook(weakref.ref(self)))
                )

    def detach(self) -> None:
        """Remove the gradient hooks (backward passes are no longer counted, eager updates
        stop).  The optimizer still steps."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # --- backward-time bookkeeping ------------------------------------------------------

    def set_accumulation_steps(self, steps: int, *, advice: str | None = None) -> None:
        """Set the backward passes per ``step()`` after construction: what a framework is
        configured for, which the ``offload_adamw`` service reads when training starts
        (``OnTrainBegin.accumulation_steps``).  ``advice`` replaces the error's last clause
        (what to do about a surplus backward pass) for whoever set the count."""
        self.accumulation_steps = check_int(
            "accumulation_steps", steps, minimum=1, owner="OffloadAdamW.set_accumulation_steps"
        )
        if advice is not None:
            self._accumulation_advice = advice

    def _grad_landed(self, p: torch.Tensor) -> None:
        count = self._counts.get(p, 0) + 1
        self._counts[p] = count
        if count > self.accumulation_steps:
            n = self.accumulation_steps
            raise RuntimeError(
                f"OffloadAdamW: backward pass {count} reached a parameter since the last "
                f"step(), but accumulation_steps={n}; call step() (or zero_grad(), or "
                f"skip_step() when a step is skipped) after every {n} backward pass(es), "
                f"or {self._accumulation_advice}"
            )
        if self.eager and count == self.accumulation_steps:
            with torch.no_grad():
                self._update(p, self._group_of[p], 1.0)
            self._updated.add(p)
            if p.grad is not None:
                self._eager_grads[p] = (p.grad, p.grad._version)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wait_for_devices()  # no gradient is zeroed while a copy of it is queued
        super().zero_grad(set_to_none)
        self._counts.clear()
        self._updated.clear()
        self._eager_grads.clear()

    def skip_step(self) -> None:
        """End this step without updating: the backward passes counted since the last
        ``step()`` start over, as after a step (the gradients are left alone).  For a step
        that is not taken, e.g. skipped by a loss scaler for inf/NaN gradients, in a loop
        that then zeroes the gradients without this optimizer (``model.zero_grad()``, as the
        Hugging Face Trainer does); the ``offload_adamw`` service calls it on
        ``OnOptimizerStep(skipped=True)``.

        Raises after eager updates of this step (they cannot be taken back): create the
        optimizer with ``eager=False`` for a loop that skips steps."""
        self._wait_for_devices()
        updated = len(self._updated)
        self._counts.clear()
        self._updated.clear()
        self._eager_grads.clear()
        if updated:
            raise RuntimeError(
                f"OffloadAdamW.skip_step: {updated} tensor(s) were already updated eagerly "
                "during backward and cannot be taken back; a loop that skips steps (a loss "
                "scaler's inf/NaN steps) needs OffloadAdamW(..., eager=False)"
            )

    # --- the step -----------------------------------------------------------------------

    def _clip_coefficient(self) -> float:
        grads = [
            p.grad for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        if not grads or self.max_grad_norm is None:
            return 1.0
        # Over FSDP2 shards: the norm of every rank's shards together (one all-reduce).
        total = total_norm([g.detach() for g in grads])
        self.last_grad_norm = float(total)
        coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        return float(coef)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step for every parameter that has a gradient and was not already
        updated eagerly during backward."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_eager_grads()
        scale = self._clip_coefficient()
        # The host updates are gathered and run as one batch (one kernel call, its threads
        # shared by all tensors: small tensors no longer cost a call and a parallel region
        # each); the others (CUDA kernel, host pipeline) are started as they come.
        batch: list[tuple[torch.Tensor, torch.Tensor | None, Update]] = []
        copies = 0  # bytes of gradient copies the batch holds
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p in self._updated:
                    continue
                held = len(batch)
                self._update(p, group, scale, batch)
                if len(batch) > held and batch[-1][2].g.data_ptr() != local(p.grad).data_ptr():
                    copies += batch[-1][2].g.numel() * 4
                    if copies >= BATCH_COPY_BYTES:
                        self._run_batch(batch)
                        batch, copies = [], 0
        self._run_batch(batch)
        self._counts.clear()
        self._updated.clear()
        self._eager_grads.clear()
        self._steps += 1
        for ref in self._replaced:
            # LR schedulers built on the optimizer this one replaced check that it stepped
            # (torch's private flag); it did, through this one.
            replaced = ref()
            if replaced is not None:
                replaced._opt_called = True  # type: ignore[attr-defined]
        self._wait_for_devices()
        self._last_moved = (self._moved[0], self._moved[1])
        self._moved = [0, 0]
        return loss

    def _check_eager_grads(self) -> None:
        """Raise when a gradient changed after its eager update (clipped or unscaled in
        place, or replaced): the update already used the old one."""
        for p, (grad, version) in self._eager_grads.items():
            if p.grad is not grad or grad._version != version:
                self._counts.clear()
                self._updated.clear()
                self._eager_grads.clear()
                raise RuntimeError(
                    f"OffloadAdamW: the gradient of parameter {self._index[p]} changed after "
                    f"its eager update during backward ({self.eager_reason}); a loop that "
                    "clips or unscales gradients between backward and step() needs "
                    "OffloadAdamW(..., max_grad_norm=<norm>) (the optimizer clips) or "
                    "eager=False"
                )

    def synchronize(self) -> None:
        """Block until every queued update has landed: the CUDA kernel's, and the host
        updates of CUDA parameters with their copies back (a no-op when none is queued)."""
        self._wait_for_devices()

    def stats(self) -> dict[str, Any]:
        """Where the state lives and what the optimizer did (after waiting for queued
        updates): ``backend``; ``moment_dtype``, ``moment_dtype_reason``; ``host_budget``;
        ``moment_bytes``, ``master_bytes`` (allocated so far), ``pin_moments``,
        ``pin_reason``, ``pinned_bytes``; ``eager``, ``eager_reason``; ``steps``;
        ``kernel_seconds``; ``d2h_bytes_per_step``, ``h2d_bytes_per_step`` (this
        optimizer's copies in the last step).  Each key: the package README, "Options"."""
        self._wait_for_devices()
        moments, masters, pinned = state_bytes(self.state.values(), self._grad_buffers.values())
        return {
            "backend": self.backend.name,
            "moment_dtype": self.moment_dtype,
            "moment_dtype_reason": self.moment_dtype_reason,
            "host_budget": self.host_budget,
            "moment_bytes": moments,
            "master_bytes": masters,
            "pin_moments": self.pin_moments,
            "pin_reason": self.pin_reason,
            "pinned_bytes": pinned,
            "eager": self.eager,
            "eager_reason": self.eager_reason,
            "steps": self._steps,
            "kernel_seconds": self._kernel_s,
            "d2h_bytes_per_step": self._last_moved[0],
            "h2d_bytes_per_step": self._last_moved[1],
        }

    @property
    def _host_backend(self) -> Backend:
        """What updates the parameters that are not on a CUDA device."""
        return self.backend.host if isinstance(self.backend, CudaBackend) else self.backend

    def _on_device(self, p: torch.Tensor) -> bool:
        """True when ``p``'s update runs in the CUDA kernel."""
        return p.device.type == "cuda" and isinstance(self.backend, CudaBackend)

    def _wait_for_devices(self) -> None:
        """Wait for the CUDA updates in flight: they write host RAM that the caller may read
        next (a state dict).  Then the host updates of CUDA parameters: the worker's jobs
        are drained and the compute streams wait for the copies back to the parameters."""
        if self._pipeline is not None:
            self._pipeline.drain()
        if self._transfer is not None:
            self._transfer.order_compute()
        for device in self._devices:
            torch.cuda.current_stream(device).synchronize()
        self._devices.clear()

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        zeros = getattr(self._host_backend, "zeros", None)  # huge pages from the C++ backend
        state.update(new_state(p, self.moment_dtype, master=self._needs_master(p), zeros=zeros))
        if self.pin_moments:
            _pinned(state)

    def _update(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        grad_scale: float,
        batch: list[tuple[torch.Tensor, torch.Tensor | None, Update]] | None = None,
    ) -> None:
        """``p``'s update; a host update is appended to ``batch`` instead where one is
        given (run by :meth:`_run_batch`)."""
        if p.grad is None:
            return
        if p.grad.is_sparse:
            raise RuntimeError("OffloadAdamW does not support sparse gradients")
        grad = local(p.grad)
        shard = local(p)  # an FSDP2 parameter is updated through its local shard
        state = self.state[p]
        if not state:
            self._init_state(shard, state)
        step_tensor = state["step"]
        step = int(step_tensor.item()) + 1
        step_tensor.fill_(step)  # (cheaper than += 1, which wraps the 1 in a tensor)
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        h = Hyper(
            decay=1.0 - lr * group["weight_decay"],
            w1=1.0 - beta1,
            beta2=beta2,
            c2=1.0 - beta2,
            eps=group["eps"],
            neg_step=-(lr / (1.0 - beta1**step)),
            bc2_sqrt=math.sqrt(1.0 - beta2**step),
            grad_scale=grad_scale,
            key=fmt.stream_key(self.seed, step, self._index[p]),
        )
        on_device = self._on_device(p)
        transfer = self._transfer
        if not on_device:
            if grad.device.type != "cpu":
                self._moved[0] += grad.numel() * grad.element_size()
            if p.device.type != "cpu":
                self._moved[1] += shard.numel() * shard.element_size()
        if not on_device and transfer is not None and transfer.handles(p):
            self._update_through_host(p, shard, state, grad, h, transfer)
            return
        if on_device:
            for tensor in _pinned(state):
                cast(CudaBackend, self.backend).check_reachable(tensor)
            self._devices.add(p.device)
            g = grad.detach().to(torch.float32).contiguous().view(-1)  # stays on the device
            backend = self.backend
        elif grad.dtype == torch.float32 and grad.device.type == "cpu" and grad.is_contiguous():
            g = _flat(grad)  # (step() runs under no_grad: no detach needed)
            backend = self._host_backend
        else:
            g = grad.detach().to("cpu", torch.float32).contiguous().view(-1)
            backend = self._host_backend
        master = state.get("master")
        work = master if master is not None else shard.detach()
        if batch is not None and not on_device:
            batch.append((shard, master, _update_of(_flat(work), g, state, h)))
            return
        self._run_update(backend, work.view(-1), g, state, h)
        if master is not None:
            # After a CUDA update the copy must be stream-ordered behind the kernel that
            # writes the master: a blocking copy that changes the dtype converts on the host
            # first, and would read the master before the kernel is done.
            shard.detach().copy_(master.view(shard.shape), non_blocking=on_device)

    def _run_batch(self, batch: list[tuple[torch.Tensor, torch.Tensor | None, Update]]) -> None:
        """The gathered host updates in one backend call, then their masters copied to the
        parameters."""
        if not batch:
            return
        start = time.perf_counter()
        try:
            self._host_backend.batch(self.moment_dtype, [update for _, _, update in batch])
        finally:
            elapsed = time.perf_counter() - start
            with self._kernel_lock:
                self._kernel_s += elapsed
        for p, master, _ in batch:
            if master is not None:
                p.detach().copy_(master.view(p.shape))

    def _run_update(
        self, backend: Backend, flat: torch.Tensor, g: torch.Tensor, state: dict[str, Any], h: Hyper
    ) -> None:
        start = time.perf_counter()
        try:
            self._run_kernel(backend, flat, g, state, h)
        finally:
            elapsed = time.perf_counter() - start
            with self._kernel_lock:  # the host pipeline's worker thread runs updates too
                self._kernel_s += elapsed

    def _run_kernel(
        self, backend: Backend, flat: torch.Tensor, g: torch.Tensor, state: dict[str, Any], h: Hyper
    ) -> None:
        u = _update_of(flat, g, state, h)
        if self.moment_dtype == "float32":
            backend.fp32(u.p, u.g, u.m, u.v, h)
        elif self.moment_dtype == "bfloat16":
            backend.bf16(u.p, u.g, u.m, u.v, h)
        else:
            backend.int8(
                u.p,
                u.g,
                u.m,
                cast(torch.Tensor, u.m_absmax),
                u.v,
                cast(torch.Tensor, u.v_absmax),
                h,
            )

    def _update_through_host(
        self,
        p: torch.Tensor,
        shard: torch.Tensor,
        state: dict[str, Any],
        grad: torch.Tensor,
        h: Hyper,
        transfer: DeviceTransfer,
    ) -> None:
        """Queue ``p``'s gradient copy and hand its update to the worker thread (see
        :mod:`sakura_offload.host_optimizer.device_stream`); ``step()`` waits for it."""
        master = state["master"]  # a device parameter always has one
        if not master.is_pinned():
            master = state["master"] = transfer.pin(master)
        buffer = self._grad_buffers.get(p)
        if buffer is None:
            buffer = transfer.pin(torch.empty(shard.numel(), dtype=torch.float32))
            self._grad_buffers[p] = buffer
        event = transfer.to_host(grad, buffer)
        backend, wait, index = self._host_backend, self.event_wait, self._index[p]

        def job() -> None:
            wait.wait(event, f"the gradient copy of parameter {index}")
            self._run_update(backend, master.view(-1), buffer, state, h)
            transfer.to_device(master, shard)

        if self._pipeline is None:
            self._pipeline = HostPipeline(timeout_s=wait.timeout_s)
            weakref.finalize(self, self._pipeline.close)
        self._pipeline.submit(job)

    # --- state dicts --------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`torch.optim.AdamW.state_dict`: per parameter ``step``, ``exp_avg`` and
        ``exp_avg_sq`` (always float32, in the parameter's shape), plus ``master`` (the fp32
        master weights) for parameters that have one."""
        self._wait_for_devices()
        return super().state_dict()  # exported by export_hook, the first post-hook

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this class or of :class:`torch.optim.AdamW` (moments of any
        float dtype, converted to ``moment_dtype``; masters taken from the parameters when the
        dict has none).

        The conversion cannot go through :meth:`torch.optim.Optimizer.load_state_dict`
        (it would cast the moments to each parameter's dtype), so the load hooks registered
        on this optimizer (sakura-zero's, for one) are run here, as torch runs them."""
        state_dict = dict(state_dict)  # the hooks take (and may replace) a dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        by_id = match_saved(self.param_groups, state_dict["param_groups"])
        self.state.clear()
        for key, saved_state in state_dict["state"].items():
            if key not in by_id:
                raise ValueError(
                    f"OffloadAdamW.load_state_dict: state for parameter id {key!r}, which no "
                    "param group lists"
                )
            p = by_id[key]
            state = import_state(
                p, saved_state, moment_dtype=self.moment_dtype, seed=self.seed, index=self._index[p]
            )
            if self.pin_moments:
                _pinned(state)
            self.state[p] = state
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
