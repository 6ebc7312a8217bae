"""Re-planning once reality is measured: ``fit`` decides from estimates (the model's sizes;
the activations only become known at the first forward) and checks them against the first
training step.

Two measurements can show the plan too optimistic:

- **the activations** (at the first training forward, measured by the
  :class:`~sakura_offload.MemoryPlanner`): they need more than the plan left them, even with
  every block recomputed;
- **the step's device peak** (after the first optimizer step): on CUDA
  ``torch.cuda.max_memory_allocated`` since ``fit`` applied its plan; on a CPU (a simulated
  device) an accounting, not an allocator reading: the bytes of the model's state left on
  the device (trainable parameters, gradients, frozen tensors not streamed, the optimizer's
  state as it now is), the most streamed weight bytes live at once, and the saved-activation
  peak the planner derived from its measured forward.  It exceeds ``device_budget`` e.g.
  when the optimizer's state was not known before its first step (an SGD with momentum).

Then ``fit`` re-plans once: the first plan of the ladder (frozen weights resident, streamed
from host RAM, streamed from disk) that holds the measured figures, with the optimizer where
it is (the loop holds it: it cannot be swapped under a running loop); when none does and the
base is not shrunk yet, the same ladder with the base shrunk by a fit choice, cheapest option
first (a quantized base: the first step ran on the weights as they were, the next ones run
on the shrunk base).  The activation planner
gets what the new plan leaves of the device budget.  The weights move at a safe point: after
the optimizer step, or before the next forward if that comes first (gradient
accumulation).  The change is logged once (WARNING, logger ``sakura_offload.fit``) and kept
in :attr:`FitState.replans <sakura_offload.fit.wrap.FitState>`; ``memory_report()`` and the
plan's table show it.  When no plan fits the measured figures, :class:`FitError` names the
smallest device budget that would.

The host side (:mod:`.host_replan`): with ``host_reserve="auto"`` and an explicit
``host_budget``, the first step run under the activation planner's plan measures the
process's anonymous RSS against the plan's accounting, and the reserve's surplus goes to the
activations' host paging (or its shortfall is taken from it), once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sakura_offload.fit.choices import FitChoice, FitOption
from sakura_offload.fit.decide import WEIGHT_PLACES, FitError, FitPlan, ModelSizes, candidates
from sakura_offload.fit.host_replan import HostReserve

if TYPE_CHECKING:
    from sakura_offload.fit.wrap import FitState

__all__ = ["MARGIN", "Replan", "Replanner", "measured_device_bytes"]

_LOG = logging.getLogger("sakura_offload.fit")

MARGIN = 0.05
"""A measured step peak within the budget but this fraction over the plan's estimate is
logged (INFO); over the budget it re-plans."""


@dataclass(frozen=True)
class Replan:
    """One re-plan: what was measured against what the plan estimated, and the change."""

    step: int
    """Optimizer steps taken when it was measured (0: at the first forward)."""
    what: str
    """``"activations"``, ``"step peak"`` or ``"host reserve"``."""
    measured: int
    """Bytes measured: the activations' least peak, the step's device peak, or the peak
    anonymous RSS above the baseline (:mod:`.host_replan`)."""
    estimated: int
    """Bytes the plan had for them: what it left the activations, ``device_budget``, or
    the host limit (``host_budget``, plus ``device_budget`` on a CPU)."""
    before: str
    after: str

    def describe(self) -> str:
        if self.what == "activations":
            seen = (
                f"the activations need at least {self.measured} bytes (measured at the first "
                f"forward), the plan left them {self.estimated}"
            )
        elif self.what == "host reserve":
            from sakura_offload.fit.host_replan import reserve_margin

            left = self.estimated - self.measured
            seen = (
                f"the process's anonymous RSS peaked {self.measured} bytes above its baseline "
                f"in step {self.step}, of a limit of {self.estimated} (host_budget, and "
                f"device_budget on a CPU): {left} bytes left, margin "
                f"{reserve_margin(self.estimated)}, so host_reserve's "
                + ("unused part goes to" if left > reserve_margin(self.estimated) else
                   "shortfall comes from")
                + " the activations' host paging"
            )  # fmt: skip
        else:
            seen = (
                f"the step's device peak measured {self.measured} bytes after step "
                f"{self.step}, over device_budget={self.estimated}"
            )
        return f"re-planned: {seen}; was {self.before}; now {self.after}"


def measured_device_bytes(state: FitState, model: Any) -> tuple[int, int]:
    """``(peak, state_bytes)``: the step's device peak (module docstring) and the bytes of
    model and optimizer state on the device, measured now."""
    from sakura_offload.fit.report import memory_report

    device = memory_report(model)["device"]
    held = sum(int(device[k]) for k in ("trainable", "gradients", "frozen", "optimizer"))
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(param.device)), held
    live = 0 if state.paging is None else int(state.paging.stats.max_live_bytes)
    applied = getattr(state.planner, "applied", None)
    activations = 0 if applied is None else int(applied.estimated_peak)
    return held + live + activations, held


class Replanner:
    """Watches the first step of a model ``fit`` prepared and re-plans once (module
    docstring).  ``options``: ``fit``'s checked options."""

    def __init__(
        self,
        model: Any,
        state: FitState,
        options: dict[str, Any],
        choices: Mapping[str, FitChoice] | None = None,
    ) -> None:
        self.model = model
        self.choices = dict(choices or {})
        self.state = state
        self.options = options
        self.enabled: bool = bool(options.get("replan", True))
        self.steps = 0
        self.pending: FitPlan | None = None
        self.handles: list[Any] = []
        self._measured = False
        self.host: HostReserve | None = None
        """The host side (:mod:`.host_replan`), when the reserve adapts."""
        if self.enabled and HostReserve.applies(state):
            self.host = HostReserve(model, state, int(state.host_baseline or 0))

    # --- hooks -------------------------------------------------------------------------

    def attach(self, optimizer: Any) -> None:
        """Measure after ``optimizer``'s steps (a torch optimizer; the ``fit`` service
        calls :meth:`after_step` from its event instead) and move the weights before the
        next forward when a re-plan is pending."""
        self.handles.append(
            self.model.register_forward_pre_hook(self._before_forward, prepend=True)
        )
        if isinstance(optimizer, torch.optim.Optimizer):
            self.handles.append(optimizer.register_step_post_hook(self._after_optimizer))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.host is not None:
            self.host.remove()

    def _before_forward(self, module: Any, args: Any) -> None:
        if self.pending is not None:
            self._switch(self.pending)
        if self.host is not None and self._measured and self.pending is None:
            self.host.before_forward()  # after the device side measured its step

    def _after_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.after_step()

    # --- measuring ---------------------------------------------------------------------

    def after_step(self) -> None:
        """An optimizer step happened: move pending weights; after the first step,
        measure its device peak and re-plan when it exceeds the budget."""
        self.steps += 1
        if self.host is not None:
            self.host.after_step(self.steps)
        if self.pending is not None:
            self._switch(self.pending)
            return
        if self._measured or not self.enabled:
            return
        self._measured = True
        budget = self.state.budgets.device
        if budget is None or self.state.replans:
            return
        peak, held = measured_device_bytes(self.state, self.model)
        planner = self.state.planner
        applied = getattr(planner, "applied", None)
        if peak <= budget:
            estimate = self.estimated_peak()
            if peak > estimate * (1 + MARGIN):
                _LOG.info(
                    "fit: the first step's device peak measured %d bytes, over the plan's "
                    "estimate of %d; it fits device_budget=%d, the plan stays",
                    peak, estimate, budget,
                )  # fmt: skip
            return
        activations = 0 if applied is None else int(applied.least_peak)
        if planner is None and held < peak:  # CUDA without a planner: what is not state
            activations = peak - held
        sizes = self._measured_sizes()
        new = self._next(sizes, activations, "step peak", peak, budget)
        self._switch(new)
        if planner is not None and new.activation_budget is not None:
            planner.budget = new.activation_budget
            planner.decide()

    def estimated_peak(self) -> int:
        """The device peak the plan expects: its state bytes, with the activations' reserve
        replaced by the planner's estimated peak once it planned."""
        plan = self.state.plan
        applied = getattr(self.state.planner, "applied", None)
        if applied is None:
            return plan.device_bytes
        reserve = self.state.budgets.activation_reserve
        return plan.device_bytes - reserve + int(applied.estimated_peak)

    def on_activations(self, budget: int, minimum: int) -> int | None:
        """The activation planner cannot fit ``minimum`` bytes (its least peak) in
        ``budget``: re-plan and return the activations' new budget (the weights move
        after this step's backward), or None when re-planning is off or done."""
        if not self.enabled or self.state.replans:
            return None
        new = self._next(self.state.plan.sizes, minimum, "activations", minimum, budget)
        self.pending = new
        self.state.plan = new
        return new.activation_budget

    def _measured_sizes(self) -> ModelSizes:
        """The plan's sizes with the optimizer's device state as it now is."""
        sizes = self.state.plan.sizes
        optimizer = self.state.optimizer
        if self.state.plan.optimizer != "device" or optimizer is None:
            return sizes
        state = getattr(optimizer, "state", {})
        held = sum(  # (0-d tensors are step counters)
            v.numel() * v.element_size()
            for s in state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        return dataclasses.replace(sizes, optimizer_bytes=max(sizes.optimizer_bytes, held))

    def _next(self, sizes: ModelSizes, activations: int, what: str, measured: int,
              estimated: int) -> FitPlan:  # fmt: skip
        """The first plan of the weights' ladder that holds ``activations`` on top of its
        state; records and logs it.  Raises :class:`FitError` when none does."""
        plan, budgets = self.state.plan, self.state.budgets
        device = budgets.device if budgets.device is not None else 0
        ladder = [(plan.optimizer, w) for w in WEIGHT_PLACES]
        # the reserve was the estimate for the activations: the measured figure replaces it
        measured_budgets = dataclasses.replace(budgets, activation_reserve=0)
        tried = candidates(sizes, measured_budgets, plan.option, ladder)
        if plan.option is None:  # then the base shrunk by a fit choice, cheapest first
            for option in self._options(sizes):
                tried += candidates(sizes.shrunk(option), measured_budgets, option, ladder)
        for candidate in tried:
            if (
                candidate.device_bytes + activations <= device
                and candidate.host_bytes <= budgets.host
                and (budgets.disk is None or candidate.disk_bytes <= budgets.disk)
            ):
                record = Replan(
                    self.steps, what, measured, estimated, plan.summary(), candidate.summary()
                )
                line = record.describe()
                new = dataclasses.replace(candidate, reasons=(*plan.reasons, line))
                self.state.replans.append(record)
                _LOG.warning("fit: %s (activations get %s bytes)", line, new.activation_budget)
                return new
        least = min(c.device_bytes for c in tried) + activations
        raise FitError(
            f"fit: the measured first step does not fit device_budget={device} bytes under "
            f"any plan that keeps the optimizer on the {plan.optimizer}"
            + (
                f" (fit choices tried: {', '.join(sorted(self.choices)) or 'none'})"
                if plan.option is None
                else f" and the base as {plan.option.label}"
            )
            + f" ({what}: {measured} bytes measured); device_budget >= {least} bytes would fit",
            budget=device,
            minimum=least,
        )

    def _options(self, sizes: ModelSizes) -> list[FitOption]:
        """What the fit choices offer for the model as it is now (sized from shapes, so a
        streamed model is estimated too), cheapest first."""
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        offered: list[FitOption] = []
        for choice in self.choices.values():
            if choice.applies(self.model):
                offered.extend(choice.estimate(self.model, blocks=sizes.block_names, device=device))
        return sorted(offered, key=lambda o: (o.cost, -o.bytes_saved))

    def _switch(self, new: FitPlan) -> None:
        """Move the frozen weights to where ``new`` puts them."""
        from sakura_offload.fit.wrap import weight_bandwidths
        from sakura_offload.paging.weights import WeightPaging

        self.pending = None
        state = self.state
        state.plan = new
        if state.paging is not None:
            state.paging.remove()
            state.paging = None
        if new.option is not None and state.choice is None:  # every weight is back here
            choice = self.choices[new.option.choice]
            choice.apply(self.model, new.option)
            state.choice = choice
        if new.weights != "resident":
            disk = self.options["disk_offload"]
            state.paging = WeightPaging(
                self.model,
                blocks=self.options["blocks"],
                indices=new.streamed_blocks,
                prefetch=self.options["prefetch"],
                disk_offload=disk if new.weights == "disk" else None,
                host_budget=new.host_weight_bytes if new.weights == "disk" else None,
            )
            state.bandwidths = weight_bandwidths(self.model, new, self.options)
        else:
            state.bandwidths = {}
        if state.planner is not None and state.planner.model is not None:
            state.planner._refresh_param_keys()
