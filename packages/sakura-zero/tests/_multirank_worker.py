"""One rank of the multi-rank tests (run as a script by ``test_multirank.py``).

Every check runs real gloo collectives between separate processes, launched like torchrun
(file rendezvous, loopback only).  Each rank writes what it measured to
``<out>/<phase>-ws<W>-rank<R>.json``; the test process makes the assertions.

Phases: ``main`` (any world size): bit-identity of SGD / Adam / AdamW under ZeRO1 and
ZeRO2 against the unsharded optimizer on the same gradients, state bytes, consolidated
state; ``flows`` (2 ranks): the reference quickstart flow, ``rt.prepare`` flows, gradient
accumulation, clipping, error messages; ``save`` (2 ranks) and ``resume`` (3 ranks):
checkpoints across world sizes.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sakura import SakuraRuntime
from sakura_zero import ZeRO1, ZeRO2

STEPS = 5
TINY_RUN_MB = 1e-4  # forces the overlapped step into several runs even on tiny models
DDP_BUCKET_MB = 0.004  # several DDP buckets, each with parameters of several owners


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 24)
        self.mid = nn.ModuleList(nn.Linear(24, 24) for _ in range(3))
        self.out = nn.Linear(24, 4)
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)  # frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.mid:
            h = torch.tanh(layer(h))
        return self.out(h) * self.scale


def groups(net: Net) -> list[dict[str, Any]]:
    return [
        {"params": list(net.inp.parameters()), "lr": 0.02, "weight_decay": 0.0},
        {"params": [p for m in net.mid for p in m.parameters()]},
        {"params": [*net.out.parameters(), net.scale], "lr": 0.005, "weight_decay": 0.2},
    ]


OPTIMIZERS = {
    "SGD": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda g: torch.optim.Adam(g, lr=0.01, weight_decay=0.01, amsgrad=True),
    "AdamW": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.05),
    # the implementation the user picked is the one that runs, sharded or not
    "AdamW-foreach": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.05, foreach=True),
    "AdamW-fused": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.05, fused=True),
    "RMSprop": lambda g: torch.optim.RMSprop(g, lr=0.01, momentum=0.5, centered=True),
}
EXTRA_OPTIMIZERS = ("AdamW-foreach", "AdamW-fused", "RMSprop")  # ZeRO1 only: enough


def batch(step: int, rank: int, world: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-specific data (``world=None``), or the full batch every rank shares."""
    g = torch.Generator().manual_seed(1000 * step + (rank if world is None else 0))
    return torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)


def loss_of(model: Any, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(model(x), y)


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def state_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def make_zero(stage: int, **kwargs: Any) -> Any:
    if stage == 1:
        return ZeRO1(overlap_mb=TINY_RUN_MB, **kwargs)
    return ZeRO2(overlap_mb=TINY_RUN_MB, grad_bucket_mb=0.004, **kwargs)


# --- phase "main" ---------------------------------------------------------------------------


def identity_case(rank: int, world: int, opt_name: str, mode: str) -> dict[str, Any]:
    """Sharded optimizer vs the unsharded one stepped on exactly the same gradients."""
    stage = 1 if mode == "zero1-ddp" else 2
    net = Net()
    ref = copy.deepcopy(net)
    model: Any = net if mode == "zero2-hooks" else DDP(net, bucket_cap_mb=DDP_BUCKET_MB)
    optimizer = OPTIMIZERS[opt_name](groups(net))
    reference = OPTIMIZERS[opt_name](groups(ref))
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(reference, step_size=2, gamma=0.5)
    zero = make_zero(stage)
    record: dict[str, Any] = {"case": f"{opt_name}/{mode}"}
    with SakuraRuntime([zero], strict=True) as rt:
        model, wrapped = rt.prepare(model, optimizer)
        record["same_object"] = wrapped is optimizer
        sharding = zero.sharding(optimizer)

        def capture(opt: Any, args: Any, kwargs: Any) -> None:
            # registered after ZeRO's own pre-hook: the gradients are final here
            for p, q in zip(net.parameters(), ref.parameters(), strict=True):
                if not p.requires_grad:
                    continue
                owner = sharding.owner(p)
                if stage == 1 or rank == owner:
                    grad = p.grad.detach().clone()
                else:
                    grad = torch.empty_like(p)
                if stage == 2:
                    dist.broadcast(grad, src=owner)
                q.grad = grad

        optimizer.register_step_pre_hook(capture)
        for step in range(1, STEPS + 1):
            loss_of(model, batch(step, rank)).backward()
            optimizer.step()
            sched.step()
            reference.step()
            ref_sched.step()
            optimizer.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            if step in (1, STEPS):
                record[f"equal_after_{step}"] = params_equal(net, ref)
        record["lr"] = [g["lr"] for g in optimizer.param_groups]
        record["ref_lr"] = [g["lr"] for g in reference.param_groups]
        record["state_bytes"] = sharding.state_bytes()
        record["total_state_bytes"] = sum(tensor_bytes(s) for s in reference.state.values())
        record["imbalance"] = sharding.imbalance
        record["param_bytes"] = sum(p.numel() * p.element_size() for p in net.parameters())
        record["num_params"] = len(sharding.params)
        record["owned_params"] = len(sharding.owned_parameters())
        record["syncs"] = sharding.steps
        record["grad_mode"] = sharding.grad_mode
        record["runs"] = sharding._broadcast.chunks if sharding._broadcast else 0
        record["state_only_owned"] = all(sharding.owner(p) == rank for p in optimizer.state)
        consolidated = sharding.consolidated_state_dict(0)
        if rank == 0:
            record["consolidated_equal"] = state_equal(consolidated, reference.state_dict())
        if stage == 2 and mode == "zero2-ddp":
            record["ddp_hook_calls"] = zero.ddp_hook.calls
    return record


def state_bytes_case(rank: int, world: int) -> dict[str, Any]:
    """A model of many equal layers: per-rank AdamW state close to total / world size."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(12)])
    model = DDP(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    zero = ZeRO1()
    with SakuraRuntime([zero], strict=True) as rt:
        model, optimizer = rt.prepare(model, optimizer)
        loss_of_ = model(torch.randn(4, 32)).square().mean()
        loss_of_.backward()
        optimizer.step()
        sharding = zero.sharding(optimizer)
        local = sharding.state_bytes()
        totals = [torch.tensor([local])]
        gathered = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(gathered, totals[0])
        return {
            "case": "state_bytes",
            "state_bytes": local,
            "all_state_bytes": [int(t) for t in gathered],
            "imbalance": sharding.imbalance,
            "num_params": len(sharding.params),
            "loads": list(sharding.partition.loads),
        }


def phase_main(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    records = [
        identity_case(rank, world, opt, mode)
        for opt in OPTIMIZERS
        for mode in ("zero1-ddp", "zero2-ddp", "zero2-hooks")
        if opt not in EXTRA_OPTIMIZERS or mode == "zero1-ddp"
    ]
    records.append(state_bytes_case(rank, world))
    return records


# --- phase "flows" (2 ranks) ---------------------------------------------------------------


def train_one_step(model: Any, data: Any, optimizer: Any) -> torch.Tensor:
    loss = loss_of(model, data)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def plain_ddp_weights(rank: int, steps: int, accumulate: bool = False) -> Net:
    """The reference: a plain DDP loop with an unsharded AdamW."""
    net = Net()
    model = DDP(net, bucket_cap_mb=DDP_BUCKET_MB)
    optimizer = torch.optim.AdamW(groups(net), lr=0.01, weight_decay=0.05)
    for step in range(1, steps + 1):
        if accumulate:
            with model.no_sync():
                loss_of(model, batch(100 + step, rank)).backward()
            loss_of(model, batch(step, rank)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            train_one_step(model, batch(step, rank), optimizer)
    return net


def quickstart_flow(rank: int, world: int, stage: int) -> dict[str, Any]:
    """The reference README's raw loop: no rt.prepare, the loop steps its own optimizer."""
    from sakura_adapters.ddp import DDPAdapter

    net = Net()
    model = DDP(net, bucket_cap_mb=DDP_BUCKET_MB)
    optimizer = torch.optim.AdamW(groups(net), lr=0.01, weight_decay=0.05)
    train_loader = [batch(step, rank) for step in range(1, STEPS + 1)]
    zero = make_zero(stage)
    with SakuraRuntime(strict=True) as rt:
        rt.install(zero)
        adapter = DDPAdapter(rt, rank=dist.get_rank(), world_size=dist.get_world_size())
        adapter.on_train_begin(model, optimizer, train_loader)
        adapter.on_epoch_begin(0)
        for step, data in enumerate(train_loader):
            adapter.on_train_step_begin(model, data, step)
            loss = train_one_step(model, data, optimizer)
            adapter.on_optimizer_step(optimizer)
        adapter.on_epoch_end(0, model, optimizer, metrics={"train_loss": loss})
        adapter.on_train_end(model)
        sharding = zero.sharding(optimizer)
        return {
            "case": f"quickstart/zero{stage}",
            "equal": params_equal(net, plain_ddp_weights(rank, STEPS)),
            "syncs": sharding.steps,
            "steps": adapter.global_step,
            "grad_mode": sharding.grad_mode,
            "state_only_owned": all(sharding.owner(p) == rank for p in optimizer.state),
        }


def prepare_flow(rank: int, world: int, stage: int, ddp: bool) -> dict[str, Any]:
    """rt.prepare + the adapter's own backward/step, and on_train_begin with the same
    optimizer: still one step and one broadcast per iteration."""
    from sakura_adapters.ddp import DDPAdapter

    net = Net()
    model: Any = DDP(net, bucket_cap_mb=DDP_BUCKET_MB) if ddp else net
    optimizer = torch.optim.AdamW(groups(net), lr=0.01, weight_decay=0.05)
    zero = make_zero(stage)
    with SakuraRuntime([zero], strict=True) as rt:
        model, optimizer = rt.prepare(model, optimizer)
        adapter = DDPAdapter(rt)
        adapter.on_train_begin(model, optimizer, None)
        for step in range(1, STEPS + 1):
            optimizer.zero_grad(set_to_none=True)
            adapter.backward(loss_of(model, batch(step, rank)))
            adapter.step(optimizer)
        sharding = zero.sharding(optimizer)
        return {
            "case": f"prepare/zero{stage}/{'ddp' if ddp else 'no-ddp'}",
            "equal": params_equal(net, plain_ddp_weights(rank, STEPS)),
            "syncs": sharding.steps,
            "shardings": len(zero.shardings),
            "grad_mode": sharding.grad_mode,
        }


def accumulation_flow(rank: int, world: int) -> dict[str, Any]:
    """ZeRO2 without DDP: two micro-batches per step, the first inside no_sync()."""
    net = Net()
    optimizer = torch.optim.AdamW(groups(net), lr=0.01, weight_decay=0.05)
    zero = make_zero(2)
    record: dict[str, Any] = {"case": "accumulation/zero2"}
    with SakuraRuntime([zero], strict=True) as rt:
        model, optimizer = rt.prepare(net, optimizer)
        for step in range(1, 4):
            with zero.no_sync():
                loss_of(model, batch(100 + step, rank)).backward()
            loss_of(model, batch(step, rank)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        record["equal"] = params_equal(net, plain_ddp_weights(rank, 3, accumulate=True))
        # accumulating without no_sync is refused with advice
        loss_of(model, batch(50, rank)).backward()
        try:
            loss_of(model, batch(51, rank)).backward()
            record["error"] = None
        except RuntimeError as exc:
            record["error"] = str(exc)
        zero.reduce_gradients()
    return record


def clip_flow(rank: int, world: int) -> dict[str, Any]:
    """ZeRO2's clip_grad_norm_ across ranks vs torch's on the full averaged gradients."""
    net = Net()
    ref = copy.deepcopy(net)
    optimizer = torch.optim.SGD(groups(net), lr=0.1)
    reference = torch.optim.SGD(groups(ref), lr=0.1)
    ref_model = DDP(ref, bucket_cap_mb=DDP_BUCKET_MB)
    zero = make_zero(2)
    with SakuraRuntime([zero], strict=True) as rt:
        model, optimizer = rt.prepare(net, optimizer)
        loss_of(model, batch(1, rank)).backward()
        total = zero.clip_grad_norm_(optimizer, 0.05)
        optimizer.step()
        loss_of(ref_model, batch(1, rank)).backward()
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        reference.step()
        diff = max(
            float((p - q).abs().max())
            for p, q in zip(net.parameters(), ref.parameters(), strict=True)
        )
        return {
            "case": "clip/zero2",
            "total": float(total),
            "ref_total": float(ref_total),
            "max_param_diff": diff,
        }


def error_flow(rank: int, world: int) -> dict[str, Any]:
    """state_dict() of a sharded optimizer needs consolidation first, and says so."""
    net = Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    zero = ZeRO1()
    record: dict[str, Any] = {"case": "errors"}
    with SakuraRuntime([zero], strict=True) as rt:
        model, optimizer = rt.prepare(DDP(net), optimizer)
        loss_of(model, batch(1, rank)).backward()
        optimizer.step()
        try:
            optimizer.state_dict()
            record["unconsolidated"] = None
        except RuntimeError as exc:
            record["unconsolidated"] = str(exc)
        optimizer.consolidate_state_dict(to=0)
        try:
            full = optimizer.state_dict()
            record["consolidated_keys"] = sorted(int(k) for k in full["state"])
            record["wrong_rank"] = None
        except RuntimeError as exc:
            record["consolidated_keys"] = None
            record["wrong_rank"] = str(exc)
        try:
            torch.optim.Adam(net.parameters()).load_state_dict(
                zero.sharding(optimizer).sharded_state_dict()
            )
            record["shard_into_plain"] = None
        except Exception as exc:
            record["shard_into_plain"] = type(exc).__name__
        try:
            optimizer.load_state_dict(zero.sharding(optimizer).sharded_state_dict())
            record["shard_load"] = None
        except ValueError as exc:
            record["shard_load"] = str(exc)
    # an optimizer whose update is not per-parameter is refused on every rank at once
    other = Net()
    global_state = GlobalCount(other.parameters(), lr=0.1)
    zero = ZeRO1()
    with SakuraRuntime([zero], strict=True) as rt:
        model, global_state = rt.prepare(DDP(other), global_state)
        loss_of(model, batch(1, rank)).backward()
        try:
            global_state.step()
            record["not_per_parameter"] = None
        except TypeError as exc:
            record["not_per_parameter"] = str(exc)
    return record


class GlobalCount(torch.optim.SGD):
    """Keeps a step counter on the first parameter it was built with, whichever
    parameters it is asked to step: not a per-parameter optimizer."""

    def __init__(self, params: Any, lr: float) -> None:
        params = list(params)
        super().__init__(params, lr=lr)
        self.first = params[0]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self.state[self.first]["count"] = self.state[self.first].get("count", 0) + 1
        return loss


def phase_flows(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    return [
        quickstart_flow(rank, world, 1),
        quickstart_flow(rank, world, 2),
        prepare_flow(rank, world, 1, ddp=True),
        prepare_flow(rank, world, 2, ddp=True),
        prepare_flow(rank, world, 2, ddp=False),
        accumulation_flow(rank, world),
        clip_flow(rank, world),
        error_flow(rank, world),
    ]


# --- phases "save" (2 ranks) and "resume" (3 ranks) -----------------------------------------
# Every rank computes the full batch's gradient (no DDP), so the trajectory does not depend
# on the world size and runs with 1, 2 or 3 ranks must agree bit for bit.

SAVE_AT, END_AT = 3, 6


def ckpt_setup() -> tuple[Net, torch.optim.Optimizer, Any]:
    net = Net()
    optimizer = torch.optim.AdamW(groups(net), lr=0.01, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return net, optimizer, sched


def ckpt_steps(net: Net, optimizer: Any, sched: Any, first: int, last: int) -> None:
    for step in range(first, last + 1):
        loss_of(net, batch(step, 0, world=1)).backward()
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)


def phase_save(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    from sakura_adapters.ddp import DDPAdapter

    net, optimizer, sched = ckpt_setup()
    ref, reference, ref_sched = ckpt_setup()
    zero = make_zero(1)
    record: dict[str, Any] = {"case": "save"}
    with SakuraRuntime([zero], strict=True) as rt:
        model, optimizer = rt.prepare(net, optimizer)
        adapter = DDPAdapter(rt)
        adapter.on_train_begin(model, optimizer, None)
        ckpt_steps(net, optimizer, sched, 1, SAVE_AT)
        ckpt_steps(ref, reference, ref_sched, 1, SAVE_AT)
        checkpoint = adapter.on_save_checkpoint(
            {"global_step": SAVE_AT, "model": net.state_dict(), "scheduler": sched.state_dict()}
        )
        zero.save_sharded(out / "sharded")
        if rank == 0:
            torch.save(checkpoint, out / "consolidated.pt")
            record["consolidated_equal"] = state_equal(
                checkpoint["sakura"]["zero1"]["optimizers"][0], reference.state_dict()
            )
        ckpt_steps(net, optimizer, sched, SAVE_AT + 1, END_AT)
        if rank == 0:
            torch.save([p.detach() for p in net.parameters()], out / "final.pt")
        record["imbalance"] = zero.sharding(optimizer).imbalance
    return [record]


def resume(rank: int, out: Path, source: str, process_group: Any = None) -> dict[str, Any]:
    from sakura_adapters.ddp import DDPAdapter

    checkpoint = torch.load(out / "consolidated.pt", weights_only=True)
    net, optimizer, sched = ckpt_setup()
    net.load_state_dict(checkpoint["model"])
    sched.load_state_dict(checkpoint["scheduler"])
    zero = make_zero(1, process_group=process_group)
    with SakuraRuntime([zero], strict=True) as rt:
        adapter = DDPAdapter(rt)
        if source == "consolidated":  # before sharding: applied when the optimizer is sharded
            adapter.on_load_checkpoint(checkpoint)
        _, optimizer = rt.prepare(net, optimizer)
        if source == "sharded":
            zero.load_sharded(out / "sharded")
        sharding = zero.sharding(optimizer)
        ckpt_steps(net, optimizer, sched, SAVE_AT + 1, END_AT)
        final = torch.load(out / "final.pt", weights_only=True)
        return {
            "case": f"resume/{source}/ws{sharding.info.world_size}",
            "equal": all(torch.equal(p, q) for p, q in zip(net.parameters(), final, strict=True)),
            "state_only_owned": all(
                sharding.owner(p) == sharding.info.rank for p in optimizer.state
            ),
            "global_step": adapter.global_step,
        }


def phase_resume(rank: int, world: int, out: Path) -> list[dict[str, Any]]:
    records = [resume(rank, out, "consolidated"), resume(rank, out, "sharded")]
    # sub-groups (made on every rank, in the same order): ranks 1-2 as a world of 2 whose
    # group ranks differ from the global ones, and rank 0 alone as a world of 1
    pair = dist.new_group([1, 2])
    alone = dist.new_group([0])
    if rank == 0:
        records.append(resume(rank, out, "sharded", process_group=alone))
    else:
        records.append(resume(rank, out, "consolidated", process_group=pair))
    return records


PHASES = {"main": phase_main, "flows": phase_flows, "save": phase_save, "resume": phase_resume}


def main() -> None:
    rank, world, init, out, phases = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        Path(sys.argv[4]),
        sys.argv[5].split(","),
    )
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for phase in phases:  # one process start for several phases: startup dominates
            records = PHASES[phase](rank, world, out)
            (out / f"{phase}-ws{world}-rank{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
