"""The ``sakura-bench`` command.

    sakura-bench run --workload W --runner baseline|sakura --framework F [--service SPEC ...]
                     --output DIR [--trials N] [--epochs N] [--seed S] [--threads T]
                     [--scale auto|tiny|small|full] [--data DIR] [--device auto|cpu|cuda]
                     [--warmup-steps N] [--nproc N] [--variant NAME] [--in-process] [--quiet]
    sakura-bench pair --workload W --framework F [--service SPEC ...] --output DIR
                      [--baseline-variant NAME] [--variant NAME] [...]
                      (the baseline and sakura runs, trials interleaved, then compared)
    sakura-bench compare A.json B.json [--json]
    sakura-bench export reports/*.json [--output DIR]
    sakura-bench list [--json]

Exit status: 0 on success, 1 when a trial fails, 2 for a usage error (a wrong name,
value or file, which the message explains).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape

__all__ = ["main"]


def _add_trial_options(parser: argparse.ArgumentParser, service_help: str) -> None:
    """The options that say what a trial runs (``run`` and ``pair``)."""
    parser.add_argument("--workload", required=True, help="a workload name (sakura-bench list)")
    parser.add_argument(
        "--framework", required=True, help="pytorch-ddp, lightning, hf-trainer, ..."
    )
    parser.add_argument(
        "--service",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"a service spec {service_help} (repeatable): telemetry, async_eval:thread, "
        "async_eval:process, mixed_precision:bf16, ...",
    )
    parser.add_argument(
        "--output", default="reports", help="folder of the report (default: reports)"
    )
    parser.add_argument(
        "--trials", type=int, default=3, help="trials, each in a fresh process (default 3)"
    )
    parser.add_argument("--epochs", type=int, default=None, help="epochs (default: the workload's)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of data, model and order (default 0)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (and OMP/MKL) per process"
    )
    parser.add_argument(
        "--scale",
        default="auto",
        help="tiny, small, full or auto (default auto: full on a CUDA GPU, small on CPU, "
        "about a minute a command on a laptop CPU; --scale full for the long form)",
    )
    parser.add_argument(
        "--data", default=None, metavar="DIR", help="read the real dataset files from DIR"
    )
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    parser.add_argument(
        "--warmup-steps", type=int, default=5, help="steps left out of the step time (default 5)"
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks per trial (pytorch-ddp only)")
    parser.add_argument(
        "--in-process", action="store_true", help="run the trials in this process (debugging)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sakura-bench",
        description="Benchmark training loops: a framework's vanilla loop against the same "
        "loop through sakura with chosen services.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a workload and write a RunReport JSON")
    run.add_argument("--runner", required=True, help="baseline (vanilla loop) or sakura")
    _add_trial_options(run, "for --runner sakura")
    run.add_argument(
        "--variant",
        default=None,
        metavar="NAME",
        help="a variant of the workload's model (sakura-bench list), e.g. smollm2-qlora's "
        "peft-bnb: stock PEFT over a bitsandbytes NF4 base",
    )
    pair = sub.add_parser(
        "pair",
        help="the baseline and sakura runs with their trials interleaved, then compared",
        description="Run --runner baseline and --runner sakura (with the --service specs) "
        "alternately, trial by trial (A B, B A, ...), so that a shared machine's drift lands "
        "on both sides alike; write both reports and print their comparison.",
    )
    _add_trial_options(pair, "of the sakura side")
    pair.add_argument(
        "--baseline-variant",
        default=None,
        metavar="NAME",
        help="the baseline side builds this variant of the workload's model (e.g. "
        "peft-bnb: stock PEFT + bitsandbytes as the rival of the sakura side)",
    )
    pair.add_argument(
        "--variant",
        default=None,
        metavar="NAME",
        help="the sakura side builds this variant of the workload's model",
    )
    for sub_parser in (run, pair):
        sub_parser.add_argument(
            "--quiet", action="store_true", help="no progress or summary; print the report path"
        )

    compare = sub.add_parser("compare", help="compare two reports (B against A)")
    compare.add_argument("a", metavar="A.json")
    compare.add_argument("b", metavar="B.json")
    compare.add_argument("--json", action="store_true", help="machine-readable output")

    export = sub.add_parser("export", help="Markdown, PNG charts and an HTML page from reports")
    export.add_argument("reports", nargs="+", metavar="REPORT.json")
    export.add_argument(
        "--output", default=None, help="folder (default: the first report's folder)"
    )

    lister = sub.add_parser(
        "list", help="workloads, frameworks and services, and who provides each"
    )
    lister.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 120  # files and pipes: wide enough for the tables
    return Console(stderr=stderr, highlight=False, emoji=False, width=width)


# --- run ----------------------------------------------------------------------------------


def _trial_config(
    args: argparse.Namespace, runner: str, services: list[str], variant: str | None
) -> Any:
    from sakura_bench.trial import TrialConfig

    return TrialConfig(
        workload=args.workload,
        runner=runner,
        framework=args.framework,
        services=services,
        epochs=args.epochs,
        seed=args.seed,
        scale=args.scale,
        data_dir=args.data,
        threads=args.threads,
        device=args.device,
        warmup_steps=args.warmup_steps,
        variant=variant,
    )


def _validated(
    args: argparse.Namespace, runner: str, services: list[str], variant: str | None = None
) -> Any:
    from sakura_bench.runner import RunOptions, validate

    options = RunOptions(
        config=_trial_config(args, runner, services, variant),
        output=Path(args.output),
        trials=args.trials,
        nproc=args.nproc,
        in_process=args.in_process,
    )
    return validate(options)


def _label(run: Any) -> str:
    c = run.options.config
    runner = c.runner + (f"[{c.variant}]" if c.variant else "")
    return " · ".join([c.workload, runner, c.framework, *c.services])


@contextlib.contextmanager
def _trial_progress(
    title: str, total_epochs: int
) -> Iterator[tuple[Callable[[str], None], Callable[[dict[str, Any]], None], Callable[..., None]]]:
    """A rich progress bar over epochs (on stderr; off when it is not a terminal) and the
    three callbacks of the runner: a trial starts, a trial reports progress, a trial ends."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    err = _console(stderr=True)
    err.print(title)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("epochs"),
        TimeElapsedColumn(),
        console=err,
        disable=not err.is_terminal,
    ) as progress:
        task = progress.add_task("starting", total=total_epochs)
        finished_epochs = [0]

        def on_start(description: str) -> None:
            progress.update(task, description=escape(description))

        def on_progress(info: dict[str, Any]) -> None:
            if info.get("event") == "epoch":
                progress.advance(task)

        def on_end(what: str, result: dict[str, Any], epochs: int) -> None:
            finished_epochs[0] += epochs
            progress.update(task, completed=finished_epochs[0])
            step = result.get("step_time_s") or {}
            metrics = ", ".join(
                f"{k} {v:.4g}" for k, v in (result.get("final_metrics") or {}).items()
            )
            progress.console.print(
                f"  {escape(what)}: wall {result['wall_s']:.3f} s, step "
                f"{step.get('median', float('nan')) * 1000:.2f} ms, {metrics or 'no metrics'}"
                f" (process {result['process_s']:.1f} s)"
            )
            for error in result.get("errors", []):
                progress.console.print(f"  [yellow]warning:[/] {escape(error)}")

        yield on_start, on_progress, on_end


def _cmd_run(args: argparse.Namespace) -> int:
    from sakura_bench.runner import execute

    run = _validated(args, args.runner, list(args.service), args.variant)
    if args.quiet:
        path, _ = execute(run)
        print(path)
        return 0
    trials = run.options.trials
    title = (
        f"[bold]sakura-bench run[/] {escape(_label(run))}: {trials} trial(s) × "
        f"{run.epochs} epoch(s)"
    )
    with _trial_progress(title, trials * run.epochs) as (start, advance, end):
        path, report = execute(
            run,
            on_trial_start=lambda i: start(f"trial {i + 1}/{trials}"),
            on_progress=advance,
            on_trial_end=lambda i, r: end(f"trial {i + 1}/{trials}", r, run.epochs),
        )
    _print_run_summary(report, path)
    return 0


# --- pair ---------------------------------------------------------------------------------


def _cmd_pair(args: argparse.Namespace) -> int:
    from sakura_bench.runner import execute_interleaved

    runs = [
        _validated(args, "baseline", [], args.baseline_variant),
        _validated(args, "sakura", list(args.service), args.variant),
    ]
    if args.quiet:
        for path, _ in execute_interleaved(runs):
            print(path)
        return 0
    trials, epochs = runs[0].options.trials, runs[0].epochs
    sides = ("A", "B")
    title = (
        f"[bold]sakura-bench pair[/] A: {escape(_label(runs[0]))}, B: {escape(_label(runs[1]))}"
        f": {trials} trial(s) each, interleaved (A B, B A, ...), × {epochs} epoch(s)"
    )
    with _trial_progress(title, 2 * trials * epochs) as (start, advance, end):
        written = execute_interleaved(
            runs,
            on_trial_start=lambda k, i: start(f"{sides[k]} trial {i + 1}/{trials}"),
            on_progress=advance,
            on_trial_end=lambda k, i, r: end(f"{sides[k]} trial {i + 1}/{trials}", r, epochs),
        )
    for side, (path, _) in zip(sides, written, strict=True):
        _console().print(f"{side}: {escape(str(path))}")
    _print_comparison(str(written[0][0]), str(written[1][0]), as_json=False)
    return 0


def _print_run_summary(report: dict[str, Any], path: Path) -> None:
    from rich.table import Table

    from sakura_bench.export import _fmt, _stat

    s = report["summary"]
    table = Table(
        title=f"{report['workload']['name']} · {report['runner']}"
        + (f"[{report['workload']['variant']}]" if report["workload"].get("variant") else "")
        + f" · {report['framework']}"
    )
    table.add_column("quantity")
    table.add_column("median (min–max) over trials")
    table.add_row("wall time (s)", _stat(s.get("wall_s")))
    table.add_row("step time (ms)", _stat(s.get("step_time_s"), 1000.0))
    table.add_row("samples/s", _stat(s.get("samples_per_s")))
    if s.get("tokens_per_s"):
        table.add_row("tokens/s", _stat(s.get("tokens_per_s")))
    table.add_row("train per epoch (s)", _stat(s.get("train_epoch_s")))
    table.add_row("eval per epoch, training thread (s)", _stat(s.get("eval_epoch_s")))
    for key, value in (s.get("final_metrics") or {}).items():
        table.add_row(key, _fmt(value, 5))
    table.add_row("peak RSS (MiB)", _fmt(s.get("peak_rss_mib"), 5))
    if s.get("peak_rss_children_mib"):
        table.add_row("peak RSS, child processes (MiB)", _fmt(s.get("peak_rss_children_mib"), 5))
    console = _console()
    console.print(table)
    if not s.get("metrics_agree", True):
        console.print("[yellow]warning:[/] the trials' final metrics differ")
    console.print(f"report: {escape(str(path))}")


# --- compare ------------------------------------------------------------------------------


def _cmd_compare(args: argparse.Namespace) -> int:
    _print_comparison(args.a, args.b, as_json=args.json)
    return 0


def _print_comparison(a: str, b: str, *, as_json: bool) -> None:
    from rich.table import Table

    from sakura_bench.compare import compare_reports
    from sakura_bench.export import _fmt, _stat
    from sakura_bench.report import load_report

    result = compare_reports(load_report(a), load_report(b))
    if as_json:
        print(json.dumps(result, indent=2))
        return
    console = _console()
    table = Table(title="B against A: median (min–max) over trials")
    table.add_column("")
    table.add_column(f"A: {escape(result['a']['label'])}")
    table.add_column(f"B: {escape(result['b']['label'])}")
    table.add_column("B/A")
    for row in result["rows"]:
        scale = 1000.0 if row["key"] == "step_time_s" else 1.0
        unit = "ms" if row["key"] == "step_time_s" else row["unit"]
        title = row["title"] + (f" ({unit})" if unit else "")
        ratio = f"{row['b_over_a']:.3f}" if row["b_over_a"] else "–"
        if isinstance(row["a"], dict) or isinstance(row["b"], dict):
            table.add_row(title, _stat(row["a"], scale), _stat(row["b"], scale), ratio)
        else:
            table.add_row(title, _fmt(row["a"], 5), _fmt(row["b"], 5), ratio)
    for m in result["metrics"]:
        table.add_row(escape(m["metric"]), _fmt(m["a"], 5), _fmt(m["b"], 5), "")
    console.print(table)
    low, high = result["speedup_range"]
    console.print(
        f"speed-up of B over A (wall time): [bold]{result['speedup']:.2f}×[/] "
        f"(range {low:.2f}–{high:.2f} over {result['trials'][0]} and {result['trials'][1]} trials): "
        f"{result['verdict']}"
    )
    if result["ideal_overlap_speedup"]:
        console.print(
            f"ideal bound when evaluation fully overlaps training: "
            f"{result['ideal_overlap_speedup']:.2f}× ((train + eval) / max(train, eval) of A)"
        )
    if result["metrics_agree"] is False:
        console.print("[yellow]note:[/] the final metrics differ between A and B")
    for line in result["notes"] + result["advice"]:
        console.print(f"[yellow]note:[/] {escape(line)}")
    for side in ("a", "b"):
        for error in result["errors"][side]:
            console.print(f"[yellow]{side.upper()} reported:[/] {escape(error)}")


# --- export ---------------------------------------------------------------------------------


def _cmd_export(args: argparse.Namespace) -> int:
    from sakura_bench.export import export_reports

    output = args.output or str(Path(args.reports[0]).parent)
    written = export_reports(args.reports, output)
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


# --- list -----------------------------------------------------------------------------------


def listing() -> dict[str, Any]:
    """Workloads, frameworks, services and dispatchers, with their providers."""
    from sakura.plugins import get_plugin_manager
    from sakura_bench.registry import get_registry

    registry = get_registry()
    frameworks = []
    loaded: dict[str, Any] = {}
    for name in registry.names("framework"):
        entry = registry.get("framework", name)
        item: dict[str, Any] = {
            "name": name,
            "provided_by": entry.provider,
            "description": entry.description,
        }
        try:
            loaded[name] = entry.load()()
            item["description"] = item["description"] or loaded[name].description
        except Exception as exc:
            item["error"] = str(exc)
        frameworks.append(item)
    workloads = []
    for name in registry.names("workload"):
        entry = registry.get("workload", name)
        item = {"name": name, "provided_by": entry.provider, "description": entry.description}
        try:
            cls = entry.load()
        except Exception as exc:
            item["error"] = str(exc)
            workloads.append(item)
            continue
        item["description"] = item["description"] or cls.description
        item["frameworks"] = [
            f
            for f, fw in loaded.items()
            if (cls.frameworks is None or f in cls.frameworks) and fw.incompatibility(cls) is None
        ]
        item["hf_shaped"] = bool(cls.hf_shaped)
        item["scales"] = list(cls.configs)
        item["gpu_scales"] = list(cls.gpu_scales)
        item["default_epochs"] = cls.default_epochs
        item["variants"] = dict(cls.variants)
        workloads.append(item)
    manager = get_plugin_manager()
    services = [
        {"name": p.name, "provided_by": p.distribution or p.plugin, "description": p.description}
        for p in sorted(manager.registry("service").values(), key=lambda p: p.name)
    ]
    dispatchers = [
        {"name": p.name, "provided_by": p.distribution or p.plugin, "description": p.description}
        for p in sorted(manager.registry("dispatcher").values(), key=lambda p: p.name)
    ]
    failures = [str(f) for f in manager.failures]
    return {
        "workloads": workloads,
        "frameworks": frameworks,
        "services": services,
        "dispatchers": dispatchers,
        "failures": failures,
    }


def _cmd_list(args: argparse.Namespace) -> int:
    data = listing()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.table import Table

    console = _console()
    table = Table(title="workloads")
    for column in ("name", "frameworks", "scales (GPU)", "provided by", "description"):
        table.add_column(column, no_wrap=column in ("name", "provided by"))
    for w in data["workloads"]:
        if "error" in w:
            table.add_row(
                escape(w["name"]),
                "–",
                "–",
                escape(w["provided_by"]),
                f"[red]unavailable:[/] {escape(w['error'])}",
            )
            continue
        scales = ", ".join(s + ("*" if s in w["gpu_scales"] else "") for s in w["scales"])
        description = w["description"] + "".join(
            f"; --variant {name}: {text}" for name, text in w["variants"].items()
        )
        table.add_row(
            *map(escape, (w["name"], ", ".join(w["frameworks"]), scales)),
            escape(w["provided_by"]),
            escape(description),
        )
    console.print(table)
    console.print("* needs a CUDA GPU")
    for kind in ("frameworks", "services", "dispatchers"):
        table = Table(title=kind)
        for column in ("name", "provided by", "description"):
            table.add_column(column, no_wrap=column != "description")
        for item in data[kind]:
            # Names and descriptions are plugins' text: printed as is, never as markup.
            description = escape(item["description"])
            if "error" in item:
                description = f"[red]unavailable:[/] {escape(item['error'])}"
            table.add_row(escape(item["name"]), escape(item["provided_by"]), description)
        console.print(table)
    for failure in data["failures"]:
        console.print(f"[yellow]plugin failure:[/] {escape(failure)}")
    return 0


COMMANDS = {
    "run": _cmd_run,
    "pair": _cmd_pair,
    "compare": _cmd_compare,
    "export": _cmd_export,
    "list": _cmd_list,
}


def main(argv: Sequence[str] | None = None) -> int:
    from sakura.errors import SakuraError
    from sakura_bench.errors import TrialFailed

    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except TrialFailed as exc:
        print(f"sakura-bench: {exc}", file=sys.stderr)
        return 1
    except (SakuraError, ImportError) as exc:
        print(f"sakura-bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sakura-bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
