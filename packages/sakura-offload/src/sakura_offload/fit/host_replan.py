"""The host side of re-planning: ``host_reserve="auto"`` measured instead of guessed
(:class:`HostReserve`).

With an explicit ``host_budget``, ``fit`` keeps ``host_reserve`` (``"auto"``: 1/8 of it, at
most 1 GiB) from every part, for what no part accounts for: the C allocator's free pages,
the loop's batches, autograd's temporaries, Python objects.  That guess can be too large (the
activation planner then pages blocks to disk or recomputes them where host RAM had room) or
too small (the process's anonymous RSS exceeds the budget).  So during the first training
step run under the activation planner's plan (the step after the planner's measuring
forward), the process's anonymous resident memory (``RssAnon``,
:func:`~sakura_offload.fit.verify.rss_anon`) is sampled where it peaks: at the step's first
forward (the reference), after each planned block's forward, when each block's backward
starts (a hook on its output's gradient), after the model's forward and after the optimizer
step.  The growth over the reference is compared with what the plan accounts for the step:

- on a CPU (the device is host RAM): the gradients not yet held at the reference, the
  streamed blocks' working set on the device (``prefetch + 1`` of the largest streamed
  blocks) less what was live at the reference, the activation planner's estimated peak of
  saved activations, and its host paging (each ``page_host`` block's copy bytes);
- on CUDA: only the host paging (the rest is device memory).

The excess is the **untracked overhead** (0 when the step stayed within its accounting).
What the reserve must keep is that overhead plus a margin, :func:`reserve_needed`.  When
that is below the reserve, the difference goes to the activation planner's host paging;
when it is above, the difference is taken from it (blocks then page to disk or recompute;
what the activations cannot return is logged as a WARNING).  Nothing changes when the
difference is under 64 KiB, or when the activations' host paging can hold every block's
copies before and after.  The planner decides again at
once (its timed costs are cached), after the optimizer step: a safe point, nothing is
saved for a backward then.  The change is recorded in :attr:`FitState.replans
<sakura_offload.fit.wrap.FitState>` (``what="host reserve"``), shown by ``memory_report()``
and the plan's table, and logged (INFO when the reserve is given back, WARNING when room is
taken back).  Once: the step after it is not measured again.

Only ``host_reserve="auto"`` with an explicit ``host_budget`` adapts; an explicit
``host_reserve=N`` is kept as given, and without a ``host_budget`` the reserve is 0 (the
RAM floor keeps RAM free).  On a system without ``/proc/self/status`` nothing is measured.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sakura_offload.fit.wrap import FitState

__all__ = ["MARGIN_FLOOR", "MARGIN_SHARE", "HostReserve", "reserve_needed"]

_LOG = logging.getLogger("sakura_offload.fit")

MARGIN_SHARE = 4
"""The margin is a quarter of the measured overhead ...

Measured with ``benchmarks/fit.py`` (48 MiB host budget, a CPU, fp32 blocks streamed from
disk): the anonymous RSS above the parts' bytes was 4-6 MiB from run to run, a spread of
about a quarter of it; the allocator's slack also grows with the activations paged to host
RAM, which the re-plan gives more room."""
MARGIN_FLOOR = 2**20
"""... and at least 1 MiB: glibc's heap grows in steps of its top pad (128 KiB) and a
block's copies of 0.5-1.5 MiB (the benchmark's) come and go between samples."""
MIN_CHANGE = 64 * 2**10
"""A difference below this (bytes) changes nothing."""


def reserve_needed(overhead: int) -> int:
    """What ``host_reserve`` must keep for a measured untracked ``overhead`` (bytes):
    ``overhead + max(overhead // MARGIN_SHARE, MARGIN_FLOOR)``."""
    if overhead < 0:
        raise ValueError(f"reserve_needed: overhead must be >= 0, got {overhead}")
    return overhead + max(overhead // MARGIN_SHARE, MARGIN_FLOOR)


def _rss_anon() -> int:
    from sakura_offload.fit.verify import rss_anon

    return rss_anon()


class HostReserve:
    """Measures the first planned step's anonymous RSS against the plan's accounting and
    moves the reserve's surplus to (or its shortfall from) the activations' host paging
    (module docstring).  ``read_rss``: the reader sampled (bytes; tests inject one)."""

    def __init__(self, model: Any, state: FitState, read_rss: Callable[[], int] | None = None):
        self.model = model
        self.state = state
        self.read_rss: Callable[[], int] = read_rss or _rss_anon
        self.done = False
        self.measuring = False
        self.reference = 0
        self.peak = 0
        self.samples = 0
        self.accounted = 0
        """The step's growth the plan accounts for (bytes), fixed at the reference."""
        self.overhead: int | None = None
        """The measured untracked overhead (bytes), once measured."""
        self._handles: list[Any] = []

    @staticmethod
    def applies(state: FitState) -> bool:
        """Whether ``state`` has a reserve that adapts: ``"auto"`` of an explicit
        ``host_budget``, and an activation planner to give host room to."""
        return bool(
            state.budgets.host_reserve_auto
            and state.budgets.host_reserve > 0
            and state.planner is not None
        )

    # --- sampling ------------------------------------------------------------------------

    def before_forward(self) -> None:
        """A forward of the model starts: the reference, at the first planned training
        step's first forward."""
        if self.done or self.measuring or not torch.is_grad_enabled():
            return
        planner = self.state.planner
        if planner is None or getattr(planner, "applied", None) is None:
            return  # the planner's measuring forward: not a planned step yet
        try:
            self.reference = self.read_rss()
        except OSError:  # no /proc/self/status: nothing to measure
            self.done = True
            return
        self.peak = self.reference
        self.samples = 1
        self.accounted = self.accounted_growth()
        self.measuring = True
        for wrapper in planner.wrappers:
            self._handles.append(wrapper.module.register_forward_hook(self._after_block))
        self._handles.append(self.model.register_forward_hook(self._after_model))

    def remove(self) -> None:
        """Stop measuring (``unwrap``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.measuring = False
        self.done = True

    def sample(self) -> None:
        if self.measuring:
            self.peak = max(self.peak, self.read_rss())
            self.samples += 1

    def _after_block(self, module: Any, args: Any, output: Any) -> None:
        self.sample()
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._backward_hook)  # this block's backward starts

    def _backward_hook(self, grad: torch.Tensor) -> None:
        self.sample()

    def _after_model(self, module: Any, args: Any, output: Any) -> None:
        self.sample()

    def accounted_growth(self) -> int:
        """What the plan accounts for the step beyond what is held now (module
        docstring)."""
        state = self.state
        applied = state.planner.applied
        paged = sum(d.copy_bytes for d in applied.decisions if d.choice == "page_host")
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        if device.type != "cpu":
            return int(paged)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        grads_now = sum(p.grad.nbytes for p in trainable if p.grad is not None)
        plan = state.plan
        streamed = sorted(
            (b for b, t in zip(plan.sizes.block_frozen, plan.block_tiers, strict=True)
             if t != "device"),
            reverse=True,
        )  # fmt: skip
        working = sum(streamed[: state.budgets.prefetch + 1])
        live = 0 if state.paging is None else int(state.paging.stats.live_bytes)
        return int(
            max(0, plan.sizes.trainable_bytes - grads_now)
            + max(0, working - live)
            + int(applied.estimated_peak)
            + paged
        )

    # --- deciding ------------------------------------------------------------------------

    def after_step(self, steps: int) -> None:
        """An optimizer step ended: the measured step is over; move the reserve's
        difference and re-plan the activations (once)."""
        if not self.measuring:
            return
        self.sample()
        self.remove()
        self.overhead = max(0, self.peak - self.reference - self.accounted)
        self.apply(steps, self.overhead)

    def apply(self, steps: int, overhead: int) -> None:
        """Give the activations' host paging what the reserve keeps beyond
        :func:`reserve_needed` of ``overhead`` (or take the shortfall back)."""
        from sakura_offload.fit.replan import Replan

        state = self.state
        planner = state.planner
        reserve = state.budgets.host_reserve
        needed = reserve_needed(overhead)
        change = reserve - needed
        if abs(change) < MIN_CHANGE:
            _LOG.info(
                "fit: the first planned step's untracked host memory measured %d bytes; "
                "host_reserve=%d holds it with its margin; the plan stays", overhead, reserve,
            )  # fmt: skip
            return
        old = int(planner.host_budget or 0)
        new = max(0, old + change)
        pageable = sum(d.copy_bytes for d in planner.applied.decisions)
        if min(old, new) >= pageable:  # every block can page to host RAM either way
            _LOG.info(
                "fit: the first planned step's untracked host memory measured %d bytes (with "
                "its margin %d of host_reserve=%d); the activations' host paging (%d bytes) "
                "holds every block either way, the plan stays", overhead, needed, reserve, old,
            )  # fmt: skip
            return
        short = max(0, -(old + change))
        before = _paging_summary(planner, old)
        planner.host_budget = new
        applied = planner.decide()
        record = Replan(
            steps, "host reserve", overhead, reserve, before, _paging_summary(planner, new, applied)
        )
        line = record.describe()
        state.replans.append(record)
        kept = reserve - (new - old)
        state.budgets = dataclasses.replace(state.budgets, host_reserve=kept)
        state.plan = dataclasses.replace(
            state.plan,
            host_bytes=state.plan.host_bytes - reserve + kept,
            reasons=(*state.plan.reasons, line),
        )
        if change > 0:
            _LOG.info("fit: %s", line)
        else:
            _LOG.warning("fit: %s", line)
        if short:
            _LOG.warning(
                "fit: the activations' host paging had only %d bytes to return; the process "
                "may exceed host_budget=%d by about %d bytes (a larger host_budget, or "
                "host_reserve=%d, would hold it)",
                old, state.budgets.host, short, needed,
            )  # fmt: skip


def _paging_summary(planner: Any, host_budget: int, plan: Any = None) -> str:
    plan = plan if plan is not None else planner.applied
    counts: dict[str, int] = {}
    for d in plan.decisions:
        counts[d.label] = counts.get(d.label, 0) + 1
    blocks = ", ".join(f"{n} {label}" for label, n in sorted(counts.items()))
    return f"activations' host paging {host_budget} bytes ({blocks})"
