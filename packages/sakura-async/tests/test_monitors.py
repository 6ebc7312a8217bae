"""Monitors of an AsyncEval metric decide as with a synchronous evaluation.

Lightning's EarlyStopping, ModelCheckpoint and ReduceLROnPlateau, and the Hugging Face
Trainer's best-model selection, EarlyStoppingCallback and plateau scheduler read a metric
at the end of epoch e: an AsyncEval metric must then be epoch e's (``OnEpochEnd.monitored``
makes AsyncEval wait for it).  Each run is compared with a synchronous run in which the
same metric values are computed on the training thread.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import OnEpochEnd, OnTrainEnd, SakuraRuntime
from sakura_async import AsyncEval

# The evaluation's value per epoch: the best epoch (1) is neither the first nor the last;
# with patience 1, early stopping stops after epoch 2.
PATTERN = [1.0, 0.6, 0.8, 0.9, 0.7]
EPOCHS = len(PATTERN)


def pattern_eval(epoch: int, payload: Any) -> dict[str, float]:
    """eval_fn(epoch, payload), the reference contract."""
    return {"val_loss": PATTERN[epoch]}


# --- the service alone -----------------------------------------------------------------------


def test_in_thread_results_arrive_at_the_end_of_their_own_epoch() -> None:
    with SakuraRuntime(strict=True) as rt:
        ae = rt.install(AsyncEval(pattern_eval, dispatcher="inthread"))
        for epoch in range(2):
            rt.emit(OnEpochEnd, epoch=epoch, step=epoch + 1)
            assert [r.epoch for r in ae.history] == list(range(epoch + 1))


def test_only_a_monitored_metric_makes_the_epoch_end_wait() -> None:
    gate = threading.Event()

    def gated(epoch: int, payload: Any) -> dict[str, float]:
        if epoch == 1:
            gate.wait(30)  # a bound only: the test opens the gate itself
        return {"val_loss": float(epoch)}

    with SakuraRuntime(strict=True) as rt:
        ae = rt.install(AsyncEval(gated, dispatcher="thread", max_pending=2))
        # Before a result names the metrics, any monitored name may be one: it waits.
        rt.emit(OnEpochEnd, epoch=0, step=1, monitored=frozenset({"train_loss"}))
        assert [r.epoch for r in ae.history] == [0]
        # Now AsyncEval knows it computes val_loss only: a monitor of train_loss costs no wait.
        rt.emit(OnEpochEnd, epoch=1, step=2, monitored=frozenset({"train_loss"}))
        assert [r.epoch for r in ae.history] == [0]
        gate.set()
        rt.emit(OnEpochEnd, epoch=2, step=3, monitored=frozenset({"val_loss"}))
        assert [r.epoch for r in ae.history] == [0, 1, 2]
        rt.emit(OnTrainEnd, epoch=2, step=3)


def test_a_result_at_its_own_epoch_end_carries_the_live_model(tmp_path: Path) -> None:
    """AsyncCheckpoint(every="best") then saves the live (evaluated) weights directly."""
    from sakura import OnTrainBegin
    from sakura_async import AsyncCheckpoint, load_best

    model = torch.nn.Linear(2, 1)
    with SakuraRuntime(strict=True) as rt:
        rt.install(AsyncEval(pattern_eval, dispatcher="inthread"))
        ckpt = rt.install(AsyncCheckpoint(tmp_path, every="best", metric="val_loss"))
        rt.emit(OnTrainBegin, model=model)
        for epoch in range(EPOCHS):
            with torch.no_grad():
                model.weight.fill_(float(epoch))
            rt.emit(OnEpochEnd, epoch=epoch, step=epoch + 1, model=model)
        rt.emit(OnTrainEnd, epoch=EPOCHS - 1, step=EPOCHS, model=model)
    best = load_best(tmp_path)
    assert not ckpt.errors and best is not None and best.epoch == 1
    assert torch.equal(best.state["model"]["weight"], torch.full((1, 2), 1.0))


# --- Lightning -------------------------------------------------------------------------------

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from sakura_adapters.lightning import LightningAdapter  # noqa: E402

BATCH, STEPS = 4, 2


class Tiny(pl.LightningModule):
    """Logs the pattern itself when ``sync``: the synchronous reference."""

    def __init__(self, *, sync: bool, plateau: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)
        self.sync, self.plateau = sync, plateau

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_epoch_end(self) -> None:
        if self.sync:
            self.log("val_loss", PATTERN[self.current_epoch])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.plateau:
            return opt
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


class LearningRates(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def fit(tmp_path: Path, dispatcher: str | None, *callbacks: Any, plateau: bool = False) -> Any:
    """One run: synchronous (``dispatcher`` None) or with AsyncEval on ``dispatcher``."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(STEPS * BATCH, 3, generator=g), torch.randn(STEPS * BATCH, 1, generator=g)
    )
    with SakuraRuntime(strict=True) as rt:
        if dispatcher is not None:
            rt.install(AsyncEval(pattern_eval, dispatcher=dispatcher))
        trainer = pl.Trainer(
            max_epochs=EPOCHS,
            callbacks=[*callbacks, LightningAdapter(rt)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in callbacks),
            num_sanity_val_steps=0,
            default_root_dir=str(tmp_path),
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(Tiny(sync=dispatcher is None, plateau=plateau), DataLoader(data, BATCH))
    return trainer


DISPATCHERS = ["inthread", "thread"]


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_lightning_early_stopping_stops_at_the_synchronous_epoch(
    tmp_path: Path, dispatcher: str, strict: bool
) -> None:
    sync = fit(tmp_path / "sync", None, EarlyStopping("val_loss", patience=1, strict=strict))
    run = fit(tmp_path / "async", dispatcher, EarlyStopping("val_loss", patience=1, strict=strict))
    assert sync.current_epoch == 3 and sync.global_step == 3 * STEPS  # stopped after epoch 2
    assert (run.current_epoch, run.global_step) == (sync.current_epoch, sync.global_step)
    assert run.early_stopping_callback.best_score == sync.early_stopping_callback.best_score


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_lightning_model_checkpoint_keeps_the_true_best_with_its_weights(
    tmp_path: Path, dispatcher: str
) -> None:
    def checkpoint(root: Path) -> ModelCheckpoint:
        return ModelCheckpoint(root, filename="{epoch}-{val_loss:.4f}", monitor="val_loss")

    fit(tmp_path / "sync", None, reference := checkpoint(tmp_path / "sync-ckpt"))
    run = fit(tmp_path / "async", dispatcher, best := checkpoint(tmp_path / "async-ckpt"))
    assert run.global_step == EPOCHS * STEPS
    (expected,) = (tmp_path / "sync-ckpt").iterdir()
    assert [p.name for p in (tmp_path / "async-ckpt").iterdir()] == [expected.name]
    assert expected.name == "epoch=1-val_loss=0.6000.ckpt"
    assert best.best_model_score == reference.best_model_score == pytest.approx(PATTERN[1])
    want = torch.load(expected, weights_only=True)
    got = torch.load(best.best_model_path, weights_only=True)
    assert want["epoch"] == got["epoch"] == 1 and want["global_step"] == got["global_step"]
    assert want["state_dict"].keys() == got["state_dict"].keys()
    assert all(torch.equal(want["state_dict"][k], v) for k, v in got["state_dict"].items())


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_lightning_plateau_scheduler_drops_the_lr_at_the_synchronous_epoch(
    tmp_path: Path, dispatcher: str
) -> None:
    sync_lrs, async_lrs = LearningRates(), LearningRates()
    fit(tmp_path / "sync", None, sync_lrs, plateau=True)
    fit(tmp_path / "async", dispatcher, async_lrs, plateau=True)
    # patience 0: the LR halves after every epoch that did not improve (2 and 3).
    assert sync_lrs.lrs == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.025])
    assert async_lrs.lrs == sync_lrs.lrs


# --- Hugging Face ----------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from torch import nn  # noqa: E402
from transformers import EarlyStoppingCallback, Trainer, TrainingArguments  # noqa: E402

from sakura_adapters.hf import HFAdapter, SakuraTrainer  # noqa: E402

HF_TRAIN, HF_BATCH = 8, 4
HF_STEPS = HF_TRAIN // HF_BATCH


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        pred = self.net(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(pred, labels), "logits": pred}


def hf_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def hf_train(
    tmp_path: Path,
    dispatcher: str | None,
    trainer_cls: type[Trainer] = Trainer,
    *,
    metric: str = "val_loss",
    patience: int | None = None,
) -> Trainer:
    """A run with the Trainer's epoch-end evaluation; the synchronous one (``dispatcher``
    None) computes the pattern in ``compute_metrics``, the other gets it from AsyncEval."""
    calls: list[int] = []

    def compute_metrics(prediction: Any) -> dict[str, float]:
        calls.append(1)
        return {"val_loss": PATTERN[len(calls) - 1]} if dispatcher is None else {}

    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=HF_BATCH,
        num_train_epochs=EPOCHS,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model=metric,
        greater_is_better=False,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    with SakuraRuntime(strict=True) as rt:
        if dispatcher is not None:
            rt.install(AsyncEval(pattern_eval, dispatcher=dispatcher))
        callbacks: list[Any] = [HFAdapter(rt)]
        if patience is not None:
            callbacks.insert(0, EarlyStoppingCallback(early_stopping_patience=patience))
        trainer = trainer_cls(
            model=Regressor(),
            args=args,
            train_dataset=hf_data(HF_TRAIN, seed=1),
            eval_dataset=hf_data(4, seed=2),
            compute_metrics=compute_metrics,
            callbacks=callbacks,
        )
        trainer.train()
    return trainer


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


HF_CASES = [("inthread", Trainer), ("thread", Trainer), ("thread", SakuraTrainer)]
HF_IDS = ["inthread", "thread", "sakura-trainer"]


@pytest.mark.parametrize(("dispatcher", "trainer_cls"), HF_CASES, ids=HF_IDS)
@pytest.mark.parametrize("metric", ["val_loss", "eval_val_loss"])
def test_hf_load_best_model_at_end_picks_the_synchronous_best(
    tmp_path: Path, dispatcher: str, trainer_cls: type[Trainer], metric: str
) -> None:
    sync = hf_train(tmp_path / "sync", None, metric=metric)
    run = hf_train(tmp_path / "async", dispatcher, trainer_cls, metric=metric)
    best_step = 2 * HF_STEPS  # epoch 1
    assert sync.state.best_global_step == best_step
    assert run.state.best_global_step == best_step
    assert run.state.best_metric == sync.state.best_metric == PATTERN[1]
    assert Path(run.state.best_model_checkpoint).name == f"checkpoint-{best_step}"
    # The best checkpoint holds the weights of that epoch, and they were loaded at the end.
    want, got = weights(sync.model), weights(run.model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # The evaluation's log entry carries the value it was judged on.
    evals = [h for h in run.state.log_history if "eval_runtime" in h]
    assert [h["eval_val_loss"] for h in evals] == PATTERN


@pytest.mark.parametrize(("dispatcher", "trainer_cls"), HF_CASES, ids=HF_IDS)
def test_hf_early_stopping_stops_at_the_synchronous_step(
    tmp_path: Path, dispatcher: str, trainer_cls: type[Trainer]
) -> None:
    sync = hf_train(tmp_path / "sync", None, patience=1)
    run = hf_train(tmp_path / "async", dispatcher, trainer_cls, patience=1)
    assert sync.state.global_step == 3 * HF_STEPS  # stopped after epoch 2
    assert run.state.global_step == sync.state.global_step
    assert run.state.best_global_step == sync.state.best_global_step == 2 * HF_STEPS
