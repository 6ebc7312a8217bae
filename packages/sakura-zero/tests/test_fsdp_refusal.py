"""ZeRO1 / ZeRO2 refuse a model that FSDP2's ``fully_shard`` sharded (DTensor parameters).

FSDP2 already shards parameters, gradients and optimizer state; ZeRO on top would shard
DTensor shards again and broadcast them as whole tensors.  The refusal runs on a real
2-rank gloo group (this file is also the rank script, launched by ``launch_ranks``); each
rank writes what it saw to ``<out>/refusal-rank<R>.json`` and the test asserts on it.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sakura import SakuraRuntime
from sakura_zero import ZeRO1, ZeRO2

HERE = Path(__file__)
SERVICES: dict[str, Callable[[], Any]] = {"ZeRO1": ZeRO1, "ZeRO2": ZeRO2}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _error(action: Callable[[], Any]) -> str:
    try:
        action()
    except ValueError as exc:
        return str(exc)
    return ""


def _service_records(who: str, make: Callable[[], Any]) -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard

    sharded = fully_shard(_net())
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    records = {f"{who}/wrap_model": _error(lambda: make().wrap_model(sharded))}
    service = make()
    records[f"{who}/wrap_optimizer"] = _error(lambda: service.wrap_optimizer(optimizer))
    records[f"{who}/not-sharded"] = str(len(service.shardings))
    with SakuraRuntime(strict=True) as rt:
        rt.install(make())
        records[f"{who}/prepare"] = _error(lambda: rt.prepare(sharded, optimizer))
    # The same network unsharded: accepted, and the optimizer is sharded by ZeRO.
    plain = _net()
    control = make()
    control.wrap_model(plain)
    control.wrap_optimizer(torch.optim.AdamW(plain.parameters(), lr=1e-2))
    records[f"{who}/control"] = str(len(control.shardings))
    return records


def _rank_records() -> dict[str, str]:
    records: dict[str, str] = {}
    for who, make in SERVICES.items():
        records.update(_service_records(who, make))
    return records


def main() -> None:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        (out / f"refusal-rank{rank}.json").write_text(json.dumps(_rank_records()))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    from sakura.testing import launch_ranks

    out = tmp_path_factory.mktemp("zero-fsdp2")
    launch_ranks(HERE, 2, out, timeout=120)
    return [json.loads((out / f"refusal-rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("who", sorted(SERVICES))
@pytest.mark.parametrize("flow", ["wrap_model", "wrap_optimizer", "prepare"])
def test_zero_refuses_an_fsdp2_sharded_model(
    ranks: list[dict[str, str]], who: str, flow: str
) -> None:
    """On both ranks, by wrap_model, wrap_optimizer and rt.prepare: a ValueError naming the
    service, FSDP2 and what to do instead; the refused optimizer is not sharded."""
    pattern = (
        rf"{who} cannot shard (a model|an optimizer over a model) sharded by FSDP2 "
        rf"\(fully_shard\): its parameters are DTensors \(one is \(16, 8\) torch.float32 placed "
        rf"\[Shard\(dim=0\)\]\), and FSDP2 already shards the parameters, the gradients and "
        rf"the optimizer state.*remove the {who.lower()} service"
    )
    for records in ranks:
        assert re.search(pattern, records[f"{who}/{flow}"]), records[f"{who}/{flow}"]
        assert records[f"{who}/not-sharded"] == "0"


@pytest.mark.parametrize("who", sorted(SERVICES))
def test_zero_still_shards_an_unsharded_model(ranks: list[dict[str, str]], who: str) -> None:
    for records in ranks:
        assert records[f"{who}/control"] == "1"


if __name__ == "__main__":
    main()
