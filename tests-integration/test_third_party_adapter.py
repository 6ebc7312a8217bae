"""A third-party adapter (``sakura-example-adapter``, for a toy trainer Sakura has never
heard of, written from the docs) gets framework-format checkpoints, metric reporting and fp16
loss scaling from the first-party services, and no first-party package names it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sakura import SakuraRuntime
from sakura_async import AsyncCheckpoint, AsyncEval, EvalTask, load_latest
from sakura_example_adapter import CHECKPOINT_FORMAT, ToyAdapter, ToyTrainer
from sakura_precision import MixedPrecision

STEPS, EPOCHS = 4, 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def batches(n: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def toy(model: nn.Module, tmp_path: Path, rt: SakuraRuntime, **kwargs: Any) -> ToyTrainer:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    callbacks = [*kwargs.pop("callbacks", []), ToyAdapter(rt)]
    return ToyTrainer(
        model, optimizer, run_dir=str(tmp_path / "run"), callbacks=callbacks, **kwargs
    )


def test_no_first_party_package_names_the_toy_trainer() -> None:
    import sakura
    import sakura_async
    import sakura_precision

    for package in (sakura, sakura_async, sakura_precision):
        files = sorted(Path(str(package.__file__)).parent.rglob("*.py"))
        assert files, package
        for file in files:
            text = file.read_text(encoding="utf-8")
            assert "sakura_example_adapter" not in text and "ToyTrainer" not in text, file


def test_async_checkpoint_writes_the_toy_trainers_own_checkpoint(tmp_path: Path) -> None:
    """format='loop': the adapter's LoopContext.checkpoint_state, in the toy-1 layout,
    under the run directory it published (no dir= given), and it reloads equal."""
    model = make_model()
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(AsyncCheckpoint(every=1, keep=None, format="loop", dispatcher="inthread"))
        trainer = toy(model, tmp_path, rt, epochs=EPOCHS)
        trainer.fit(batches(), loss_fn)
    assert ckpt.dir == str(tmp_path / "run" / "async_checkpoint") and not ckpt.errors
    latest = load_latest(ckpt.dir)
    assert latest is not None and latest.format == "loop"
    assert (latest.epoch, latest.step) == (EPOCHS - 1, EPOCHS * STEPS)
    state = latest.state
    assert state["format"] == CHECKPOINT_FORMAT
    assert state["progress"] == {"epoch": EPOCHS - 1, "global_step": EPOCHS * STEPS}
    assert state["optimizer_steps"] == EPOCHS * STEPS
    final = model.state_dict()
    assert set(state["weights"]) == set(final)
    assert all(torch.equal(state["weights"][k], final[k]) for k in final)
    # The toy trainer restores from it: the same weights and momentum as at the save.
    fresh = make_model()
    restored = ToyTrainer(
        fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9), run_dir=str(tmp_path)
    )
    restored.restore(state)
    assert all(torch.equal(fresh.state_dict()[k], final[k]) for k in final)
    assert restored.global_step == EPOCHS * STEPS
    momentum = trainer.optimizer.inner.state_dict()["state"]
    again = restored.optimizer.inner.state_dict()["state"]
    assert all(
        torch.equal(again[i]["momentum_buffer"], momentum[i]["momentum_buffer"]) for i in momentum
    )


class SyncEval:
    """A toy-trainer callback (before the adapter) evaluating synchronously at each epoch
    end: the reference values."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.values: list[float] = []

    def on_epoch_end(self, trainer: ToyTrainer, metrics: Any) -> None:
        with torch.no_grad():
            self.values.append(float(loss_fn(trainer.model(self.x), self.y)))


def eval_fn(epoch: int, task: EvalTask) -> dict[str, float]:
    model = task.load_into(task.payload["model"])
    with torch.no_grad():
        return {"val_loss": float(loss_fn(model(task.payload["x"]), task.payload["y"]))}


def test_async_eval_results_land_in_the_toy_trainers_metric_log(tmp_path: Path) -> None:
    (x, y) = batches(1, seed=7)[0]
    reference = SyncEval(x, y)
    model = make_model()
    payload = {"model": make_model(), "x": x, "y": y}
    with SakuraRuntime(strict=True) as rt:
        ae = rt.install(AsyncEval(eval_fn=eval_fn, eval_payload=payload, dispatcher="inthread"))
        trainer = toy(model, tmp_path, rt, epochs=EPOCHS, callbacks=[reference])
        trainer.fit(batches(), loss_fn)
    assert ae.report_to == "auto" and len(reference.values) == EPOCHS
    reported = [e for e in trainer.metrics_log if e["source"] == "sakura"]
    assert reported == [
        {"name": "val_loss", "value": reference.values[e], "epoch": e, "step": STEPS * (e + 1), "source": "sakura"}
        for e in range(EPOCHS)
    ]  # fmt: skip


def reference_fp16(
    model: nn.Module, data: list[Any], clip: float, scaler: Any
) -> tuple[int, list[Any]]:
    """The hand-written torch.amp loop the service must match: (skipped steps, clipped
    gradients per step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    skipped, grads = 0, []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
        optimizer.zero_grad(set_to_none=True)
    return skipped, grads


def test_fp16_loss_scaling_unscales_once_through_the_toy_optimizer_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The toy trainer clips through its ToyOptimizer proxy and steps the real optimizer;
    the proxy is registered with sakura.proxies, so the GradScaler unscales once per step:
    gradients and weights equal the torch.amp loop's, and overflow steps are skipped."""
    options = {"init_scale": 2.0**17, "growth_interval": 3}  # the first steps overflow fp16
    data, clip = batches() * EPOCHS, 0.5
    ref_model = make_model()
    ref_skipped, ref_grads = reference_fp16(
        ref_model, data, clip, torch.amp.GradScaler("cpu", **options)
    )
    assert ref_skipped >= 1

    calls: list[int] = []
    original = torch.amp.GradScaler.unscale_

    def counting(self: Any, optimizer: Any) -> None:
        calls.append(1)
        original(self, optimizer)

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", counting)
    model = make_model()
    service = MixedPrecision("16-mixed", **options)
    with SakuraRuntime([service], strict=True) as rt:
        trainer = toy(model, tmp_path, rt, epochs=EPOCHS, clip=clip)
        trainer.fit(batches(), loss_fn)
    assert len(calls) == EPOCHS * STEPS  # once per step, not once per clip and once per step
    assert service.skipped_steps == ref_skipped
    assert len(trainer.grads_after_clip) == len(ref_grads)
    for ours, theirs in zip(trainer.grads_after_clip, ref_grads, strict=True):
        for a, b in zip(ours, theirs, strict=True):  # a skipped step's are inf/nan in both
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    final, expected = model.state_dict(), ref_model.state_dict()
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    # The unscaled gradients of a step that was not skipped are the true gradients: fp32
    # backward on the same weights agrees within fp16 autocast's tolerance.
    kept = [all(bool(g.isfinite().all()) for g in step) for step in trainer.grads_after_clip]
    first_kept = kept.index(True)  # the steps before it were skipped: the weights untouched
    assert first_kept >= 1
    probe = make_model()
    x, y = data[first_kept]
    loss_fn(probe(x), y).backward()
    nn.utils.clip_grad_norm_(probe.parameters(), clip)
    for a, p in zip(trainer.grads_after_clip[first_kept], probe.parameters(), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(a, p.grad, rtol=2e-2, atol=2e-3)
