"""The memory planner: per block of a model's stack, keep its saved activations, page them
(to host RAM, or to disk when host RAM would lose its margin) or recompute them in backward,
so that the saved activations fit a memory budget at the least estimated extra time.

:class:`MemoryPlanner` ties the steps together, each its own module: :mod:`.measure` (real
forward passes, per block), :mod:`.cost` (the extra time of each choice), :mod:`.decide`
(the choice per block), :mod:`.apply` (running under the plan); :mod:`.plan` holds the
result as data and :mod:`.service` the ``memory_plan`` service.  How and why:
``docs/offload.md``, "The memory planner" and its "Design" section.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sakura.marks import RECOMPUTED, get_mark, has_mark
from sakura.options import check_bool, check_int, check_number, option_error
from sakura_offload.host_optimizer.placement import ram_floor as default_ram_floor
from sakura_offload.paging.activations import ActivationPaging
from sakura_offload.planner.apply import (
    _Meter,
    _Pager,
    _PlannedForward,
    _unpack_held,
    apply_plan,
    keep_pack,
)
from sakura_offload.planner.cost import Costs, cached_costs, tier_bandwidth, timed_costs
from sakura_offload.planner.decide import (
    Search,
    choose,
    default_host_budget,
    disk_budget,
    given_choices,
)
from sakura_offload.planner.measure import (
    _Key,
    _Recorder,
    _storage,
    measurements,
    order,
    run_sample,
)
from sakura_offload.planner.plan import (
    _OWNER,
    CHOICES,
    BlockDecision,
    MemoryBudgetError,
    MemoryPlan,
    RamSwitch,
    parse_bytes,
)
from sakura_torch.blocks import find_blocks, validate_selector

__all__ = [
    "CHOICES",
    "BlockDecision",
    "MemoryBudgetError",
    "MemoryPlan",
    "MemoryPlanner",
    "RamSwitch",
    "default_host_budget",
    "parse_bytes",
    "plan_memory",
]

_MARK = "_sakura_memory_plan"


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
        ram_floor: host RAM always left free while training (bytes or ``"4GiB"``-style).
            ``None``: 10 % of physical RAM, at least 4 GiB (the host optimizer's floor,
            :func:`~sakura_offload.host_optimizer.placement.ram_floor`).  At the start of
            each forward pass under the plan, when available RAM is under it, half of the
            blocks still paged to host RAM recompute instead (``MemoryPlan.ram_switches``
            records it, a warning names it); they are not switched back.
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
        ram_floor: Any = None,
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
        self.ram_floor = parse_bytes("ram_floor", ram_floor, allow_none=True)
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
        self.on_switched: Callable[[MemoryPlan], None] | None = None
        self._first_block = -1
        self._forwards = 0

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
            if has_mark(block, RECOMPUTED):  # e.g. sakura-precision's ActivationCheckpoint
                raise ValueError(
                    f"MemoryPlanner: block {name} is already checkpointed by "
                    f"{get_mark(block, RECOMPUTED)!r} (its sakura.marks.RECOMPUTED mark); the "
                    f"planner chooses recomputation itself, use one"
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
            ctx = torch.autograd.graph.saved_tensors_hooks(keep_pack(self, None), _unpack_held)
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

    # --- measuring and deciding ----------------------------------------------------

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
                run_sample(self, sample)
            return self.decide()
        except BaseException:
            self.remove()
            raise

    def decide(self, choices: str | Mapping[str, str] | None = None) -> MemoryPlan:
        """Choose (or take ``choices``: one choice for every block, or a mapping block name
        -> choice, the others kept) and apply the plan; returns it."""
        measured = measurements(self)
        recorder = self._recorder
        if recorder is None:  # pragma: no cover
            raise RuntimeError("MemoryPlanner: not attached")
        given = given_choices(self.names, choices) if choices is not None else None
        use_disk = self.disk or (given is not None and "page_disk" in given)
        allowed = ["keep", "page_host", "recompute"] + (["page_disk"] if use_disk else [])
        timed = (
            timed_costs(self, measured, allowed) if given is None else (cached_costs(self) or {})
        )
        costs = Costs(
            measured,
            timed,
            host_bandwidth=tier_bandwidth(self, "page_host", measured, timed),
            disk_bandwidth=tier_bandwidth(self, "page_disk", measured, timed) if use_disk else 0.0,
        )
        search = Search(
            measured,
            order(self),
            pre=recorder.outside_pre,
            outside=sum(recorder.outside.values()),
            allowed=allowed,
            cost=costs,
            host_cap=self.host_budget if self.host_budget is not None else default_host_budget(),
            disk_cap=disk_budget(self.directory) if self.disk else 0,
        )
        budget = self.budget if self.budget is not None else self._auto_budget
        result = choose(
            search, given, budget, device=str(self.device), cost_trials=self.cost_trials
        )
        apply_plan(self, result)
        return result

    # --- running under a plan ----------------------------------------------------------

    def floor(self, total: int) -> int:
        """Host RAM to leave free on a machine of ``total`` bytes (``ram_floor``)."""
        return self.ram_floor if self.ram_floor is not None else default_ram_floor(total)

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


def plan_memory(model: nn.Module, sample: Any, budget: Any = None, **options: Any) -> MemoryPlan:
    """``MemoryPlanner(budget, **options).plan(model, sample, trials=...)``: measure,
    decide and apply in one call (see :class:`MemoryPlanner` for the options; keep a
    planner of your own to read ``measured_peak`` or to ``remove()`` the plan)."""
    trials = options.pop("trials", 2)
    return MemoryPlanner(budget, **options).plan(model, sample, trials=trials)
