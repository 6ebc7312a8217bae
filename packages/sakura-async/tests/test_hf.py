"""AsyncEval and AsyncCheckpoint under a real transformers.Trainer (CPU, tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from sakura import OnValidationEnd, SakuraRuntime
from sakura.testing import RecordingService
from sakura_adapters.hf import HFAdapter, SakuraTrainer
from sakura_async import AsyncCheckpoint, AsyncEval, load_latest
from sakura_async.checkpoint import find_checkpoints

N_TRAIN, BATCH, EPOCHS = 16, 4, 3
STEPS = N_TRAIN // BATCH


class TinyRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        pred = self.net(x).squeeze(-1)
        loss = F.mse_loss(pred, labels) if labels is not None else None
        return {"loss": loss, "logits": pred}


def make_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = 3.0 * x[:, 0] - 2.0 * x[:, 1] + 0.5
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


VAL = make_data(8, seed=2)


def val_loss(model: nn.Module) -> float:
    x = torch.stack([d["x"] for d in VAL])
    y = torch.stack([d["labels"] for d in VAL])
    with torch.no_grad():
        return F.mse_loss(model(x)["logits"], y).item()


def eval_fn(epoch: int, task: Any) -> dict[str, float]:
    return {"async_loss": val_loss(task.load_into(TinyRegressor()))}


class SyncReference(TrainerCallback):
    """Evaluates synchronously at each epoch end (the reference values) and records the
    logs the Trainer's callbacks receive."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.logged: list[dict[str, float]] = []

    def on_epoch_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        self.values.append(val_loss(model))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "async_loss" in logs:
            self.logged.append(dict(logs))


def make_trainer(
    rt: SakuraRuntime,
    tmp_path: Path,
    reference: TrainerCallback,
    trainer_cls: type[Trainer] = Trainer,
) -> Trainer:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        logging_strategy="epoch",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return trainer_cls(
        model=TinyRegressor(),
        args=args,
        train_dataset=make_data(N_TRAIN, seed=1),
        callbacks=[reference, HFAdapter(rt)],
    )


@pytest.mark.parametrize("trainer_cls", [Trainer, SakuraTrainer], ids=["stock", "sakura-trainer"])
def test_async_eval_and_checkpoint_under_the_hf_trainer(
    tmp_path: Path, trainer_cls: type[Trainer]
) -> None:
    reference = SyncReference()
    rec = RecordingService(event_types={OnValidationEnd})
    with SakuraRuntime([rec], strict=True) as rt:
        ae = rt.install(AsyncEval(eval_fn, dispatcher="thread", pass_task=True))
        ckpt = rt.install(AsyncCheckpoint(tmp_path / "ckpt", every=1, keep=2, dispatcher="thread"))
        trainer = make_trainer(rt, tmp_path, reference, trainer_cls)
        trainer.train()
    assert [e.metrics["async_loss"] for e in rec.of(OnValidationEnd)] == reference.values
    assert ae.report_to == "auto"
    # The adapter's LoopContext.report_metrics appends to the Trainer's log history.
    entries = [h for h in trainer.state.log_history if "async_loss" in h]
    assert [(h["epoch"], h["step"], h["async_loss"]) for h in entries] == [
        (float(e + 1), STEPS * (e + 1), reference.values[e]) for e in range(EPOCHS)
    ]
    # The Trainer's callbacks hear of the results where the adapter holds the Trainer.
    reaches_callbacks = trainer_cls is SakuraTrainer
    expected = [{"async_loss": v} for v in reference.values] if reaches_callbacks else []
    assert reference.logged == expected
    assert [c.step for c in find_checkpoints(tmp_path / "ckpt")] == [STEPS * 2, STEPS * 3]
    latest = load_latest(tmp_path / "ckpt")
    assert latest is not None and not ckpt.errors
    final = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    assert all(torch.equal(latest.state["model"][k], final[k]) for k in final)


def test_auto_reporting_goes_through_the_loops_report_metrics() -> None:
    """report_to="auto" hands each result to OnTrainBegin.loop.report_metrics, with the
    evaluated epoch and step; a framework object on the event's ``trainer`` is not read."""
    from transformers import TrainerState

    from sakura import OnEpochEnd, OnTrainBegin, OnTrainEnd
    from sakura.loop import LoopContext

    reported: list[tuple[dict[str, Any], int, int]] = []
    state = TrainerState()
    model = TinyRegressor()
    loop = LoopContext(report_metrics=lambda m, e, s: reported.append((dict(m), e, s)))
    with SakuraRuntime(strict=True) as rt:
        rt.install(AsyncEval(eval_fn, dispatcher="inthread", pass_task=True))
        rt.emit(OnTrainBegin, model=model, trainer=state, loop=loop)
        rt.emit(OnEpochEnd, epoch=0, step=4, model=model)
        rt.emit(OnTrainEnd, epoch=0, step=4, model=model)
    assert reported == [({"async_loss": val_loss(model)}, 0, 4)]
    assert state.log_history == []


@pytest.mark.parametrize("how", ["sakura-trainer", "stock"])
def test_without_dir_checkpoints_go_to_the_trainers_output_dir(tmp_path: Path, how: str) -> None:
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(AsyncCheckpoint(every=1, keep=1, dispatcher="inthread"))
        trainer_cls = SakuraTrainer if how == "sakura-trainer" else Trainer
        trainer = make_trainer(rt, tmp_path, SyncReference(), trainer_cls)
        trainer.train()  # the stock Trainer's callback publishes args.output_dir too
    out = tmp_path / "out" / "async_checkpoint"
    assert ckpt.dir == str(out) and not ckpt.errors
    latest = load_latest(out)
    assert latest is not None and latest.step == STEPS * EPOCHS
