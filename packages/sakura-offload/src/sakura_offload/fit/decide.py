"""``fit``'s decisions: pure functions of measured sizes and budgets.

A plan is tried in this order of cost, and the first that fits both budgets is taken
(:func:`decide`):

1. everything resident on the device (the optimizer as the loop built it);
2. the optimizer on the host (:class:`~sakura_offload.OffloadAdamW`), its moments float32
   → bfloat16 → int8 as the host budget requires
   (:func:`~sakura_offload.host_optimizer.placement.choose_moment_dtype`);
3. the blocks' frozen weights streamed from host RAM (:class:`~sakura_offload.WeightPaging`),
   the optimizer on the device if it still fits there, else on the host;
4. streamed from disk for the blocks host RAM cannot hold (only with ``disk_offload``), the
   optimizer again on the device first;
5. steps 1-4 again with the frozen weights shrunk by a fit choice (a plugin's, see
   :mod:`.choices`: sakura-quant's int8, then nf4), the cheapest option first: only when
   nothing fits otherwise.

Device bytes counted: trainable parameters and their gradients, frozen tensors that stay
(all of them when resident; those outside the blocks when streamed, plus ``prefetch + 1``
of the largest blocks being used), the optimizer's state when it stays (AdamW: two moments
the size of the parameters) and ``activation_reserve``.  What is left of the device budget
goes to the activations (:class:`~sakura_offload.MemoryPlanner` keeps, pages or recomputes
them to fit it).  Host bytes counted: OffloadAdamW's moments and fp32 masters, and the
streamed blocks kept in host RAM, and ``host_reserve``: host RAM kept free for what no
part accounts for (the allocator's slack, the loop's own buffers).  When nothing fits, :class:`FitError` names the smallest
device budget (and, if that is the limit, host budget) that would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from sakura_offload.fit.choices import FitOption
from sakura_offload.host_optimizer.placement import choose_moment_dtype, moment_bytes
from sakura_offload.planner.plan import MemoryBudgetError

__all__ = [
    "Budgets",
    "FitError",
    "FitPlan",
    "ModelSizes",
    "auto_host_reserve",
    "candidates",
    "decide",
    "smallest_host_budget",
]

OPTIMIZER_PLACES = ("device", "host")
WEIGHT_PLACES = ("resident", "host", "disk")
LADDER = (
    ("device", "resident"),
    ("host", "resident"),
    ("device", "host"),
    ("host", "host"),
    ("device", "disk"),
    ("host", "disk"),
)
"""(optimizer, frozen weights) in the order they are tried, cheapest first.  Streaming the
frozen weights moves all of them twice a step, far more than a host optimizer moves (the
trainable parameters' gradients and values), so the optimizer goes to the host before any
weight streams; once weights stream, keeping the optimizer on the device (no copies, no host
step) is tried first, since streaming frees the device memory it may need."""


class FitError(MemoryBudgetError):
    """No plan fits the budgets; ``minimum`` is the smallest device budget that would
    (``host_minimum``: the smallest host budget with it, or None when host RAM is not the
    limit)."""

    def __init__(
        self, message: str, *, budget: int, minimum: int, host_minimum: int | None = None
    ) -> None:
        super().__init__(message, budget=budget, minimum=minimum)
        self.host_minimum = host_minimum


def _gib(n: int) -> str:
    return f"{n / 2**30:.4g} GiB ({n} bytes)"


@dataclass(frozen=True)
class ModelSizes:
    """What a model's state measures (bytes), as ``fit`` needs it.

    ``trainable_bytes`` / ``trainable_numel``: parameters that train (their gradients take
    as much); ``master_bytes``: fp32 master copies OffloadAdamW keeps for the trainable
    parameters that are not fp32; ``optimizer_bytes``: the loop's optimizer state on the
    device (AdamW: ``2 * trainable_bytes`` and a ``step`` tensor each); ``host_optimizer``: whether the optimizer can
    become an OffloadAdamW (an Adam or AdamW); ``outside_frozen_bytes``: frozen tensors
    outside the blocks; ``block_names`` / ``block_frozen``: each block and the bytes of
    frozen tensors streaming would take off the device."""

    trainable_bytes: int
    trainable_numel: int
    master_bytes: int
    optimizer_bytes: int
    host_optimizer: bool
    outside_frozen_bytes: int
    block_names: tuple[str, ...]
    block_frozen: tuple[int, ...]

    @property
    def frozen_bytes(self) -> int:
        return self.outside_frozen_bytes + sum(self.block_frozen)

    def shrunk(self, option: FitOption) -> ModelSizes:
        """These sizes once ``option`` is applied (its savings subtracted per block)."""
        frozen = list(self.block_frozen)
        outside = self.outside_frozen_bytes
        for module, saved in option.saved.items():
            for i, block in enumerate(self.block_names):
                if module == block or module.startswith(block + "."):
                    frozen[i] -= saved
                    break
            else:
                outside -= saved
        if min([*frozen, outside]) < 0:
            raise ValueError(f"fit choice {option.label} claims to save more than there is")
        return dataclasses.replace(self, block_frozen=tuple(frozen), outside_frozen_bytes=outside)


HOST_RESERVE_SHARE = 8
"""``host_reserve="auto"`` keeps 1/8 of an explicit ``host_budget`` free ..."""
HOST_RESERVE_CAP = 2**30
"""... and at most 1 GiB of it."""


def auto_host_reserve(host_budget: int) -> int:
    """``host_reserve="auto"`` for an explicit ``host_budget``."""
    return min(host_budget // HOST_RESERVE_SHARE, HOST_RESERVE_CAP)


@dataclass(frozen=True)
class Budgets:
    """``device``: device bytes (None: no limit); ``host``: host RAM for the optimizer and
    the streamed weights; ``disk``: bytes the disk tier may take (None: no disk tier);
    ``activation_reserve``: device bytes kept for activations; ``prefetch``: blocks copied
    ahead while one runs (WeightPaging's); ``moment_dtype``: ``"auto"`` or a fixed format
    for the host optimizer; ``host_reserve``: host bytes counted in every plan and given to
    no part (a plan's ``host_bytes`` include them)."""

    device: int | None
    host: int
    disk: int | None = None
    activation_reserve: int = 0
    prefetch: int = 1
    moment_dtype: str = "auto"
    host_reserve: int = 0
    host_reserve_auto: bool = False
    """Whether ``host_reserve`` is :func:`auto_host_reserve` of ``host`` (then a larger
    budget brings a larger reserve: :func:`smallest_host_budget` accounts for it)."""


@dataclass(frozen=True)
class FitPlan:
    """A decided plan: where the optimizer and the frozen weights live, the fit option
    applied (or None), and the bytes each place takes."""

    optimizer: str
    weights: str
    option: FitOption | None
    sizes: ModelSizes
    moment_dtype: str | None
    moment_reason: str
    block_tiers: tuple[str, ...]
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    activation_budget: int | None
    reasons: tuple[str, ...] = ()

    @property
    def streamed_blocks(self) -> list[int]:
        return [i for i, tier in enumerate(self.block_tiers) if tier != "device"]

    @property
    def host_weight_bytes(self) -> int:
        return sum(
            b for b, t in zip(self.sizes.block_frozen, self.block_tiers, strict=True) if t == "host"
        )

    def summary(self) -> str:
        parts = [f"optimizer on the {self.optimizer}"]
        if self.optimizer == "host":
            parts[0] += f" ({self.moment_dtype} moments)"
        parts.append(
            "frozen weights resident" if self.weights == "resident" else
            f"frozen weights streamed from {self.weights}"
        )  # fmt: skip
        if self.option is not None:
            parts.append(f"frozen base shrunk by {self.option.label}")
        return "; ".join(parts)


def _working_set(block_frozen: Sequence[int], prefetch: int) -> int:
    return sum(sorted(block_frozen, reverse=True)[: prefetch + 1])


def candidates(
    sizes: ModelSizes,
    budgets: Budgets,
    option: FitOption | None = None,
    ladder: Sequence[tuple[str, str]] = LADDER,
) -> list[FitPlan]:
    """The plans of ``ladder`` (default :data:`LADDER`) for ``sizes`` (already shrunk by
    ``option``), in order, whatever the budgets (each with its bytes; :func:`decide` takes
    the first that fits).  Plans that cannot exist (host optimizer for an optimizer that is
    not AdamW, disk without a disk tier) are left out."""
    plans: list[FitPlan] = []
    grads = sizes.trainable_bytes
    n = len(sizes.block_frozen)
    for optimizer, weights in ladder:
        if optimizer == "host" and not sizes.host_optimizer:
            continue
        if weights == "disk" and budgets.disk is None:
            continue
        device = sizes.trainable_bytes + grads + budgets.activation_reserve
        host = budgets.host_reserve
        dtype: str | None = None
        reason = ""
        if optimizer == "device":
            device += sizes.optimizer_bytes
        if weights == "resident":
            device += sizes.frozen_bytes
            tiers = ("device",) * n
        else:
            device += sizes.outside_frozen_bytes + _working_set(
                sizes.block_frozen, budgets.prefetch
            )
            tiers = ("host",) * n
        streamed_host = sum(sizes.block_frozen) if weights == "host" else 0
        if optimizer == "host":
            room = budgets.host - budgets.host_reserve - streamed_host
            if budgets.moment_dtype == "auto":
                decision = choose_moment_dtype(sizes.trainable_numel, sizes.master_bytes, room)
                dtype, reason = decision.value, decision.reason
            else:
                dtype, reason = budgets.moment_dtype, f"moment_dtype={budgets.moment_dtype!r}"
            host += moment_bytes(dtype, sizes.trainable_numel) + sizes.master_bytes
        disk = 0
        if weights == "disk":  # whole blocks in order while host RAM holds them
            left = budgets.host - host
            chosen = []
            for b in sizes.block_frozen:
                if b <= left:
                    chosen.append("host")
                    left -= b
                else:
                    chosen.append("disk")
                    disk += b
            tiers = tuple(chosen)
            host += sum(b for b, t in zip(sizes.block_frozen, tiers, strict=True) if t == "host")
        else:
            host += streamed_host
        activations = None if budgets.device is None else budgets.device - device
        plans.append(
            FitPlan(
                optimizer=optimizer,
                weights=weights,
                option=option,
                sizes=sizes,
                moment_dtype=dtype,
                moment_reason=reason,
                block_tiers=tiers,
                device_bytes=device,
                host_bytes=host,
                disk_bytes=disk,
                activation_budget=activations,
            )
        )
    return plans


def _fits(plan: FitPlan, budgets: Budgets) -> bool:
    if budgets.device is not None and plan.device_bytes > budgets.device:
        return False
    if plan.host_bytes > budgets.host:
        return False
    return budgets.disk is None or plan.disk_bytes <= budgets.disk


def decide(
    sizes: ModelSizes,
    budgets: Budgets,
    options: Sequence[FitOption] = (),
    *,
    forced: FitOption | None = None,
) -> FitPlan:
    """The first plan that fits (see the module docstring); ``options``: what the fit
    choices offer, tried cheapest first only when nothing fits without them; ``forced``:
    the one option every plan applies (the user asked for it: ``quantize="nf4"``).
    Raises :class:`FitError` naming the smallest budgets that would fit."""
    ranked = sorted(options, key=lambda o: (o.cost, -o.bytes_saved))
    tried: list[FitPlan] = []
    for option in [None, *ranked] if forced is None else [forced]:
        shrunk = sizes if option is None else sizes.shrunk(option)
        for plan in candidates(shrunk, budgets, option):
            tried.append(plan)
            if _fits(plan, budgets):
                return dataclasses.replace(plan, reasons=_reasons(plan, tried[:-1], budgets))
    raise _no_fit(tried, budgets)


def _describe(plan: FitPlan) -> str:
    return plan.summary()


def _reasons(plan: FitPlan, rejected: Sequence[FitPlan], budgets: Budgets) -> tuple[str, ...]:
    lines = [f"not {_describe(p)}: {_why_not(p, budgets)}" for p in rejected]
    limit = "no device limit" if budgets.device is None else f"device budget {_gib(budgets.device)}"
    lines.append(
        f"{_describe(plan)}: needs {_gib(plan.device_bytes)} on the device ({limit}), "
        f"{_gib(plan.host_bytes)} of host RAM (budget {_gib(budgets.host)})"
        + (f", {_gib(plan.disk_bytes)} on disk" if plan.disk_bytes else "")
    )
    if plan.moment_reason:
        lines.append(f"moments: {plan.moment_reason}")
    return tuple(lines)


def _why_not(plan: FitPlan, budgets: Budgets) -> str:
    if budgets.device is not None and plan.device_bytes > budgets.device:
        return f"needs {_gib(plan.device_bytes)} on the device"
    if plan.host_bytes > budgets.host:
        return f"needs {_gib(plan.host_bytes)} of host RAM"
    return f"needs {_gib(plan.disk_bytes)} on disk"


def _no_fit(tried: Sequence[FitPlan], budgets: Budgets) -> FitError:
    """The error for budgets nothing fits: the device budget of the smallest plan when the
    device is the limit (and that plan's host budget when host RAM is too), else the
    smallest host budget among the plans the device budget holds."""
    device = budgets.device
    small = min(tried, key=lambda p: (p.device_bytes, p.host_bytes))
    disk_hint = "" if budgets.disk is not None else " (or give disk_offload=DIR)"
    if device is not None and device < small.device_bytes:
        host_min = (
            smallest_host_budget(small.host_bytes, budgets)
            if small.host_bytes > budgets.host else None
        )  # fmt: skip
        return FitError(
            f"fit: no plan fits device_budget={_gib(device)}; the smallest plan "
            f"({_describe(small)}) needs device_budget >= {_gib(small.device_bytes)}"
            + ("" if host_min is None else f" and host_budget >= {_gib(host_min)}{disk_hint}")
            + " (activations come on top: the memory planner measures them at the first step)",
            budget=device,
            minimum=small.device_bytes,
            host_minimum=host_min,
        )
    held = [p for p in tried if device is None or p.device_bytes <= device]
    best = min(held, key=lambda p: (p.host_bytes, p.device_bytes))
    host_min = smallest_host_budget(best.host_bytes, budgets)
    return FitError(
        f"fit: no plan fits host_budget={_gib(budgets.host)}"
        + ("" if budgets.disk is None else f" and a disk tier of {_gib(budgets.disk)}")
        + f"; the smallest plan the device budget holds ({_describe(best)}) needs "
        f"host_budget >= {_gib(host_min)}"
        + (f" and {_gib(best.disk_bytes)} on disk" if best.disk_bytes else "")
        + disk_hint,
        budget=device or 0,
        minimum=best.device_bytes,
        host_minimum=host_min,
    )


def smallest_host_budget(host_bytes: int, budgets: Budgets) -> int:
    """The smallest ``host_budget`` a plan of ``host_bytes`` (its parts plus
    ``budgets.host_reserve``) fits: with an automatic reserve, a larger budget reserves
    more, so the parts' bytes are what must fit beside :func:`auto_host_reserve` of it."""
    if not budgets.host_reserve_auto:
        return host_bytes
    parts = host_bytes - budgets.host_reserve
    if parts > (HOST_RESERVE_SHARE - 1) * HOST_RESERVE_CAP:
        return parts + HOST_RESERVE_CAP
    budget = parts * HOST_RESERVE_SHARE // (HOST_RESERVE_SHARE - 1)
    while budget - auto_host_reserve(budget) < parts:
        budget += 1
    while budget > 0 and budget - 1 - auto_host_reserve(budget - 1) >= parts:
        budget -= 1
    return budget
