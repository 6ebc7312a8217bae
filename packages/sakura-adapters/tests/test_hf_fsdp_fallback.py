"""The Hugging Face Trainer asked for FSDP on a CPU (issue 23): accelerate enables FSDP only
on GPU-like devices and silently trains under DDP; the HFAdapter says so instead of letting
a user believe the model is sharded.  Real Trainer, 2 gloo ranks."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from sakura.testing import launch_ranks
from sakura_adapters.hf.checks import warn_if_fsdp_fell_back

HERE = Path(__file__).parent


def test_trainer_with_fsdp_args_on_cpu_runs_ddp_and_the_adapter_warns(tmp_path: Path) -> None:
    launch_ranks(HERE / "_hf_fsdp_fallback_worker.py", 2, tmp_path, timeout=300)
    for rank in range(2):
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # what accelerate did (if a release shards on CPU, this test must be revisited)
        assert info["distributed_type"] == "DistributedType.MULTI_CPU"
        assert info["wrapped"] == "DistributedDataParallel"
        assert len(info["warnings"]) == 1
        assert "TrainingArguments.fsdp=True asked for FSDP" in info["warnings"][0]
        assert "not sharded" in info["warnings"][0]


def test_no_warning_without_fsdp_or_without_a_model(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(2, 2)
    with caplog.at_level("WARNING", logger="sakura.adapters.hf"):
        assert not warn_if_fsdp_fell_back(types.SimpleNamespace(fsdp=[]), model)
        assert not warn_if_fsdp_fell_back(types.SimpleNamespace(fsdp=["full_shard"]), None)
        assert warn_if_fsdp_fell_back(types.SimpleNamespace(fsdp=["full_shard"]), model)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "TrainingArguments.fsdp=full_shard asked for FSDP" in caplog.records[0].getMessage()
