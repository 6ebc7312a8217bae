"""bf16 autocast against fp32, and the "-true" modes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from precision_helpers import make_batches, make_model, runtime_loop, weights
from torch import nn

from sakura import SakuraRuntime
from sakura.testing import ServiceConformance
from sakura_precision import MixedPrecision, TruePrecision

# bf16 keeps 8 significant bits (relative rounding 2**-9).  Over 20 SGD steps on this model
# the loss must stay within 0.5% of fp32 at every step and every weight within 0.005 of
# fp32's (measured here: 0.06% and 0.0011).
BF16_LOSS_RTOL = 5e-3
BF16_WEIGHT_ATOL = 5e-3


def test_bf16_tracks_fp32_over_20_steps() -> None:
    batches = make_batches(20, batch=16)
    fp32 = make_model()
    with SakuraRuntime(strict=True) as rt:
        ref_losses, _ = runtime_loop(rt, fp32, batches, lr=0.05)
    model = make_model()
    service = MixedPrecision("bf16")
    with SakuraRuntime([service], strict=True) as rt:
        losses, _ = runtime_loop(rt, model, batches, lr=0.05)
    assert service.device_type == "cpu"
    assert losses != ref_losses  # bf16 really ran
    assert losses == pytest.approx(ref_losses, rel=BF16_LOSS_RTOL)
    assert ref_losses[-1] < ref_losses[0] and losses[-1] < losses[0]  # both learn
    ours, ref = weights(model), weights(fp32)
    for key in ref:
        assert ours[key].dtype == torch.float32  # mixed: master weights stay fp32
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=BF16_WEIGHT_ATOL)


def test_autocast_uses_the_model_device_and_dtype() -> None:
    service = MixedPrecision("bf16")
    seen: list[Any] = []

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return super().forward(x)

    with SakuraRuntime([service], strict=True) as rt:
        model = rt.wrap_model(Probe(4, 4))
        with rt.autocast():
            out = model(torch.randn(2, 4))
    assert seen == [(True, torch.bfloat16)] and out.dtype == torch.bfloat16
    assert MixedPrecision("fp16", device="cpu").device_type == "cpu"


def test_the_device_type_is_learned_when_a_loop_starts() -> None:
    from sakura.events import OnEpochEnd, OnValidationBegin

    service = MixedPrecision("bf16")
    with SakuraRuntime([service], strict=True) as rt:
        assert rt.emit(OnEpochEnd) is None  # not subscribed: costs nothing
        assert service._device_type is None
        rt.emit(OnValidationBegin, model=nn.Linear(2, 2))
        assert service._device_type == "cpu"


class MakesTensors(nn.Module):
    """Creates a tensor in forward, as position ids or masks are: it must follow the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.created: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        offset = torch.ones(4)
        self.created.append(offset.dtype)
        return self.fc(x) * scale + offset


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [
        ("bf16-true", torch.bfloat16),
        ("16-true", torch.float16),
        ("32-true", torch.float32),
        ("64-true", torch.float64),
    ],
)
def test_true_modes_keep_parameters_inputs_and_new_tensors_in_the_dtype(
    mode: str, dtype: torch.dtype
) -> None:
    service = MixedPrecision(mode)
    assert isinstance(service, TruePrecision)
    model = make_model().to(torch.bfloat16 if dtype == torch.float32 else torch.float32)
    with SakuraRuntime([service], strict=True) as rt:
        losses, optimizer = runtime_loop(rt, model, make_batches(4), lr=0.05)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert all(
        s["momentum_buffer"].dtype == dtype for s in optimizer.state.values()
    )  # the optimizer works in the dtype too
    assert all(torch.isfinite(torch.tensor(losses)))

    probe = MakesTensors()
    with SakuraRuntime([MixedPrecision(mode)], strict=True) as rt:
        probe = rt.wrap_model(probe)
        with rt.autocast():
            out = probe(torch.randn(3, 4), scale=torch.tensor(2.0))  # fp32 inputs, kwargs too
    assert out.dtype == dtype and probe.created == [dtype]
    assert torch.get_default_dtype() == torch.float32  # restored after the forward


def test_true_mode_leaves_integer_inputs_alone() -> None:
    embed = nn.Embedding(10, 4)
    with SakuraRuntime([MixedPrecision("bf16-true")], strict=True) as rt:
        embed = rt.wrap_model(embed)
        with rt.autocast():
            out = embed(torch.tensor([1, 2, 3]))
    assert out.dtype == torch.bfloat16


def test_true_mode_must_come_before_ddp() -> None:
    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self) -> None:
            nn.Module.__init__(self)

    with (
        SakuraRuntime([MixedPrecision("bf16-true")], strict=True) as rt,
        pytest.raises(
            ValueError, match=r"call rt.prepare\(model\) .* before wrapping the model in DDP"
        ),
    ):
        rt.wrap_model(FakeDDP())


class TestAutocastConformance(ServiceConformance):
    def make_service(self) -> Any:
        return MixedPrecision("bf16")


class TestTrueConformance(ServiceConformance):
    def make_service(self) -> Any:
        return MixedPrecision("64-true")
