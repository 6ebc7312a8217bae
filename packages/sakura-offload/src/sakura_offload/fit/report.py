"""What ``fit`` shows: the plan as a table (:func:`plan_table`) and where every byte of a
wrapped model lives (:func:`memory_report`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sakura_offload.fit.decide import Budgets, FitPlan

__all__ = ["memory_report", "plan_table", "weight_seconds"]


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def weight_seconds(plan: FitPlan, bandwidths: Mapping[str, float]) -> list[float | None]:
    """Expected extra seconds per step of each block's frozen weights: a streamed block is
    copied to the device twice a step (its forward, its backward), so
    ``2 * bytes / bandwidths[tier]``; 0 for a resident block; None where the tier's
    bandwidth is unknown."""
    out: list[float | None] = []
    for size, tier in zip(plan.sizes.block_frozen, plan.block_tiers, strict=True):
        if tier == "device":
            out.append(0.0)
            continue
        per_second = bandwidths.get(tier)
        out.append(None if not per_second else 2 * size / per_second)
    return out


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.3f} ms"


def plan_table(
    plan: FitPlan,
    budgets: Budgets,
    *,
    bandwidths: Mapping[str, float] | None = None,
    activations: Any = None,
) -> str:
    """The plan: per block where its frozen weights live and why, their bytes and the
    expected extra time per step (``bandwidths``: one-way bytes/s of each tier weights
    stream from, :func:`weight_seconds`; ``activations``: the memory planner's
    :class:`~sakura_offload.MemoryPlan`, whose per-block ``cost_seconds`` are added for the
    activations' choice), then the totals and the reasons each cheaper plan was rejected
    (and a re-plan, when one was made)."""
    why = {
        "device": "resident: the device budget holds it",
        "host": "streamed from host RAM: the device budget cannot hold every block",
        "disk": "streamed from disk: host RAM cannot hold it",
    }
    weights = weight_seconds(plan, bandwidths or {})
    acts: dict[str, Any] = {}
    if activations is not None:
        acts = {d.name: d for d in activations.decisions}
    rows = [
        f"{'block':<32} {'frozen':>12}  {'+time/step':>12}  where"
        + ("  (+ activations)" if acts else "")
    ]
    act_total = 0.0
    for name, size, tier, seconds in zip(
        plan.sizes.block_names, plan.sizes.block_frozen, plan.block_tiers, weights, strict=True
    ):
        line = f"{name:<32} {_mb(size):>12}  {_ms(seconds):>12}  {why[tier]}"
        decision = acts.get(name)
        if decision is not None:
            act_total += decision.cost_seconds
            line += f"; activations {decision.choice} +{_ms(decision.cost_seconds)}"
        rows.append(line)
    rows.append(f"{'outside the blocks':<32} {_mb(plan.sizes.outside_frozen_bytes):>12}  resident")
    rows.append(
        f"{'trainable (+ gradients)':<32} {_mb(2 * plan.sizes.trainable_bytes):>12}  device"
    )
    if plan.optimizer == "host":
        state = plan.host_bytes - plan.host_weight_bytes
        where = f"host RAM ({plan.moment_dtype} moments): {plan.moment_reason}"
    else:
        state, where = plan.sizes.optimizer_bytes, "device: the device budget holds it"
    rows.append(f"{'optimizer state':<32} {_mb(state):>12}  {where}")
    if plan.option is not None:
        rows.append(
            f"fit choice: {plan.option.label}, saves {_mb(plan.option.bytes_saved)} "
            f"({plan.option.description})"
        )
    rows.append(
        f"totals: device {_mb(plan.device_bytes)} of {_mb(budgets.device)} "
        f"(activations get {_mb(plan.activation_budget)}); host {_mb(plan.host_bytes)} of "
        f"{_mb(budgets.host)}"
        + (
            f" ({_mb(budgets.host_reserve)} of it kept free: host_reserve)"
            if budgets.host_reserve
            else ""
        )
        + f"; disk {_mb(plan.disk_bytes)}"
    )
    moved = sum(2 * b for b, t in zip(plan.sizes.block_frozen, plan.block_tiers, strict=True)
                if t != "device")  # fmt: skip
    known = [s for s in weights if s is not None]
    weight_total = sum(known) if len(known) == len(weights) else None
    speeds = ", ".join(f"{t} {v / 1e9:.3g} GB/s" for t, v in sorted((bandwidths or {}).items()))
    line = (
        f"expected extra time per step: weights {_ms(weight_total)} ({_mb(moved)} copied to "
        f"the device{'; ' + speeds if speeds else ''})"
    )
    if acts:
        total = None if weight_total is None else weight_total + act_total
        line += f", activations {_ms(act_total)}, total {_ms(total)}"
    else:
        line += ", activations: planned at the first forward"
    rows.append(line)
    rows.extend(f"  {line}" for line in plan.reasons)
    return "\n".join(rows)


def memory_report(model: Any) -> dict[str, Any]:
    """Where the state of a model ``sakura_offload.wrap`` (or the ``fit`` service)
    prepared lives, in bytes by place and category, measured from the parts in use:
    ``device`` (``trainable``, ``gradients``, ``frozen``, ``optimizer``,
    ``activation_budget``), ``host`` (``frozen``: streamed blocks in RAM; ``optimizer``:
    OffloadAdamW's moments and masters), ``disk`` (``frozen``), ``moved`` (bytes copied
    per step by the optimizer, ``d2h_bytes_per_step`` / ``h2d_bytes_per_step``, and the
    weight streaming's counters: blocks materialised so far, the most bytes of them live
    at once), ``plan`` (the plan's summary) and ``activations`` (the memory planner's
    table once it planned), ``replans`` (what re-planning after the measured first step
    changed: :mod:`.replan`) and ``table`` (the plan's table with the expected extra time
    per block, :func:`plan_table`)."""
    from sakura_offload.host_optimizer.optimizer import OffloadAdamW

    state = getattr(model, "sakura_fit", None)
    if state is None:
        raise ValueError("memory_report: the model was not wrapped by sakura_offload.wrap / fit")
    device = model_device_bytes(model)
    host_optimizer = 0
    moved: dict[str, int] = {}
    optimizer = state.optimizer
    while optimizer is not None and not isinstance(optimizer, OffloadAdamW):
        optimizer = getattr(optimizer, "optimizer", None)
    if optimizer is not None:
        stats = optimizer.stats()
        host_optimizer = int(stats["moment_bytes"]) + int(stats["master_bytes"])
        moved["d2h_bytes_per_step"] = int(stats["d2h_bytes_per_step"])
        moved["h2d_bytes_per_step"] = int(stats["h2d_bytes_per_step"])
    elif state.optimizer is not None:
        device["optimizer"] = sum(
            v.numel() * v.element_size()
            for s in state.optimizer.state.values()
            for v in s.values()
            if hasattr(v, "numel")
        )
    host_frozen = disk_frozen = 0
    if state.paging is not None:
        stats = state.paging.stats
        disk_frozen = stats.disk_bytes
        host_frozen = stats.paged_bytes - stats.disk_bytes
        device["frozen"] -= stats.paged_bytes - stats.live_bytes  # (the stored copies)
        moved["weight_blocks_materialised"] = stats.materialised
        moved["weight_max_live_bytes"] = stats.max_live_bytes
    device["activation_budget"] = state.plan.activation_budget
    planner = state.planner
    applied = getattr(planner, "applied", None)
    return {
        "plan": state.plan.summary(),
        "device": device,
        "host": {"frozen": host_frozen, "optimizer": host_optimizer},
        "disk": {"frozen": disk_frozen},
        "moved": moved,
        "activations": None if applied is None else applied.table(),
        "replans": [r.describe() for r in state.replans],
        "table": plan_table(
            state.plan, state.budgets, bandwidths=state.bandwidths, activations=applied
        ),
    }


def model_device_bytes(model: Any) -> dict[str, Any]:
    """Bytes of ``model``'s tensors on its device, by category (every frozen tensor counted:
    :func:`memory_report` takes the streamed ones off)."""
    params = list(model.parameters())
    trainable = frozen = grads = 0
    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        size = p.numel() * p.element_size()
        if p.requires_grad:
            trainable += size
            if p.grad is not None:
                grads += p.grad.numel() * p.grad.element_size()
        else:
            frozen += size
    for b in model.buffers():
        frozen += b.numel() * b.element_size()
    return {"trainable": trainable, "gradients": grads, "frozen": frozen, "optimizer": 0}
