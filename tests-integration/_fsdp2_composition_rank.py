"""One rank of ``test_fsdp2_composition.py``: a raw ``torch.distributed`` loop (sakura's
``DDPAdapter``) training a tiny Llama under FSDP2 (``fully_shard`` per decoder layer and at
the root) with MixedPrecision (bf16 autocast), ActivationCheckpoint, the chunked loss and
OffloadAdamW all installed, then the same under ``DistributedDataParallel``; on 2 ranks
also under FSDP2 with ``fsdp_mp_policy("bf16-mixed")`` (FSDP2's module-level bf16, which
MixedPrecision sees and does not autocast on top of).

Every rank sees the same rows under both strategies, so each computes the same bf16
products; both average the gradients over the ranks.  Rank 0 writes each run's gathered
weights and losses; every rank writes what it observed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from sakura import SakuraRuntime
from sakura_adapters import DDPAdapter
from sakura_kernels import ChunkedLoss
from sakura_offload import OffloadAdamWService
from sakura_precision import ActivationCheckpoint, MixedPrecision, fsdp_mp_policy

ROWS = 6
STEPS = 3


def build() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return LlamaForCausalLM(config)


def run(strategy: str, rank: int, world: int, out: Path) -> None:
    model: Any = build()
    if strategy.startswith("fsdp2"):
        # fsdp2-policy: FSDP2's own bf16 (module-level casts) in place of autocast
        policy = {"mp_policy": fsdp_mp_policy("bf16-mixed")} if strategy == "fsdp2-policy" else {}
        for layer in model.model.layers:
            fully_shard(layer, **policy)
        fully_shard(model, **policy)
    precision = MixedPrecision("bf16-mixed")
    services = [
        precision,
        ActivationCheckpoint(),
        ChunkedLoss(chunk=8),
        OffloadAdamWService(),
    ]
    rt = SakuraRuntime(services, strict=True)
    adapter = DDPAdapter(rt)
    losses: list[float] = []
    logits_seen: list[Any] = []
    autocasting: list[bool] = []
    with rt:
        model, optimizer = rt.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        if strategy == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        adapter.on_train_begin(model, optimizer)
        per = ROWS // world
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 64, (ROWS, 12), generator=g)[rank * per : (rank + 1) * per]
            adapter.on_train_step_begin(model, ids, step)
            with rt.autocast():
                autocasting.append(torch.is_autocast_enabled("cpu"))
                output = model(input_ids=ids, labels=ids)
            logits_seen.append(output.logits)
            adapter.backward(output.loss)
            adapter.step(optimizer)
            optimizer.zero_grad()
            losses.append(float(output.loss.detach()))
        adapter.on_train_end(model)
    inner = model.module if strategy == "ddp" else model
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in inner.state_dict().items()
    }
    if rank == 0:
        torch.save({"weights": full, "losses": losses}, out / f"{strategy}.w{world}.pt")
    info = {
        "optimizer": type(optimizer).__name__,
        "logits_none": all(x is None for x in logits_seen),
        "dtensor_params": sum(type(p).__name__ == "DTensor" for p in inner.parameters()),
        "params": sum(1 for _ in inner.parameters()),
        "moment_bytes": int(optimizer.stats()["moment_bytes"]),
        "autocasting": autocasting,
        "fsdp_reason": precision.fsdp_reason,
        "param_dtypes": sorted({str(p.dtype) for p in inner.parameters()}),
    }
    (out / f"{strategy}.w{world}.rank{rank}.json").write_text(json.dumps(info))
    dist.barrier()


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        strategies = ["fsdp2", "ddp"] + (["fsdp2-policy"] if world == 2 else [])
        for strategy in strategies:
            run(strategy, rank, world, Path(out_dir))
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank, _world, _init, _out = sys.argv[1:5]
    main(int(_rank), int(_world), _init, _out)
