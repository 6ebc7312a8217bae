"""LightningAdapter under Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in
``configure_model``) on 2 gloo ranks on CPU (issue 23).

The ranks are started as torchrun would start them (see ``_model_parallel_worker.py``), so
Lightning creates no processes of its own.  The references run here, in one process, on
the same rows in batches of 8.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning.pytorch")
pytest.importorskip("sakura_precision")

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from sakura import SakuraRuntime
from sakura.testing import launch_ranks
from sakura_adapters.lightning import LightningAdapter

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _model_parallel_worker as worker  # noqa: E402

TORCHRUN_ENV = {
    "TORCHELASTIC_RUN_ID": "sakura-adapters-model-parallel",
    "GROUP_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    # read by Lightning's environment object only: the worker initialises the process
    # group with a file rendezvous, so nothing listens on this port
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29401",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model-parallel")
    launch_ranks(HERE / "_model_parallel_worker.py", 2, out, timeout=300, env=TORCHRUN_ENV)
    return out


def weights(out: Path, variant: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{variant}.weights.pt", weights_only=True)  # type: ignore[no-any-return]


def info(out: Path, variant: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{variant}.rank{r}.json").read_text()) for r in range(2)]


def one_process_reference() -> dict[str, torch.Tensor]:
    rt = SakuraRuntime([], strict=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=worker.EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LightningAdapter(rt)],
    )
    module = worker.Module(shard=False)
    trainer.fit(module, DataLoader(worker.dataset(), batch_size=worker.GLOBAL_BATCH))
    return {k: v.detach() for k, v in module.state_dict().items()}


def test_fsdp2_run_equals_one_process_on_the_whole_batch(runs: Path) -> None:
    """FSDP2 averages the two ranks' gradients by reduce-scatter: the gathered weights are
    the one-process run's up to the order of that sum (fp32)."""
    sharded = weights(runs, "fsdp2-32")
    reference = one_process_reference()
    start = worker.Module(shard=False).state_dict()
    for name, value in reference.items():
        assert not torch.equal(value, start[name]), "the reference trained"
        torch.testing.assert_close(sharded[name], value, rtol=0, atol=2e-7)
    for rank, rank_info in enumerate(info(runs, "fsdp2-32")):
        assert set(rank_info["param_types"].values()) == {"DTensor"}  # sharded for real
        assert rank_info["plugin"] == "SakuraPrecision"
        assert {(e[1], e[2]) for e in rank_info["events"]} == {(rank, 2)}
        steps = [e[3] for e in rank_info["events"] if e[0] == "OnOptimizerStep"]
        assert steps == list(range(1, worker.EPOCHS * worker.ROWS // worker.GLOBAL_BATCH + 1))


def test_mixed_precision_under_fsdp2_equals_it_under_ddp(runs: Path) -> None:
    """sakura's MixedPrecision (bf16 autocast through the adapter's precision plugin) under
    ModelParallelStrategy: each rank computes the same bf16 products as under DDP, and the
    two strategies average the same gradients."""
    sharded, ddp = weights(runs, "fsdp2-bf16"), weights(runs, "ddp-bf16")
    fp32 = weights(runs, "fsdp2-32")
    assert any(not torch.equal(sharded[k], fp32[k]) for k in fp32), "bf16 autocast was active"
    for name, value in ddp.items():
        torch.testing.assert_close(sharded[name], value, rtol=0, atol=2e-7)
    assert all(i["autocast_seen"] == [True] for i in info(runs, "fsdp2-bf16"))


def test_mixed_precision_leaves_fsdp2s_own_policy_alone(runs: Path) -> None:
    """``configure_model`` shards with FSDP2's bf16 ``MixedPrecisionPolicy``
    (``fsdp_mp_policy``): the service reads the policy through the adapter and does not
    autocast on top of it, so the run equals the same policy with no sakura precision
    service, bit for bit, and it did train in bf16 (unlike the fp32 run)."""
    with_service, plain = weights(runs, "policy-bf16"), weights(runs, "policy-plain")
    fp32 = weights(runs, "fsdp2-32")
    assert any(not torch.equal(with_service[k], fp32[k]) for k in fp32), "the policy cast"
    for name, value in plain.items():
        assert value.dtype == torch.float32  # the shards the optimizer steps stay fp32
        torch.testing.assert_close(with_service[name], value, rtol=0, atol=0)
    for rank_info in info(runs, "policy-bf16"):
        assert rank_info["autocast_seen"] == [False]
        assert rank_info["fsdp_reason"] is not None
        assert set(rank_info["param_types"].values()) == {"DTensor"}
    assert all(i["autocast_seen"] == [False] for i in info(runs, "policy-plain"))
