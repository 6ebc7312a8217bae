"""``fit`` beyond the weights and the optimizer: the activations planned in what the device
budget leaves (the memory planner's choices, bit-identical to plain training on a CPU), the
``fit`` service under a raw loop through ``SakuraRuntime``, Lightning and the Hugging Face
Trainer (each equal to the same choices by hand), ``unwrap`` and ``memory_report``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_fit import HUGE, adamw, assert_same, by_hand, ladder, lora_llama, rung, train, trained

import sakura_offload
from sakura import SakuraRuntime
from sakura_offload.fit import Fit

pytest.importorskip("peft")
pytest.importorskip("transformers")

KEPT_PEAK = 117_120 + 40_000
"""Device bytes for activations between every block recomputed (117120 measured) and
everything kept (about 0.2 MB) for the tiny model's batch."""


def test_activations_get_what_the_device_budget_leaves() -> None:
    plain = lora_llama()
    train(plain, adamw(plain))
    plans = ladder(lora_llama())
    model = lora_llama()
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), device_budget=plans[0].device_bytes + KEPT_PEAK, cost_trials=0
    )
    state = model.sakura_fit
    assert state.plan.activation_budget == KEPT_PEAK
    assert state.planner.budget == KEPT_PEAK
    train(model, optimizer)
    choices = state.planner.applied.choices
    assert set(choices.values()) - {"keep"}, choices  # something paged or recomputed
    assert_same(trained(model), trained(plain))
    report = sakura_offload.memory_report(model)
    assert report["device"]["activation_budget"] == KEPT_PEAK
    assert "recompute" in report["activations"] or "page" in report["activations"]
    sakura_offload.unwrap(model)
    assert state.planner.model is None  # the planner's hooks are gone


def _runtime_training(spec: str) -> tuple[dict[str, torch.Tensor], Any]:
    model = lora_llama()
    with SakuraRuntime(strict=True) as rt:
        service = rt.install(spec)
        assert isinstance(service, Fit)
        model, optimizer = rt.prepare(model, adamw(model))
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            ids = torch.randint(0, 61, (2, 12), generator=g)
            rt.backward(model(input_ids=ids, labels=ids).loss)
            if not rt.optimizer_step(optimizer):
                optimizer.step()
            optimizer.zero_grad()
        result = trained(model)
        plan = service.state.plan if service.state is not None else None
    return result, plan


def test_service_in_a_raw_loop_matches_the_choices_by_hand() -> None:
    plans = ladder(lora_llama())
    device = rung(
        plans, "host", "host"
    ).device_bytes  # weights streamed from host, optimizer on the host
    result, plan = _runtime_training(
        f"fit:device_budget={device},host_budget={HUGE},activations=keep,report=false"
    )
    assert (plan.optimizer, plan.weights, plan.moment_dtype) == ("host", "host", "float32")
    assert_same(result, by_hand(plan))


def test_service_spec_options() -> None:
    service = SakuraRuntime().install(
        "fit:device_budget=2GiB,host_budget=8GiB,disk_offload=/tmp/fit-x,"
        "choices=quantize_base+other,moment_dtype=bf16,report=false"
    )
    options = service.options
    assert (options["device_budget"], options["host_budget"]) == (2 * 2**30, 8 * 2**30)
    assert str(options["disk_offload"]) == "/tmp/fit-x"
    assert options["choices"] == ("quantize_base", "other")
    assert (options["moment_dtype"], options["report"]) == ("bfloat16", False)
    assert SakuraRuntime().install("fit:512MiB").options["device_budget"] == 2**29


def test_service_options_are_checked() -> None:
    with pytest.raises(ValueError, match="Fit: prefetch=-1 is not accepted"):
        Fit(prefetch=-1)
    with pytest.raises(ValueError, match="device_budget='x'"):
        Fit("x")


def test_unwrap_puts_every_weight_back() -> None:
    plans = ladder(lora_llama())
    model = lora_llama()
    reference = {n: t.clone() for n, t in model.state_dict().items()}
    model, _ = sakura_offload.wrap(
        model,
        adamw(model),
        device_budget=rung(plans, "host", "host").device_bytes,
        activations="keep",
    )
    assert model.sakura_fit.paging.stats.paged_bytes > 0
    sakura_offload.unwrap(model)
    assert_same({n: t for n, t in model.state_dict().items()}, reference)
    with pytest.raises(ValueError, match="not wrapped"):
        sakura_offload.unwrap(model)


def test_service_under_lightning_matches_the_choices_by_hand(tmp_path: Any) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from sakura_adapters.lightning import LightningAdapter

    g = torch.Generator().manual_seed(5)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 61, (6, 12), generator=g)]

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self, make_optimizer: Any) -> None:
            super().__init__()
            self.model = lora_llama()
            self.make_optimizer = make_optimizer

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            return self.make_optimizer(self)

    def fit(module: Any, rt: SakuraRuntime | None) -> dict[str, torch.Tensor]:
        trainer = pl.Trainer(
            max_steps=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=str(tmp_path),
            accelerator="cpu",
            devices=1,
            callbacks=[LightningAdapter(rt)] if rt is not None else [],
        )
        trainer.fit(module, DataLoader(rows, batch_size=2, shuffle=False))
        return trained(module.model)

    device = rung(
        ladder(lora_llama()), "host", "host"
    ).device_bytes  # streamed from host, host optimizer
    by_hand = Module(
        lambda m: sakura_offload.OffloadAdamW.from_optimizer(adamw(m), moment_dtype="float32")
    )
    paging = sakura_offload.WeightPaging(by_hand.model)
    expected = fit(by_hand, None)
    paging.remove()
    with SakuraRuntime(strict=True) as rt:
        service = rt.install(
            f"fit:device_budget={device},host_budget={HUGE},activations=keep,report=false"
        )
        result = fit(Module(adamw), rt)
    plan = service.state.plan
    assert (plan.optimizer, plan.weights, plan.moment_dtype) == ("host", "host", "float32")
    assert isinstance(service.state.optimizer, sakura_offload.OffloadAdamW)
    assert_same(result, expected)
    start = trained(lora_llama())
    assert all(not torch.equal(start[n], expected[n]) for n in start)  # it trained


def test_activations_that_cannot_fit_name_the_whole_device_budget() -> None:
    from sakura_offload.fit import FitError

    plans = ladder(lora_llama())
    fixed = plans[0].device_bytes
    model = lora_llama()
    start = trained(model)
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), device_budget=fixed + 1000, cost_trials=0, replan=False
    )  # (re-planning off: test_fit_replan re-plans this case)
    with pytest.raises(FitError, match="the activations do not fit") as info:
        train(model, optimizer)  # the first forward measures the activations
    least = info.value.__cause__.minimum  # the planner's: every block recomputed
    assert least == 117_120 and info.value.minimum == fixed + least
    assert f"device_budget >= {fixed + least} bytes" in str(info.value)
    assert_same(trained(model), start)  # no step was taken


def test_service_under_the_hf_trainer_matches_the_choices_by_hand(tmp_path: Any) -> None:
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from sakura_adapters.hf import SakuraTrainer

    g = torch.Generator().manual_seed(5)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 61, (6, 12), generator=g)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    device = rung(
        ladder(lora_llama()), "host", "host"
    ).device_bytes  # streamed from host, host optimizer
    by_hand = lora_llama()
    paging = sakura_offload.WeightPaging(by_hand)
    optimizer = sakura_offload.OffloadAdamW.from_optimizer(
        torch.optim.AdamW(
            [p for p in by_hand.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0
        ),
        moment_dtype="float32",
        eager=False,  # the Trainer clips after backward
    )
    Trainer(model=by_hand, args=args, train_dataset=rows, optimizers=(optimizer, None)).train()
    expected = trained(by_hand)
    paging.remove()
    rt = SakuraRuntime(strict=True)
    service = rt.install(
        f"fit:device_budget={device},host_budget={HUGE},activations=keep,report=false"
    )
    model = lora_llama()
    SakuraTrainer(model=model, args=args, train_dataset=rows, runtime=rt).train()
    plan = service.state.plan
    assert (plan.optimizer, plan.weights, plan.moment_dtype) == ("host", "host", "float32")
    assert_same(trained(model), expected)
    start = trained(lora_llama())
    assert all(not torch.equal(start[n], expected[n]) for n in start)  # it trained
