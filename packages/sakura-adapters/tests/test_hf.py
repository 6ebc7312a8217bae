"""HFAdapter and SakuraTrainer on a real ``transformers.Trainer`` (CPU, tiny models)."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
)

from sakura import SakuraRuntime
from sakura.events import (
    OnError,
    OnLoadCheckpoint,
    OnTestBegin,
    OnTrainBegin,
    OnTrainStepEnd,
    OnValidationEpochBegin,
)
from sakura.options import OptionError
from sakura.resume import ServiceStateError, ServiceStateWarning
from sakura.testing.recording import RecordingService
from sakura_adapters.emitted import UnemittedEventWarning
from sakura_adapters.hf import (
    STATE_FILE,
    HFAdapter,
    SakuraTrainer,
    SakuraTrainerRequiredError,
    state_file_name,
)

N_TRAIN = 16
N_EVAL = 8
BATCH = 4
EPOCHS = 2
STEPS_PER_EPOCH = N_TRAIN // BATCH
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH
LR = 0.1


# --- fixtures: a tiny model, synthetic data, Trainer arguments -------------------------------


class TinyRegressor(nn.Module):
    """forward(**batch) -> {"loss", "logits"}, as the Trainer expects of a model."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.forward_calls = 0
        self.autocast_seen: list[bool] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        self.forward_calls += 1
        self.autocast_seen.append(FlagAutocast.active > 0)
        pred = self.net(x).squeeze(-1)
        loss = F.mse_loss(pred, labels) if labels is not None else None
        return {"loss": loss, "logits": pred}


class CountingWrapper(nn.Module):
    """What a wrap_model service may return: a new module around the model."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        self.calls += 1
        return self.inner(x=x, labels=labels)


def make_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = 3.0 * x[:, 0] - 2.0 * x[:, 1] + 0.5 + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


@pytest.fixture
def train_data() -> list[dict[str, torch.Tensor]]:
    return make_data(N_TRAIN, seed=1)


@pytest.fixture
def eval_data() -> list[dict[str, torch.Tensor]]:
    return make_data(N_EVAL, seed=2)


@pytest.fixture
def model() -> TinyRegressor:
    torch.manual_seed(0)
    return TinyRegressor()


def make_args(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": BATCH,
        "num_train_epochs": EPOCHS,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "train_sampling_strategy": "sequential",
        "logging_steps": 2,
        "eval_strategy": "no",
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "seed": 0,
    }
    options.update(overrides)
    return TrainingArguments(**options)


SGD = (torch.optim.SGD, {"lr": LR})


# --- test services --------------------------------------------------------------------------


class StepCounter:
    """A stateful service: counts optimizer steps; the count travels in checkpoints."""

    name = "step_counter"
    priority = 50

    def __init__(self) -> None:
        self.count = 0
        self.count_at_train_begin: int | None = None

    def on_optimizer_step(self, event: Any) -> None:
        self.count += 1

    def on_train_begin(self, event: Any) -> None:
        self.count_at_train_begin = self.count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: Any) -> None:
        self.count = int(state["count"])


class LossScaler:
    """Owns the step: scales the loss by 1024, unscales once per step, steps itself."""

    name = "loss_scaler"
    priority = 10

    def __init__(self, scale: float = 1024.0) -> None:
        self.scale = scale
        self._unscaled = False
        self.steps = 0
        self.unscales = 0
        self.optimizer_types: set[type] = set()

    def wrap_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_gradients(self, optimizer: Any) -> None:
        if self._unscaled:
            return
        self.unscales += 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self.scale)
        self._unscaled = True

    def optimizer_step(self, optimizer: Any) -> bool:
        self.optimizer_types.add(type(optimizer))
        self.unscale_gradients(optimizer)
        optimizer.step()
        self._unscaled = False
        self.steps += 1
        return True


class FlagAutocast:
    """An autocast service whose context the model can observe."""

    name = "flag_autocast"
    priority = 20
    active = 0

    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def _ctx(self) -> Any:
        type(self).active += 1
        self.entered += 1
        try:
            yield
        finally:
            type(self).active -= 1

    def autocast(self) -> Any:
        return self._ctx()


class InPlaceTagger:
    """wrap_model that modifies the model in place (works with the stock Trainer)."""

    name = "tagger"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model.sakura_tag = "tagged"
        return model


class Rewrapper:
    """wrap_model that returns a new module (needs SakuraTrainer)."""

    name = "rewrapper"

    def __init__(self) -> None:
        self.wrapper: CountingWrapper | None = None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.wrapper = CountingWrapper(model)
        return self.wrapper


class StepCountingOptimizer:
    """What a wrap_optimizer service may return: a new object around the optimizer."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.steps = 0

    @property
    def param_groups(self) -> Any:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def defaults(self) -> Any:
        return self.inner.defaults

    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class OptimizerWrapper:
    name = "optimizer_wrapper"

    def __init__(self) -> None:
        self.wrapped: list[StepCountingOptimizer] = []

    def wrap_optimizer(self, optimizer: Any) -> Any:
        self.wrapped.append(StepCountingOptimizer(optimizer))
        return self.wrapped[-1]


# --- helpers ----------------------------------------------------------------------------------


def sakura_run_names() -> list[str]:
    """The exact event sequence of the run in test_sakura_trainer_event_sequence."""
    names = ["OnSetup", "OnFitBegin", "OnTrainBegin"]
    step = 0
    for _epoch in range(EPOCHS):
        names.append("OnEpochBegin")
        for _ in range(STEPS_PER_EPOCH):
            step += 1
            names += [
                "OnTrainStepBegin",
                "OnBeforeBackward",
                "OnAfterBackward",
                "OnBeforeOptimizerStep",
                "OnOptimizerStep",
                "OnBeforeZeroGrad",
                "OnTrainStepEnd",
            ]
            if step % 2 == 0:
                names.append("OnLog")
            if step in (6, TOTAL_STEPS):  # save_steps=6, and the Trainer saves at the end
                names.append("OnSaveCheckpoint")
        names.append("OnEpochEnd")
        names += ["OnValidationBegin", "OnValidationBatchEnd", "OnValidationBatchEnd"]
        names += ["OnLog", "OnValidationEnd"]
    names += ["OnLog", "OnTrainEnd", "OnFitEnd"]
    return names


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# --- the event mapping ------------------------------------------------------------------------


def test_sakura_trainer_event_sequence(tmp_path, model, train_data, eval_data):
    rt = SakuraRuntime(strict=True)
    rec = rt.install(RecordingService())
    args = make_args(tmp_path, eval_strategy="epoch", save_strategy="steps", save_steps=6)
    trainer = SakuraTrainer(
        model=model,
        args=args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        optimizer_cls_and_kwargs=SGD,
        runtime=rt,
    )
    trainer.train()

    assert rec.names == sakura_run_names()
    assert all(e.rank == 0 and e.world_size == 1 for e in rec.events)
    assert rt.rank == 0 and rt.world_size == 1

    def values(name: str, field: str) -> list[Any]:
        return [getattr(e, field) for e in rec.events if type(e).__name__ == name]

    assert values("OnTrainStepBegin", "step") == list(range(TOTAL_STEPS))
    assert values("OnTrainStepBegin", "epoch") == [0] * 4 + [1] * 4
    assert values("OnTrainStepBegin", "batch_idx") == [0, 1, 2, 3] * 2
    assert values("OnBeforeOptimizerStep", "step") == list(range(TOTAL_STEPS))
    assert values("OnOptimizerStep", "step") == list(range(1, TOTAL_STEPS + 1))
    assert values("OnTrainStepEnd", "step") == list(range(1, TOTAL_STEPS + 1))
    assert values("OnEpochBegin", "epoch") == [0, 1]
    assert values("OnEpochEnd", "epoch") == [0, 1]
    assert values("OnEpochEnd", "step") == [4, 8]
    assert values("OnValidationEnd", "epoch") == [0, 1]
    assert values("OnValidationEnd", "step") == [4, 8]
    assert all("eval_loss" in m for m in values("OnValidationEnd", "metrics"))
    assert values("OnValidationBatchEnd", "batch_idx") == [0, 1, 0, 1]
    out = str(tmp_path / "out")
    assert values("OnSaveCheckpoint", "path") == [
        os.path.join(out, "checkpoint-6"),
        os.path.join(out, "checkpoint-8"),
    ]
    assert values("OnSaveCheckpoint", "epoch") == [1, 1]
    assert values("OnSetup", "stage") == ["init"]
    # epoch metrics: what the Trainer logged during the epoch (loss at steps 2 and 4)
    assert "loss" in values("OnEpochEnd", "metrics")[0]
    assert "train_loss" in values("OnTrainEnd", "metrics")[0]
    assert values("OnLog", "logs")[0]["loss"] > 0
    # the objects of the moment
    begin = rec.of(OnTrainBegin)[0]
    assert begin.model is trainer.model
    assert begin.trainer is trainer  # SakuraTrainer binds itself; the stock Trainer: its state
    assert type(begin.optimizer) is torch.optim.SGD
    assert begin.train_loader is not None
    losses = [e.loss for e in rec.of(OnTrainStepEnd)]
    assert all(isinstance(x, torch.Tensor) and x.ndim == 0 for x in losses)
    assert rt.event_counts["OnTrainStepEnd"] == TOTAL_STEPS

    # predict: OnPredictBegin, a batch end per batch, OnPredictEnd
    rec.events.clear()
    trainer.predict(eval_data)
    assert rec.names == ["OnPredictBegin", "OnPredictBatchEnd", "OnPredictBatchEnd", "OnPredictEnd"]
    # the events read from the code cover every event the run emitted
    emitted = {cls.__name__ for cls in HFAdapter.emitted_events(SakuraTrainer)}
    assert set(sakura_run_names()) | set(rec.names) <= emitted


def test_stock_trainer_with_event_services_only(tmp_path, train_data):
    """The reference quickstart: callbacks=[HFAdapter(rt)] on the stock Trainer, a real
    PreTrainedModel."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    bert = BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(3)
    data = [
        {"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": torch.tensor(i % 2)}
        for i in range(N_TRAIN)
    ]
    rt = SakuraRuntime(strict=True)
    rec = rt.install(RecordingService())
    args = make_args(
        tmp_path,
        learning_rate=1e-3,
        eval_strategy="epoch",
        save_strategy="epoch",
        gradient_accumulation_steps=2,
    )
    trainer = Trainer(
        model=bert,
        args=args,
        train_dataset=data,
        eval_dataset=data[:N_EVAL],
        callbacks=[HFAdapter(rt)],
    )
    trainer.train()

    steps = TOTAL_STEPS // 2  # gradient accumulation over 2 batches
    counts = rec.counts()
    assert counts == Counter(
        {
            "OnSetup": 1,
            "OnFitBegin": 1,
            "OnTrainBegin": 1,
            "OnEpochBegin": EPOCHS,
            "OnTrainStepBegin": steps,
            "OnSubstepEnd": steps,
            "OnBeforeOptimizerStep": steps,
            "OnOptimizerStep": steps,
            "OnBeforeZeroGrad": steps,
            "OnTrainStepEnd": steps,
            "OnLog": 2 + EPOCHS + 1,  # logging_steps=2 over 4 steps, one per evaluation, final
            "OnEpochEnd": EPOCHS,
            "OnValidationBatchEnd": EPOCHS * N_EVAL // BATCH,
            "OnValidationEnd": EPOCHS,
            "OnSaveCheckpoint": EPOCHS,
            "OnTrainEnd": 1,
            "OnFitEnd": 1,
        }
    )
    # a callback cannot see backward or the start of evaluation
    assert "OnBeforeBackward" not in counts and "OnValidationBegin" not in counts
    assert set(counts) <= {cls.__name__ for cls in HFAdapter.emitted_events()}
    names = rec.names
    assert names[:4] == ["OnSetup", "OnFitBegin", "OnTrainBegin", "OnEpochBegin"]
    assert names[-2:] == ["OnTrainEnd", "OnFitEnd"]
    assert rec.of(OnTrainBegin)[0].trainer is trainer.state  # a callback is not given more
    assert rec.of(OnTrainBegin)[0].accumulation_steps == 2  # the Trainer's setting, published
    first_step = names.index("OnTrainStepBegin")
    assert names[first_step : first_step + 6] == [
        "OnTrainStepBegin",
        "OnSubstepEnd",
        "OnBeforeOptimizerStep",
        "OnOptimizerStep",
        "OnBeforeZeroGrad",
        "OnTrainStepEnd",
    ]
    substeps = [e.batch_idx for e in rec.events if type(e).__name__ == "OnSubstepEnd"]
    ends = [e.batch_idx for e in rec.events if type(e).__name__ == "OnTrainStepEnd"]
    assert substeps == [0, 2, 0, 2] and ends == [1, 3, 1, 3]
    assert [e.step for e in rec.events if type(e).__name__ == "OnTrainStepEnd"] == [1, 2, 3, 4]
    assert all(e.rank == 0 and e.world_size == 1 for e in rec.events)
    # no stateful service: no state file is written
    assert not (tmp_path / "out" / "checkpoint-2" / STATE_FILE).exists()


def test_handler_failure_is_isolated_and_reported(tmp_path, model, train_data):
    rt = SakuraRuntime()
    rt.install(RecordingService("flaky", priority=1, fail_on={"OnTrainStepEnd"}))
    watcher = rt.install(RecordingService("watcher", priority=2))
    trainer = Trainer(
        model=model,
        args=make_args(tmp_path),
        train_dataset=train_data,
        optimizer_cls_and_kwargs=SGD,
        callbacks=[HFAdapter(rt)],
    )
    result = trainer.train()

    assert result.global_step == TOTAL_STEPS
    errors = watcher.of(OnError)
    assert len(errors) == TOTAL_STEPS
    assert {e.source for e in errors} == {"flaky"}
    assert all(type(e.event).__name__ == "OnTrainStepEnd" for e in errors)
    assert watcher.counts()["OnTrainStepEnd"] == TOTAL_STEPS
    assert len(rt.errors) == TOTAL_STEPS


# --- services that need the Trainer subclass ------------------------------------------------


def reference_training(
    model: nn.Module, data: list[dict[str, torch.Tensor]], *, max_grad_norm: float
) -> tuple[list[float], list[float]]:
    """The hand-written loop SakuraTrainer must match: same order, SGD, constant LR.
    Returns the losses and the gradient norms (before clipping) of every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses: list[float] = []
    norms: list[float] = []
    for _epoch in range(EPOCHS):
        for start in range(0, N_TRAIN, BATCH):
            chunk = data[start : start + BATCH]
            x = torch.stack([d["x"] for d in chunk])
            labels = torch.stack([d["labels"] for d in chunk])
            loss = model(x=x, labels=labels)["loss"]
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            norms.append(norm.item())
    return losses, norms


def test_step_owning_service_matches_reference_loop(tmp_path, model, train_data):
    reference = copy.deepcopy(model)
    ref_losses, ref_norms = reference_training(reference, train_data, max_grad_norm=0.5)
    assert max(ref_norms) > 0.5  # clipping is active, so unscaling before it matters

    rt = SakuraRuntime(strict=True)
    scaler = rt.install(LossScaler())
    rec = rt.install(RecordingService(event_types={OnTrainStepEnd}))
    trainer = SakuraTrainer(
        model=model,
        args=make_args(tmp_path, max_grad_norm=0.5),
        train_dataset=train_data,
        optimizer_cls_and_kwargs=SGD,
        callbacks=[HFAdapter(rt)],
    )
    result = trainer.train()

    assert scaler.steps == TOTAL_STEPS
    assert scaler.unscales == TOTAL_STEPS  # once per step: clipping, then the step
    assert scaler.optimizer_types == {torch.optim.SGD}  # never accelerate's wrapper
    got, want = weights(model), weights(reference)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0)
    # the loss the Trainer logs and the services see is unscaled
    step_losses = [e.loss.item() for e in rec.of(OnTrainStepEnd)]
    assert step_losses == pytest.approx(ref_losses, abs=1e-6)
    assert result.training_loss == pytest.approx(sum(ref_losses) / len(ref_losses), abs=1e-6)
    # so is the gradient norm it logs (every logging_steps=2 steps)
    logged_norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    assert logged_norms == pytest.approx(ref_norms[1::2], rel=1e-5)


def test_stock_trainer_rejects_step_owning_service(tmp_path, model, train_data):
    rt = SakuraRuntime()
    rt.install(LossScaler())
    before = weights(model)
    with pytest.raises(SakuraTrainerRequiredError) as info:
        Trainer(
            model=model,
            args=make_args(tmp_path),
            train_dataset=train_data,
            callbacks=[HFAdapter(rt)],
        )
    message = str(info.value)
    assert "sakura_adapters.hf.SakuraTrainer" in message
    assert "'loss_scaler'" in message
    assert "wrap_loss" in message and "optimizer_step" in message

    # installed after the Trainer was built: stops at the start of training
    rt2 = SakuraRuntime()
    trainer = Trainer(
        model=model,
        args=make_args(tmp_path),
        train_dataset=train_data,
        callbacks=[HFAdapter(rt2)],
    )
    rt2.install(LossScaler())
    with pytest.raises(SakuraTrainerRequiredError, match="SakuraTrainer"):
        trainer.train()
    after = weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no step was taken


def test_hf_mixed_precision_conflicts_with_sakura_autocast(tmp_path, model, train_data):
    rt = SakuraRuntime()
    rt.install(FlagAutocast())
    args = make_args(tmp_path, bf16=True)
    for cls, extra in ((SakuraTrainer, {"runtime": rt}), (Trainer, {"callbacks": [HFAdapter(rt)]})):
        with pytest.raises(ValueError, match=r"bf16=True.*flag_autocast.*use one"):
            cls(model=model, args=args, train_dataset=train_data, **extra)


# --- services that take effect under the stock Trainer ----------------------------------------


def test_stock_trainer_applies_autocast_and_in_place_wrap_model(
    tmp_path, model, train_data, eval_data
):
    rt = SakuraRuntime(strict=True)
    autocast = rt.install(FlagAutocast())
    rt.install(InPlaceTagger())
    trainer = Trainer(
        model=model,
        args=make_args(tmp_path, eval_strategy="epoch"),
        train_dataset=train_data,
        eval_dataset=eval_data,
        optimizer_cls_and_kwargs=SGD,
        callbacks=[HFAdapter(rt)],
    )
    assert model.sakura_tag == "tagged"
    trainer.train()
    n_forward = TOTAL_STEPS + EPOCHS * N_EVAL // BATCH
    assert model.forward_calls == n_forward
    assert model.autocast_seen == [True] * n_forward
    assert autocast.entered == n_forward


def test_stock_trainer_rejects_wrap_model_returning_new_module(tmp_path, model, train_data):
    rt = SakuraRuntime()
    rt.install(Rewrapper())
    with pytest.raises(
        SakuraTrainerRequiredError, match=r"'rewrapper'.*CountingWrapper.*SakuraTrainer"
    ):
        Trainer(
            model=model,
            args=make_args(tmp_path),
            train_dataset=train_data,
            callbacks=[HFAdapter(rt)],
        )


def test_sakura_trainer_wraps_model_and_autocasts(tmp_path, model, train_data, eval_data):
    rt = SakuraRuntime(strict=True)
    rewrapper = rt.install(Rewrapper())
    autocast = rt.install(FlagAutocast())
    trainer = SakuraTrainer(
        model=model,
        args=make_args(tmp_path, eval_strategy="epoch"),
        train_dataset=train_data,
        eval_dataset=eval_data,
        optimizer_cls_and_kwargs=SGD,
        runtime=rt,
    )
    assert trainer.model is rewrapper.wrapper
    assert trainer.model.inner is model
    trainer.train()
    n_forward = TOTAL_STEPS + EPOCHS * N_EVAL // BATCH
    assert rewrapper.wrapper.calls == n_forward
    assert model.autocast_seen == [True] * n_forward
    assert autocast.entered == n_forward
    assert "__wrapped__" not in model.forward.__dict__  # no forward patching in the subclass


def test_sakura_trainer_wraps_optimizer(tmp_path, model, train_data):
    rt = SakuraRuntime(strict=True)
    wrapper = rt.install(OptimizerWrapper())
    rec = rt.install(RecordingService(event_types={OnTrainBegin}))
    args = make_args(tmp_path, save_strategy="steps", save_steps=4)
    trainer = SakuraTrainer(
        model=model, args=args, train_dataset=train_data, optimizer_cls_and_kwargs=SGD, runtime=rt
    )
    trainer.train()
    assert len(wrapper.wrapped) == 1
    assert wrapper.wrapped[0].steps == TOTAL_STEPS
    assert rec.events[0].optimizer is wrapper.wrapped[0]  # services see what they returned
    assert (tmp_path / "out" / "checkpoint-4" / "optimizer.pt").exists()  # state_dict works

    # a second train() reuses the optimizer: wrapped once, still stepped through the runtime
    trainer.train()
    assert len(wrapper.wrapped) == 1
    assert wrapper.wrapped[0].steps == 2 * TOTAL_STEPS

    # the stock Trainer cannot take a new optimizer from a callback
    rt2 = SakuraRuntime()
    rt2.install(OptimizerWrapper())
    stock = Trainer(model=model, args=args, train_dataset=train_data, callbacks=[HFAdapter(rt2)])
    with pytest.raises(
        SakuraTrainerRequiredError, match=r"'optimizer_wrapper'.*wrap_optimizer.*SakuraTrainer"
    ):
        stock.train()


def test_user_optimizer_goes_through_the_runtime(tmp_path, model, train_data):
    rt = SakuraRuntime(strict=True)
    scaler = rt.install(LossScaler())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = SakuraTrainer(
        model=model,
        args=make_args(tmp_path),
        train_dataset=train_data,
        optimizers=(optimizer, None),
        runtime=rt,
    )
    trainer.train()
    assert scaler.steps == TOTAL_STEPS
    assert scaler.optimizer_types == {torch.optim.SGD}


class ExplodingModel(TinyRegressor):
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        if self.forward_calls == 2:
            raise FloatingPointError("boom")
        return super().forward(x, labels)


def test_training_exception_reaches_services(tmp_path, train_data):
    rt = SakuraRuntime()
    watcher = rt.install(RecordingService(event_types={OnError}))
    torch.manual_seed(0)
    trainer = SakuraTrainer(
        model=ExplodingModel(), args=make_args(tmp_path), train_dataset=train_data, runtime=rt
    )
    with pytest.raises(FloatingPointError, match="boom"):
        trainer.train()
    (error,) = watcher.of(OnError)
    assert error.source == "transformers"
    assert isinstance(error.exception, FloatingPointError)
    assert error.step == 2


# --- service state in checkpoints -------------------------------------------------------------


def test_sakura_trainer_resume_restores_service_state(tmp_path, model, train_data):
    args = make_args(tmp_path, save_strategy="steps", save_steps=6)
    rt = SakuraRuntime(strict=True)
    counter = rt.install(StepCounter())
    SakuraTrainer(
        model=model, args=args, train_dataset=train_data, optimizer_cls_and_kwargs=SGD, runtime=rt
    ).train()
    assert counter.count == TOTAL_STEPS
    checkpoint = tmp_path / "out" / "checkpoint-6"
    saved = torch.load(checkpoint / STATE_FILE, weights_only=True)
    assert saved == {"step_counter": {"count": 6}}
    assert [p.name for p in checkpoint.iterdir() if ".tmp" in p.name] == []

    torch.manual_seed(0)
    rt2 = SakuraRuntime(strict=True)
    counter2 = rt2.install(StepCounter())
    rec = rt2.install(RecordingService(event_types={OnLoadCheckpoint, OnTrainBegin}))
    trainer = SakuraTrainer(
        model=TinyRegressor(),
        args=args,
        train_dataset=train_data,
        optimizer_cls_and_kwargs=SGD,
        callbacks=[HFAdapter(rt2)],
    )
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert counter2.count_at_train_begin == 6
    assert counter2.count == TOTAL_STEPS
    assert rec.names == ["OnLoadCheckpoint", "OnTrainBegin"]
    assert rec.events[0].path == str(checkpoint)
    assert rec.events[0].step == 6


def test_stock_trainer_resume_restores_service_state(tmp_path, model, train_data):
    args = make_args(tmp_path, save_strategy="steps", save_steps=6, num_train_epochs=1.5)
    rt = SakuraRuntime(strict=True)
    counter = rt.install(StepCounter())
    Trainer(
        model=model,
        args=args,
        train_dataset=train_data,
        optimizer_cls_and_kwargs=SGD,
        callbacks=[HFAdapter(rt)],
    ).train()
    assert counter.count == 6  # 1.5 epochs of 4 steps; saved at step 6

    args = make_args(tmp_path, save_strategy="steps", save_steps=6)
    torch.manual_seed(0)
    rt2 = SakuraRuntime(strict=True)
    counter2 = rt2.install(StepCounter())
    Trainer(
        model=TinyRegressor(),
        args=args,
        train_dataset=train_data,
        optimizer_cls_and_kwargs=SGD,
        callbacks=[HFAdapter(rt2)],
    ).train(resume_from_checkpoint=True)
    assert counter2.count_at_train_begin == 6
    assert counter2.count == TOTAL_STEPS


# --- services that handle events the Trainer never emits --------------------------------------


class BackwardMonitor:
    """Handles on_after_backward (the stock Trainer tells a callback nothing about it)."""

    name = "grad_monitor"

    def __init__(self) -> None:
        self.calls = 0

    def on_after_backward(self, event: Any) -> None:
        self.calls += 1


class LoopMonitor:
    """Handles on_test_begin: the transformers.Trainer has no test loop at all."""

    name = "test_watcher"

    def on_test_begin(self, event: Any) -> None:
        pass


def test_emitted_events_are_read_from_the_code():
    stock = HFAdapter.emitted_events()
    with_trainer = HFAdapter.emitted_events(SakuraTrainer)
    assert stock is not None and with_trainer is not None
    names = {cls.__name__ for cls in with_trainer - stock}
    assert names == {
        "OnBeforeBackward",
        "OnAfterBackward",
        "OnValidationBegin",
        "OnPredictBegin",
        "OnError",
    }
    assert {"OnSubstepEnd", "OnLog", "OnPushBegin", "OnLoadCheckpoint"} <= {
        cls.__name__ for cls in stock
    }
    assert not {"OnTestBegin", "OnSanityCheckBegin"} & {cls.__name__ for cls in with_trainer}

    class Extended(SakuraTrainer):  # a subclass that emits more is read as well
        def evaluate(self, *args: Any, **kwargs: Any) -> Any:
            self.runtime.emit(OnValidationEpochBegin, step=0, epoch=0, model=self.model)
            return super().evaluate(*args, **kwargs)

    assert HFAdapter.emitted_events(Extended) == with_trainer | {OnValidationEpochBegin}


def test_stock_trainer_warns_about_events_it_never_emits(tmp_path, model, train_data):
    rt = SakuraRuntime(strict=True)
    monitor = rt.install(BackwardMonitor())
    rt.install(LoopMonitor())
    rt.install(RecordingService())  # a catch-all takes whatever comes: no warning
    # One on_event for several moments is alive when one of them comes: no warning ...
    rt.install(RecordingService("first_of", event_types={OnTrainBegin, OnTestBegin}))
    # ... and dead when none can.
    rt.install(RecordingService("test_only", event_types={OnTestBegin}))
    trainer = Trainer(
        model=model,
        args=make_args(tmp_path),
        train_dataset=train_data,
        optimizer_cls_and_kwargs=SGD,
        callbacks=[HFAdapter(rt)],
    )
    with pytest.warns(UnemittedEventWarning) as record:
        trainer.train()
    messages = [str(w.message) for w in record if w.category is UnemittedEventWarning]
    assert len(messages) == 3
    assert messages[0].startswith(
        "sakura service 'grad_monitor' handles on_after_backward (OnAfterBackward), which "
        "HFAdapter under the stock transformers.Trainer never emits, so that handler will "
        "never run; use sakura_adapters.hf.SakuraTrainer"
    )
    assert messages[0].endswith("which emits it")
    assert messages[1].startswith("sakura service 'test_watcher' handles on_test_begin")
    assert "the transformers.Trainer has no such moment" in messages[1]
    assert messages[2].startswith("sakura service 'test_only' handles on_test_begin")
    assert monitor.calls == 0


def test_sakura_trainer_emits_what_the_stock_trainer_cannot(tmp_path, model, train_data):
    rt = SakuraRuntime(strict=True)
    monitor = rt.install(BackwardMonitor())
    trainer = SakuraTrainer(
        model=model,
        args=make_args(tmp_path),
        train_dataset=train_data,
        optimizer_cls_and_kwargs=SGD,
        runtime=rt,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnemittedEventWarning)
        trainer.train()
    assert monitor.calls == TOTAL_STEPS


# --- resuming with a changed service list -------------------------------------------------------


def _save_at_step_6(tmp_path, model, train_data, services):
    """A stock-Trainer run of 1.5 epochs with ``services``, saved at step 6."""
    args = make_args(tmp_path, save_strategy="steps", save_steps=6, num_train_epochs=1.5)
    rt = SakuraRuntime(services, strict=True)
    Trainer(
        model=model,
        args=args,
        train_dataset=train_data,
        optimizer_cls_and_kwargs=SGD,
        callbacks=[HFAdapter(rt)],
    ).train()
    return tmp_path / "out" / "checkpoint-6"


def _resume(tmp_path, train_data, services, *, sakura_trainer=False, **options):
    args = make_args(tmp_path, save_strategy="steps", save_steps=6)
    torch.manual_seed(0)
    rt = SakuraRuntime(services, strict=True)
    kwargs = dict(model=TinyRegressor(), args=args, train_dataset=train_data)
    if sakura_trainer:
        trainer = SakuraTrainer(**kwargs, optimizer_cls_and_kwargs=SGD, runtime=rt, **options)
    else:
        adapter = HFAdapter(rt, **options)
        trainer = Trainer(**kwargs, optimizer_cls_and_kwargs=SGD, callbacks=[adapter])
    trainer.train(resume_from_checkpoint=True)


def test_resume_with_an_added_service_starts_it_fresh(tmp_path, model, train_data, epoch_counter):
    _save_at_step_6(tmp_path, model, train_data, [StepCounter()])
    counter, added = StepCounter(), epoch_counter
    with pytest.warns(
        ServiceStateWarning, match=r"no state for installed service\(s\) \['epoch_counter'\]"
    ):
        _resume(tmp_path, train_data, [counter, added])
    assert counter.count_at_train_begin == 6 and counter.count == TOTAL_STEPS
    assert added.loaded is None
    assert added.epochs == 1  # fresh: only the epoch the resumed run finished


def test_resume_without_a_service_keeps_its_state_in_the_next_checkpoint(
    tmp_path, model, train_data, epoch_counter
):
    checkpoint = _save_at_step_6(tmp_path, model, train_data, [StepCounter(), epoch_counter])
    saved = torch.load(checkpoint / STATE_FILE, weights_only=True)
    assert saved == {"step_counter": {"count": 6}, "epoch_counter": {"epochs": 1}}
    counter = StepCounter()
    with pytest.warns(ServiceStateWarning, match=r"state for service\(s\) \['epoch_counter'\]"):
        _resume(tmp_path, train_data, [counter])
    assert counter.count == TOTAL_STEPS
    final = torch.load(
        tmp_path / "out" / f"checkpoint-{TOTAL_STEPS}" / STATE_FILE, weights_only=True
    )
    assert final == {
        "step_counter": {"count": TOTAL_STEPS},
        "epoch_counter": {"epochs": 1},  # not installed in the resumed run, kept as it was
    }


@pytest.mark.parametrize("sakura_trainer", [False, True], ids=["stock", "sakura_trainer"])
@pytest.mark.parametrize("saved_with_epoch_counter", [False, True], ids=["added", "removed"])
def test_strict_resume_rejects_a_changed_service_list(
    tmp_path, model, train_data, epoch_counter, sakura_trainer, saved_with_epoch_counter
):
    first = [StepCounter(), epoch_counter] if saved_with_epoch_counter else [StepCounter()]
    _save_at_step_6(tmp_path, model, train_data, first)
    counter = StepCounter()
    second = [counter] if saved_with_epoch_counter else [counter, type(epoch_counter)()]
    with pytest.raises(ServiceStateError, match="epoch_counter"):
        _resume(tmp_path, train_data, second, sakura_trainer=sakura_trainer, strict_resume=True)
    assert counter.count_at_train_begin is None  # stopped before training started


# --- bad input ----------------------------------------------------------------------------------


def test_the_never_released_exception_name_is_gone():
    import sakura_adapters.hf as hf

    assert not hasattr(hf, "SakuraTrainerRequired")
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        hf.NoSuchName  # noqa: B018


def test_state_file_names():
    assert state_file_name() == STATE_FILE == "sakura_state.pt"
    assert state_file_name(3, 4) == "sakura_state_3.pt"


def test_bad_input(tmp_path, model, train_data):
    with pytest.raises(
        TypeError, match=r"HFAdapter\(rt=\.\.\.\) must be a sakura.SakuraRuntime, got int"
    ):
        HFAdapter(42)  # type: ignore[arg-type]
    args = make_args(tmp_path)
    with pytest.raises(TypeError, match=r"SakuraTrainer\(runtime=\.\.\.\) must be a sakura"):
        SakuraTrainer(model=model, args=args, runtime="bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a sakura runtime"):
        SakuraTrainer(model=model, args=args)
    with pytest.raises(TypeError, match="pass an instance"):
        SakuraTrainer(model=model, args=args, callbacks=[HFAdapter])
    with pytest.raises(
        OptionError, match=r"HFAdapter: strict_resume=1 is not accepted; accepted: True or False"
    ):
        HFAdapter(SakuraRuntime(), strict_resume=1)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=r"SakuraTrainer: strict_resume='no' is not accepted"):
        SakuraTrainer(model=model, args=args, runtime=SakuraRuntime(), strict_resume="no")
    with pytest.raises(ValueError, match="different SakuraRuntimes"):
        SakuraTrainer(
            model=model, args=args, runtime=SakuraRuntime(), callbacks=[HFAdapter(SakuraRuntime())]
        )
