"""One rank of test_checkpoint_service_dcp.py (run through sakura.testing.launch_ranks).

``save`` (2 ranks): a tiny Llama (built from a config) sharded with FSDP2 trains under a
SakuraRuntime with ``AsyncCheckpoint(every="1 steps", keep=2)``, which must detect the
DTensor parameters and write with torch.distributed.checkpoint on every rank.  A service
subscribed to OnCheckpointDurable records what became durable, and when.  After step 3
rank 0 writes the full (unsharded) model and AdamW state as the reference; step 4's write
fails on rank 1 (an OSError injected into DCP's file writer).  ``hang`` (2 ranks): rank 1
never comes to the save (a small MLP there and in ``refuse``).  ``refuse`` (1 rank): the options a sharded model cannot honour
are each reported, naming the option, and nothing is written.  ``load`` (any world size): a fresh sharded model and optimizer
resume through ``AsyncCheckpoint.resume``; rank 0 compares the full state with the
reference tensor by tensor.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dcp_rank import flatten, full_state  # the same state views as ShardedCheckpoint's test
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sakura import (
    OnBeforeOptimizerStep,
    OnEpochEnd,
    OnOptimizerStep,
    OnTrainBegin,
    OnTrainEnd,
    OnTrainStepEnd,
    SakuraRuntime,
    Service,
)
from sakura_async import AsyncCheckpoint, OnCheckpointDurable
from sakura_async.checkpoint import find_sharded
from sakura_async.errors import CheckpointWriteError

VOCAB = 256


class Durable(Service):
    """Records each OnCheckpointDurable with the loop event it arrived during."""

    priority = 10  # before AsyncCheckpoint (70): ``where`` names the event being handled
    event_types = frozenset({OnCheckpointDurable, OnTrainStepEnd, OnEpochEnd, OnTrainEnd})

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.where = "begin"

    def on_event(self, event: Any) -> None:
        if isinstance(event, OnCheckpointDurable):
            self.seen.append(
                {
                    "step": event.step,
                    "path": os.path.basename(event.path),
                    "sharded": event.sharded,
                    "format": event.format,
                    "rank": event.rank,
                    "at": self.where,
                }
            )
        else:
            self.where = f"{type(event).__name__}@{event.step}"


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The tiny Llama, each decoder layer and the root sharded with FSDP2."""
    from transformers import LlamaConfig, LlamaForCausalLM  # not for hang/refuse: faster

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def build_small() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A two-layer MLP under FSDP2: enough DTensors for the failure paths."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def save(ckpt_dir: str, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build()
    service = AsyncCheckpoint(ckpt_dir, every="1 steps", keep=2, timeout_s=60)
    durable = Durable()
    drained = ""
    try:
        with SakuraRuntime([service, durable], rank=rank, world_size=world) as rt:
            rt.emit(OnTrainBegin, step=0, model=model, optimizer=optimizer)
            for step in (1, 2, 3):
                train_step(model, optimizer, step)
                rt.emit(OnTrainStepEnd, step=step, model=model)
            rt.emit(OnEpochEnd, step=3, model=model, optimizer=optimizer)
            reference = full_state(model, optimizer)
            if rank == 0:
                torch.save(reference, f"{out}/reference.pt")
            train_step(model, optimizer, 4)
            if rank == 1:  # this rank's writer breaks mid-write

                def broken(self: Any, plan: Any, planner: Any) -> Any:
                    raise OSError("injected: disk full")

                dcp.FileSystemWriter.write_data = broken  # type: ignore[method-assign]
            rt.emit(OnTrainStepEnd, step=4, model=model)
            rt.emit(OnTrainEnd, step=4, model=model)
    except CheckpointWriteError as exc:
        drained = str(exc)
    result = {
        "durable": durable.seen,
        "saved": [os.path.basename(p) for p in service.saved],
        "errors": [repr(e) for e in service.errors],
        "drained": drained,
        "published": [step for step, _ in find_sharded(ckpt_dir)],
        "temporaries": [e for e in os.listdir(ckpt_dir) if e.startswith(".tmp")],
    }
    with open(f"{out}/save-rank{rank}.json", "w") as sink:
        json.dump(result, sink)


def overlap(ckpt_dir: str, out: str) -> None:
    """overlap=True: each save's host copy runs on DCP's staging thread during the next
    step's forward and backward, and the service waits for it at OnBeforeOptimizerStep.
    Step 5's loop skips that event: the checkpoint of step 4 must be discarded."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build()
    service = AsyncCheckpoint(ckpt_dir, every="1 steps", keep=None, overlap=True)
    drained = ""

    def step(rt: SakuraRuntime, number: int, *, announce: bool = True) -> None:
        gen = torch.Generator().manual_seed(100 * number + rank)
        ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        if announce:
            rt.emit(OnBeforeOptimizerStep, step=number - 1, model=model, optimizer=optimizer)
        optimizer.step()
        rt.emit(OnOptimizerStep, step=number, model=model, optimizer=optimizer)
        optimizer.zero_grad()

    try:
        with SakuraRuntime([service], rank=rank, world_size=world) as rt:
            rt.emit(OnTrainBegin, step=0, model=model, optimizer=optimizer)
            for number in (1, 2, 3):
                step(rt, number)
                rt.emit(OnTrainStepEnd, step=number, model=model)
            reference = full_state(model, optimizer)
            if rank == 0:
                torch.save(reference, f"{out}/reference.pt")
            step(rt, 4)  # step 3's copy overlaps this forward/backward
            rt.emit(OnTrainStepEnd, step=4, model=model)
            step(rt, 5, announce=False)  # the weights change under step 4's copy
            rt.emit(OnTrainEnd, step=5, model=model)
    except CheckpointWriteError as exc:
        drained = str(exc)
    result = {
        "saved": [os.path.basename(p) for p in service.saved],
        "drained": drained,
        "overlap_after": service.overlap,
        "published": [s for s, _ in find_sharded(ckpt_dir)],
    }
    with open(f"{out}/overlap-rank{rank}.json", "w") as sink:
        json.dump(result, sink)


def hang(ckpt_dir: str, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build_small()
    service = AsyncCheckpoint(ckpt_dir, every="1 steps", timeout_s=3)
    drained = ""
    try:
        with SakuraRuntime([service], rank=rank, world_size=world) as rt:
            rt.emit(OnTrainBegin, step=0, model=model, optimizer=optimizer)
            if rank == 0:  # rank 1 never reaches the step end that saves
                rt.emit(OnTrainStepEnd, step=1, model=model)
            rt.emit(OnTrainEnd, step=1, model=model)
    except CheckpointWriteError as exc:
        drained = str(exc)
    result = {"drained": drained, "published": [s for s, _ in find_sharded(ckpt_dir)]}
    with open(f"{out}/hang-rank{rank}.json", "w") as sink:
        json.dump(result, sink)
    sys.stdout.flush()
    os._exit(0)  # the side group saw a timeout: do not wait on its teardown


REFUSED: list[dict[str, Any]] = [
    {"every": "30s"},
    {"every": "best", "metric": "val_loss"},
    {"format": "safetensors"},
    {"compress": 3},
    {"state_provider": dict},
]


def refuse(ckpt_dir: str, out: str) -> None:
    model, optimizer = build_small()
    messages = []
    for options in REFUSED:
        service = AsyncCheckpoint(ckpt_dir, **options)
        try:
            with SakuraRuntime([service]) as rt:
                rt.emit(OnTrainBegin, step=0, model=model, optimizer=optimizer)
                rt.emit(OnTrainStepEnd, step=1, model=model)
                rt.emit(OnEpochEnd, step=1, model=model, optimizer=optimizer)
                rt.emit(OnTrainEnd, step=1, model=model)
            messages.append("")
        except CheckpointWriteError as exc:
            messages.append(str(exc))
    result = {"messages": messages, "written": sorted(os.listdir(ckpt_dir))}
    with open(f"{out}/refuse.json", "w") as sink:
        json.dump(result, sink)


def load(ckpt_dir: str, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build()
    step = AsyncCheckpoint(ckpt_dir).resume(model, optimizer)
    loaded = flatten(full_state(model, optimizer))  # gathered on rank 0 only (cpu_offload)
    reference = flatten(torch.load(f"{out}/reference.pt", weights_only=True))
    unequal = [
        key
        for key, value in reference.items()
        if key not in loaded
        or (
            not torch.equal(loaded[key], value)
            if isinstance(value, torch.Tensor)
            else loaded[key] != value
        )
    ]
    if rank != 0:
        unequal = ["(compared on rank 0)"] if loaded else []
    shard = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[operator]
    total = sum(p.numel() for p in model.parameters())
    result = {"step": step, "unequal": unequal, "keys": len(reference), "local": shard}
    result["total"] = total
    with open(f"{out}/load{world}-rank{rank}.json", "w") as sink:
        json.dump(result, sink)


def main() -> None:
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mode, ckpt_dir = sys.argv[5], sys.argv[6]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    {"save": save, "hang": hang, "load": load, "refuse": refuse, "overlap": overlap}[mode](
        ckpt_dir, out
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
