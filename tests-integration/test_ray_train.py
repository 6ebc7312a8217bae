"""Sakura-enabled loops inside Ray Train (issue 23): a real local Ray cluster (2 CPUs),
``TorchTrainer`` with 2 CPU workers, AsyncEval + AsyncCheckpoint + RayReport.

Each loop's workers record, on rank 0, the weights at every epoch end and the validation
loss a synchronous evaluation of them gives; the test checks that every checkpoint Ray
registered is complete (its manifest's checksums verify), loads with
``weights_only=True``, and holds exactly the weights of its step, and that the metrics Ray
attached to it are AsyncEval's for that epoch.  Skipped where ``ray`` is not installed.

A raw DDP loop, a Lightning Trainer and a Hugging Face Trainer run here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the Ray Train integration needs ray installed")
pytest.importorskip("ray.train.torch", reason="the Ray Train integration needs ray[train]")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.ray

EPOCHS = 3
BATCHES = 3


@pytest.fixture(scope="module")
def cluster() -> Any:
    import ray.cloudpickle

    # The training functions below travel to the workers by value: this test module is
    # not importable there.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # Ray refuses a temporary folder inside a virtualenv, which is where nox points TMPDIR;
    # its workers then die at start and the run waits: give it a folder of its own in /tmp.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _data(rank: int) -> tuple[list[Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(10 + rank)
    batches = [
        (torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(BATCHES)
    ]
    gv = torch.Generator().manual_seed(99)
    val = {"x": torch.randn(32, 6, generator=gv), "y": torch.randn(32, 2, generator=gv)}
    return batches, val


def _net() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))


def _val_loss(module: Any, payload: dict[str, Any]) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(module(payload["x"]), payload["y"]))


def _record(out: str, rank: int, name: str, entry: dict[str, Any]) -> None:
    path = Path(out, f"{name}-rank{rank}.jsonl")
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def _weights(module: Any) -> dict[str, list[Any]]:
    return {k: v.detach().tolist() for k, v in module.state_dict().items()}


def raw_loop(config: dict[str, Any]) -> None:
    """A raw DDP loop with DDPAdapter, as a user writes it; Ray set up the process group."""
    import ray.train
    from torch.nn.parallel import DistributedDataParallel

    from sakura import SakuraRuntime
    from sakura.dispatch import InThreadDispatcher
    from sakura_adapters import DDPAdapter
    from sakura_async import AsyncCheckpoint, AsyncEval
    from sakura_ray import RayReport

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    net = _net()
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches, val = _data(rank)

    def eval_fn(epoch: int, payload: dict[str, Any]) -> dict[str, float]:
        return {"val_loss": _val_loss(net, payload)}

    report = RayReport()
    services = [
        AsyncEval(eval_fn, val, dispatcher=InThreadDispatcher()),
        AsyncCheckpoint(dir=config["dir"], every=1, metric="val_loss"),
        report,
    ]
    with SakuraRuntime(services) as rt:
        loop = DDPAdapter(rt)
        loop.on_train_begin(model, optimizer, batches)
        for epoch in range(EPOCHS):
            loop.on_epoch_begin(epoch)
            for i, (x, y) in enumerate(batches):
                loop.on_train_step_begin(model, (x, y), i)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                loop.on_optimizer_step(optimizer)
            entry = {"step": loop.global_step, "epoch": epoch, "weights": _weights(net)}
            entry["val_loss"] = _val_loss(net, val)
            _record(config["out"], rank, "raw", entry)
            loop.on_epoch_end(epoch, model, optimizer)
        loop.on_train_end(model)
    _record(config["out"], rank, "raw-reports", {"reports": report.reports})


def lightning_loop(config: dict[str, Any]) -> None:
    """A lightning.Trainer on Ray's DDP strategy (Ray's documented Lightning setup), with
    the Sakura services through LightningAdapter."""
    import lightning.pytorch as pl
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from sakura import SakuraRuntime
    from sakura.dispatch import InThreadDispatcher
    from sakura_adapters.lightning import LightningAdapter
    from sakura_async import AsyncCheckpoint, AsyncEval
    from sakura_ray import RayReport

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    _, val = _data(0)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Reference(pl.Callback):  # runs before the adapter: the same epoch-end weights
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            entry = {"step": trainer.global_step, "epoch": trainer.current_epoch}
            entry["weights"] = _weights(module)
            entry["val_loss"] = _val_loss(module.net, val)
            _record(config["out"], rank, "lightning", entry)

    def eval_fn(epoch: int, task: Any) -> dict[str, float]:
        fresh = _net()
        fresh.load_state_dict({k.removeprefix("net."): v for k, v in task.state_dict.items()})
        return {"val_loss": _val_loss(fresh, task.payload)}

    g = torch.Generator().manual_seed(5)
    dataset = TensorDataset(
        torch.randn(4 * BATCHES * 2, 6, generator=g), torch.randn(4 * BATCHES * 2, 2, generator=g)
    )
    report = RayReport()
    services = [
        AsyncEval(eval_fn, val, dispatcher=InThreadDispatcher(), pass_task=True),
        AsyncCheckpoint(dir=config["dir"], every=1, metric="val_loss"),
        report,
    ]
    with SakuraRuntime(services) as rt:
        trainer = pl.Trainer(
            max_epochs=EPOCHS,
            accelerator="cpu",
            devices="auto",
            strategy=RayDDPStrategy(),
            plugins=[RayLightningEnvironment()],
            callbacks=[Reference(), LightningAdapter(rt)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            default_root_dir=config["dir"],
        )
        trainer = prepare_trainer(trainer)
        trainer.fit(Tiny(), DataLoader(dataset, batch_size=4))
    _record(config["out"], rank, "lightning-reports", {"reports": report.reports})


def _fit(tmp_path: Path, loop: Any, name: str) -> Any:
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp_path / "out"
    out.mkdir()
    trainer = TorchTrainer(
        loop,
        train_loop_config={"dir": str(tmp_path / "ckpt"), "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp_path / "ray"),
            checkpoint_config=CheckpointConfig(num_to_keep=None),
        ),
    )
    return trainer.fit(), out


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _check_checkpoints(result: Any, expected: list[dict[str, Any]]) -> None:
    """Every checkpoint Ray registered verifies, loads, and equals the weights of its step;
    its metrics are AsyncEval's for that epoch."""
    from sakura_async.checkpoint import find_checkpoints

    by_step = {row["step"]: row for row in expected}
    registered = result.best_checkpoints
    assert len(registered) == EPOCHS
    seen_steps = []
    for checkpoint, metrics in registered:
        with checkpoint.as_directory() as directory:
            found = find_checkpoints(Path(directory).parent, verify=True)
            mine = [c for c in found if os.path.samefile(c.path, directory)]
            assert len(mine) == 1, f"{directory} is not a complete sakura checkpoint"
            state = torch.load(mine[0].file, weights_only=True)
        row = by_step[mine[0].step]
        for key, values in row["weights"].items():
            torch.testing.assert_close(state["model"][key], torch.tensor(values), rtol=0, atol=1e-7)
        assert metrics["val_loss"] == pytest.approx(row["val_loss"], rel=1e-6)
        seen_steps.append(mine[0].step)
    assert sorted(seen_steps) == sorted(by_step)


def hf_loop(config: dict[str, Any]) -> None:
    """A stock transformers.Trainer (it reads the process group Ray set up from the
    environment), with the Sakura services through HFAdapter."""
    import ray.train
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from sakura import SakuraRuntime
    from sakura.dispatch import InThreadDispatcher
    from sakura_adapters.hf import HFAdapter
    from sakura_async import AsyncCheckpoint, AsyncEval
    from sakura_ray import RayReport

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    _, val = _data(0)

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
            out = self.net(x)
            loss = None if labels is None else torch.nn.functional.mse_loss(out, labels)
            return {"loss": loss, "logits": out}

    class Reference(TrainerCallback):  # runs before the adapter: the same epoch-end weights
        def on_epoch_end(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            entry = {"step": state.global_step, "epoch": round(state.epoch) - 1}
            entry["weights"] = _weights(model)
            entry["val_loss"] = _val_loss(model.net, val)
            _record(config["out"], rank, "hf", entry)

    def eval_fn(epoch: int, task: Any) -> dict[str, float]:
        return {"val_loss": _val_loss(task.load_into(Regressor()).net, task.payload)}

    g = torch.Generator().manual_seed(5)
    x, y = (
        torch.randn(4 * BATCHES * 2, 6, generator=g),
        torch.randn(4 * BATCHES * 2, 2, generator=g),
    )
    dataset = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    args = TrainingArguments(
        output_dir=config["dir"],
        per_device_train_batch_size=4,
        num_train_epochs=EPOCHS,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        logging_strategy="epoch",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    report = RayReport()
    services = [
        AsyncEval(eval_fn, val, dispatcher=InThreadDispatcher(), pass_task=True),
        AsyncCheckpoint(dir=config["dir"], every=1, metric="val_loss"),
        report,
    ]
    with SakuraRuntime(services) as rt:
        trainer = Trainer(
            model=Regressor(),
            args=args,
            train_dataset=dataset,
            callbacks=[Reference(), HFAdapter(rt)],
        )
        trainer.train()
    _record(config["out"], rank, "hf-reports", {"reports": report.reports})


def test_raw_ddp_loop_reports_metrics_and_durable_checkpoints(cluster: Any, tmp_path: Path) -> None:
    result, out = _fit(tmp_path, raw_loop, "raw")
    assert result.error is None
    expected = _rows(out / "raw-rank0.jsonl")
    assert [r["epoch"] for r in expected] == list(range(EPOCHS))
    _check_checkpoints(result, expected)
    last = expected[-1]
    assert result.metrics["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert result.metrics["step"] == last["step"] == EPOCHS * BATCHES
    # Both ranks called ray.train.report equally often (Ray's barrier rule).
    counts = [_rows(out / f"raw-reports-rank{r}.jsonl")[0]["reports"] for r in (0, 1)]
    assert counts[0] == counts[1] >= EPOCHS


def test_lightning_trainer_reports_metrics_and_durable_checkpoints(
    cluster: Any, tmp_path: Path
) -> None:
    pytest.importorskip("lightning.pytorch")
    result, out = _fit(tmp_path, lightning_loop, "lightning")
    assert result.error is None
    expected = _rows(out / "lightning-rank0.jsonl")
    assert [r["epoch"] for r in expected] == list(range(EPOCHS))
    _check_checkpoints(result, expected)
    last = expected[-1]
    assert result.metrics["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert result.metrics["step"] == last["step"] == EPOCHS * BATCHES
    counts = [_rows(out / f"lightning-reports-rank{r}.jsonl")[0]["reports"] for r in (0, 1)]
    assert counts[0] == counts[1] >= EPOCHS


def test_hf_trainer_reports_metrics_and_durable_checkpoints(cluster: Any, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    result, out = _fit(tmp_path, hf_loop, "hf")
    assert result.error is None
    expected = _rows(out / "hf-rank0.jsonl")
    assert [r["epoch"] for r in expected] == list(range(EPOCHS))
    _check_checkpoints(result, expected)
    last = expected[-1]
    assert result.metrics["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert result.metrics["step"] == last["step"] == EPOCHS * BATCHES
    counts = [_rows(out / f"hf-reports-rank{r}.jsonl")[0]["reports"] for r in (0, 1)]
    assert counts[0] == counts[1] >= EPOCHS
