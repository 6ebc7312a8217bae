"""OffloadAdamW's placement options: moment_dtype="auto" forced by host_budget, pin_moments
decided from injected RAM figures, eager=None, synchronize() and stats()."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from _offload_models import batches, drift, loss_of, max_diff, mlp, train

from sakura import SakuraRuntime
from sakura.errors import SpecError
from sakura.options import OptionError
from sakura_offload import OffloadAdamW, OffloadAdamWService
from sakura_offload.host_optimizer.placement import (
    choose_eager,
    choose_moment_dtype,
    choose_pinning,
    default_moment_budget,
    moment_bytes,
    ram_floor,
)

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
NUMEL = 32 * 300 + 300 + 300 * 10 + 10  # mlp()'s parameters
GiB = 2**30


def reference(steps: int = 20) -> torch.nn.Module:
    model, _ = train(lambda p: torch.optim.AdamW(p, **HYPER), steps)  # type: ignore[arg-type]
    return model


# --- moment_dtype="auto" ----------------------------------------------------------------


def test_moment_bytes_per_format() -> None:
    assert moment_bytes("float32", NUMEL) == 8 * NUMEL == 103280
    assert moment_bytes("bfloat16", NUMEL) == 4 * NUMEL
    assert moment_bytes("int8", NUMEL) == int(NUMEL * (2 + 8 / 256)) == 26223


@pytest.mark.parametrize(
    ("budget", "chosen"),
    [(8 * NUMEL, "float32"), (8 * NUMEL - 1, "bfloat16"), (4 * NUMEL - 1, "int8"), (100, "int8")],
)
def test_auto_chooses_from_the_budget(budget: int, chosen: str) -> None:
    decision = choose_moment_dtype(NUMEL, 0, budget)
    assert decision.value == chosen
    if budget == 100:
        assert "no format fits" in decision.reason
    # master weights count against the budget too
    assert choose_moment_dtype(NUMEL, 4 * NUMEL, 8 * NUMEL).value == "bfloat16"


def test_auto_fp32_branch_trains_as_torch_adamw(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sakura_offload.host_optimizer"):
        model, opt = train(
            lambda p: OffloadAdamW(p, **HYPER, moment_dtype="auto", host_budget=200_000)
        )
    assert opt.moment_dtype == "float32"
    assert opt.stats()["moment_dtype"] == "float32"
    assert "fit in the host budget" in opt.moment_dtype_reason
    assert [r.getMessage() for r in caplog.records] == [
        f"OffloadAdamW: moment_dtype=float32 ({opt.moment_dtype_reason})"
    ]
    assert max_diff(model, reference()) <= 3e-7  # test_optimizer's fp32 tolerance


def test_auto_bf16_branch_trains_close_to_torch_adamw() -> None:
    model, opt = train(lambda p: OffloadAdamW(p, **HYPER, moment_dtype="auto", host_budget="60KB"))
    assert opt.host_budget == 60_000
    assert opt.moment_dtype == "bfloat16"
    assert opt.state[next(iter(model.parameters()))]["exp_avg"].dtype == torch.bfloat16
    ref = reference()
    assert drift(model, ref) < 0.02 and max_diff(model, ref) < 3e-3  # test_optimizer's bf16


def test_auto_int8_branch_trains_close_to_torch_adamw() -> None:
    model, opt = train(
        lambda p: OffloadAdamW(p, **HYPER, moment_dtype="auto", host_budget=30_000), steps=30
    )
    assert opt.moment_dtype == "int8"
    stats = opt.stats()
    assert stats["moment_bytes"] == sum(
        2 * 256 * -(-p.numel() // 256) + 8 * -(-p.numel() // 256) for p in model.parameters()
    )
    assert drift(model, reference(30)) < 0.10  # test_optimizer's int8 tolerance


def test_auto_default_budget_is_available_ram_less_the_floor() -> None:
    opt = OffloadAdamW(mlp().parameters(), moment_dtype="auto")
    assert opt.moment_dtype == "float32"  # 100 KB fit on any machine that runs tests
    assert opt.host_budget >= 0
    assert default_moment_budget(64 * GiB, 100 * GiB) == 54 * GiB
    assert default_moment_budget(10 * GiB, 16 * GiB) == 6 * GiB  # 4 GiB floor
    assert default_moment_budget(GiB, 16 * GiB) == 0
    assert ram_floor(8 * GiB) == 4 * GiB


def test_auto_counts_master_weights_of_bf16_parameters() -> None:
    # bf16 parameters need fp32 masters (4 bytes each) besides the moments
    params = list(mlp(torch.bfloat16).parameters())
    fits = OffloadAdamW(params, moment_dtype="auto", host_budget=12 * NUMEL)
    assert fits.moment_dtype == "float32"
    short = OffloadAdamW(params, moment_dtype="auto", host_budget=12 * NUMEL - 1)
    assert short.moment_dtype == "bfloat16"


# --- pin_moments ------------------------------------------------------------------------


def test_pinning_decisions_from_injected_ram() -> None:
    total = 100 * GiB
    assert choose_pinning(None, 40 * GiB, total, cuda=True).value is True
    too_much = choose_pinning(None, 40 * GiB + 1, total, cuda=True)
    assert too_much.value is False and "40 %" in too_much.reason
    assert choose_pinning(True, 90 * GiB, total, cuda=True).value is True
    assert choose_pinning(False, 1, total, cuda=True).value is False
    no_cuda = choose_pinning(None, 1, total, cuda=False)
    assert no_cuda.value is False and "CUDA" in no_cuda.reason
    with pytest.raises(OptionError, match=r"pin_moments=True.*CUDA"):
        choose_pinning(True, 1, total, cuda=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_pin_moments_without_cuda() -> None:
    opt = OffloadAdamW(mlp().parameters())
    assert opt.pin_moments is False and opt.stats()["pinned_bytes"] == 0
    with pytest.raises(OptionError, match=r"OffloadAdamW: pin_moments=True"):
        OffloadAdamW(mlp().parameters(), pin_moments=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_pin_moments_pins_the_state() -> None:
    model, opt = train(lambda p: OffloadAdamW(p, **HYPER, pin_moments=True), steps=2)
    stats = opt.stats()
    assert stats["pin_moments"] is True
    assert stats["pinned_bytes"] == stats["moment_bytes"] + stats["master_bytes"] > 0
    assert all(opt.state[p]["exp_avg"].is_pinned() for p in model.parameters())


# --- eager ------------------------------------------------------------------------------


def test_eager_decisions() -> None:
    assert choose_eager(None, max_grad_norm=None, distributed=False).value is True
    assert choose_eager(None, max_grad_norm=1.0, distributed=False).value is False
    assert choose_eager(None, max_grad_norm=None, distributed=True).value is False
    assert choose_eager(False, max_grad_norm=None, distributed=False).value is False
    assert OffloadAdamW(mlp().parameters()).eager is True
    clipped = OffloadAdamW(mlp().parameters(), max_grad_norm=1.0)
    assert clipped.eager is False and "max_grad_norm" in clipped.eager_reason


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bf16", "int8"])
def test_default_eager_is_bit_identical_to_the_plain_step(backend: str, dtype: str) -> None:
    runs = []
    for eager in (None, False):
        model, opt = train(
            lambda p, e=eager: OffloadAdamW(
                p, **HYPER, moment_dtype=dtype, eager=e, backend=backend
            ),
            steps=8,
        )
        runs.append((model, opt))
    (eager_model, eager_opt), (plain_model, plain_opt) = runs
    assert eager_opt.eager is True and plain_opt.eager is False
    for a, b in zip(eager_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_clipping_after_an_eager_update_is_an_error() -> None:
    model = mlp()
    opt = OffloadAdamW(model.parameters(), **HYPER)
    loss_of(model, batches(1)[0]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"changed after its eager update.*max_grad_norm"):
        opt.step()
    # the optimizer is usable again after the error
    opt.zero_grad()
    loss_of(model, batches(1)[0]).backward()
    opt.step()
    assert opt.stats()["steps"] == 1


def test_skip_step_after_eager_updates_is_an_error() -> None:
    model = mlp()
    opt = OffloadAdamW(model.parameters(), **HYPER)
    loss_of(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"skip_step.*eager=False"):
        opt.skip_step()
    lazy = OffloadAdamW(mlp().parameters(), **HYPER, eager=False)
    lazy.skip_step()  # nothing was updated: fine


# --- synchronize() and stats() ----------------------------------------------------------


def test_stats_and_synchronize_values() -> None:
    model = mlp(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), **HYPER, moment_dtype="bf16", backend="torch")
    opt.synchronize()  # nothing queued: a no-op
    empty = opt.stats()
    assert (empty["steps"], empty["moment_bytes"], empty["master_bytes"]) == (0, 0, 0)
    assert empty["kernel_seconds"] == 0.0
    for batch in batches(3):
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
    opt.synchronize()
    stats = opt.stats()
    assert stats["backend"] == "torch"
    assert stats["steps"] == 3
    assert stats["moment_bytes"] == 2 * 2 * NUMEL  # two bf16 moments
    assert stats["master_bytes"] == 4 * NUMEL  # fp32 masters of bf16 parameters
    assert (
        stats["moment_dtype"] == "bfloat16"
        and stats["moment_dtype_reason"] == "moment_dtype='bf16'"
    )
    assert stats["eager"] is True and stats["kernel_seconds"] > 0.0
    # host parameters: nothing crosses a device link
    assert stats["d2h_bytes_per_step"] == stats["h2d_bytes_per_step"] == 0
    assert set(stats) == {
        "backend", "moment_dtype", "moment_dtype_reason", "host_budget", "moment_bytes",
        "master_bytes", "pin_moments", "pin_reason", "pinned_bytes", "eager", "eager_reason",
        "steps", "kernel_seconds", "d2h_bytes_per_step", "h2d_bytes_per_step",
    }  # fmt: skip


# --- options ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "accepted"),
    [
        ("pin_moments", "yes", "None, True, False"),
        ("pin_moments", 1, "None, True, False"),
        ("host_budget", -1, "bytes"),
        ("host_budget", "lots", "bytes"),
        ("moment_dtype", "automatic", "'auto'"),
    ],
)
def test_bad_placement_options(option: str, value: object, accepted: str) -> None:
    with pytest.raises(OptionError) as info:
        OffloadAdamW(mlp().parameters(), **{option: value})  # type: ignore[arg-type]
    message = str(info.value)
    assert f"OffloadAdamW: {option}={value!r}" in message and accepted in message


def test_service_spec_takes_the_placement_options() -> None:
    model = mlp()
    reference_model = copy.deepcopy(model)
    with SakuraRuntime(strict=True) as rt:
        service = rt.install("offload_adamw:auto,host_budget=60000,pin_moments=false")
        assert isinstance(service, OffloadAdamWService)
        model, opt = rt.prepare(model, torch.optim.AdamW(model.parameters(), **HYPER))  # type: ignore[arg-type]
        assert isinstance(opt, OffloadAdamW)
        assert opt.moment_dtype == "bfloat16" and opt.pin_moments is False
        assert opt.eager is False and "service" in opt.eager_reason  # None: off here
        for batch in batches(5):
            opt.zero_grad()
            rt.backward(loss_of(model, batch))
            if not rt.optimizer_step(opt):
                opt.step()
    assert max_diff(model, reference_model) > 0  # it trained
    with pytest.raises(SpecError, match="pin_moments"):
        SakuraRuntime().install("offload_adamw:pin_moments=maybe")
    with pytest.raises(SpecError, match="host_budget"):
        SakuraRuntime().install("offload_adamw:host_budget=-5")


def test_service_eager_true_refuses_a_clipping_loop() -> None:
    from sakura.events import OnTrainBegin
    from sakura.loop import LoopContext

    service = OffloadAdamWService(eager=True)
    opt = service.wrap_optimizer(torch.optim.AdamW(mlp().parameters()))
    assert opt.eager is True
    event = OnTrainBegin(
        rank=0,
        world_size=1,
        optimizer=opt,
        loop=LoopContext(gradient_clipping="Trainer(gradient_clip_val=1.0)"),
    )
    with pytest.raises(OptionError, match=r"eager=True.*gradient_clip_val"):
        service.on_train_begin(event)
