"""A third-party workload, registered through sakura-bench's hook by another plugin, is
listed and runs; sakura-bench's hookspecs are documented with their exact signatures."""

from __future__ import annotations

import inspect
import json
import sys
import textwrap
from pathlib import Path

import pytest

from sakura_bench import hookspecs
from sakura_bench.cli import main
from sakura_bench.registry import get_registry
from sakura_bench.trial import TrialConfig, run_trial

REPO = Path(__file__).resolve().parents[3]

PLUGIN = """
from sakura import hookimpl

@hookimpl(optionalhook=True)  # loads even where sakura-bench (which declares the hook) is off
def sakura_register_workloads(register):
    register("xor-mlp", "{module}_workload:XorMLP", description="XOR of two bits")

@hookimpl(optionalhook=True)
def sakura_register_frameworks(register):
    register("plain-loop", "{module}_workload:PlainLoop")
"""

WORKLOAD = """
import torch
from sakura_bench.framework import Framework
from sakura_bench.workload import Workload, classification_sums, move_to

class XorMLP(Workload):
    description = "XOR with a two-layer MLP"
    configs = {"tiny": {"batch_size": 8}, "full": {"batch_size": 32}}
    default_epochs = 2

    def _split(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 2, (n, 2), generator=g).float()
        return {"x": x, "y": (x[:, 0] != x[:, 1]).long()}

    def train_split(self):
        return self._split(64, self.seed)

    def eval_split(self):
        return self._split(32, self.seed + 1)

    def make_model(self):
        torch.manual_seed(self.seed)
        return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def loss(self, model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def eval_batch(self, model, batch):
        return classification_sums(model(batch["x"]), batch["y"])

class PlainLoop(Framework):
    description = "SGD without anything else"

    def incompatibility(self, workload):
        return None if workload.__name__ == "XorMLP" else "it only runs xor-mlp"

    def run(self, ctx):
        w, rec = ctx.workload, ctx.recorder
        model = ctx.model = w.make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        rec.train_begin()
        for epoch in range(ctx.epochs):
            rec.epoch_begin(epoch)
            for batch in w.train_batches(ctx.train_split):
                w.loss(model, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec.step()
            rec.train_phase_end()
            rec.eval_begin()
            rec.eval_end(w.evaluate(model, w.eval_batches(ctx.eval_split), ctx.device))
            rec.epoch_end(epoch)
        rec.finish_begin()
        rec.train_end()
"""


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sakura_plugins) -> str:  # type: ignore[no-untyped-def]
    module = f"thirdparty{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PLUGIN.format(module=module)))
    (tmp_path / f"{module}_workload.py").write_text(textwrap.dedent(WORKLOAD))
    monkeypatch.syspath_prepend(str(tmp_path))
    sakura_plugins(["sakura-bench", "sakura-async", module])
    yield module
    for name in (module, f"{module}_workload"):
        sys.modules.pop(name, None)


def test_third_party_workload_and_framework_are_listed(
    third_party: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    workloads = {w["name"]: w for w in data["workloads"]}
    assert workloads["xor-mlp"]["provided_by"] == third_party  # a module plugin: no distribution
    assert workloads["xor-mlp"]["frameworks"] == ["lightning", "plain-loop", "pytorch-ddp"]
    assert workloads["xor-mlp"]["description"] == "XOR of two bits"  # the registration's
    assert "mnist-mlp" in workloads  # sakura-bench's own, registered the same way
    assert workloads["mnist-mlp"]["frameworks"] == ["lightning", "pytorch-ddp"]  # not plain-loop
    assert data["failures"] == []


@pytest.mark.parametrize("framework", ["plain-loop", "pytorch-ddp"])
def test_third_party_workload_runs(third_party: str, framework: str) -> None:
    result = run_trial(TrialConfig("xor-mlp", "baseline", framework, scale="tiny"))
    assert result["epochs_run"] == 2 and result["steps"] == 16
    assert set(result["final_metrics"]) == {"val_loss", "val_acc"}


def test_third_party_workload_under_async_eval(third_party: str) -> None:
    """The evaluation finds the workload through the plugins, as a worker process would."""
    base = run_trial(TrialConfig("xor-mlp", "baseline", "pytorch-ddp", scale="tiny"))
    sak = run_trial(
        TrialConfig(
            "xor-mlp", "sakura", "pytorch-ddp", scale="tiny", services=["async_eval:thread"]
        )
    )
    assert sak["final_metrics"] == pytest.approx(base["final_metrics"], rel=1e-6)


def test_incompatible_third_party_framework_says_why(third_party: str) -> None:
    from sakura_bench.errors import IncompatibleError

    with pytest.raises(
        IncompatibleError, match="cannot run --workload mnist-mlp: it only runs xor-mlp"
    ):
        run_trial(TrialConfig("mnist-mlp", "baseline", "plain-loop", scale="tiny"))


def test_bench_hooks_work_without_sakura_benchs_own_plugin(
    third_party: str, sakura_plugins
) -> None:  # type: ignore[no-untyped-def]
    sakura_plugins(
        [third_party]
    )  # sakura-bench's plugin not loaded: its hookspecs are added anyway
    registry = get_registry()
    assert registry.names("workload") == ["xor-mlp"]


def test_every_bench_hook_is_documented_with_its_signature() -> None:
    doc = (REPO / "docs" / "bench.md").read_text()
    hooks = [name for name in vars(hookspecs) if name.startswith("sakura_register_")]
    assert hooks == ["sakura_register_workloads", "sakura_register_frameworks"]
    for name in hooks:
        signature = f"{name}{inspect.signature(getattr(hookspecs, name))}".replace("'", "")
        assert f"`{signature}`" in doc, f"docs/bench.md lacks {signature}"
