"""Costs: the extra time per step of each choice for each block.

Measured where it can be: one block of each shape runs forward + backward on the inputs it
got in the measured pass, under keep and each other choice (:func:`time_choices`), and a
choice costs the median of its difference to keep.  Where that cannot run, or a tier's
bandwidth is given, paging costs its copy bytes over the round-trip bandwidth (given, or
probed with tensors of one block's sizes) and recomputing the block's forward time
(:class:`Costs`).  See ``docs/offload.md``, "The memory planner: design"."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from sakura_offload.planner.measure import BlockSample, _sync, order
from sakura_offload.planner.plan import BlockDecision

if TYPE_CHECKING:
    from sakura_offload.planner import MemoryPlanner

__all__ = [
    "Costs",
    "bandwidth",
    "cached_costs",
    "copy_bandwidth",
    "tier_bandwidth",
    "time_choices",
    "timed_costs",
]

Run = Callable[[str, tuple[Any, ...], dict[str, Any]], Any]
"""``run(choice, args, kwargs)``: call the block with ``choice`` applied."""

_LOG = logging.getLogger("sakura_offload.planner")

clock: Callable[[], float] = time.perf_counter
"""The clock trials are timed with (a test replaces it with one it advances itself)."""


_PROBE_CAP = 256 * 2**20
"""Most bytes a bandwidth probe copies (one block's pageable tensors, largest first)."""


def _fresh(t: torch.Tensor) -> torch.Tensor:
    # A copy per trial: a block that changes an input in place changes the copy, never the
    # storage it shares with the training's own tensors; and an input that requires grad
    # becomes the output of an op, as in training (paging leaves a leaf alone).
    return t.clone()


def _sync_type(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def _trial(
    sample: BlockSample,
    choice: str,
    run: Run,
    targets: list[torch.Tensor],
) -> float:
    device_type, enabled, dtype = sample.autocast
    _sync_type(device_type)
    start = clock()
    with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
        args = tree_map_only(torch.Tensor, _fresh, sample.args)
        kwargs = tree_map_only(torch.Tensor, _fresh, sample.kwargs)
        out = run(choice, args, kwargs)
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        torch.autograd.grad(outs, targets, [torch.ones_like(t) for t in outs], allow_unused=True)
    _sync_type(device_type)
    elapsed = clock() - start
    del out, outs, args, kwargs
    return elapsed


def time_choices(
    sample: BlockSample,
    choices: Sequence[str],
    run: Run,
    trials: int,
) -> dict[str, float] | None:
    """Extra seconds of each choice over ``"keep"`` for one call of the block: the median
    over ``trials`` rounds (after one unmeasured round) of each round's difference, the
    choices in a rotated order each round; at least 0.  A choice the block cannot run
    under (a block that changes its input in place cannot be recomputed) costs ``inf``
    and is not tried again.  None when the block has nothing to differentiate, runs out
    of device memory, or fails even when kept."""
    targets = [
        t for t in tree_leaves((sample.args, sample.kwargs))
        if isinstance(t, torch.Tensor) and t.requires_grad
    ] + [p for p in sample.module.parameters() if p.requires_grad]  # fmt: skip
    if not targets:
        return None
    order = ["keep", *(c for c in choices if c != "keep")]
    buffers = {name: b.detach().clone() for name, b in sample.module.named_buffers()}
    devices = [t.device for t in targets if t.device.type == "cuda"]
    differences: dict[str, list[float]] = {c: [] for c in order[1:]}
    failed: dict[str, str] = {}
    try:
        with torch.random.fork_rng(devices=sorted({d.index or 0 for d in devices})):
            for round_ in range(trials + 1):
                shift = round_ % len(order)
                times: dict[str, float] = {}
                for c in order[shift:] + order[:shift]:
                    if c in failed:
                        continue
                    try:
                        times[c] = _trial(sample, c, run, targets)
                    except torch.OutOfMemoryError:
                        raise
                    except Exception as exc:  # the block cannot run this way
                        if c == "keep":
                            raise
                        failed[c] = f"{type(exc).__name__}: {exc}"
                        _LOG.info("cost trial of %s failed (%s); not chosen", c, failed[c])
                if round_ > 0:
                    for c in order[1:]:
                        if c not in failed:
                            differences[c].append(times[c] - times["keep"])
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None
    except Exception as exc:  # even keeping fails here: leave the costs estimated
        _LOG.warning("cost trials skipped: the block failed when kept (%s)", exc)
        return None
    finally:
        with torch.no_grad():
            for name, b in sample.module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    costs = {"keep": 0.0}
    costs.update({c: max(0.0, statistics.median(d)) for c, d in differences.items() if d})
    costs.update({c: math.inf for c in failed})
    return costs


# --- the planner's costs --------------------------------------------------------------------


def probe_sizes(planner: MemoryPlanner) -> list[int]:
    """Byte sizes of the pageable saved tensors of the block that pages the most (at
    most ``_PROBE_CAP`` bytes in all): what a bandwidth probe copies, so that the
    estimate carries the real tensors' sizes and per-tensor costs, not one cached
    buffer's."""
    recorder = planner._recorder
    blocks = recorder.blocks if recorder is not None else []
    if not blocks:
        return [1 << 22]
    widest = max(blocks, key=lambda b: b.copy_bytes)
    sizes, total = [], 0
    for nbytes, pageable in sorted(widest.saved.values(), key=lambda e: -e[0]):
        if pageable and nbytes > 0 and total + nbytes <= _PROBE_CAP:
            sizes.append(nbytes)
            total += nbytes
    return sizes or [1 << 22]


def bandwidth(planner: MemoryPlanner, tier: str) -> float:
    """Round-trip bytes per second of ``tier``: as given, else measured by paging out
    tensors of the sizes one block saves (all packed, then all unpacked, as forward and
    backward do), the best of five rounds (the first ones also pay for fresh pages)."""
    given = planner.host_bandwidth if tier == "host" else planner.disk_bandwidth
    if given is not None:
        return float(given)
    pager = planner._pager("page_host" if tier == "host" else "page_disk")
    # filled, not random: the probe must not draw from the training's RNG
    probes = [
        torch.full((max(1, n // 4),), 1.5, device=planner.device) for n in probe_sizes(planner)
    ]
    nbytes = sum(p.numel() * p.element_size() for p in probes)
    best = math.inf
    for _ in range(5):
        _sync(planner.device)
        start = time.perf_counter()
        pages = [pager.pack(p) for p in probes]
        back = [pager.unpack(page) for page in pages]
        _sync(planner.device)
        best = min(best, time.perf_counter() - start)
        del pages, back
    return nbytes / max(best, 1e-9)


def copy_bandwidth(
    device: torch.device,
    sizes: Sequence[int],
    *,
    tier: str = "host",
    directory: str | os.PathLike[str] | None = None,
    rounds: int = 5,
) -> float:
    """One-way bytes per second from ``tier`` to ``device``, as weight streaming copies:
    tensors of ``sizes`` bytes from host RAM (page-locked on CUDA) or, for ``"disk"``, from
    a memory-mapped file written in ``directory`` (the system's temporary directory when
    None; the page cache serves it while RAM has room, as it serves the streamed blocks)
    copied to ``device``; the best of ``rounds``."""
    if tier not in ("host", "disk"):
        raise ValueError(f"copy_bandwidth: tier={tier!r} is not accepted; 'host' or 'disk'")
    counts = [max(1, n // 4) for n in sizes]
    with contextlib.ExitStack() as stack:
        if tier == "disk":
            folder = stack.enter_context(tempfile.TemporaryDirectory(dir=directory))
            path = os.path.join(folder, "probe.bin")
            torch.full((sum(counts),), 1.5).numpy().tofile(path)
            flat = torch.from_file(path, shared=False, size=sum(counts), dtype=torch.float32)
            sources = list(flat.split(counts))
        else:
            pin = device.type == "cuda"
            sources = [torch.full((c,), 1.5, pin_memory=pin) for c in counts]
        nbytes = 4 * sum(counts)
        best = math.inf
        for _ in range(rounds):
            _sync(device)
            start = time.perf_counter()
            copies = [_copy_to(s, device) for s in sources]
            _sync(device)
            best = min(best, time.perf_counter() - start)
            del copies
    return nbytes / max(best, 1e-9)


def _copy_to(source: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``source`` copied to ``device`` as weight streaming copies it (on a CPU, into a
    memory map of its own: :func:`~sakura_offload.paging.mapped.mapped_empty_like`)."""
    if device.type == "cpu":
        from sakura_offload.paging.mapped import mapped_empty_like

        return mapped_empty_like(source).copy_(source)
    return source.to(device, copy=True, non_blocking=True)


def cached_costs(planner: MemoryPlanner) -> dict[int, dict[str, float]] | None:
    """The costs timed on the current measurement, or None when not timed yet."""
    recorder = planner._recorder
    if planner._timed is None or recorder is None or planner._timed[0] != recorder.forwards:
        return None
    return planner._timed[1]


def timed_costs(
    planner: MemoryPlanner, measured: Sequence[BlockDecision], allowed: Sequence[str]
) -> dict[int, dict[str, float]]:
    """Block index -> extra seconds per step of each choice, timed on one block of each
    shape (blocks with the same measured bytes and class) through the code the plan
    runs; blocks that could not be timed are missing (their costs are estimated).  A
    tier with a given bandwidth is not timed.  Done once per measurement."""
    recorder = planner._recorder
    if recorder is None or planner.cost_trials == 0:
        return {}
    cached = cached_costs(planner)
    if cached is not None:
        return cached
    given = {"page_host": planner.host_bandwidth, "page_disk": planner.disk_bandwidth}
    choices = [c for c in allowed if given.get(c) is None]
    pagers = {c: planner._pager(c) for c in choices if c in given}
    shapes: dict[tuple[Any, ...], list[int]] = {}
    for i in order(planner):
        d, block = measured[i], recorder.blocks[i]
        key = (
            type(planner.wrappers[i].module),
            block.calls,
            d.activation_bytes,
            d.pageable_bytes,
            d.copy_bytes,
            d.input_bytes,
            d.recompute_bytes,
            d.parameter_bytes,
        )
        shapes.setdefault(key, []).append(i)

    timed: dict[int, dict[str, float]] = {}
    # untracked: the trials' backward goes through autograd.grad, and tracking's
    # gradient hooks on parameters cannot run there (nor should trials count)
    saved = planner._pagers, planner.track
    planner._pagers, planner.track = pagers, False
    try:
        for indices in shapes.values():
            found = [(i, recorder.blocks[i].sample) for i in indices]
            index, sample = next(((i, s) for i, s in found if s is not None), (-1, None))
            if sample is None:
                continue
            costs = time_choices(sample, choices, trial_call(planner, index), planner.cost_trials)
            if costs is not None:
                for i in indices:
                    calls = recorder.blocks[i].calls
                    timed[i] = {c: seconds * calls for c, seconds in costs.items()}
    finally:
        planner._pagers, planner.track = saved
        for block in recorder.blocks:
            block.sample = None  # the inputs' storages are not held beyond this
    planner._timed = (recorder.forwards, timed)
    return timed


def trial_call(planner: MemoryPlanner, index: int) -> Callable[[str, Any, Any], Any]:
    """Calls block ``index`` (module hooks and all) with a choice applied to it."""
    wrapper = planner.wrappers[index]

    def run(choice: str, args: Any, kwargs: Any) -> Any:
        previous, wrapper.choice = wrapper.choice, choice
        try:
            return wrapper.module(*args, **kwargs)
        finally:
            wrapper.choice = previous

    return run


def tier_bandwidth(
    planner: MemoryPlanner,
    choice: str,
    measured: Sequence[BlockDecision],
    timed: Mapping[int, Mapping[str, float]],
) -> float:
    """The round-trip bandwidth shown for a paging tier and used for blocks whose cost
    was not timed: given, or probed when some block needs it, else the effective one."""
    tier = "host" if choice == "page_host" else "disk"
    given = planner.host_bandwidth if tier == "host" else planner.disk_bandwidth
    if given is not None or any(choice not in timed.get(i, {}) for i in range(len(measured))):
        return bandwidth(planner, tier)
    finite = [i for i in range(len(measured)) if math.isfinite(timed[i][choice])]
    copied = sum(measured[i].copy_bytes for i in finite)
    seconds = sum(timed[i][choice] for i in finite)
    return copied / max(seconds, 1e-9) if finite else 0.0


@dataclass(frozen=True)
class Costs:
    """``costs(i, choice)``: extra seconds per step of ``choice`` for block ``i``: timed
    where it was (``timed``), else estimated: recomputation as the block's forward time,
    paging as its copy bytes over the tier's round-trip bandwidth (``inf`` without one)."""

    measured: Sequence[BlockDecision]
    timed: Mapping[int, Mapping[str, float]]
    host_bandwidth: float
    disk_bandwidth: float

    def __call__(self, i: int, choice: str) -> float:
        d = self.measured[i]
        if choice == "keep":
            return 0.0
        seconds = self.timed.get(i, {}).get(choice)
        if seconds is not None:
            return seconds
        if choice == "recompute":
            return d.forward_seconds
        per_second = self.host_bandwidth if choice == "page_host" else self.disk_bandwidth
        return d.copy_bytes / per_second if per_second > 0 else math.inf
