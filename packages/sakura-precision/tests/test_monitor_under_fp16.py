"""A third-party monitor reading gradients under fp16 loss scaling: ``rt.loss_scale()``.

After backward the gradients still carry the loss scale; a monitor divides by
``rt.loss_scale()`` and gets the values the optimizer step will see after unscaling,
checked against the gradients after ``unscale_gradients`` (in a raw loop with gradient
accumulation and an overflow, and under a real ``lightning.Trainer``), and the scales
checked against torch's hand-written GradScaler loop.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from precision_helpers import loss_fn, make_batches, make_model

from sakura import OnAfterBackward, OnBeforeOptimizerStep, SakuraRuntime
from sakura_precision import MixedPrecision

SETTINGS = {"init_scale": 2.0**19, "growth_interval": 2}  # fp16 overflows first: back-off


def _grad_norm(model: torch.nn.Module) -> float:
    grads = [p.grad.detach().float() for p in model.parameters() if p.grad is not None]
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    )


class GradNormMonitor:
    """What a third-party monitor does: true gradient norms right after backward."""

    name = "grad_norm_monitor"
    priority = 100

    def __init__(self) -> None:
        self.after_backward: list[float] = []
        self.scales: list[float | None] = []
        self.before_step: list[float] = []

    def setup(self, runtime: SakuraRuntime) -> None:
        self.runtime = runtime

    def on_after_backward(self, event: OnAfterBackward) -> None:
        scale = self.runtime.loss_scale()
        self.scales.append(scale)
        self.after_backward.append(_grad_norm(event.model) / (scale or 1.0))

    def on_before_optimizer_step(self, event: OnBeforeOptimizerStep) -> None:
        self.before_step.append(_grad_norm(event.model))  # unscaled by now


def _assert_norms_close(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        if math.isinf(e) or math.isnan(e):
            assert not math.isfinite(a)
        else:
            assert a == pytest.approx(e, rel=1e-6)


def test_loss_scale_is_none_without_a_scaler() -> None:
    assert SakuraRuntime().loss_scale() is None
    assert SakuraRuntime([MixedPrecision("bf16")]).loss_scale() is None
    fp16 = MixedPrecision("fp16")
    assert SakuraRuntime([fp16]).loss_scale() is None  # nothing scaled yet


def _reference(
    batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int, accumulation: int
) -> tuple[torch.nn.Module, list[float], list[float]]:
    """torch's hand-written GradScaler loop with ``unscale_`` before each step: the model,
    the scale of each step and the unscaled gradient norm of each step."""
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    ref_scales, ref_norms = [], []
    for step in range(steps):
        for x, y in batches[step * accumulation : (step + 1) * accumulation]:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(reference(x), y) / accumulation
            scaler.scale(loss).backward()
        ref_scales.append(scaler.get_scale())
        scaler.unscale_(ref_opt)
        ref_norms.append(_grad_norm(reference))
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad(set_to_none=True)
    return reference, ref_scales, ref_norms


def test_monitor_divides_by_the_loss_scale_in_a_raw_loop_with_accumulation() -> None:
    torch.set_num_threads(1)
    accumulation, steps = 2, 6
    batches = make_batches(steps * accumulation)
    _, ref_scales, ref_norms = _reference(batches, steps, accumulation)

    model = make_model()
    monitor = GradNormMonitor()
    service = MixedPrecision("fp16", **SETTINGS)
    skipped = []
    with SakuraRuntime([service, monitor], strict=True) as rt:
        model, optimizer = rt.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        )
        for step in range(steps):
            for x, y in batches[step * accumulation : (step + 1) * accumulation]:
                with rt.autocast():
                    loss = loss_fn(model(x), y) / accumulation
                rt.backward(loss)
                rt.emit(OnAfterBackward, model=model, loss=loss)
            rt.unscale_gradients(optimizer)
            rt.emit(OnBeforeOptimizerStep, model=model, optimizer=optimizer)
            assert rt.optimizer_step(optimizer) is True
            skipped.append(rt.last_step_skipped)
            assert rt.loss_scale() == ref_scales[step]  # after the step: still this step's
            optimizer.zero_grad(set_to_none=True)

    assert skipped == [True, False, False, False, True, False]  # overflow, growth, overflow
    per_step_scales = monitor.scales[accumulation - 1 :: accumulation]
    assert per_step_scales == ref_scales
    assert monitor.scales[::accumulation] == ref_scales  # same scale for every micro-batch
    # the accumulated gradient (after the last micro-batch) divided by the scale is the
    # gradient the step unscaled, and torch's reference loop saw the same
    _assert_norms_close(
        monitor.after_backward[accumulation - 1 :: accumulation], monitor.before_step
    )
    _assert_norms_close(monitor.before_step, ref_norms)
    # the monitor saw the true size: finite steps are far below the scale
    finite = [n for n in monitor.before_step if math.isfinite(n)]
    assert finite and all(n < 100 for n in finite)


def test_monitor_reads_unscaled_norms_under_lightning(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    pytest.importorskip("sakura_adapters")
    from torch.utils.data import DataLoader, TensorDataset

    from sakura_adapters.lightning import LightningAdapter

    torch.set_num_threads(1)

    class Module(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return loss_fn(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    xs, ys = zip(*make_batches(5), strict=True)
    data = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)
    monitor = GradNormMonitor()
    service = MixedPrecision("16-mixed", **SETTINGS)
    with SakuraRuntime([service, monitor], strict=True) as rt:
        trainer = pl.Trainer(
            callbacks=[LightningAdapter(rt)],
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=str(tmp_path),
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(Module(), data)
    assert len(monitor.after_backward) == 5
    assert all(isinstance(s, float) for s in monitor.scales)
    assert monitor.scales[0] == SETTINGS["init_scale"] and len(set(monitor.scales)) > 1
    _assert_norms_close(monitor.after_backward, monitor.before_step)
    assert service.skipped_steps >= 1


class HandOn:
    """A third-party service that runs before MixedPrecision's step, reads the unscaled
    gradients and hands the step on (returns False)."""

    name = "hand_on"
    priority = 5  # MixedPrecision is 10

    def __init__(self) -> None:
        self.norms: list[float] = []

    def setup(self, runtime: SakuraRuntime) -> None:
        self.runtime = runtime

    def optimizer_step(self, optimizer: Any) -> bool:
        self.runtime.unscale_gradients(optimizer)  # once: the scaler's step will not repeat it
        self.norms.append(_grad_norm_of(optimizer))
        return False  # hand the step on: MixedPrecision steps, or skips on inf/NaN


class LateOwner:
    """A step owner behind MixedPrecision: under fp16 it is never asked."""

    name = "late_owner"
    priority = 50

    def __init__(self) -> None:
        self.calls = 0

    def optimizer_step(self, optimizer: Any) -> bool:
        self.calls += 1
        optimizer.step()
        return True


def _grad_norm_of(optimizer: torch.optim.Optimizer) -> float:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    )


def test_a_service_before_mixed_precision_hands_the_step_on() -> None:
    torch.set_num_threads(1)
    steps = 6
    batches = make_batches(steps)
    reference, _, ref_norms = _reference(batches, steps, accumulation=1)

    model = make_model()
    hand_on, late = HandOn(), LateOwner()
    skipped = []
    with SakuraRuntime([MixedPrecision("fp16", **SETTINGS), hand_on, late], strict=True) as rt:
        model, optimizer = rt.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        )
        for x, y in batches:
            with rt.autocast():
                loss = loss_fn(model(x), y)
            rt.backward(loss)
            assert rt.optimizer_step(optimizer) is True  # MixedPrecision owned it
            skipped.append(rt.last_step_skipped)
            optimizer.zero_grad(set_to_none=True)

    assert rt.implements("optimizer_step") == ("hand_on", "mixed_precision", "late_owner")
    assert late.calls == 0
    assert skipped[0] and not all(skipped)  # overflows, then steps: both paths covered
    _assert_norms_close(hand_on.norms, ref_norms)
    for key, value in reference.state_dict().items():  # bit-identical to the reference
        assert torch.equal(model.state_dict()[key], value), key


class OwnsFirst:
    """A third-party service that owns the step before MixedPrecision: it unscales, skips
    on inf/NaN with STEP_SKIPPED, and steps otherwise (what docs/precision.md tells it)."""

    name = "owns_first"
    priority = 5

    def __init__(self) -> None:
        self.performed = 0

    def setup(self, runtime: SakuraRuntime) -> None:
        self.runtime = runtime

    def optimizer_step(self, optimizer: Any) -> Any:
        from sakura import STEP_SKIPPED

        self.runtime.unscale_gradients(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        if not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
            return STEP_SKIPPED
        optimizer.step()
        self.performed += 1
        return True


def test_a_service_owning_the_step_before_mixed_precision_skips_with_step_skipped() -> None:
    torch.set_num_threads(1)
    steps = 6
    batches = make_batches(steps)
    reference, ref_scales, _ = _reference(batches, steps, accumulation=1)

    model = make_model()
    owner = OwnsFirst()
    service = MixedPrecision("fp16", **SETTINGS)
    skipped, scales = [], []
    with SakuraRuntime([service, owner], strict=True) as rt:
        model, optimizer = rt.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        )
        for x, y in batches:
            with rt.autocast():
                loss = loss_fn(model(x), y)
            rt.backward(loss)
            scales.append(rt.loss_scale())
            assert rt.optimizer_step(optimizer) is True  # owned by OwnsFirst either way
            skipped.append(rt.last_step_skipped)
            optimizer.zero_grad(set_to_none=True)

    assert service.optimizer_steps == 0  # MixedPrecision was never offered the step
    assert skipped[0] and not all(skipped)
    assert owner.performed == skipped.count(False)
    assert scales == ref_scales  # the scale still backs off and grows as the scaler's does
    for key, value in reference.state_dict().items():  # bit-identical to the reference
        assert torch.equal(model.state_dict()[key], value), key
