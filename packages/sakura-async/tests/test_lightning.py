"""AsyncEval and AsyncCheckpoint under a real lightning.Trainer (CPU, tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from sakura import OnValidationEnd, SakuraRuntime  # noqa: E402
from sakura.testing import RecordingService  # noqa: E402
from sakura_adapters.lightning import LightningAdapter  # noqa: E402
from sakura_async import AsyncCheckpoint, AsyncEval, load_latest  # noqa: E402
from sakura_async.checkpoint import find_checkpoints  # noqa: E402
from sakura_async.errors import CheckpointWriteError  # noqa: E402

BATCH, STEPS = 4, 3


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(seed: int = 1, n: int = STEPS * BATCH) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g))


VAL = data(seed=2, n=16)


def val_loss(model: torch.nn.Module) -> float:
    x, y = VAL.tensors
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def eval_fn(epoch: int, task: Any) -> dict[str, float]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    state = {k.removeprefix("net."): v for k, v in task.state_dict.items()}
    model.load_state_dict(state)
    return {"async_val_loss": val_loss(model)}


def make_trainer(rt: SakuraRuntime, tmp_path: Path, **kwargs: Any) -> Any:
    options: dict[str, Any] = dict(
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
    )
    options.update(kwargs)
    callbacks = [*options.pop("callbacks", []), LightningAdapter(rt)]
    return pl.Trainer(callbacks=callbacks, **options)


class SyncReference(pl.Callback):
    """The metric a synchronous evaluation of each epoch's weights gives."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.values.append(val_loss(module.net))


def test_async_eval_reaches_lightning_metrics_and_loggers(tmp_path: Path) -> None:
    reference = SyncReference()
    rec = RecordingService(event_types={OnValidationEnd})
    logger = CSVLogger(str(tmp_path), name="logs")
    with SakuraRuntime([rec], strict=True) as rt:
        rt.install(AsyncEval(eval_fn, dispatcher="thread", pass_task=True))
        # The reference callback runs before the adapter: it sees the same epoch-end weights.
        trainer = make_trainer(rt, tmp_path, logger=logger, callbacks=[reference])
        trainer.fit(Tiny(), DataLoader(data(), batch_size=BATCH))
    got = [(e.epoch, e.step, e.metrics["async_val_loss"]) for e in rec.of(OnValidationEnd)]
    assert got == [(e, STEPS * (e + 1), reference.values[e]) for e in range(3)]
    # The last result was drained at train end into Lightning's metrics...
    assert trainer.callback_metrics["async_val_loss"].item() == pytest.approx(
        reference.values[2], abs=0
    )
    assert trainer.logged_metrics["async_val_loss"].item() == pytest.approx(
        reference.values[2], abs=0
    )
    # ...and every result reached the logger with the step of the evaluated weights.
    logger.finalize("success")
    lines = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = [dict(zip(header, line.split(","), strict=True)) for line in lines[1:]]
    logged = [(int(r["step"]), float(r["async_val_loss"])) for r in rows if r.get("async_val_loss")]
    assert logged == [
        (STEPS * (e + 1), pytest.approx(reference.values[e], rel=1e-6)) for e in range(3)
    ]


def final_weights(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_lightning_layout_checkpoint_resumes_a_real_trainer(tmp_path: Path) -> None:
    # Reference: 4 epochs straight through.
    with SakuraRuntime(strict=True) as rt:
        straight = Tiny()
        make_trainer(rt, tmp_path / "a", max_epochs=4).fit(
            straight, DataLoader(data(), batch_size=BATCH)
        )
    # Interrupted run: 2 epochs, checkpointing every epoch in Lightning's layout.
    ckpt_dir = tmp_path / "ckpt"
    with SakuraRuntime(strict=True) as rt:
        rt.install(
            AsyncCheckpoint(ckpt_dir, every=1, keep=1, format="lightning", dispatcher="thread")
        )
        make_trainer(rt, tmp_path / "b", max_epochs=2).fit(
            Tiny(), DataLoader(data(), batch_size=BATCH)
        )
    latest = load_latest(ckpt_dir)
    assert latest is not None and latest.format == "lightning" and latest.epoch == 1
    assert latest.state["global_step"] == 2 * STEPS and "optimizer_states" in latest.state
    assert [c.epoch for c in find_checkpoints(ckpt_dir)] == [1]
    # Resume from it with a fresh module and Trainer.
    with SakuraRuntime(strict=True) as rt:
        resumed = Tiny()
        with torch.no_grad():
            for p in resumed.parameters():
                p.add_(1.0)  # make sure the weights really come from the checkpoint
        trainer = make_trainer(rt, tmp_path / "c", max_epochs=4)
        trainer.fit(resumed, DataLoader(data(), batch_size=BATCH), ckpt_path=latest.file)
    assert trainer.global_step == 4 * STEPS
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class StepWeights(pl.Callback):
    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.after[trainer.global_step] = final_weights(module)


@pytest.mark.parametrize("overlap", [False, True])
def test_async_checkpoint_torch_format_under_lightning(tmp_path: Path, overlap: bool) -> None:
    weights = StepWeights()
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(
            AsyncCheckpoint(
                tmp_path / "ckpt", every="2 steps", keep=None, overlap=overlap, dispatcher="thread"
            )
        )
        module = Tiny()
        make_trainer(rt, tmp_path, max_epochs=2, callbacks=[weights]).fit(
            module, DataLoader(data(), batch_size=BATCH)
        )
    assert [c.step for c in find_checkpoints(tmp_path / "ckpt")] == [2, 4, 6]
    assert ckpt.errors == []
    from sakura_async.checkpoint.encoding import read_state

    for c in find_checkpoints(tmp_path / "ckpt", verify=True):
        state = read_state(c.file, "torch")
        assert set(state) == {"model", "optimizer"}
        assert state["optimizer"]["param_groups"][0]["momentum"] == 0.9
        assert all(torch.equal(state["model"][k], v) for k, v in weights.after[c.step].items())


def test_without_dir_checkpoints_go_to_the_trainers_default_root_dir(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "run"
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(AsyncCheckpoint(every=1, keep=1, dispatcher="inthread"))
        assert ckpt.dir is None
        make_trainer(rt, root, max_epochs=2).fit(Tiny(), DataLoader(data(), batch_size=BATCH))
    assert ckpt.dir == str(root / "async_checkpoint") and not ckpt.errors
    latest = load_latest(root / "async_checkpoint")
    assert latest is not None and latest.epoch == 1
    assert not (tmp_path / "checkpoints").exists()


def test_an_unwritable_default_root_dir_is_reported_once_and_raised_at_exit(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (root / "async_checkpoint").write_text("a file where the checkpoints would go")
    rt = SakuraRuntime()
    ckpt = rt.install(AsyncCheckpoint(every=1, dispatcher="inthread"))
    expected = r"dir='.*async_checkpoint' is not accepted"
    with pytest.raises(CheckpointWriteError, match=expected), rt:
        make_trainer(rt, root, max_epochs=2).fit(Tiny(), DataLoader(data(), batch_size=BATCH))
    assert ckpt.dir is None and len(ckpt.errors) == 1 and ckpt.saved == []
