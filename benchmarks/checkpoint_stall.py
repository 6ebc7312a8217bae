"""How long a checkpoint blocks the training thread, for a ~400 MB state.

A training loop (a 6 x Linear(4096, 4096) MLP, fp32, plain SGD: the state is the
~403 MB of weights) checkpoints every ``--every`` steps with:

* ``torch.save``             the call blocks until the file is written (page cache);
* ``torch.save + fsync``     ... and flushed to the disk;
* ``dcp.async_save``         ``torch.distributed.checkpoint.async_save``: blocks while it
                             stages a copy (plus any wait for the previous save);
* ``AsyncCheckpoint``        sakura-async, per format and dispatcher: blocks for the
                             snapshot copy into reused buffers (plus any wait for the
                             previous write); with ``overlap=True`` the copy of the weights
                             runs during the next step's forward/backward and the loop
                             waits for it only if it is not done by the optimizer step.

Reported per method: the blocked time per checkpoint (median and spread over every save
after the first, whose buffer allocation is shown apart), the ratio to ``torch.save``, the
AsyncCheckpoint blocked time split by cause, and the run's wall time against a run without
checkpoints (an overlapped copy still uses memory bandwidth and a core; on a shared machine
this column is only as steady as the machine).  Then the bytes written for the same state with and without
zstd, fp32 and bf16 (these weights are freshly initialised; trained weights compress about
as little).

    python benchmarks/checkpoint_stall.py [--steps 15] [--every 5] [--trials 2] [--dir /tmp/x]

``--fsdp`` measures the sharded case instead: an FSDP2 (``fully_shard``) MLP with AdamW on
2 gloo ranks (``torch.multiprocessing``), checkpointing every ``--every`` steps with
the ``AsyncCheckpoint`` service (what a user installs: on an FSDP2 model it drives
``ShardedCheckpoint``), the service with ``overlap=True`` (DCP's staging copy runs during the
next forward/backward), ``ShardedCheckpoint`` called directly (DCP ``async_save`` staging + an
atomic commit on a side group), DCP's own ``async_save`` (staging, no commit), and a blocking
``dcp.save``; the training stall per checkpoint on rank 0 (for the service: every moment the
loop spends inside its events, summed per interval of ``--every`` steps), medians over each
trial, per-trial ratios to the blocking save.

    python benchmarks/checkpoint_stall.py --fsdp [--steps 12] [--every 3] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from sakura import OnBeforeOptimizerStep, OnTrainBegin, OnTrainStepEnd, SakuraRuntime
from sakura_bench.measure import interleaved, load_average, machine_note, summary

WIDTH, LAYERS, BATCH = 4096, 6, 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def fsync_save(state: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


class Method:
    """One way to checkpoint: ``begin``/``save``/``barrier``/``end`` around the loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.blocked: list[float] = []

    def begin(self, rt: SakuraRuntime | None, model: Any, opt: Any, root: str) -> None:
        self.root = root

    def save(self, step: int, model: Any, opt: Any) -> None:
        raise NotImplementedError

    def end(self) -> None:
        pass


class TorchSave(Method):
    def __init__(self, fsync: bool) -> None:
        super().__init__("torch.save + fsync" if fsync else "torch.save")
        self.fsync = fsync

    def save(self, step: int, model: Any, opt: Any) -> None:
        t = time.perf_counter()
        path = os.path.join(self.root, f"step{step}.pt")
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if self.fsync:
            fsync_save(state, path)
        else:
            torch.save(state, path)
        self.blocked.append(time.perf_counter() - t)


class DcpAsyncSave(Method):
    def __init__(self) -> None:
        super().__init__("dcp.async_save")
        self.future: Any = None

    def save(self, step: int, model: Any, opt: Any) -> None:
        import torch.distributed.checkpoint as dcp

        t = time.perf_counter()
        if self.future is not None:
            self.future.result()  # one save in flight, as AsyncCheckpoint(max_pending=1)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        self.future = dcp.async_save(state, checkpoint_id=os.path.join(self.root, f"step{step}"))
        self.blocked.append(time.perf_counter() - t)

    def end(self) -> None:
        if self.future is not None:
            self.future.result()


class Sakura(Method):
    def __init__(self, fmt: str, dispatcher: str, overlap: bool) -> None:
        label = f"AsyncCheckpoint {fmt}, {dispatcher}" + (", overlap" if overlap else "")
        super().__init__(label)
        self.fmt, self.dispatcher, self.overlap = fmt, dispatcher, overlap

    def begin(self, rt: SakuraRuntime | None, model: Any, opt: Any, root: str) -> None:
        from sakura_async import AsyncCheckpoint

        if rt is None:
            raise ValueError("AsyncCheckpoint needs the runtime")
        self.service = rt.install(
            AsyncCheckpoint(
                root,
                every=f"{self.every} steps",
                keep=1,
                format=self.fmt,
                dispatcher=self.dispatcher,
                overlap=self.overlap,
            )
        )

    def save(self, step: int, model: Any, opt: Any) -> None:
        pass  # the service triggers itself on OnTrainStepEnd

    def end(self) -> None:
        self.blocked = list(self.service.blocked_s)
        self.parts = [(t.wait_s, t.copy_s, t.barrier_s) for t in self.service.timings]
        self.allocations = self.service._pool.allocations if self.service._pool else 0


def run(method: Method | None, steps: int, every: int, root: str) -> float:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(BATCH, WIDTH, generator=g) for _ in range(4)]
    with SakuraRuntime() as rt:
        if isinstance(method, Sakura):
            method.every = every
        if method is not None:
            method.begin(rt, model, opt, root)
        rt.emit(OnTrainBegin, model=model, optimizer=opt)
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            loss = model(batches[step % 4]).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            rt.emit(OnBeforeOptimizerStep, step=step - 1, model=model, optimizer=opt)
            opt.step()
            rt.emit(OnTrainStepEnd, step=step, model=model)
            if method is not None and step % every == 0:
                method.save(step, model, opt)
        wall = time.perf_counter() - t0
        if method is not None:
            method.end()
    return wall


def zstd_sizes(root: str) -> list[tuple[str, int, int, float, float]]:
    from sakura_async.checkpoint import write_checkpoint

    out = []
    fp32 = make_model().state_dict()
    bf16 = {k: v.to(torch.bfloat16) for k, v in fp32.items()}
    for label, state in (("fp32", fp32), ("bf16", bf16)):
        sizes, times = [], []
        for compress in (None, 3):
            t = time.perf_counter()
            path = write_checkpoint(
                os.path.join(root, f"z-{label}-{compress}"), state, compress=compress
            )
            times.append(time.perf_counter() - t)
            with open(os.path.join(path, "manifest.json")) as f:
                (info,) = json.load(f)["files"].values()
            sizes.append(info["bytes"])
        out.append((label, sizes[0], sizes[1], times[0], times[1]))
    return out


FSDP_WIDTH, FSDP_LAYERS = 1024, 4
FSDP_METHODS = (
    "AsyncCheckpoint",
    "AsyncCheckpoint overlap",
    "ShardedCheckpoint",
    "dcp.async_save",
    "dcp.save",
)


def _fsdp_service_trial(
    overlap: bool, model: Any, optimizer: Any, args: Any, root: str, rank: int, world: int
) -> list[float]:
    """One run with the AsyncCheckpoint service; the time the loop spends in the
    service's events, per interval of ``--every`` steps (one save each)."""
    from sakura import OnOptimizerStep, OnTrainEnd
    from sakura_async import AsyncCheckpoint

    service = AsyncCheckpoint(
        os.path.join(root, "service"), every=f"{args.every} steps", keep=1, overlap=overlap
    )
    inside = 0.0
    stalls = []
    with SakuraRuntime([service], rank=rank, world_size=world) as rt:

        def emit(event: Any, **fields: Any) -> None:
            nonlocal inside
            t0 = time.perf_counter()
            rt.emit(event, model=model, **fields)
            inside += time.perf_counter() - t0

        emit(OnTrainBegin, step=0, optimizer=optimizer)
        for step in range(1, args.steps + 1):
            model(torch.randn(BATCH, FSDP_WIDTH)).pow(2).mean().backward()
            emit(OnBeforeOptimizerStep, step=step - 1, optimizer=optimizer)
            optimizer.step()
            emit(OnOptimizerStep, step=step, optimizer=optimizer)
            optimizer.zero_grad()
            emit(OnTrainStepEnd, step=step)
            if step % args.every == 0:
                stalls.append(inside)
                inside = 0.0
        emit(OnTrainEnd, step=args.steps)
    if service.errors or len(service.saved) != args.steps // args.every:
        raise RuntimeError(f"AsyncCheckpoint failed: {service.errors!r}, saved {service.saved}")
    return stalls


def _fsdp_trial(
    method: str, model: Any, optimizer: Any, side: Any, args: Any, root: str
) -> list[float]:
    """One run of ``--steps`` steps checkpointing with ``method``; the stall of each save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from sakura_async.checkpoint import ShardedCheckpoint

    if method.startswith("AsyncCheckpoint"):
        return _fsdp_service_trial(
            method.endswith("overlap"),
            model,
            optimizer,
            args,
            root,
            dist.get_rank(),
            dist.get_world_size(),
        )
    ckpt = (
        ShardedCheckpoint(os.path.join(root, "sakura"), keep=1)
        if method == "ShardedCheckpoint"
        else None
    )
    previous: Any = None
    stalls = []
    for step in range(1, args.steps + 1):
        x = torch.randn(BATCH, FSDP_WIDTH)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % args.every:
            continue
        t0 = time.perf_counter()
        if ckpt is not None:
            ckpt.save(step, model, optimizer)
        else:
            msd, osd = get_state_dict(model, [optimizer])
            where = os.path.join(root, method, str(step))
            if method == "dcp.save":
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=where, process_group=side)
            else:
                if previous is not None:
                    previous.result()  # one in flight, as ShardedCheckpoint
                previous = dcp.async_save(
                    {"model": msd, "optim": osd}, checkpoint_id=where, process_group=side
                )
        stalls.append(time.perf_counter() - t0)
    if ckpt is not None:
        ckpt.close()
    if previous is not None:
        previous.result()
    return stalls


def _fsdp_rank(rank: int, world: int, init: str, root: str, args: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sakura_bench.measure import ratio_summary

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(FSDP_WIDTH, FSDP_WIDTH) for _ in range(FSDP_LAYERS)]
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    side = dist.new_group(backend="gloo")
    medians: dict[str, list[float]] = {m: [] for m in FSDP_METHODS}
    spreads: dict[str, list[float]] = {m: [] for m in FSDP_METHODS}
    for trial in range(args.trials):
        turn = trial % len(FSDP_METHODS)
        for method in FSDP_METHODS[turn:] + FSDP_METHODS[:turn]:  # interleaved
            stalls = _fsdp_trial(
                method, model, optimizer, side, args, os.path.join(root, str(trial))
            )
            later = stalls[1:] or stalls  # the first save allocates the staging buffers
            medians[method].append(summary(later).median)
            spreads[method] += later
            shutil.rmtree(os.path.join(root, str(trial)), ignore_errors=True)
    if rank == 0:
        nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3  # weights + 2 AdamW moments
        print(
            f"# FSDP2 checkpoint stall on {world} gloo ranks: {nbytes / 1e6:.0f} MB fp32 state "
            f"(weights + AdamW), {args.steps} steps, a save every {args.every}, "
            f"{args.trials} interleaved trial(s); rank 0's stall per save\n# {machine_note()}\n"
        )
        print(
            "| method | stall per save, ms (median of trials, min-max) | all saves | ratio to dcp.save |"
        )
        print("|---|---|---|---|")
        for method in FSDP_METHODS:
            ratio = ratio_summary(medians[method], medians["dcp.save"])
            print(
                f"| {method} | {summary(medians[method]).format(1, ' ms', scale=1e3)} | "
                f"{summary(spreads[method]).format(1, ' ms', scale=1e3)} | {ratio.format(2, 'x')} |"
            )
        print(f"\n# load average {load_average()}")
    dist.destroy_process_group()


def fsdp_main(args: Any) -> int:
    import torch.multiprocessing as mp

    root = args.dir or tempfile.mkdtemp(prefix="sakura-dcp-bench-")
    init = os.path.join(root, "init")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_fsdp_rank, args=(2, init, root, args), nprocs=2, join=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--trials", type=int, default=2, help="runs per method (interleaved)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="fewer methods (a smoke run)")
    parser.add_argument("--fsdp", action="store_true", help="the FSDP2 / DCP case, 2 gloo ranks")
    args = parser.parse_args()
    if args.fsdp:
        return fsdp_main(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    base_dir = args.dir or tempfile.mkdtemp(prefix="sakura-ckpt-bench-")
    os.makedirs(base_dir, exist_ok=True)
    nbytes = sum(v.numel() * v.element_size() for v in make_model().state_dict().values())
    load_before = load_average()
    print(
        f"# checkpoint stall: {nbytes / 1e6:.0f} MB fp32 state, {args.steps} steps, a checkpoint every "
        f"{args.every} steps, {args.trials} trial(s) per method (interleaved); torch threads "
        f"{torch.get_num_threads()}; writing to {base_dir}\n# {machine_note()}"
    )
    factories: list[Callable[[], Method | None]] = [
        lambda: None,
        lambda: TorchSave(False),
        lambda: TorchSave(True),
        lambda: DcpAsyncSave(),
        lambda: Sakura("torch", "thread", False),
        lambda: Sakura("torch", "thread", True),
        lambda: Sakura("safetensors", "thread", True),
        lambda: Sakura("torch", "process", True),
    ]
    if args.quick:
        factories = factories[:2] + factories[4:6]

    def name_of(method: Method | None) -> str:
        return method.name if method is not None else "no checkpoint"

    def contender(make: Callable[[], Method | None]) -> Callable[[int], tuple[float, Any]]:
        def one_run(trial: int) -> tuple[float, Method | None]:
            method = make()
            name = name_of(method)
            root = os.path.join(base_dir, f"{name.replace(' ', '_').replace(',', '')}-{trial}")
            os.makedirs(root, exist_ok=True)
            wall = run(method, args.steps, args.every, root)
            shutil.rmtree(root, ignore_errors=True)
            return wall, method

        return one_run

    try:
        runs = interleaved(
            {name_of(make()): contender(make) for make in factories},
            args.trials,
            on_trial=lambda trial, r: print(
                f"# trial {trial + 1}: " + ", ".join(f"{n} {w:.2f} s" for n, (w, _) in r.items()),
                flush=True,
            ),
        )
        sizes = zstd_sizes(base_dir)
    finally:
        if not args.dir:
            shutil.rmtree(base_dir, ignore_errors=True)
    results: dict[str, dict[str, Any]] = {}
    for name, per_trial in runs.items():
        entry = results[name] = {"wall": [], "first": [], "blocked": [], "alloc": [], "parts": []}
        for wall, method in per_trial:
            entry["wall"].append(wall)
            if method is not None:
                entry["first"].append(method.blocked[0])
                entry["blocked"].extend(method.blocked[1:])
                entry["alloc"].append(getattr(method, "allocations", None))
                entry["parts"].extend(getattr(method, "parts", [])[1:])
    ref = summary(results["torch.save"]["blocked"] or results["torch.save"]["first"]).median
    base_wall = summary(results["no checkpoint"]["wall"]).median
    saves = args.steps // args.every
    print()
    print(
        "| method | blocked per checkpoint, median (min-max) | first save | vs torch.save | run wall time vs no checkpoint |"
    )
    print("|---|---|---|---|---|")
    for name, entry in results.items():
        wall = summary(entry["wall"])
        overhead = (
            f"{wall.format(2, ' s')} ({(wall.median - base_wall) / saves:+.3f} s per checkpoint)"
        )
        if name == "no checkpoint":
            print(f"| {name} | - | - | - | {wall.format(2, ' s')} |")
            continue
        b = summary(entry["blocked"] or entry["first"])
        first = summary(entry["first"])
        print(
            f"| {name} | {b.format(1, ' ms', scale=1e3)} | {first.format(0, ' ms', scale=1e3)} | "
            f"{100 * b.median / ref:.1f} % | {overhead} |"
        )
    print()
    print("AsyncCheckpoint blocked time by cause (median over the same saves, ms):")
    print()
    print(
        "| method | waiting for the previous write | copy on the training thread "
        "| waiting for the overlapped copy |"
    )
    print("|---|---|---|---|")
    for name, entry in results.items():
        if entry["parts"]:
            wait, copy, barrier = (
                summary(p[i] for p in entry["parts"]).median * 1000 for i in range(3)
            )
            print(f"| {name} | {wait:.1f} | {copy:.1f} | {barrier:.1f} |")
    print()
    print(
        "| state | bytes, no compression | bytes, zstd level 3 | ratio | write time, none / zstd |"
    )
    print("|---|---|---|---|---|")
    for label, plain, packed, t_plain, t_packed in sizes:
        print(
            f"| {label} | {plain:,} | {packed:,} | {plain / packed:.3f}x | {t_plain:.2f} s / {t_packed:.2f} s |"
        )
    print(f"\n# {machine_note(load_before)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
