"""The ``memory_plan`` service: a :class:`~sakura_offload.planner.MemoryPlanner` that plans
on the first training forward passes and applies the plan from the next one."""

from __future__ import annotations

from typing import Any

from torch import nn

from sakura import Service
from sakura.options import check_bool, check_int, check_number
from sakura_offload.planner import MemoryPlan, MemoryPlanner

__all__ = ["MemoryPlannerService"]


class MemoryPlannerService(Service):
    """Spec ``memory_plan[:budget][,key=value...]``, e.g. ``memory_plan:budget=2GB``.

    ``wrap_model`` attaches a :class:`MemoryPlanner` (its options are the planner's); the
    first ``measure_steps`` training forward passes (under grad) measure the blocks with
    everything kept (paged to host RAM on a GPU), and the plan is applied from the next
    one.  ``report=True`` prints the plan's table when it is made; ``plan`` holds it (and,
    after a switch to hold ``ram_floor``, the plan as switched).
    """

    name = "memory_plan"
    priority: float = 60

    def __init__(
        self,
        budget: Any = None,
        *,
        blocks: Any = None,
        host_budget: Any = None,
        disk: bool = True,
        directory: str | None = None,
        min_bytes: int = 1 << 16,
        host_bandwidth: float | None = None,
        disk_bandwidth: float | None = None,
        cost_trials: int = 3,
        track: bool = False,
        ram_floor: Any = None,
        measure_steps: int = 2,
        report: bool = True,
        priority: float | None = None,
    ) -> None:
        owner = "MemoryPlannerService"
        self.measure_steps: int = check_int("measure_steps", measure_steps, minimum=1, owner=owner)
        self.report = check_bool("report", report, owner=owner)
        if priority is not None:
            self.priority = check_number("priority", priority, owner=owner)
        self.planner = MemoryPlanner(
            budget,
            blocks=blocks,
            host_budget=host_budget,
            disk=disk,
            directory=directory,
            min_bytes=min_bytes,
            host_bandwidth=host_bandwidth,
            disk_bandwidth=disk_bandwidth,
            cost_trials=cost_trials,
            track=track,
            ram_floor=ram_floor,
        )
        self.planner.measure_forwards = self.measure_steps
        self.planner.on_planned = self._planned
        self.planner.on_switched = self._switched
        self.plan: MemoryPlan | None = None

    def _planned(self, plan: MemoryPlan) -> None:
        self.plan = plan
        if self.report:
            print(plan.table(), flush=True)

    def _switched(self, plan: MemoryPlan) -> None:
        self.plan = plan  # the planner's warning names the switch; the table ends with it

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"MemoryPlannerService needs a torch.nn.Module, got {type(model)}")
        if self.planner.model is None:
            self.planner.attach(model)
        return model
