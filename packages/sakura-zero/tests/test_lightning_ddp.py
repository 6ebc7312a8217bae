"""ZeRO under a real ``lightning.Trainer(strategy="ddp")`` with 2 CPU processes.

The two processes are started as torchrun would start them (see _lightning_worker.py), so
Lightning does not re-run pytest to create its own.  One launch trains every variant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning.pytorch")
pytest.importorskip("sakura_adapters.lightning")

from sakura.testing import launch_ranks

HERE = Path(__file__).parent

TORCHRUN_ENV = {
    "TORCHELASTIC_RUN_ID": "sakura-zero-test",  # Lightning: processes are created externally
    "GROUP_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    # read by Lightning's environment object only; the process group is initialised by
    # the worker with a file rendezvous, so nothing listens on this port
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29400",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero-lightning")
    launch_ranks(HERE / "_lightning_worker.py", 2, out, timeout=240, env=TORCHRUN_ENV)
    return out


def weights(out: Path, name: str) -> list[torch.Tensor]:
    return torch.load(out / f"{name}.weights.pt", weights_only=True)  # type: ignore[no-any-return]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def info(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]


def test_zero1_equals_unsharded_lightning_run_with_clipping(runs: Path) -> None:
    """Lightning clips inside the closure it passes to optimizer.step(): ZeRO1 runs that
    closure before narrowing the param groups, so clipping sees every gradient."""
    assert same(weights(runs, "zero1-clip"), weights(runs, "plain-clip"))
    assert not same(weights(runs, "plain-clip"), weights(runs, "plain")), "clipping was active"
    for rank_info in info(runs, "zero1-clip"):
        assert rank_info["steps"] == 8  # 2 epochs x 4 batches, one broadcast each
        assert rank_info["same_optimizer"] and rank_info["state_only_owned"]


def test_zero2_equals_unsharded_lightning_run(runs: Path) -> None:
    assert same(weights(runs, "zero2"), weights(runs, "plain"))
    for rank_info in info(runs, "zero2"):
        assert rank_info["grad_mode"] == "ddp"  # the DDP comm hook, found via trainer.model
        assert rank_info["steps"] == 8


def test_lightning_checkpoint_holds_the_unsharded_optimizer_state(runs: Path) -> None:
    """Lightning's strategy calls consolidate_state_dict() then state_dict() on rank 0: the
    checkpoint's optimizer state is exactly the unsharded AdamW's."""
    plain = torch.load(runs / "plain-clip.ckpt", weights_only=True)
    zero = torch.load(runs / "zero1-clip.ckpt", weights_only=True)
    a, b = plain["optimizer_states"][0], zero["optimizer_states"][0]
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][index][key]), (index, key)
    assert "zero1" in zero["sakura"]


def test_resume_from_lightning_checkpoint(runs: Path) -> None:
    assert same(weights(runs, "zero1-resume"), weights(runs, "plain-resume"))
    for rank_info in info(runs, "zero1-resume"):
        assert rank_info["steps"] == 4 and rank_info["state_only_owned"]


def test_zero2_refuses_lightning_gradient_clipping(runs: Path) -> None:
    for rank in range(2):
        message = json.loads((runs / f"zero2-clip.rank{rank}.error.json").read_text())
        assert message is not None and "gradient_clip_val=0.5" in message
        assert "clip_grad_norm_" in message
