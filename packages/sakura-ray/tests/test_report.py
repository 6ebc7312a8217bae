"""RayReport: outside Ray it refuses to start; inside a real Ray Train worker (a local
cluster, one CPU worker) a checkpoint still being written is never reported, and each one
reaches Ray, once durable, with the metrics of its own step."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.train.torch", reason="sakura-ray's tests need ray[train]")
torch = pytest.importorskip("torch")

from sakura import SakuraRuntime  # noqa: E402
from sakura.options import OptionError  # noqa: E402
from sakura_ray import RayReport  # noqa: E402

EPOCHS = 2


def test_setup_outside_a_ray_train_worker_names_the_problem() -> None:
    with SakuraRuntime(strict=True) as rt, pytest.raises(RuntimeError) as info:
        rt.install("ray_report")
    assert "inside a Ray Train worker" in str(info.value)
    assert "ray.train.get_context()" in str(info.value)


def test_options_are_validated() -> None:
    with pytest.raises(OptionError, match="logs"):
        RayReport(logs="yes")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="name"):
        RayReport(name="")
    assert RayReport(name="ray2", logs=False).name == "ray2"


def _loop(config: dict[str, Any]) -> None:
    """A single-worker raw loop whose first checkpoint write is held back on the
    dispatcher until after the first report point."""
    from sakura.dispatch import InThreadDispatcher
    from sakura_adapters import DDPAdapter
    from sakura_async import AsyncCheckpoint, AsyncEval
    from sakura_async.dispatch import ThreadDispatcher

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)

    def eval_fn(epoch: int, payload: Any) -> dict[str, float]:
        with torch.no_grad():
            return {"val_loss": float(torch.nn.functional.mse_loss(net(x), y))}

    gate = threading.Event()
    writer = ThreadDispatcher(threads=1, max_pending=4).start()
    writer.submit(gate.wait)  # the single writer thread waits here: writes queue behind
    report = RayReport()
    record: dict[str, Any] = {"weights": {}, "val_loss": {}}
    services = [
        AsyncEval(eval_fn, None, dispatcher=InThreadDispatcher()),
        AsyncCheckpoint(dir=config["dir"], every=1, dispatcher=writer),
        report,
    ]
    with SakuraRuntime(services) as rt:
        loop = DDPAdapter(rt)
        loop.on_train_begin(net, optimizer)
        for epoch in range(EPOCHS):
            loop.on_epoch_begin(epoch)
            for i in range(2):
                loop.on_train_step_begin(net, (x, y), i)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                optimizer.step()
                loop.on_optimizer_step(optimizer)
            step = loop.global_step
            record["weights"][step] = [v.tolist() for v in net.state_dict().values()]
            with torch.no_grad():
                record["val_loss"][step] = float(torch.nn.functional.mse_loss(net(x), y))
            loop.on_epoch_end(epoch, net, optimizer)
            if epoch == 0:
                record["reported_after_epoch0"] = list(report.reported)
                gate.set()
        loop.on_train_end(net)
    writer.close()
    record["reports"] = report.reports
    Path(config["out"]).write_text(json.dumps(record), encoding="utf-8")


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # Ray refuses a temporary folder inside a virtualenv, which is where nox points TMPDIR;
    # its workers then die at start and the run waits: give it a folder of its own in /tmp.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def test_only_durable_checkpoints_reach_ray_with_their_steps_metrics(
    ray_cluster: Any, tmp_path: Path
) -> None:
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from sakura_async.checkpoint import find_checkpoints

    out = tmp_path / "record.json"
    result = TorchTrainer(
        _loop,
        train_loop_config={"dir": str(tmp_path / "ckpt"), "out": str(out)},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(
            name="unit",
            storage_path=str(tmp_path / "ray"),
            checkpoint_config=CheckpointConfig(num_to_keep=None),
        ),
    ).fit()
    assert result.error is None
    record = json.loads(out.read_text(encoding="utf-8"))
    # Epoch 0's write was still queued at its report point: no checkpoint went with it.
    assert record["reported_after_epoch0"] == []
    # epoch 0: metrics only; end of epoch 1: nothing durable yet or step 2's checkpoint;
    # end of training: the rest.  Each checkpoint is reported exactly once.
    steps = []
    for checkpoint, metrics in result.best_checkpoints:
        with checkpoint.as_directory() as directory:
            (found,) = [
                c
                for c in find_checkpoints(Path(directory).parent, verify=True)
                if Path(c.path).resolve() == Path(directory).resolve()
            ]
            state = torch.load(found.file, weights_only=True)
        expected = record["weights"][str(found.step)]
        for value, reference in zip(state["model"].values(), expected, strict=True):
            torch.testing.assert_close(value, torch.tensor(reference), rtol=0, atol=0)
        assert metrics["step"] == found.step
        assert metrics["val_loss"] == pytest.approx(record["val_loss"][str(found.step)], rel=1e-6)
        steps.append(found.step)
    assert sorted(steps) == [2, 4]
    assert result.metrics["step"] == 4
    assert result.metrics["val_loss"] == pytest.approx(record["val_loss"]["4"], rel=1e-6)
