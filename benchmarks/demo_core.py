"""Demo: a raw PyTorch loop driven through the sakura runtime, with Telemetry.

The runtime is built the way a user's configuration builds it,
``SakuraRuntime.from_config(services=["telemetry:path=..."])``, so the service is found
through the plugin registry (sakura-core registers ``telemetry`` through its own entry
point, as any plugin would).  A small MLP trains on synthetic data through
:func:`sakura.testing.run_tiny_loop`, the reference loop that emits every event; a
service defined here prints progress at each epoch end; at the end the telemetry file is
summarised with :func:`sakura.telemetry.summarize`.

    python benchmarks/demo_core.py [--epochs 5] [--output DIR]

The synthetic labels are random, so the training loss falls (the model memorises the
fixed training batches) while the validation loss does not: the point is the plumbing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Loop sizes: big enough to be a real (if small) training run, small enough for seconds.
LOOP = {
    "steps_per_epoch": 100,
    "val_batches": 10,
    "batch_size": 64,
    "features": 64,
    "hidden": 256,
    "classes": 10,
    "lr": 0.05,
    "clip": 1.0,
    "seed": 0,
}


class EpochProgress:
    """A service of our own: prints one line per epoch from OnEpochEnd's metrics."""

    name = "demo_progress"
    priority = 500

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs
        self.started = time.perf_counter()

    def on_train_begin(self, event: Any) -> None:
        self.started = time.perf_counter()

    def on_epoch_end(self, event: Any) -> None:
        metrics = dict(event.metrics or {})
        elapsed = time.perf_counter() - self.started
        print(
            f"  epoch {event.epoch + 1}/{self.epochs}  step {event.step:>5}  "
            f"train_loss {metrics.get('train_loss', float('nan')):.4f}  "
            f"val_loss {metrics.get('val_loss', float('nan')):.4f}  ({elapsed:.1f} s)",
            flush=True,
        )


def telemetry_spec(path: Path) -> str | dict[str, Any]:
    """The service spec for Telemetry writing to ``path``: the spec string a user would
    write, or the table form when the path holds a comma (the string form's separator)."""
    if "," in str(path) or str(path) != str(path).strip():
        return {"name": "telemetry", "path": str(path)}
    return f"telemetry:path={path}"


def print_summary(summary: dict[str, Any], path: Path, loop_order: Sequence[str]) -> None:
    order: dict[str, int] = {}
    for name in loop_order:  # events in the order the loop first emits them
        order.setdefault(name, len(order))
    events: dict[str, int] = summary["events"]
    print()
    print(f"Telemetry summary ({path})")
    print(f"  {'event':<26} {'count':>7}")
    print(f"  {'-' * 26} {'-' * 7}")
    for name in sorted(events, key=lambda n: (order.get(n, len(order)), n)):
        print(f"  {name:<26} {events[name]:>7}")
    print(f"  {'total':<26} {summary['total_events']:>7}")
    print(f"  epochs recorded   {summary['epochs']}")
    print(f"  wall time         {summary['wall_s']:.2f} s (first to last event)")
    if "last_loss" in summary:
        print(f"  last step loss    {summary['last_loss']:.4f}")
    for key, value in sorted(summary.get("last_metrics", {}).items()):
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"  last {key:<12} {shown}")


def run(epochs: int, output: Path) -> int:
    import torch  # noqa: F401 - imported before the clock starts; run_tiny_loop needs it

    from sakura import SakuraRuntime
    from sakura.telemetry import summarize
    from sakura.testing import expected_event_names, run_tiny_loop

    output.mkdir(parents=True, exist_ok=True)
    telemetry_path = output / "telemetry.jsonl"
    rt = SakuraRuntime.from_config(services=[telemetry_spec(telemetry_path)])
    rt.install(EpochProgress(epochs))
    print(f"sakura runtime: {', '.join(s.name for s in rt.services)}")
    print(
        f"training an MLP {LOOP['features']}-{LOOP['hidden']}-{LOOP['classes']} for {epochs} "
        f"epochs x {LOOP['steps_per_epoch']} steps (batch {LOOP['batch_size']}, SGD, "
        f"grad clip {LOOP['clip']}); the labels are random, so only the training loss "
        "is expected to fall"
    )
    started = time.perf_counter()
    with rt:
        result = run_tiny_loop(rt, epochs=epochs, **LOOP)
    elapsed = time.perf_counter() - started

    expected = expected_event_names(epochs, LOOP["steps_per_epoch"], LOOP["val_batches"])
    summary = summarize(telemetry_path)
    print_summary(summary, telemetry_path, expected)
    print()
    print(
        f"final train loss {result.losses[-1]:.4f} (last step), "
        f"final val loss {result.val_losses[-1]:.4f}; "
        f"{result.steps} steps in {elapsed:.2f} s"
    )

    # The demo checks itself: Telemetry recorded exactly the events the loop emitted.
    problems = []
    if summary["total_events"] != len(expected):
        problems.append(f"{summary['total_events']} events recorded, {len(expected)} emitted")
    if summary["events"].get("OnTrainStepEnd") != result.steps:
        problems.append(
            f"{summary['events'].get('OnTrainStepEnd')} OnTrainStepEnd, {result.steps} steps"
        )
    if rt.errors:
        problems.append(f"service errors: {list(rt.errors)}")
    if problems:
        print("demo check FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"demo check passed: every emitted event was recorded ({len(expected)})")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small MLP through the sakura runtime with Telemetry and print "
        "the telemetry summary."
    )
    parser.add_argument("--epochs", type=int, default=5, help="training epochs (default 5)")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="directory for telemetry.jsonl (default: a temporary directory, removed after)",
    )
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.output is not None and args.output.exists() and not args.output.is_dir():
        parser.error(f"--output must be a directory, got the file {args.output}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.output is not None:
        return run(args.epochs, args.output)
    with tempfile.TemporaryDirectory(prefix="sakura-demo-") as tmp:
        return run(args.epochs, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
