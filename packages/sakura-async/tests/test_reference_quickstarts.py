"""The reference README's quickstarts, with ``AsyncEval(eval_fn=..., eval_payload=...)`` written
as the reference writes it: ``eval_fn(epoch, payload)`` receives ``eval_payload`` and
indexes it.  Under a real ``lightning.Trainer``, a real ``transformers.Trainer`` and a raw
DDP loop on two gloo ranks.  (The quickstarts' MixedPrecision and Compile lines are left
out: they belong to sakura-precision's tests, and compiling is slow on a CPU.)  The task
form (``pass_task=True``) is tested under the same frameworks in ``test_lightning.py``,
``test_hf.py`` and the two-rank test below.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import SakuraRuntime
from sakura.testing import launch_ranks

HERE = Path(__file__).parent
EPOCHS = 3


def _lightning_module() -> Any:
    import lightning as L

    class Model(L.LightningModule):
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
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model()


def _loader(seed: int, n: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g))
    return DataLoader(data, batch_size=4)


def evaluate(model: torch.nn.Module, val_loader: Any) -> float:
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in val_loader]
    return torch.stack(losses).mean().item()


def test_the_lightning_quickstart_as_written(tmp_path: Path, monkeypatch: Any) -> None:
    L = pytest.importorskip("lightning")
    from sakura.adapters import LightningAdapter
    from sakura.dispatch import InThreadDispatcher
    from sakura.services import AsyncCheckpoint, AsyncEval
    from sakura_async import load_best

    monkeypatch.chdir(tmp_path)  # the quickstart's dir="ckpt/" is relative
    model = _lightning_module()
    train_loader = _loader(1, 12)
    val_loader = _loader(2, 16)

    class SyncReference(L.Callback):
        """The synchronous evaluation and weights of each epoch end (runs before the
        adapter, on the same weights)."""

        def __init__(self) -> None:
            self.values: list[float] = []
            self.weights: list[dict[str, torch.Tensor]] = []

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self.values.append(evaluate(pl_module, val_loader))
            self.weights.append({k: v.clone() for k, v in pl_module.state_dict().items()})

    reference = SyncReference()
    with SakuraRuntime() as rt:
        ae = rt.install(
            AsyncEval(
                eval_fn=lambda epoch, payload: {"val_loss": evaluate(model, payload["val_loader"])},
                eval_payload={"val_loader": val_loader},
                dispatcher=InThreadDispatcher(),
            )
        )
        ckpt = rt.install(
            AsyncCheckpoint(
                dir="ckpt/",
                every="best",
                metric="val_loss",
                dispatcher=InThreadDispatcher(),
                state_provider=lambda: {k: v.cpu() for k, v in model.state_dict().items()},
            )
        )

        trainer = L.Trainer(
            max_epochs=EPOCHS,
            accelerator="auto",
            callbacks=[reference, LightningAdapter(rt)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(model, train_loader)
    assert ae.pass_task is False and not ae.errors and not rt.errors
    assert [r.metrics for r in ae.history] == [{"val_loss": v} for v in reference.values]
    assert ckpt.dir == str(tmp_path / "ckpt") and not ckpt.errors
    best = load_best(tmp_path / "ckpt")
    assert best is not None
    epoch = min(range(EPOCHS), key=lambda e: reference.values[e])
    assert best.metric_value == reference.values[epoch]
    assert all(torch.equal(best.state[k], v) for k, v in reference.weights[epoch].items())


def test_the_hugging_face_quickstart_as_written(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from sakura.adapters import HFAdapter
    from sakura.dispatch import InThreadDispatcher
    from sakura.services import AsyncEval

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
            )

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            pred = self.net(x).squeeze(-1)
            loss = None if labels is None else torch.nn.functional.mse_loss(pred, labels)
            return {"loss": loss, "logits": pred}

    g = torch.Generator().manual_seed(1)
    xs = torch.randn(16, 4, generator=g)
    train_ds = [{"x": xs[i], "labels": 2.0 * xs[i, 0] - xs[i, 1]} for i in range(16)]
    gv = torch.Generator().manual_seed(2)
    val_x = torch.randn(8, 4, generator=gv)
    val_payload = {"x": val_x, "y": 2.0 * val_x[:, 0] - val_x[:, 1]}
    torch.manual_seed(0)
    model = Regressor()

    def eval_fn(epoch, payload):  # the reference contract: payload is eval_payload
        with torch.no_grad():
            pred = model(payload["x"])["logits"]
        return {"val_loss": torch.nn.functional.mse_loss(pred, payload["y"]).item()}

    class SyncReference(TrainerCallback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.values.append(eval_fn(-1, val_payload)["val_loss"])

    hf_args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
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
    reference = SyncReference()
    with SakuraRuntime() as rt:
        ae = rt.install(
            AsyncEval(eval_fn=eval_fn, eval_payload=val_payload, dispatcher=InThreadDispatcher())
        )
        trainer = Trainer(
            model=model,
            args=hf_args,
            train_dataset=train_ds,
            callbacks=[reference, HFAdapter(rt)],
        )
        trainer.train()
    assert not ae.errors and not rt.errors
    assert [r.metrics for r in ae.history] == [{"val_loss": v} for v in reference.values]
    logged = [h["val_loss"] for h in trainer.state.log_history if "val_loss" in h]
    assert logged == reference.values


@pytest.mark.parametrize("form", ["payload", "task"])
def test_the_raw_ddp_quickstart_on_two_gloo_ranks(tmp_path: Path, form: str) -> None:
    pytest.importorskip("sakura_zero")
    pytest.importorskip("sakura_adapters")
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    launch_ranks(HERE / "_quickstart_ddp_rank.py", 2, tmp_path, form, timeout=180, env=env)
    rank0, rank1 = (json.loads((tmp_path / f"{form}-rank{r}.json").read_text()) for r in (0, 1))
    for record in (rank0, rank1):
        assert record["errors"] == [] and record["runtime_errors"] == []
        assert record["pass_task"] is (form == "task")
    # Rank 0 evaluates (ranks="zero"); its metrics are those of a synchronous evaluation of
    # the same epoch's weights, bit for bit.
    assert rank0["delivered"] == [[e, {"val_loss": v}] for e, v in enumerate(rank0["reference"])]
    assert len(rank0["delivered"]) == EPOCHS
    assert rank1["delivered"] == []
