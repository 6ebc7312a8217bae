"""The ``memory_plan`` service under a real ``lightning.Trainer`` and a real
``transformers.Trainer`` (through sakura-adapters): it measures the first two training
steps, times its choices, applies a mixed plan for a budget the model does not fit, and
the run trains bit-identically to the same run without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _offload_models import tiny_llama as llama

from sakura import SakuraRuntime
from sakura_offload.planner import MemoryPlanner
from sakura_offload.planner.service import MemoryPlannerService

transformers = pytest.importorskip("transformers")

STEPS = 5
BATCH = 2


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (STEPS * BATCH, 48), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def budget() -> int:
    """Halfway between the least reachable peak and keeping everything: a mix."""
    model = llama()
    batch = {k: torch.stack([r[k] for r in rows()[:BATCH]]) for k in ("input_ids", "labels")}
    plan = MemoryPlanner(10**12, min_bytes=1024, cost_trials=0).plan(
        model, lambda: model(**batch).loss
    )
    return (plan.keep_peak + plan.least_peak) // 2


def service(limit: int) -> MemoryPlannerService:
    return MemoryPlannerService(limit, min_bytes=1024, track=True, report=False, cost_trials=2)


def check(service: MemoryPlannerService, limit: int, trained: Any, reference: Any) -> None:
    plan = service.plan
    assert plan is not None and plan.budget == limit
    assert set(plan.choices.values()) != {"keep"}
    assert all(d.costs_measured for d in plan.decisions)
    assert 0 < service.planner.measured_peak <= limit
    for (name, a), b in zip(trained.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(next(trained.parameters()), next(llama().parameters()))  # trained


def test_lightning_trainer_runs_the_plan(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from sakura_adapters.lightning import LightningAdapter

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(rt: SakuraRuntime | None) -> Module:
        module = Module()
        trainer = pl.Trainer(
            max_steps=STEPS,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=str(tmp_path),
            accelerator="cpu",
            devices=1,
            callbacks=[LightningAdapter(rt)] if rt is not None else [],
        )
        trainer.fit(module, DataLoader(rows(), batch_size=BATCH, shuffle=False))
        return module

    reference = fit(None)
    limit = budget()
    with SakuraRuntime(strict=True) as rt:
        planned = rt.install(service(limit))
        module = fit(rt)
    check(planned, limit, module.model, reference.model)


def test_hf_trainer_runs_the_plan(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from sakura_adapters.hf import SakuraTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    reference = llama()
    Trainer(model=reference, args=args, train_dataset=rows()).train()
    limit = budget()
    rt = SakuraRuntime(strict=True)
    planned = rt.install(service(limit))
    model = llama()
    SakuraTrainer(model=model, args=args, train_dataset=rows(), runtime=rt).train()
    check(planned, limit, model, reference)
