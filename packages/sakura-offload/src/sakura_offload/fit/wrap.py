"""``wrap(model, optimizer)`` / ``unwrap(model)``: ``fit`` for a plain PyTorch loop.

:func:`fit_options` checks the options (the ``fit`` service takes the same), :func:`measure`
reads the model's sizes, :func:`plan_fit` decides (:mod:`.decide`) and :func:`apply_fit`
applies the plan with the existing parts: the chosen fit option (a plugin's, e.g.
sakura-quant's), :class:`~sakura_offload.WeightPaging`,
:class:`~sakura_offload.OffloadAdamW` and :class:`~sakura_offload.MemoryPlanner`.  What was
applied is kept on the model as ``model.sakura_fit`` (a :class:`FitState`), which
:func:`unwrap` and :func:`~sakura_offload.fit.report.memory_report` read.

Long file: the options, the measuring, the applying with its roll-back and ``unwrap`` share
:class:`FitState` and the checked options; split, each part would import the others.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sakura.options import check_bool, check_choice, check_int, option_error
from sakura_offload.fit.choices import FitChoice, FitOption, fit_choices
from sakura_offload.fit.decide import (
    Budgets,
    FitError,
    FitPlan,
    ModelSizes,
    auto_host_reserve,
    decide,
)
from sakura_offload.fit.heap import HeapTrim, trim_heap
from sakura_offload.fit.report import plan_table
from sakura_offload.host_optimizer.options import check_moment_dtype
from sakura_offload.host_optimizer.placement import default_moment_budget
from sakura_offload.paging.weight_store import frozen_block_bytes, frozen_tensors
from sakura_offload.planner.decide import disk_budget
from sakura_offload.planner.plan import parse_bytes
from sakura_torch.blocks import find_blocks, validate_selector
from sakura_torch.host_memory import host_ram

__all__ = ["FitState", "apply_fit", "fit_options", "measure", "plan_fit", "unwrap", "wrap"]

_LOG = logging.getLogger("sakura_offload.fit")
_ATTR = "sakura_fit"
ACTIVATIONS = ("auto", "plan", "keep")


@dataclass
class FitState:
    """What ``fit`` applied to a model."""

    plan: FitPlan
    choice: FitChoice | None
    paging: Any
    planner: Any
    optimizer: Any
    budgets: Budgets
    replans: list[Any] = dataclasses.field(default_factory=list)
    """Re-plans made after measuring the first steps (:class:`~.replan.Replan`): at most one
    of the device side (``"activations"`` or ``"step peak"``) and one ``"host reserve"``
    (:mod:`.host_replan`)."""
    replanner: Any = None
    bandwidths: dict[str, float] = dataclasses.field(default_factory=dict)
    """Probed one-way copy bandwidth (bytes/s) to the device of each tier weights stream
    from (the plan's expected extra time per block is computed from it)."""
    host_baseline: int | None = None
    """Anonymous RSS less the model's anonymous tensors when ``fit`` started applying (only
    with ``host_reserve="auto"`` and an explicit ``host_budget``: :mod:`.host_replan`)."""
    heap_trim: Any = None
    """The :class:`~.heap.HeapTrim` returning the C heap's free pages after each optimizer
    step, when the plan moves something off the device (:func:`trims_heap`)."""


def fit_options(
    *,
    device_budget: Any = None,
    host_budget: Any = None,
    host_reserve: Any = "auto",
    disk_offload: Any = None,
    blocks: Any = None,
    choices: Any = "auto",
    quantize: Any = "auto",
    moment_dtype: Any = "auto",
    activations: Any = "auto",
    activation_reserve: Any = 0,
    prefetch: Any = 1,
    cost_trials: Any = 3,
    report: Any = True,
    replan: Any = True,
    accumulation_steps: Any = None,
    trim_heap: Any = True,
    owner: str = "wrap",
) -> dict[str, Any]:
    """Every ``fit`` option checked (an OptionError names the option, the value and what
    is accepted); returns them normalised."""
    if disk_offload is not None and not isinstance(disk_offload, (str, os.PathLike)):
        raise option_error("disk_offload", disk_offload, "None or a directory path", owner=owner)
    if choices in (None, False, "none"):
        names: tuple[str, ...] | None = ()
    elif choices == "auto":
        names = None
    elif isinstance(choices, str):
        names = tuple(c for c in choices.split("+") if c)
    elif isinstance(choices, (list, tuple)) and all(isinstance(c, str) for c in choices):
        names = tuple(choices)
    else:
        raise option_error(
            "choices",
            choices,
            "'auto' (every registered fit choice), None / 'none', a choice name, names "
            "joined by '+', or a list of names",
            owner=owner,
        )
    check_choice("activations", activations, ACTIVATIONS, owner=owner)
    if quantize in (None, False, "none"):
        quantize = None
    elif not isinstance(quantize, str) or not quantize:
        raise option_error(
            "quantize",
            quantize,
            "'auto' (a fit choice only when nothing fits without one), None / False / 'none', "
            "or an option a registered fit choice offers (sakura-quant's quantize_base: "
            "'int8', 'nf4'; or 'choice:option')",
            owner=owner,
        )
    if quantize is None:
        names = ()
    host = parse_bytes("host_budget", host_budget, allow_none=True, owner=owner)
    reserve = _host_reserve(host_reserve, host, owner)
    return {
        "device_budget": parse_bytes("device_budget", device_budget, minimum=1, allow_none=True,
                                     owner=owner),
        "host_budget": host,
        "host_reserve": reserve,
        "host_reserve_auto": host_reserve == "auto" and host is not None,
        "disk_offload": None if disk_offload is None else Path(disk_offload),
        "blocks": validate_selector(blocks, owner=owner),
        "choices": names,
        "quantize": quantize,
        "moment_dtype": check_moment_dtype(moment_dtype, owner=owner),
        "activations": activations,
        "activation_reserve": parse_bytes("activation_reserve", activation_reserve, owner=owner),
        "prefetch": check_int("prefetch", prefetch, minimum=0, owner=owner),
        "cost_trials": check_int("cost_trials", cost_trials, minimum=0, owner=owner),
        "report": check_bool("report", report, owner=owner),
        "replan": check_bool("replan", replan, owner=owner),
        "accumulation_steps": check_int("accumulation_steps", accumulation_steps, minimum=1,
                                        allow_none=True, owner=owner),
        "trim_heap": check_bool("trim_heap", trim_heap, owner=owner),
    }  # fmt: skip


def _host_reserve(value: Any, host_budget: int | None, owner: str) -> int:
    """``host_reserve`` in bytes: host RAM within ``host_budget`` that no part is given.
    What the parts hold is counted to the byte, but a process holds more: the C
    allocator's free pages between steps, the loop's batches and buffers, Python objects.
    Measured with ``benchmarks/fit.py`` (48 MiB host budget, a CPU): 4-6 MiB of anonymous
    RSS above what the parts held, so a plan that gave every byte of the budget to
    streamed blocks ran 3.4 MiB over it.  ``"auto"``: 1/8 of an explicit budget, at most
    1 GiB; 0 without one (the default budget is available RAM less the RAM floor, which
    keeps RAM free already)."""
    if value == "auto":
        if host_budget is None:
            return 0
        return auto_host_reserve(host_budget)
    reserve = int(parse_bytes("host_reserve", value, owner=owner) or 0)
    if host_budget is not None and reserve >= host_budget:
        raise option_error(
            "host_reserve",
            value,
            f"'auto' or a size below host_budget ({host_budget} bytes)",
            owner=owner,
        )
    return reserve


def _device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _adamw_like(optimizer: Any) -> bool:
    """Whether OffloadAdamW.from_optimizer takes ``optimizer``."""
    if not isinstance(optimizer, torch.optim.Adam):
        return False
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay", False) for g in optimizer.param_groups
    )
    return decoupled or not any(g.get("weight_decay", 0) for g in optimizer.param_groups)


def _find_blocks(model: nn.Module, blocks: Any, owner: str) -> list[tuple[str, nn.Module]]:
    try:
        return find_blocks(model, blocks, owner=owner)
    except ValueError:
        if blocks is not None:
            raise
        return []  # no repeated stack: nothing to stream


ADAM_STEP_BYTES = 4
"""torch's Adam/AdamW keep a float32 ``step`` tensor per parameter besides its two moments
(on the parameter's device when fused or capturable; counted as device state either way)."""


def adam_state_bytes(params: Iterable[torch.Tensor]) -> int:
    """What torch's Adam/AdamW allocate for ``params`` at their first step."""
    return sum(2 * p.numel() * p.element_size() + ADAM_STEP_BYTES for p in params)


def measure(model: nn.Module, optimizer: Any = None, *, blocks: Any = None) -> ModelSizes:
    """``model``'s sizes for :func:`~sakura_offload.fit.decide.decide`.  The optimizer's
    device state is what an Adam/AdamW allocates at its first step (two moments the size
    of each parameter and a ``step`` tensor), else what it holds now."""
    trainable = [p for p in model.parameters() if p.requires_grad]  # (shared ones once)
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    frozen_total = sum(f.nbytes for f in frozen_tensors(model, set()))
    found = _find_blocks(model, blocks, "wrap")
    per_block = frozen_block_bytes(model, blocks) if found else []
    if optimizer is None:
        optimizer_bytes = 0
    elif isinstance(optimizer, torch.optim.Adam):
        optimizer_bytes = adam_state_bytes([p for g in optimizer.param_groups for p in g["params"]])
    else:
        optimizer_bytes = sum(
            v.numel() * v.element_size()
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
    return ModelSizes(
        trainable_bytes=trainable_bytes,
        trainable_numel=sum(p.numel() for p in trainable),
        master_bytes=sum(4 * p.numel() for p in trainable if p.dtype != torch.float32),
        optimizer_bytes=optimizer_bytes,
        host_optimizer=optimizer is not None and _adamw_like(optimizer),
        outside_frozen_bytes=frozen_total - sum(b for _, b in per_block),
        block_names=tuple(name for name, _ in per_block),
        block_frozen=tuple(b for _, b in per_block),
    )


def _device_budget(model: nn.Module, given: int | None) -> int | None:
    """The device budget: as given; on CUDA by default the free memory plus what the
    model's tensors take there already (the plan counts them); on a CPU, no limit."""
    if given is not None:
        return given
    device = _device(model)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    on_device = sum(
        t.numel() * t.element_size()
        for t in [*model.parameters(), *model.buffers()]
        if t.device == device
    )
    return int(free) + on_device


def _disk_cap(directory: Path | None) -> int | None:
    if directory is None:
        return None
    base = directory
    while not base.exists() and base.parent != base:
        base = base.parent
    return disk_budget(base)


def plan_fit(
    model: nn.Module, optimizer: Any, options: dict[str, Any], *, assume_adamw: bool = False
) -> tuple[FitPlan, dict[str, FitChoice], Budgets]:
    """Measure and decide (no change to ``model``); the choices asked about, and the
    budgets decided against.  ``assume_adamw``: the optimizer, not known yet, will be an
    AdamW over the trainable parameters (the ``fit`` service decides before it sees it)."""
    sizes = measure(model, optimizer, blocks=options["blocks"])
    if assume_adamw and optimizer is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        sizes = dataclasses.replace(
            sizes, optimizer_bytes=adam_state_bytes(trainable), host_optimizer=True
        )
    host = options["host_budget"]
    if host is None:
        host = default_moment_budget(*host_ram())
    budgets = Budgets(
        device=_device_budget(model, options["device_budget"]),
        host=host,
        disk=_disk_cap(options["disk_offload"]),
        activation_reserve=options["activation_reserve"],
        prefetch=options["prefetch"],
        moment_dtype=options["moment_dtype"],
        host_reserve=options["host_reserve"],
        host_reserve_auto=options["host_reserve_auto"],
    )
    names = options["choices"]
    choices = fit_choices(names) if names != () else {}
    offered: list[FitOption] = []
    context = {"blocks": sizes.block_names, "device": _device(model)}
    for choice in choices.values():
        if choice.applies(model):
            offered.extend(choice.estimate(model, **context))
    forced = _forced_option(options.get("quantize", "auto"), offered)
    return decide(sizes, budgets, offered, forced=forced), choices, budgets


def _forced_option(quantize: str | None, offered: list[FitOption]) -> FitOption | None:
    """The fit option ``quantize=`` names (None for ``"auto"`` / None): matched by its
    name (``"nf4"``) or its label (``"quantize_base:nf4"``) among those offered."""
    if quantize in (None, "auto"):
        return None
    matches = [o for o in offered if quantize in (o.name, o.label)]
    if len(matches) != 1:
        known = ", ".join(repr(o.label) for o in offered) or "none: no fit choice applies"
        raise option_error(
            "quantize",
            quantize,
            f"'auto', None / 'none', or exactly one option a fit choice offers for this model "
            f"({known}){'; the name is ambiguous, give choice:option' if matches else ''}",
            owner="wrap",
        )
    return matches[0]


def apply_fit(
    model: nn.Module,
    optimizer: Any,
    plan: FitPlan,
    choices: dict[str, FitChoice],
    budgets: Budgets,
    options: dict[str, Any],
) -> FitState:
    """Apply ``plan`` to ``model`` (and ``optimizer``); record it as ``model.sakura_fit``.
    When a part fails, the parts already applied are removed again (a fit choice that
    cannot be undone stays, and a note on the error says so) and the error propagates."""
    if getattr(model, _ATTR, None) is not None:
        raise RuntimeError("fit: the model is wrapped already; call sakura_offload.unwrap first")
    parts = _Applied(model)
    baseline = None
    if budgets.host_reserve_auto and budgets.host_reserve > 0 and options["replan"]:
        from sakura_offload.fit.host_replan import host_baseline

        baseline = host_baseline(model)
    try:
        state = _apply_parts(model, optimizer, plan, choices, budgets, options, parts, baseline)
    except BaseException as error:
        parts.roll_back(error)
        raise
    if options["report"]:
        _LOG.info("fit: plan\n%s", plan_table(plan, budgets, bandwidths=state.bandwidths))
    return state


def _note(error: BaseException, text: str) -> None:
    """Add ``text`` to ``error``'s notes (shown under its traceback; ``__notes__``)."""
    notes = getattr(error, "__notes__", None)
    if notes is None:
        notes = []
        error.__notes__ = notes  # type: ignore[attr-defined]
    notes.append(text)


class _Applied:
    """The parts of a plan applied so far, to take back when a later part fails: the
    replanner's hooks, the activation planner, weight streaming, a reversible fit choice
    (one that cannot be undone stays, and the error says so)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.choice: FitChoice | None = None
        self.option: FitOption | None = None
        self.paging: Any = None
        self.planner: Any = None
        self.replanner: Any = None
        self.heap_trim: Any = None

    def roll_back(self, error: BaseException) -> None:
        self.model.__dict__.pop(_ATTR, None)
        undone: list[str] = []
        for what, part in (("heap trim", self.heap_trim), ("replanner", self.replanner),
                           ("planner", self.planner), ("paging", self.paging)):  # fmt: skip
            if part is None:
                continue
            try:
                part.remove()
                undone.append(what)
            except Exception as exc:  # keep rolling back; the first error propagates
                _note(error, f"fit: removing the {what} while rolling back failed: {exc}")
        if self.choice is not None and self.option is not None:
            if self.choice.reversible:
                self.choice.undo(self.model)
                undone.append(f"fit choice {self.option.label}")
            else:
                _note(
                    error,
                    f"fit: the fit choice {self.option.label} was applied and cannot be undone: "
                    "the model keeps it (everything else fit applied was removed)",
                )
        if undone:
            _note(error, f"fit: rolled back ({', '.join(undone)})")


def _apply_parts(
    model: nn.Module,
    optimizer: Any,
    plan: FitPlan,
    choices: dict[str, FitChoice],
    budgets: Budgets,
    options: dict[str, Any],
    parts: _Applied,
    baseline: int | None = None,
) -> FitState:
    from sakura_offload.fit.replan import Replanner
    from sakura_offload.host_optimizer.optimizer import OffloadAdamW
    from sakura_offload.paging.weights import WeightPaging

    choice = None
    if plan.option is not None:
        choice = choices[plan.option.choice]
        parts.choice, parts.option = choice, plan.option
        choice.apply(model, plan.option)
    paging = None
    disk = options["disk_offload"]
    if plan.weights != "resident":
        paging = parts.paging = WeightPaging(
            model,
            blocks=options["blocks"],
            indices=plan.streamed_blocks,
            prefetch=options["prefetch"],
            disk_offload=disk if plan.weights == "disk" else None,
            host_budget=plan.host_weight_bytes if plan.weights == "disk" else None,
        )
    if plan.optimizer == "host" and optimizer is not None:
        steps = options["accumulation_steps"] or 1
        optimizer = OffloadAdamW.from_optimizer(optimizer, moment_dtype=plan.moment_dtype)
        optimizer.set_accumulation_steps(steps, advice=_ACCUMULATION_ADVICE)
    planner = None
    mode = options["activations"]
    if mode == "plan" and plan.activation_budget is None:
        raise option_error(
            "activations", "plan", "'auto' or 'keep' without a device budget (on a CPU, give "
            "device_budget=)", owner="wrap",
        )  # fmt: skip
    state = FitState(plan, choice, paging, None, optimizer, budgets, host_baseline=baseline)
    if mode != "keep" and plan.activation_budget is not None:
        if plan.activation_budget < 1:
            raise option_error(
                "activation_reserve", budgets.activation_reserve,
                "at least 1 byte left for activations under device_budget", owner="wrap",
            )  # fmt: skip
        if disk is not None:
            disk.mkdir(parents=True, exist_ok=True)
        planner = _activation_planner(plan.device_bytes)(
            plan.activation_budget,
            blocks=options["blocks"],
            host_budget=max(0, budgets.host - plan.host_bytes),
            disk=disk is not None,
            directory=disk,
            cost_trials=options["cost_trials"],
        )
        # The planner decides after its measuring forward when someone listens; it logs
        # its table itself (logger sakura_offload.planner).
        planner.on_planned = _planned
        parts.planner = planner
        planner.attach(model)
        state.planner = planner
    if options["replan"] and budgets.device is not None:  # nothing to hold without a limit
        replanner = parts.replanner = Replanner(model, state, options, choices)
        replanner.attach(optimizer)
        state.replanner = replanner
        if planner is not None:
            planner.replanner = replanner
    if paging is not None:
        state.bandwidths = weight_bandwidths(model, plan, options)
    if trims_heap(plan):
        trim_heap()  # what applying the plan freed (copies, bandwidth probes)
        if optimizer is not None and options["trim_heap"]:
            state.heap_trim = parts.heap_trim = HeapTrim(optimizer)
    dev = _device(model)
    if dev.type == "cuda":  # the step's measured peak counts from here
        torch.cuda.reset_peak_memory_stats(dev)
    model.__dict__[_ATTR] = state
    return state


_ACCUMULATION_ADVICE = (
    "pass the loop's backward passes per optimizer step to fit: "
    "sakura_offload.wrap(..., accumulation_steps=N); the fit service reads a framework's "
    "setting itself (or takes fit:accumulation_steps=N)"
)
"""The end of OffloadAdamW's error for a backward pass beyond ``accumulation_steps``, when
fit built the optimizer."""


def trims_heap(plan: FitPlan) -> bool:
    """Whether ``fit`` returns the C heap's free pages after applying ``plan`` and after
    each optimizer step (:mod:`.heap`): when the plan moves something off the device (the
    host budget then holds), not for a plan that keeps everything resident."""
    return plan.weights != "resident" or plan.optimizer == "host" or plan.option is not None


def weight_bandwidths(model: nn.Module, plan: FitPlan, options: dict[str, Any]) -> dict[str, float]:
    """One-way copy bandwidth to the device of each tier ``plan`` streams weights from,
    probed with tensors of its largest streamed block's size
    (:func:`~sakura_offload.planner.cost.copy_bandwidth`)."""
    from sakura_offload.planner.cost import copy_bandwidth

    tiers = sorted({t for t in plan.block_tiers if t != "device"})
    largest = max(
        (
            b
            for b, t in zip(plan.sizes.block_frozen, plan.block_tiers, strict=True)
            if t != "device"
        ),
        default=0,
    )
    sizes = [max(4, min(largest, 64 * 2**20))]
    return {
        tier: copy_bandwidth(_device(model), sizes, tier=tier, directory=options["disk_offload"])
        for tier in tiers
    }


def _activation_planner(fixed: int) -> Any:
    """``MemoryPlanner`` whose budget error (raised at the first training forward, when the
    activations are measured: before any optimizer step) is a :class:`FitError` naming the
    whole device budget that would fit: the plan's ``fixed`` bytes plus the activations'
    least peak."""
    from sakura_offload.planner import MemoryBudgetError, MemoryPlan, MemoryPlanner

    class FitPlanner(MemoryPlanner):
        replanner: Any = None

        def decide(self, choices: Any = None) -> MemoryPlan:
            try:
                return super().decide(choices)
            except FitError:
                raise
            except MemoryBudgetError as error:
                if self.replanner is not None and choices is None:
                    budget = self.replanner.on_activations(error.budget, error.minimum)
                    if budget is not None:  # the measured step re-planned (fit.replan)
                        self.budget = budget
                        return super().decide(choices)
                total = fixed + error.minimum
                raise FitError(
                    f"fit: the activations do not fit what the plan leaves of the device "
                    f"budget ({error.budget} bytes); they need at least {error.minimum}, so "
                    f"device_budget >= {total} bytes would fit ({error})",
                    budget=fixed + error.budget,
                    minimum=total,
                ) from error

    return FitPlanner


def _planned(plan: Any) -> None:
    _LOG.debug("fit: activations planned: %s", plan.choices)
    trim_heap()  # the measuring forward's and the timed trials' pages (fit.heap)


def wrap(model: nn.Module, optimizer: Any = None, **options: Any) -> tuple[nn.Module, Any]:
    """Decide how ``model`` (and ``optimizer``) train within the memory budgets and apply
    it; returns ``(model, optimizer)`` (the optimizer an OffloadAdamW when the plan puts it
    on the host: use the one returned).  Options: ``device_budget`` (bytes or ``"2GiB"``;
    default: CUDA's free memory, none on a CPU), ``host_budget`` (default: available RAM
    less the floor), ``host_reserve`` (``"auto"``: 1/8 of an explicit ``host_budget``, at
    most 1 GiB, kept free for what no part accounts for, then measured in the first planned
    step and its surplus given to the activations' host paging, :mod:`.host_replan`; or
    bytes, kept as given), ``disk_offload`` (a directory: the disk tier for frozen weights and
    activations), ``blocks``, ``choices`` (``"auto"``: every registered fit choice),
    ``moment_dtype`` (``"auto"``), ``activations`` (``"auto"``: a memory planner when a
    device budget is known; ``"plan"``; ``"keep"``), ``activation_reserve``, ``prefetch``,
    ``cost_trials``, ``report``, ``replan`` (default True: measure the first step and
    re-plan once when it does not fit, :mod:`.replan`), ``accumulation_steps`` (backward
    passes per optimizer step, for the host optimizer a plan may build; ``None``: 1).  See
    ``docs/offload.md``, "fit"."""
    if not isinstance(model, nn.Module):
        raise option_error("model", type(model).__name__, "a torch.nn.Module", owner="wrap")
    checked = fit_options(**options)
    plan, choices, budgets = plan_fit(model, optimizer, checked)
    state = apply_fit(model, optimizer, plan, choices, budgets, checked)
    return model, state.optimizer


def unwrap(model: nn.Module) -> nn.Module:
    """``model`` as an ordinary module again: the activation planner's hooks removed and
    every streamed weight back on the device.  A fit option that cannot be undone (a
    quantized base: sakura-quant's choice is not reversible) stays applied.  The optimizer
    ``wrap`` returned stays what it is."""
    state = model.__dict__.pop(_ATTR, None)
    if state is None:
        raise ValueError("unwrap: the model was not wrapped by sakura_offload.wrap")
    if state.heap_trim is not None:
        state.heap_trim.remove()
    if state.replanner is not None:
        state.replanner.remove()
    if state.planner is not None:
        state.planner.remove()
    if state.paging is not None:
        state.paging.remove()
    if state.choice is not None and state.choice.reversible:
        state.choice.undo(model)
    return model
