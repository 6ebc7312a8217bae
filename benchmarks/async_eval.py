"""AsyncEval: per-epoch evaluation overlapped with the next epoch's training.

An MLP workload whose per-epoch evaluation costs about as much as its training epoch (the
number of validation batches is calibrated on this machine so that it does), run three
ways in one process, trials interleaved (``sakura_bench.measure.interleaved``):

* ``sync``     the baseline: the loop evaluates at each epoch end, then trains on;
* ``thread``   AsyncEval + ThreadDispatcher (a background thread of this process);
* ``process``  AsyncEval + LocalDispatcher (a sakura-worker process: its own GIL).

Every mode runs with the same thread settings: ``torch.set_num_threads(T)`` in the
training process and ``threads=T`` in the worker (``--threads``, default 1).  The worker is
started and ready before the timed region (in real use it starts while the first epoch
trains); its start-up time is reported separately.

Reported: the median wall time per mode with its spread, the speedup over ``sync`` (the
median of the per-trial ratios, with their spread), and the
ideal bound ``(train + eval) / max(train, eval)`` from the measured per-epoch times, plus the
bound for this number of epochs (the last evaluation cannot overlap anything).  Every mode's
validation metrics must equal the baseline's exactly (checked).

    python benchmarks/async_eval.py [--trials 5] [--epochs 10] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from _common import write_json

from sakura import OnEpochEnd, OnTrainBegin, OnTrainEnd, SakuraRuntime
from sakura_bench.measure import (
    interleaved,
    load_average,
    machine_note,
    ratio_summary,
    summary,
)

IN, HIDDEN, OUT = 784, 512, 10
TRAIN_BATCH, VAL_BATCH = 64, 512


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def make_train(batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(TRAIN_BATCH, IN, generator=g),
            torch.randint(0, OUT, (TRAIN_BATCH,), generator=g),
        )
        for _ in range(batches)
    ]


def make_val(batches: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    n = batches * VAL_BATCH
    return {"x": torch.randn(n, IN, generator=g), "y": torch.randint(0, OUT, (n,), generator=g)}


def evaluate(model: torch.nn.Module, val: dict[str, torch.Tensor]) -> dict[str, float]:
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(val["x"]), VAL_BATCH):
            x, y = val["x"][i : i + VAL_BATCH], val["y"][i : i + VAL_BATCH]
            logits = model(x)
            loss_sum += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(-1) == y).sum())
    model.train()
    return {"val_loss": loss_sum / len(val["x"]), "val_acc": correct / len(val["x"])}


def eval_fn(epoch: int, task: Any) -> dict[str, float]:
    """What AsyncEval dispatches: the epoch's snapshot loaded into a fresh model."""
    return evaluate(task.load_into(make_model()), task.payload)


def train_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[Any]) -> None:
    for x, y in data:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def run(
    mode: str, epochs: int, data: list[Any], val: dict[str, Any], dispatcher: Any
) -> dict[str, Any]:
    from sakura_async import AsyncEval

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_s = eval_s = 0.0
    metrics: list[dict[str, float]] = []
    t0 = time.perf_counter()
    if mode == "sync":
        for _ in range(epochs):
            t = time.perf_counter()
            train_epoch(model, opt, data)
            t2 = time.perf_counter()
            metrics.append(evaluate(model, val))
            train_s += t2 - t
            eval_s += time.perf_counter() - t2
    else:
        with SakuraRuntime() as rt:
            service = rt.install(AsyncEval(eval_fn, val, dispatcher=dispatcher, pass_task=True))
            rt.emit(OnTrainBegin, model=model, optimizer=opt)
            step = 0
            for epoch in range(epochs):
                train_epoch(model, opt, data)
                step += len(data)
                rt.emit(OnEpochEnd, epoch=epoch, step=step, model=model, optimizer=opt)
            rt.emit(OnTrainEnd, epoch=epochs - 1, step=step, model=model)
        metrics = [r.metrics for r in service.history]
        if service.errors:
            raise RuntimeError(f"{mode}: evaluations failed: {[r.error for r in service.errors]}")
    return {
        "wall_s": time.perf_counter() - t0,
        "train_s": train_s,
        "eval_s": eval_s,
        "metrics": metrics,
    }


def calibrate(threads: int, target_epoch_s: float) -> tuple[int, int]:
    """Train batches for ~target_epoch_s, then validation batches costing about as much."""
    model, opt = make_model(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = make_train(8)
    train_epoch(model, opt, probe)
    t = time.perf_counter()
    for _ in range(3):
        train_epoch(model, opt, probe)
    per_batch = (time.perf_counter() - t) / 24
    train_batches = max(4, round(target_epoch_s / per_batch))
    val = make_val(4)
    evaluate(model, val)
    t = time.perf_counter()
    for _ in range(3):
        evaluate(model, val)
    per_val_batch = (time.perf_counter() - t) / 12
    val_batches = max(1, round(train_batches * per_batch / per_val_batch))
    return train_batches, val_batches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--epoch-seconds", type=float, default=0.4, help="target training time per epoch"
    )
    parser.add_argument("--modes", default="sync,thread,process")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    if args.trials < 1 or args.epochs < 2 or args.threads < 1:
        parser.error("--trials >= 1, --epochs >= 2 and --threads >= 1 are required")
    modes = args.modes.split(",")
    torch.set_num_threads(args.threads)
    from sakura_async.dispatch import LocalDispatcher, ThreadDispatcher

    load_before = load_average()
    train_batches, val_batches = calibrate(args.threads, args.epoch_seconds)
    data, val = make_train(train_batches), make_val(val_batches)
    print(
        f"# AsyncEval benchmark: MLP {IN}-{HIDDEN}-{HIDDEN}-{OUT}, {train_batches} train batches of "
        f"{TRAIN_BATCH} / epoch, {val_batches} val batches of {VAL_BATCH}, {args.epochs} epochs, "
        f"{args.trials} trials, torch threads {args.threads} (per process)\n# {machine_note()}"
    )
    dispatchers: dict[str, Any] = {}
    if "thread" in modes:
        dispatchers["thread"] = ThreadDispatcher().start()
    if "process" in modes:
        t = time.perf_counter()
        local = LocalDispatcher(threads=args.threads)
        local.wait_ready()
        print(
            f"# worker start-up (spawn + import torch), not timed below: {time.perf_counter() - t:.2f} s"
        )
        dispatchers["process"] = local
    results = interleaved(
        {
            mode: lambda _, mode=mode: run(mode, args.epochs, data, val, dispatchers.get(mode))
            for mode in modes
        },
        args.trials,
        on_trial=lambda trial, r: print(
            f"# trial {trial + 1}: " + ", ".join(f"{m} {r[m]['wall_s']:.2f} s" for m in modes),
            flush=True,
        ),
    )
    for d in dispatchers.values():
        d.close()

    reference = results["sync"][0]["metrics"] if "sync" in results else None
    for mode in modes:
        for r in results[mode]:
            if reference is not None and r["metrics"] != reference:
                print(
                    f"ERROR: {mode} metrics differ from the synchronous evaluation", file=sys.stderr
                )
                return 1
    out: dict[str, Any] = {"modes": {}}
    base = [r["wall_s"] for r in results["sync"]] if "sync" in results else None
    if "sync" in results:
        train = summary(r["train_s"] for r in results["sync"]).median / args.epochs
        ev = summary(r["eval_s"] for r in results["sync"]).median / args.epochs
        ideal = (train + ev) / max(train, ev)
        n = args.epochs
        ideal_n = n * (train + ev) / (n * max(train, ev) + min(train, ev))
        print(f"\nper epoch (sync runs, median): train {train:.3f} s, eval {ev:.3f} s")
        print(
            f"ideal speedup (train + eval) / max(train, eval) = {ideal:.3f}x; for {n} epochs "
            f"(the last eval cannot overlap) = {ideal_n:.3f}x\n"
        )
        out.update(train_epoch_s=train, eval_epoch_s=ev, ideal=ideal, ideal_for_epochs=ideal_n)
    print(
        "| mode | wall time, median (min-max) | speedup vs sync, per-trial median (min-max) "
        "| % of ideal | % of ideal for N epochs |"
    )
    print("|---|---|---|---|---|")
    for mode in modes:
        walls = summary(r["wall_s"] for r in results[mode])
        row: dict[str, Any] = {"wall_s": walls}
        if base is not None:
            speedup = ratio_summary(base, walls.values)
            of_ideal, of_ideal_n = speedup.median / ideal, speedup.median / ideal_n
            row.update(speedup=speedup, of_ideal=of_ideal, of_ideal_n=of_ideal_n)
            print(
                f"| {mode} | {walls.format(3, ' s')} | {speedup.format(3, 'x')} "
                f"| {100 * of_ideal:.0f} % | {100 * of_ideal_n:.0f} % |"
            )
        else:
            print(f"| {mode} | {walls.format(3, ' s')} | | | |")
        out["modes"][mode] = row
    print("\nvalidation metrics identical to the synchronous evaluation in every trial: yes")
    print(f"# {machine_note(load_before)}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
