"""One rank of test_zero.py (run as a script through sakura.testing.launch_ranks).

Two copies of one model on every rank see the same DDP-averaged gradients: one steps with
``rt.prepare`` under ``offload_adamw`` + ``ZeRO1`` (each rank updates its shard on the host,
then the shards are broadcast), the other with a plain, unsharded ``OffloadAdamW``.  The
rank writes the largest difference between the two after every step, and its own share of
the optimizer state, to ``<out>/<moments>-rank<R>.json``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sakura import SakuraRuntime
from sakura_offload import OffloadAdamW
from sakura_zero import ZeRO1

STEPS = 5


def main() -> None:
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    moments = sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
    plain_net = copy.deepcopy(net)
    hyper = {"lr": 1e-2, "weight_decay": 0.01}

    sharded_model = DDP(net)
    plain_model = DDP(plain_net)
    plain = OffloadAdamW(plain_net.parameters(), **hyper, moment_dtype=moments)
    diffs = []
    with SakuraRuntime() as rt:
        rt.install(f"offload_adamw:{moments}")
        rt.install(ZeRO1())
        sharded_model, sharded = rt.prepare(
            sharded_model, torch.optim.AdamW(net.parameters(), **hyper)
        )
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
            for model, optimizer in ((sharded_model, sharded), (plain_model, plain)):
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
            if not rt.optimizer_step(sharded):
                sharded.step()
            plain.step()
            diffs.append(
                max(
                    (a - b).abs().max().item()
                    for a, b in zip(net.parameters(), plain_net.parameters(), strict=True)
                )
            )
        held = len(sharded.state)  # the parameters whose moments this rank keeps
        sharded.consolidate_state_dict(to=0)  # a collective: every rank
        moment_diff = None
        if rank == 0:  # the consolidated state, in torch.optim.AdamW's layout, vs unsharded
            full, reference = sharded.state_dict()["state"], plain.state_dict()["state"]
            assert sorted(full) == sorted(reference), (sorted(full), sorted(reference))
            moment_diff = max(
                (full[i][k] - reference[i][k]).abs().max().item()
                for i in reference
                for k in ("exp_avg", "exp_avg_sq")
            )
        # Resume: the consolidated state loads into a freshly sharded optimizer (through
        # ZeRO1's load hooks, which OffloadAdamW.load_state_dict runs) and the next step
        # equals the unsharded optimizer's.
        box = [sharded.state_dict() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
    resumed_net, resumed_plain_net = copy.deepcopy(net), copy.deepcopy(plain_net)
    resumed_plain = OffloadAdamW(resumed_plain_net.parameters(), **hyper, moment_dtype=moments)
    resumed_plain.load_state_dict(plain.state_dict())
    with SakuraRuntime() as rt:
        rt.install(f"offload_adamw:{moments}")
        rt.install(ZeRO1())
        model, resumed = rt.prepare(
            DDP(resumed_net), torch.optim.AdamW(resumed_net.parameters(), **hyper)
        )
        resumed.load_state_dict(box[0])
        resumed_held = len(resumed.state)
        gen = torch.Generator().manual_seed(999 + rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        for m, optimizer in ((model, resumed), (DDP(resumed_plain_net), resumed_plain)):
            optimizer.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        if not rt.optimizer_step(resumed):
            resumed.step()
        resumed_plain.step()
    resumed_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(resumed_net.parameters(), resumed_plain_net.parameters(), strict=True)
    )
    result = {
        "type": type(sharded).__name__,
        "inner": type(getattr(sharded, "optimizer", sharded)).__name__,
        "diffs": diffs,
        "moment_diff": moment_diff,
        "held_states": held,
        "resumed_held_states": resumed_held,
        "resumed_diff": resumed_diff,
        "total_params": len(list(net.parameters())),
    }
    Path(out, f"{moments}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
