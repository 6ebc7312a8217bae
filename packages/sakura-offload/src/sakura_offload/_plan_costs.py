"""Measured costs for the memory planner: time one block's forward + backward under each
choice (keep, page to host, page to disk, recompute) and take the extra time over keeping.

Why measure instead of estimating: the planner used to charge paging its copy bytes over a
probed bandwidth and recomputation a block's forward time.  On a CPU the probe moved by
10x with the allocator's state, and a recomputed forward costs less than a measured one
(the memory it frees makes the rest cheaper), so the planner paged to disk where
recomputing was far cheaper.  A trial calls the real block (its module hooks run too, e.g.
``WeightPaging`` bringing its weights in) on the inputs it got in the measured forward
pass, with the choice under test applied, so copies, page faults, allocator effects and
the block's real backward are all in the figure.

Trials leave no trace: they run on copies of the inputs (an in-place change of an input
never reaches the training's tensors), gradients go through ``torch.autograd.grad`` (no
``.grad`` is touched), the RNG state is restored (a block with dropout draws the same
numbers in training as without the planner) and so are the block's buffers (BatchNorm
statistics).  A block whose arguments hold objects other than tensors and plain values (a
KV cache object, which every forward would append to) is not run: its costs stay
estimated.  A choice the block fails under costs ``inf``, so it is never chosen.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = ["BlockSample", "capture_sample", "time_choices"]

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)

Run = Callable[[str, tuple[Any, ...], dict[str, Any]], Any]
"""``run(choice, args, kwargs)``: call the block with ``choice`` applied."""

_LOG = logging.getLogger("sakura_offload.planner")

clock: Callable[[], float] = time.perf_counter
"""The clock trials are timed with (a test replaces it with one it advances itself)."""


@dataclass
class BlockSample:
    """What a block got in the measured forward: its inputs and autocast state."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    autocast: tuple[str, bool, torch.dtype]


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.requires_grad)


def capture_sample(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> BlockSample | None:
    """The block's inputs as new leaves of autograd (the same storages, no copy), or None
    when an argument is an object a forward could change (see the module docstring)."""
    everything = tree_leaves((args, kwargs))
    if not all(isinstance(x, (torch.Tensor, *_PLAIN)) for x in everything):
        return None
    leaves = [x for x in everything if isinstance(x, torch.Tensor)]
    device_type = leaves[0].device.type if leaves else "cpu"
    autocast = (
        device_type,
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
    )
    return BlockSample(
        module,
        tree_map_only(torch.Tensor, _detached, args),
        tree_map_only(torch.Tensor, _detached, kwargs),
        autocast,
    )


def _fresh(t: torch.Tensor) -> torch.Tensor:
    # A copy per trial: a block that changes an input in place changes the copy, never the
    # storage it shares with the training's own tensors; and an input that requires grad
    # becomes the output of an op, as in training (paging leaves a leaf alone).
    return t.clone()


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def _trial(
    sample: BlockSample,
    choice: str,
    run: Run,
    targets: list[torch.Tensor],
) -> float:
    device_type, enabled, dtype = sample.autocast
    _sync(device_type)
    start = clock()
    with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
        args = tree_map_only(torch.Tensor, _fresh, sample.args)
        kwargs = tree_map_only(torch.Tensor, _fresh, sample.kwargs)
        out = run(choice, args, kwargs)
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        torch.autograd.grad(outs, targets, [torch.ones_like(t) for t in outs], allow_unused=True)
    _sync(device_type)
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
