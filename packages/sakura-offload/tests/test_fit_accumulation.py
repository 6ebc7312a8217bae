"""Gradient accumulation under a plan that puts the optimizer in host RAM: fit's
OffloadAdamW takes the loop's backward passes per step (``wrap(accumulation_steps=)`` in a
raw loop; the ``fit`` service reads a framework's setting from ``OnTrainBegin``, through
the ``offload_adamw`` service it hands the optimizer to, or takes its option).  Each run is
compared with the same choices by hand (WeightPaging, ``OffloadAdamW.from_optimizer`` with
``set_accumulation_steps(2)``): equal to the bit on a CPU, the arithmetic being the same."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from test_fit import HUGE, adamw, assert_same, ladder, lora_llama, trained

import sakura_offload
from sakura import SakuraRuntime
from sakura.options import OptionError
from sakura_offload.fit import Fit

pytest.importorskip("peft")
pytest.importorskip("transformers")

ACCUMULATE = 2
STEPS = 3


@functools.cache
def streamed_host_budget() -> int:
    """The device budget of the plan with the weights streamed from host RAM and the
    optimizer there (the activations kept: ``activations="keep"``)."""
    plan = next(p for p in ladder(lora_llama()) if (p.optimizer, p.weights) == ("host", "host"))
    return int(plan.device_bytes)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 61, (2, 12), generator=g) for _ in range(STEPS * ACCUMULATE)]


def train_accumulating(model: Any, optimizer: Any) -> None:
    for i, ids in enumerate(batches()):
        (model(input_ids=ids, labels=ids).loss / ACCUMULATE).backward()
        if (i + 1) % ACCUMULATE == 0:
            optimizer.step()
            optimizer.zero_grad()


def by_hand() -> dict[str, torch.Tensor]:
    model = lora_llama()
    paging = sakura_offload.WeightPaging(model)
    optimizer = sakura_offload.OffloadAdamW.from_optimizer(adamw(model), moment_dtype="float32")
    optimizer.set_accumulation_steps(ACCUMULATE)
    train_accumulating(model, optimizer)
    result = trained(model)
    paging.remove()
    return result


def wrapped(**options: Any) -> tuple[Any, Any]:
    model = lora_llama()
    return sakura_offload.wrap(  # type: ignore[no-any-return]
        model, adamw(model), device_budget=streamed_host_budget(), host_budget=HUGE,
        activations="keep", choices=None, report=False, **options,
    )  # fmt: skip


def test_raw_loop_accumulates_under_a_host_optimizer_plan() -> None:
    model, optimizer = wrapped(accumulation_steps=ACCUMULATE)
    plan = model.sakura_fit.plan
    assert (plan.optimizer, plan.weights, plan.moment_dtype) == ("host", "host", "float32")
    assert isinstance(optimizer, sakura_offload.OffloadAdamW)
    assert optimizer.accumulation_steps == ACCUMULATE
    train_accumulating(model, optimizer)
    result = trained(model)
    sakura_offload.unwrap(model)
    expected = by_hand()
    assert_same(result, expected)
    start = trained(lora_llama())
    assert all(not torch.equal(start[n], expected[n]) for n in start)  # it trained


def test_an_unannounced_second_backward_names_the_option() -> None:
    model, optimizer = wrapped()  # accumulation_steps=None: one backward per step
    assert optimizer.accumulation_steps == 1
    with pytest.raises(RuntimeError, match=r"wrap\(\.\.\., accumulation_steps=N\)"):
        train_accumulating(model, optimizer)
    sakura_offload.unwrap(model)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_accumulation_steps_is_checked(value: Any) -> None:
    with pytest.raises(OptionError, match=f"wrap: accumulation_steps={value!r} is not accepted"):
        wrapped(accumulation_steps=value)
    with pytest.raises(OptionError, match=f"Fit: accumulation_steps={value!r} is not accepted"):
        Fit(accumulation_steps=value)


def test_service_in_a_raw_loop_takes_the_option() -> None:
    """A raw loop under ``rt.prepare`` does not say how many backward passes a step has:
    ``fit:accumulation_steps=2`` does."""
    model = lora_llama()
    with SakuraRuntime(strict=True) as rt:
        service = rt.install(
            f"fit:device_budget={streamed_host_budget()},host_budget={HUGE},activations=keep,"
            f"choices=none,report=false,accumulation_steps={ACCUMULATE}"
        )
        model, optimizer = rt.prepare(model, adamw(model))
        assert service.state.plan.optimizer == "host"
        assert optimizer.accumulation_steps == ACCUMULATE
        for i, ids in enumerate(batches()):
            rt.backward(model(input_ids=ids, labels=ids).loss / ACCUMULATE)
            if (i + 1) % ACCUMULATE == 0:
                if not rt.optimizer_step(optimizer):
                    optimizer.step()
                optimizer.zero_grad()
        result = trained(model)
    assert_same(result, by_hand())


def test_service_under_lightning_reads_accumulate_grad_batches(tmp_path: Any) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from sakura_adapters.lightning import LightningAdapter

    rows = [{"input_ids": ids, "labels": ids} for ids in batches()]

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = lora_llama()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            return adamw(self)

    module = Module()
    with SakuraRuntime(strict=True) as rt:
        service = rt.install(
            f"fit:device_budget={streamed_host_budget()},host_budget={HUGE},activations=keep,"
            "choices=none,report=false"
        )
        trainer = pl.Trainer(
            max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            default_root_dir=str(tmp_path), accelerator="cpu", devices=1,
            callbacks=[LightningAdapter(rt)],
        )  # fmt: skip
        trainer.fit(module, DataLoader(rows, batch_size=None))  # the batches as they are
    state = service.state
    assert (state.plan.optimizer, state.plan.weights) == ("host", "host")
    assert state.optimizer.accumulation_steps == ACCUMULATE
    # Lightning divides each micro-batch's loss by accumulate_grad_batches itself
    assert_same(trained(module.model), by_hand())
