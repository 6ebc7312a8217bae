"""ZeRO1 / ZeRO2 on real gloo process groups of 2 and 3 ranks (separate processes).

Two launches carry every check (process start-up dominates the cost): 2 ranks run the
``main``, ``flows`` and ``save`` phases of ``_multirank_worker.py``; 3 ranks then run
``resume`` (from the 2-rank checkpoint) and ``main`` again.  The test functions below only
read what the ranks recorded.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura.testing import launch_ranks

HERE = Path(__file__).parent
WORKER = HERE / "_multirank_worker.py"

IDENTITY_CASES = [
    f"{opt}/{mode}"
    for opt in ("SGD", "Adam", "AdamW")
    for mode in ("zero1-ddp", "zero2-ddp", "zero2-hooks")
] + [f"{opt}/zero1-ddp" for opt in ("AdamW-foreach", "AdamW-fused", "RMSprop")]


def _records(out: Path, phase: str, world: int) -> list[list[dict[str, Any]]]:
    return [json.loads((out / f"{phase}-ws{world}-rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero-ws2")
    launch_ranks(WORKER, 2, out, "main,flows,save", timeout=180)
    return out


@pytest.fixture(scope="module")
def three_ranks(two_ranks: Path) -> Path:
    launch_ranks(WORKER, 3, two_ranks, "resume,main", timeout=240, init_name="init3")
    return two_ranks


def _run(request: pytest.FixtureRequest, world: int) -> Path:
    return Path(request.getfixturevalue("two_ranks" if world == 2 else "three_ranks"))


def by_case(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["case"]: r for r in records}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", IDENTITY_CASES)
def test_bit_identical_to_unsharded_step(
    request: pytest.FixtureRequest, world: int, case: str
) -> None:
    """Parameters after 1 and 5 steps (3 param groups with their own lr / weight decay, a
    frozen parameter, a StepLR scheduler) equal, bit for bit, those of the unsharded
    optimizer stepped on the same gradients; the step is overlapped in 8 runs."""
    for rank, records in enumerate(_records(_run(request, world), "main", world)):
        r = by_case(records)[case]
        assert r["same_object"], "wrap_optimizer must shard in place"
        assert r["equal_after_1"] and r["equal_after_5"], (rank, r)
        assert r["lr"] == r["ref_lr"], "the scheduler drives the sharded optimizer"
        assert r["syncs"] == 5
        assert r["runs"] == 8
        assert r["state_only_owned"]
        expected_mode = {"zero1-ddp": None, "zero2-ddp": "ddp", "zero2-hooks": "hooks"}
        assert r["grad_mode"] == expected_mode[case.split("/")[1]]
        if rank == 0:
            assert r["consolidated_equal"], "consolidated state == the unsharded state_dict()"


@pytest.mark.parametrize("world", [2, 3])
def test_state_bytes_split_across_ranks(request: pytest.FixtureRequest, world: int) -> None:
    ranks = _records(_run(request, world), "main", world)
    for case in IDENTITY_CASES:
        rows = [by_case(records)[case] for records in ranks]
        total = rows[0]["total_state_bytes"]
        imbalance = rows[0]["imbalance"]
        # every byte of state lives on exactly one rank ...
        assert sum(r["state_bytes"] for r in rows) == total, case
        # ... and no rank holds more than its share plus the partition's imbalance (the
        # per-parameter scalars such as Adam's step count are the only extra)
        scalars = 8 * rows[0]["num_params"]
        for r in rows:
            assert r["state_bytes"] <= (1 + imbalance) * total / world + scalars, (case, r)
        assert 0 <= imbalance < 0.5
    equal_layers = [by_case(records)["state_bytes"] for records in ranks]
    for r in equal_layers:  # 12 equal layers: a perfect split
        assert r["imbalance"] == 0.0
        assert r["all_state_bytes"] == [sum(r["all_state_bytes"]) // world] * world


def test_quickstart_flow_without_prepare(two_ranks: Path) -> None:
    """The reference README loop (no rt.prepare; the loop calls optimizer.step() itself and
    tells the adapter): sharded at OnTrainBegin, one broadcast per step, the same weights as
    plain DDP."""
    for records in _records(two_ranks, "flows", 2):
        cases = by_case(records)
        for stage, mode in ((1, None), (2, "ddp")):
            r = cases[f"quickstart/zero{stage}"]
            assert r["equal"], r
            assert r["syncs"] == r["steps"] == 5
            assert r["grad_mode"] == mode
            assert r["state_only_owned"]


def test_prepare_flows_step_once(two_ranks: Path) -> None:
    """rt.prepare + adapter.on_train_begin with the same optimizer + adapter.step: one
    sharding, one broadcast per step; ZeRO2 without DDP reduces gradients itself."""
    for records in _records(two_ranks, "flows", 2):
        cases = by_case(records)
        for name, mode in (
            ("prepare/zero1/ddp", None),
            ("prepare/zero2/ddp", "ddp"),
            ("prepare/zero2/no-ddp", "hooks"),
        ):
            r = cases[name]
            assert r["equal"], r
            assert r["syncs"] == 5 and r["shardings"] == 1
            assert r["grad_mode"] == mode


def test_zero2_gradient_accumulation_and_clipping(two_ranks: Path) -> None:
    for records in _records(two_ranks, "flows", 2):
        cases = by_case(records)
        acc = cases["accumulation/zero2"]
        assert acc["equal"], "no_sync() accumulation == DDP's no_sync() accumulation"
        assert "no_sync()" in acc["error"]
        clip = cases["clip/zero2"]
        assert clip["total"] == pytest.approx(clip["ref_total"], rel=1e-6)
        assert clip["max_param_diff"] <= 1e-7


def test_state_dict_errors_are_explicit(two_ranks: Path) -> None:
    ranks = [by_case(records)["errors"] for records in _records(two_ranks, "flows", 2)]
    for r in ranks:
        assert "consolidate_state_dict(to=0)" in r["unconsolidated"]
        assert r["shard_into_plain"] == "KeyError", "a plain optimizer must refuse a shard"
        assert "load_sharded" in r["shard_load"]
        assert "not per-parameter" in r["not_per_parameter"]
    assert ranks[0]["consolidated_keys"] == list(range(1, 11))  # the frozen param has none
    assert "consolidated on rank 0, not on this rank 1" in ranks[1]["wrong_rank"]


def test_consolidated_checkpoint_is_the_unsharded_state(two_ranks: Path) -> None:
    (save,) = _records(two_ranks, "save", 2)[0]
    assert save["consolidated_equal"]


def test_resume_on_three_ranks_continues_identically(three_ranks: Path) -> None:
    """Saved by 2 ranks after 3 steps; resumed by 3 ranks from the consolidated checkpoint
    (through DDPAdapter.on_load_checkpoint before the optimizer exists) and from the 2
    sharded files; by a 2-rank sub-group; by a 1-rank group: 3 more steps land exactly
    where the uninterrupted 2-rank run did."""
    seen = set()
    for records in _records(three_ranks, "resume", 3):
        for r in records:
            assert r["equal"], r
            assert r["state_only_owned"], r
            if r["case"].startswith("resume/consolidated"):
                assert r["global_step"] == 3
            seen.add(r["case"])
    assert seen == {
        "resume/consolidated/ws3",
        "resume/sharded/ws3",
        "resume/consolidated/ws2",
        "resume/sharded/ws1",
    }


def test_resume_with_a_plain_optimizer_in_one_process(two_ranks: Path) -> None:
    """The consolidated state is torch.optim.AdamW's own format: an unsharded AdamW in a
    single process without torch.distributed resumes the trajectory exactly."""
    spec = importlib.util.spec_from_file_location("_zero_worker", WORKER)
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    checkpoint = torch.load(two_ranks / "consolidated.pt", weights_only=True)
    net, optimizer, sched = worker.ckpt_setup()
    net.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["sakura"]["zero1"]["optimizers"][0])
    sched.load_state_dict(checkpoint["scheduler"])
    worker.ckpt_steps(net, optimizer, sched, worker.SAVE_AT + 1, worker.END_AT)
    final = torch.load(two_ranks / "final.pt", weights_only=True)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), final, strict=True))
