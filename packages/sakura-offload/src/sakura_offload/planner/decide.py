"""Deciding: a choice per block that fits the budget at the least extra time.

The peak of saved activation bytes is estimated for a choice per block (:meth:`Search.peak`):
at the end of the forward (what is saved outside the blocks plus what each block leaves
resident) and during each block's backward (the blocks before it plus the block's
activations brought back, by copy or recomputation).  Starting from "keep everything", the
move that lowers the peak most per second of extra time is taken until the budget is met
(:meth:`Search.descend`); then moves back to cheaper choices are taken where the budget
still holds (:meth:`Search.take_back`).  Host paging is limited to a host budget
(:func:`default_host_budget`), disk paging to the free space of its directory
(:func:`disk_budget`).  See ``docs/offload.md``, "The memory planner: design".
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sakura.options import check_choice, option_error
from sakura_offload.host_optimizer.placement import ram_floor
from sakura_offload.planner.cost import Costs
from sakura_offload.planner.plan import (
    _OWNER,
    CHOICES,
    BlockDecision,
    MemoryBudgetError,
    MemoryPlan,
    _mb,
    _resident,
)
from sakura_torch.host_memory import host_ram

__all__ = ["Search", "choose", "default_host_budget", "disk_budget", "given_choices"]


def default_host_budget() -> int:
    """Host RAM that paging may use: at most 60 % of what is available, always leaving
    10 % of physical RAM (at least 4 GiB) free."""
    available, total = host_ram()
    margin = ram_floor(total)
    return max(0, min(int(available * 0.6), available - margin))


def disk_budget(directory: str | os.PathLike[str] | None) -> int:
    """Bytes disk paging may write under ``directory`` (default: the system's temporary
    directory): its free space less 5 % of it (at least 1 GiB)."""
    base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    return max(0, free - max(free // 20, 2**30))


def given_choices(names: Sequence[str], choices: str | Mapping[str, str]) -> list[str]:
    """``choices`` (one choice for every block, or a mapping block name -> choice, the
    others kept) as a choice per block, validated."""
    if isinstance(choices, str):
        check_choice("choices", choices, CHOICES, owner=_OWNER)
        return [choices] * len(names)
    if not isinstance(choices, Mapping):
        raise option_error(
            "choices", choices, f"one of {CHOICES} or a mapping block name -> choice",
            owner=_OWNER,
        )  # fmt: skip
    unknown = sorted(set(choices) - set(names))
    if unknown:
        raise option_error("choices", dict(choices), f"block names among {names}", owner=_OWNER)
    for value in choices.values():
        check_choice("choices", value, CHOICES, owner=_OWNER)
    return [choices.get(name, "keep") for name in names]


@dataclass(frozen=True)
class Search:
    """What a plan is judged on: the measured blocks (``order``: the order their forwards
    ran), the saved bytes outside the blocks (``pre``: of them, those saved before the
    first block), the choices allowed, their costs, and the host and disk budgets."""

    measured: Sequence[BlockDecision]
    order: Sequence[int]
    pre: int
    outside: int
    allowed: Sequence[str]
    cost: Costs
    host_cap: int
    disk_cap: int

    def peak(self, plan: Sequence[str]) -> int:
        """The estimated peak of saved activation bytes under ``plan``."""
        measured = self.measured
        resident = [_resident(measured[i], plan[i]) for i in range(len(plan))]
        worst = self.outside + sum(resident)
        running = self.pre
        for i in self.order:
            d = measured[i]
            if plan[i] == "recompute":
                worst = max(worst, running + d.input_bytes + d.recompute_bytes)
            elif plan[i] != "keep":  # what stayed, and every copy brought back
                worst = max(worst, running + resident[i] + d.copy_bytes)
            running += resident[i]
        return worst

    def fits(self, plan: Sequence[str]) -> bool:
        """Whether ``plan``'s host and disk pages fit their budgets."""
        measured = self.measured
        host = sum(measured[i].copy_bytes for i, c in enumerate(plan) if c == "page_host")
        disk = sum(measured[i].copy_bytes for i, c in enumerate(plan) if c == "page_disk")
        return host <= self.host_cap and disk <= self.disk_cap

    def descend(self, target: int) -> list[str]:
        """From everything kept, take the move that lowers the peak most per second of
        extra time until the peak is at most ``target`` (or no move lowers it)."""
        cost, n = self.cost, len(self.measured)
        plan = ["keep"] * n
        current = self.peak(plan)
        while current > target:
            best: tuple[float, int, int, str] | None = None
            for i in range(n):
                for choice in self.allowed:
                    if choice == plan[i] or math.isinf(cost(i, choice)):
                        continue  # an infinite cost: the block cannot run that way
                    trial = [*plan[:i], choice, *plan[i + 1 :]]
                    if not self.fits(trial):
                        continue
                    gain = current - self.peak(trial)
                    if gain <= 0:
                        continue
                    extra = cost(i, choice) - cost(i, plan[i])
                    score = gain / max(extra, 1e-12)
                    candidate = (score, gain, -i, choice)
                    if best is None or candidate[:3] > best[:3]:
                        best = candidate
            if best is None:
                break
            plan[-best[2]] = best[3]
            current = self.peak(plan)
        return plan

    def take_back(self, plan: list[str], budget: int) -> None:
        """Change ``plan`` in place: take back the dearest extra time the budget allows,
        one move at a time."""
        cost, n = self.cost, len(self.measured)
        improved = True
        while improved:
            improved = False
            best_saving, best_move = 0.0, None
            for i in range(n):
                for choice in self.allowed:
                    saving = cost(i, plan[i]) - cost(i, choice)
                    if saving <= best_saving:
                        continue
                    trial = [*plan[:i], choice, *plan[i + 1 :]]
                    if self.fits(trial) and self.peak(trial) <= budget:
                        best_saving, best_move = saving, (i, choice)
            if best_move is not None:
                plan[best_move[0]] = best_move[1]
                improved = True


def _budget_error(
    search: Search, budget: int, least: int, keep_peak: int, every: str
) -> MemoryBudgetError:
    return MemoryBudgetError(
        f"MemoryPlanner: the saved activations cannot fit budget={budget} bytes "
        f"({_mb(budget)}): the least reachable peak is {least} bytes ({_mb(least)}; "
        f"every block recomputed: {every}, everything kept: "
        f"{_mb(keep_peak)}, outside the blocks: {_mb(search.outside)}); raise the budget "
        f"to at least {least} or make the batch smaller",
        budget=budget,
        minimum=least,
    )


def choose(
    search: Search,
    given: list[str] | None,
    budget: int | None,
    *,
    device: str,
    cost_trials: int,
) -> MemoryPlan:
    """The plan: ``given`` as it is, or the cheapest found for ``budget``
    (:class:`MemoryBudgetError` when even the least reachable peak is above it)."""
    n, cost = len(search.measured), search.cost
    keep_peak = search.peak(["keep"] * n)
    lowest = search.descend(0)
    recompute_all = ["recompute"] * n
    can_recompute_all = all(math.isfinite(cost(i, "recompute")) for i in range(n))
    least = min(
        search.peak(lowest),
        search.peak(recompute_all) if can_recompute_all else search.peak(lowest),
    )
    if given is not None:
        plan = given
        planned_for = None
    else:
        if budget is None:  # pragma: no cover - attach() requires or computes one
            raise RuntimeError("MemoryPlanner: no budget")
        if least > budget:
            every = _mb(search.peak(recompute_all)) if can_recompute_all else "not possible here"
            raise _budget_error(search, budget, least, keep_peak, every)
        plan = search.descend(budget)
        if search.peak(plan) > budget:  # the greedy path got stuck; start from the lowest plan
            plan = list(lowest) if search.peak(lowest) <= budget else recompute_all
        search.take_back(plan, budget)
        planned_for = budget
    decisions = tuple(
        dataclasses.replace(
            d,
            choice=plan[i],
            cost_seconds=cost(i, plan[i]),
            costs=tuple((c, cost(i, c)) for c in search.allowed),
            costs_measured=i in cost.timed,
        )
        for i, d in enumerate(search.measured)
    )
    return MemoryPlan(
        decisions=decisions,
        budget=planned_for,
        estimated_peak=search.peak(plan),
        keep_peak=keep_peak,
        least_peak=least,
        outside_bytes=search.outside,
        host_bandwidth=cost.host_bandwidth,
        disk_bandwidth=cost.disk_bandwidth,
        device=device,
        cost_trials=cost_trials if cost.timed else 0,
    )
