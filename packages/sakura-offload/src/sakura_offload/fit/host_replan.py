"""The host side of re-planning: ``host_reserve="auto"`` measured instead of guessed
(:class:`HostReserve`).

With an explicit ``host_budget``, ``fit`` keeps ``host_reserve`` (``"auto"``: 1/8 of it, at
most 1 GiB) from every part, for what no part accounts for: the C allocator's free pages,
the loop's batches, autograd's temporaries, Python objects.  That guess can be too large (the
activation planner then pages blocks to disk or recomputes them where host RAM had room) or
too small (the process's anonymous RSS exceeds the budget).  So it is measured once:

- **the baseline**, when ``fit`` starts applying its plan: the process's anonymous resident
  memory (``RssAnon``, :func:`~sakura_offload.fit.verify.rss_anon`) less the model's tensors
  that are anonymous memory (those whose pages are mapped from a file, e.g. weights
  ``torch.load(..., mmap=True)`` gave, take none: :func:`file_backed_bytes`).  What the
  interpreter, its libraries and the loop held before the model is not the model's, as in
  ``sakura-offload-verify``;
- **the peak**, during the first training step run under the activation planner's plan (the
  step after its measuring forward, once the device side checked its own step): sampled at
  that step's first forward, after each planned block's forward, when each block's backward
  starts (a hook on its output's gradient), after the model's forward and after the optimizer
  step.

The peak less the baseline is what the model's training holds; the limit is ``host_budget``
plus, on a CPU (the simulated device is anonymous RAM too), ``device_budget``.  What is left
under the limit, less a margin (:func:`reserve_margin`), is given to the activation
planner's host paging, at most the reserve; when less than the margin is left, the
difference is taken from the host paging (blocks then page to disk or recompute; what the
host paging cannot return is named in a WARNING).  Nothing changes when the difference is
under 64 KiB, or when the host paging holds every block's copies before and after.  The
planner decides again at once (its timed costs are cached), after the optimizer step: a safe
point, nothing is saved for a backward then, so no value changes.  The change is recorded in
:attr:`FitState.replans <sakura_offload.fit.wrap.FitState>` (``what="host reserve"``), shown
by ``memory_report()`` and the plan's table, and logged (INFO when the reserve is given back,
WARNING when room is taken back).  Once: the step after it is not measured again.

Only ``host_reserve="auto"`` with an explicit ``host_budget`` adapts; an explicit
``host_reserve=N`` is kept as given, and without a ``host_budget`` the reserve is 0 (the
RAM floor keeps RAM free).  On a system without ``/proc/self/status`` nothing is measured.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sakura_offload.fit.wrap import FitState

__all__ = [
    "MARGIN_FLOOR",
    "MARGIN_SHARE",
    "HostReserve",
    "file_backed_bytes",
    "host_baseline",
    "reserve_margin",
    "rss_reader",
]

_LOG = logging.getLogger("sakura_offload.fit")

MARGIN_SHARE = 50
"""The margin is 1/50 (2%) of the limit ...

Measured with ``benchmarks/fit.py`` (limit 72 MiB: 48 MiB host and 24 MiB device budget, a
CPU, fp32 blocks streamed from disk): ``fit``'s peak anonymous RSS with the same plan was
67.6, 68.3 and 68.7 MiB in three runs, a spread of 1.1 MiB (1.5% of the limit); 2% rounds
it up."""
MARGIN_FLOOR = 2**20
"""... and at least 1 MiB: glibc's heap grows in steps of its top pad (128 KiB), and a
block's copies (0.5-7 MiB in the benchmark) come and go between two readings."""
MIN_CHANGE = 64 * 2**10
"""A difference below this (bytes) changes nothing."""


def reserve_margin(limit: int) -> int:
    """Bytes kept free under ``limit`` beyond the measured peak:
    ``max(limit // MARGIN_SHARE, MARGIN_FLOOR)``."""
    if limit < 0:
        raise ValueError(f"reserve_margin: limit must be >= 0, got {limit}")
    return max(limit // MARGIN_SHARE, MARGIN_FLOOR)


def _file_ranges(maps: str) -> list[tuple[int, int]]:
    """Address ranges mapped from a file, sorted, from ``/proc/<pid>/maps`` text."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[4] == "0" or fields[5].startswith("["):
            continue  # anonymous, heap, stack, vdso
        start, _, end = fields[0].partition("-")
        ranges.append((int(start, 16), int(end, 16)))
    ranges.sort()
    return ranges


def file_backed_bytes(tensors: Iterable[torch.Tensor], maps: str | None = None) -> int:
    """Bytes of the distinct CPU storages among ``tensors`` whose memory is mapped from a
    file (their pages are file-backed, not anonymous; ``maps``: the text of
    ``/proc/self/maps``, read when None).  0 where that file does not exist."""
    if maps is None:
        try:
            with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
                maps = f.read()
        except OSError:
            return 0
    ranges = _file_ranges(maps)
    starts = [r[0] for r in ranges]
    total = 0
    for storage in _cpu_storages(tensors):
        ptr = storage.data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr < ranges[i][1]:
            total += storage.nbytes()
    return total


def _cpu_storages(tensors: Iterable[torch.Tensor]) -> Iterator[torch.UntypedStorage]:
    """The distinct, allocated CPU storages behind ``tensors``."""
    seen: set[int] = set()
    for t in tensors:
        if t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr != 0 and ptr not in seen:
            seen.add(ptr)
            yield storage


def rss_reader() -> int:
    """The process's anonymous resident bytes (verify's reader; a test replaces this)."""
    from sakura_offload.fit.verify import rss_anon

    return rss_anon()


def host_baseline(model: Any) -> int | None:
    """The baseline (module docstring): anonymous RSS now less the model's anonymous
    tensors; None where RSS cannot be read."""
    try:
        rss = rss_reader()
    except OSError:
        return None
    tensors = [*model.parameters(), *model.buffers()]
    held = sum(storage.nbytes() for storage in _cpu_storages(tensors))
    return rss - (held - file_backed_bytes(tensors))


class HostReserve:
    """Measures the first planned step's peak anonymous RSS against the budgets and moves
    what is left (or missing) under them to (or from) the activations' host paging (module
    docstring).  ``baseline``: :func:`host_baseline` when ``fit`` started applying."""

    def __init__(self, model: Any, state: FitState, baseline: int) -> None:
        self.model = model
        self.state = state
        self.baseline = baseline
        self.done = False
        self.measuring = False
        self.peak = 0
        self.samples = 0
        self.used: int | None = None
        """The measured peak less the baseline (bytes), once measured."""
        self._handles: list[Any] = []

    @staticmethod
    def applies(state: FitState) -> bool:
        """Whether ``state`` has a reserve that adapts: ``"auto"`` of an explicit
        ``host_budget``, an activation planner to give host room to, and a baseline."""
        return bool(
            state.budgets.host_reserve_auto
            and state.budgets.host_reserve > 0
            and state.planner is not None
            and state.host_baseline is not None
        )

    @property
    def limit(self) -> int:
        """``host_budget``, plus ``device_budget`` on a CPU (the device is host RAM)."""
        budgets = self.state.budgets
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        on_host = device.type == "cpu" and budgets.device is not None
        return budgets.host + (int(budgets.device or 0) if on_host else 0)

    # --- sampling ------------------------------------------------------------------------

    def before_forward(self) -> None:
        """A forward of the model starts: the measured step begins at the first planned
        training step's first forward."""
        if self.done or self.measuring or not torch.is_grad_enabled():
            return
        planner = self.state.planner
        if planner is None or getattr(planner, "applied", None) is None:
            return  # the planner's measuring forward: not a planned step yet
        try:
            self.peak = rss_reader()
        except OSError:  # no /proc/self/status: nothing to measure
            self.done = True
            return
        self.samples = 1
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
            self.peak = max(self.peak, rss_reader())
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

    # --- deciding ------------------------------------------------------------------------

    def after_step(self, steps: int) -> None:
        """An optimizer step ended: the measured step is over; move the difference and
        re-plan the activations (once)."""
        if not self.measuring:
            return
        self.sample()
        self.remove()
        self.used = max(0, self.peak - self.baseline)
        self.apply(steps, self.used)

    def change_for(self, used: int) -> int:
        """Bytes the activations' host paging gains (negative: loses) when the model's
        training measured ``used`` bytes at its peak: what is left under the limit less the
        margin, at most the reserve."""
        limit = self.limit
        return min(limit - used - reserve_margin(limit), self.state.budgets.host_reserve)

    def apply(self, steps: int, used: int) -> None:
        """Move :meth:`change_for` ``used`` to (or from) the activations' host paging."""
        from sakura_offload.fit.replan import Replan

        state = self.state
        planner = state.planner
        reserve, limit = state.budgets.host_reserve, self.limit
        change = self.change_for(used)
        if abs(change) < MIN_CHANGE:
            _LOG.info(
                "fit: the first planned step's anonymous RSS peaked %d bytes above the "
                "baseline, of a limit of %d; the plan stays", used, limit,
            )  # fmt: skip
            return
        old = int(planner.host_budget or 0)
        new = max(0, old + change)
        pageable = sum(d.copy_bytes for d in planner.applied.decisions)
        if min(old, new) >= pageable:  # every block can page to host RAM either way
            _LOG.info(
                "fit: the first planned step's anonymous RSS peaked %d bytes above the "
                "baseline, of a limit of %d; the activations' host paging (%d bytes) holds "
                "every block either way, the plan stays", used, limit, old,
            )  # fmt: skip
            return
        short = max(0, -(old + change))
        before = _paging_summary(planner, old)
        planner.host_budget = new
        applied = planner.decide()
        record = Replan(
            steps, "host reserve", used, limit, before, _paging_summary(planner, new, applied)
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
                "may exceed its limit of %d bytes by about %d (a larger host_budget would "
                "hold it)", old, limit, short,
            )  # fmt: skip


def _paging_summary(planner: Any, host_budget: int, plan: Any = None) -> str:
    plan = plan if plan is not None else planner.applied
    counts: dict[str, int] = {}
    for d in plan.decisions:
        counts[d.label] = counts.get(d.label, 0) + 1
    blocks = ", ".join(f"{n} {label}" for label, n in sorted(counts.items()))
    return f"activations' host paging {host_budget} bytes ({blocks})"
