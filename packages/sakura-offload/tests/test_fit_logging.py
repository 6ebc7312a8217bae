"""What ``fit`` logs (``sakura_offload.fit.metrics``): the ``sakura_*`` metrics reach
Lightning's loggers and ``callback_metrics``, the HF Trainer's ``log_history``, and a raw
loop's Telemetry (as ``OnLog``), equal to ``memory_report()`` and ``OffloadAdamW.stats()``
after the last step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fit import HUGE, ladder, lora_llama, rung

import sakura_offload
from sakura import SakuraRuntime
from sakura.telemetry import Telemetry
from sakura_offload.fit import Fit
from sakura_offload.fit.metrics import FitMetrics, fit_metrics

pytest.importorskip("peft")
pytest.importorskip("transformers")

STEPS = 4


def _spec() -> str:
    device = rung(
        ladder(lora_llama()), "host", "host"
    ).device_bytes  # streamed from host, host optimizer
    return (
        f"fit:device_budget={device},host_budget={HUGE},activations=keep,report=false,log_every=2"
    )


def _rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, 61, (8, 12), generator=g)]


def _expected(service: Fit, model: Any) -> dict[str, int]:
    """What memory_report and stats say after training (the last report's step)."""
    report = sakura_offload.memory_report(model)
    stats = service.state.optimizer.stats()  # type: ignore[union-attr]
    assert stats["moment_bytes"] > 0  # (nothing crosses a bus on a CPU: 0 bytes moved)
    assert report["host"]["frozen"] > 0
    return {
        "sakura_h2d_bytes_per_step": stats["h2d_bytes_per_step"],
        "sakura_d2h_bytes_per_step": stats["d2h_bytes_per_step"],
        "sakura_pinned_bytes": stats["pinned_bytes"],
        "sakura_host_optimizer_bytes": stats["moment_bytes"] + stats["master_bytes"],
        "sakura_host_frozen_bytes": report["host"]["frozen"],
        "sakura_host_state_bytes": report["host"]["optimizer"] + report["host"]["frozen"],
        "sakura_disk_bytes": report["disk"]["frozen"],
    }


def _check(logged: dict[str, Any], expected: dict[str, int]) -> None:
    for key, value in expected.items():
        assert float(logged[key]) == pytest.approx(value, abs=0.5), key


def test_raw_loop_telemetry_records_the_metrics(tmp_path: Path) -> None:
    from sakura_adapters import DDPAdapter

    path = tmp_path / "telemetry.jsonl"
    model = lora_llama()
    with SakuraRuntime(strict=True) as rt:
        service = rt.install(_spec())
        rt.install(Telemetry(path, events=["OnLog"]))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, optimizer = rt.prepare(model, optimizer)
        adapter = DDPAdapter(rt)
        adapter.on_train_begin(model, optimizer)
        for row in _rows()[:STEPS]:
            ids = row["input_ids"][None]
            adapter.backward(model(input_ids=ids, labels=ids).loss)
            adapter.step(optimizer)
            optimizer.zero_grad()
        expected = _expected(service, model)
        adapter.on_train_end(model)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    logs = [line for line in lines if line.get("event") == "OnLog"]
    assert len(logs) == STEPS // 2, lines  # log_every=2
    first, last = (_logs(line) for line in (logs[0], logs[-1]))
    assert first["sakura_plan"] == service.state.plan.summary()
    assert first["sakura_plan_host_bytes"] == service.state.plan.host_bytes
    assert "sakura_plan" not in last  # the plan's summary once
    _check(last, expected)
    assert last == service.metrics.last


def _logs(line: dict[str, Any]) -> dict[str, Any]:
    fields = line.get("fields", line)
    return dict(fields["logs"])


def test_lightning_logger_and_callback_metrics(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from sakura_adapters.lightning import LightningAdapter

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = lora_llama()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            params = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.AdamW(params, lr=1e-2)

    module = Module()
    with SakuraRuntime(strict=True) as rt:
        service = rt.install(_spec())
        trainer = pl.Trainer(
            max_steps=STEPS,
            logger=CSVLogger(str(tmp_path), name="csv"),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=str(tmp_path),
            accelerator="cpu",
            devices=1,
            callbacks=[LightningAdapter(rt)],
        )
        trainer.fit(module, DataLoader(_rows(), batch_size=2, shuffle=False))
        expected = _expected(service, service.metrics.model)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    _check(metrics, expected)
    assert metrics["sakura_plan_device_bytes"] == service.state.plan.device_bytes
    csv = next(Path(trainer.logger.log_dir).glob("metrics.csv")).read_text()
    assert "sakura_h2d_bytes_per_step" in csv.splitlines()[0]


def test_hf_trainer_log_history(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from sakura_adapters.hf import SakuraTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    rt = SakuraRuntime(strict=True)
    service = rt.install(_spec())
    model = lora_llama()
    trainer = SakuraTrainer(model=model, args=args, train_dataset=_rows(), runtime=rt)
    trainer.train()
    entries = [e for e in trainer.state.log_history if "sakura_h2d_bytes_per_step" in e]
    assert [e["step"] for e in entries] == [2, 4]
    _check(entries[-1], _expected(service, model))
    assert entries[0]["sakura_plan_host_bytes"] == service.state.plan.host_bytes


def test_nothing_is_read_when_nobody_listens() -> None:
    metrics = FitMetrics(1)
    metrics.model = object()  # would fail if read: nobody receives the metrics
    metrics.begin(None)
    metrics.step(0, 1, None)
    assert metrics.last is None


def test_wrap_metrics_match_memory_report() -> None:
    model = lora_llama()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    device = rung(ladder(lora_llama()), "host", "host").device_bytes
    model, optimizer = sakura_offload.wrap(
        model, optimizer, device_budget=device, host_budget=HUGE, activations="keep", report=False
    )
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    report = sakura_offload.memory_report(model)
    got = fit_metrics(model)
    assert got["sakura_h2d_bytes_per_step"] == report["moved"]["h2d_bytes_per_step"]
    assert got["sakura_d2h_bytes_per_step"] == report["moved"]["d2h_bytes_per_step"]
    assert got["sakura_host_frozen_bytes"] == report["host"]["frozen"] > 0
    assert got["sakura_host_optimizer_bytes"] == report["host"]["optimizer"] > 0
    assert got["sakura_disk_bytes"] == 0


@pytest.mark.parametrize("value", [-1, "x", 1.5])
def test_bad_log_every(value: Any) -> None:
    with pytest.raises(ValueError, match=r"Fit: log_every=.* is not accepted"):
        Fit(log_every=value)
