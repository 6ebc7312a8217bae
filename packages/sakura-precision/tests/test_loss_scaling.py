"""fp16 with dynamic loss scaling on the CPU: the scaler's dynamics, skipped steps, bit-exact
agreement with torch's hand-written GradScaler loop, unscaling exactly once, and resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from precision_helpers import (
    grad_scaler_loop,
    loss_fn,
    make_batches,
    make_model,
    runtime_loop,
    weights,
)

from sakura import SakuraRuntime
from sakura.testing import ServiceConformance, check_state_round_trip
from sakura_precision import LossScaledPrecision, MixedPrecision


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    wa, wb = weights(a), weights(b)
    for key in wb:
        assert torch.equal(wa[key], wb[key]), f"{key} differs"


def test_scale_starts_at_2_16_backs_off_on_inf_and_grows_after_the_interval() -> None:
    service = MixedPrecision("fp16", growth_interval=3)
    assert isinstance(service, LossScaledPrecision)
    assert service.scale == 2.0**16  # before any step: torch's canonical initial scale
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scales, skipped = [], []
    with SakuraRuntime([service], strict=True) as rt:
        model, optimizer = rt.prepare(model, optimizer)
        for step, (x, y) in enumerate(make_batches(6)):
            with rt.autocast():
                loss = loss_fn(model(x), y)
            rt.backward(loss)
            if step == 1:  # inject a non-finite gradient
                model.head.weight.grad[0, 0] = float("inf")
                before = weights(model)
                momentum = optimizer.state[model.head.weight]["momentum_buffer"].clone()
            assert rt.optimizer_step(optimizer) is True  # owned, also when skipped
            assert rt.last_step_skipped is (step == 1)
            if step == 1:
                _assert_same_weights_dict(weights(model), before)
                assert torch.equal(optimizer.state[model.head.weight]["momentum_buffer"], momentum)
            optimizer.zero_grad(set_to_none=True)
            skipped.append(service.last_step_skipped)
            scales.append(service.scale)
    assert scales == [2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**16, 2.0**16]
    assert skipped == [False, True, False, False, False, False]
    assert service.skipped_steps == 1
    assert service.optimizer_steps == 6


def _assert_same_weights_dict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key in b:
        assert torch.equal(a[key], b[key]), f"{key} changed during a skipped step"


@pytest.mark.parametrize("clip", [None, 0.5])
def test_bit_identical_to_the_hand_written_grad_scaler_loop(clip: float | None) -> None:
    # A huge initial scale overflows fp16 in the first steps, so the comparison covers
    # skipped steps, back-off and (with the short interval) growth too.
    settings = {"init_scale": 2.0**30, "growth_interval": 4}
    batches = make_batches(14)
    reference = make_model()
    ref_losses, scaler = grad_scaler_loop(
        reference, batches, clip=clip, scaler=torch.amp.GradScaler("cpu", **settings)
    )
    model = make_model()
    service = MixedPrecision("fp16", **settings)
    with SakuraRuntime([service], strict=True) as rt:
        losses, _ = runtime_loop(rt, model, batches, clip=clip)
    assert losses == ref_losses
    _assert_same_weights(model, reference)
    assert service.scale == scaler.get_scale()
    assert service.state_dict()["scaler"] == scaler.state_dict()
    assert service.skipped_steps >= 2  # the overflowing first steps were skipped
    assert scaler.get_scale() < 2.0**30


def test_clipping_through_the_runtime_unscales_exactly_once(monkeypatch: Any) -> None:
    """The double-unscale bug (clip, then step, each unscaling) divides the gradients by
    the scale twice; this catches it three ways: unscale calls, gradient values, weights."""
    calls: list[int] = []
    original = torch.amp.GradScaler.unscale_

    def counting_unscale(self: Any, optimizer: Any) -> None:
        calls.append(id(optimizer))
        original(self, optimizer)

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", counting_unscale)
    batches = make_batches(5)
    reference = make_model()
    grad_scaler_loop(reference, batches, clip=1e-3)
    probe = make_model()  # the true gradients of the first step: scaled once, unscaled once
    probe_scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        probe_scaler.scale(loss_fn(probe(batches[0][0]), batches[0][1])).backward()
    probe_scaler.unscale_(torch.optim.SGD(probe.parameters(), lr=0.1))
    calls.clear()

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with SakuraRuntime([MixedPrecision("fp16")], strict=True) as rt:
        model, optimizer = rt.prepare(model, optimizer)
        for step, (x, y) in enumerate(batches):
            with rt.autocast():
                loss = loss_fn(model(x), y)
            rt.backward(loss)
            rt.unscale_gradients(optimizer)  # e.g. a callback reading gradient norms
            if step == 0:
                for (name, p), q in zip(model.named_parameters(), probe.parameters(), strict=True):
                    assert torch.equal(p.grad, q.grad), name
            rt.clip_grad_norm_(optimizer, 1e-3)  # asks to unscale again: must not divide again
            rt.unscale_gradients(optimizer)
            assert rt.optimizer_step(optimizer)  # the step must not unscale a third time
            optimizer.zero_grad(set_to_none=True)
    assert calls == [id(optimizer)] * len(batches)
    _assert_same_weights(model, reference)


def test_several_optimizers_share_one_scale_update() -> None:
    batches = make_batches(6)
    settings = {"init_scale": 2.0**24, "growth_interval": 2}

    def split(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        head = list(model.head.parameters())
        body = [p for n, p in model.named_parameters() if not n.startswith("head.")]
        return torch.optim.SGD(body, lr=0.1), torch.optim.Adam(head, lr=1e-2)

    reference = make_model()
    opt_a, opt_b = split(reference)
    scaler = torch.amp.GradScaler("cpu", **settings)
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(reference(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        opt_a.zero_grad()
        opt_b.zero_grad()

    model = make_model()
    ours_a, ours_b = split(model)
    service = MixedPrecision("fp16", **settings)
    with SakuraRuntime([service], strict=True) as rt:
        for x, y in batches:
            with rt.autocast():
                loss = loss_fn(model(x), y)
            rt.backward(loss)
            assert rt.optimizer_step(ours_a) and rt.optimizer_step(ours_b)
            ours_a.zero_grad()
            ours_b.zero_grad()
        _assert_same_weights(model, reference)
        assert service.state_dict()["scaler"] == scaler.state_dict()
        rt.backward(loss_fn(model(batches[0][0]), batches[0][1]))
        rt.optimizer_step(ours_a)
        with pytest.raises(RuntimeError, match="already stepped since the last scaled backward"):
            rt.optimizer_step(ours_a)


def test_a_step_without_a_scaled_backward_is_left_to_the_loop() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with SakuraRuntime([MixedPrecision("fp16")], strict=True) as rt:
        x, y = make_batches(1)[0]
        loss_fn(model(x), y).backward()  # not through rt.backward: gradients are unscaled
        rt.unscale_gradients(optimizer)  # nothing to unscale
        assert rt.optimizer_step(optimizer) is False


def test_scaler_state_survives_a_checkpoint_resume(tmp_path: Path) -> None:
    settings = {"init_scale": 2.0**30, "growth_interval": 3}
    batches = make_batches(10)
    straight = make_model()
    full = MixedPrecision("fp16", **settings)
    with SakuraRuntime([full], strict=True) as rt:
        runtime_loop(rt, straight, batches, optimizer=torch.optim.SGD(straight.parameters(), 0.1))

    model = make_model()
    first = MixedPrecision("fp16", **settings)
    with SakuraRuntime([first], strict=True) as rt:
        optimizer = torch.optim.SGD(model.parameters(), 0.1)
        runtime_loop(rt, model, batches[:5], optimizer=optimizer)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "sakura": rt.state_dict(),
            },
            tmp_path / "ckpt.pt",
        )
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    saved = checkpoint["sakura"]["mixed_precision"]
    assert saved["scaler"]["scale"] < 2.0**30 and saved["skipped_steps"] >= 1

    resumed_model = make_model(seed=5)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = MixedPrecision("fp16")  # default settings: the checkpoint's come back
    with SakuraRuntime([resumed], strict=True) as rt:
        rt.load_state_dict(checkpoint["sakura"])
        assert resumed.scale == saved["scaler"]["scale"]
        optimizer = torch.optim.SGD(resumed_model.parameters(), 0.1)
        optimizer.load_state_dict(checkpoint["optimizer"])
        runtime_loop(rt, resumed_model, batches[5:], optimizer=optimizer)
    _assert_same_weights(resumed_model, straight)
    assert resumed.state_dict() == full.state_dict()


def test_bad_state_is_rejected() -> None:
    service = MixedPrecision("fp16")
    with pytest.raises(ValueError, match="expected a state with a 'scaler' mapping"):
        service.load_state_dict({"scale": 2.0})
    with pytest.raises(ValueError, match=r"lacks \['backoff_factor'"):
        service.load_state_dict(
            {"scaler": {"scale": 1.0, "growth_factor": 2.0, "growth_interval": 3}}
        )


def test_state_round_trip_after_training() -> None:
    check_state_round_trip(lambda: MixedPrecision("fp16", init_scale=2.0**20))


class TestLossScaledConformance(ServiceConformance):
    def make_service(self) -> Any:
        return MixedPrecision("fp16")
