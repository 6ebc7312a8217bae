"""``fit`` against every feasible hand-made plan, and against plain training when the model
fits anyway (issue 21's proof), in one run.

A config-built ``LlamaForCausalLM`` (random fp32 weights, nothing downloaded) with PEFT
LoRA adapters on a frozen base.  Its fp32 frozen weights are at least 3x the device budget
and 1.5x the host-RAM budget (checked; on a CPU the device budget is simulated through
``fit``'s ``device_budget=``, host RAM through ``host_budget=``, the disk tier is a temporary
folder).  Contenders, each on the same batches and the same number of steps:

* ``fit``: ``sakura_offload.wrap(model, optimizer, device_budget=..., host_budget=...,
  disk_offload=...)``, every choice left to it; and ``fit (quantize=nf4)``: the same with
  the base forced to NF4;
* every hand-made combination of the parts, applied by hand in ``fit``'s order: the frozen
  base as fp32 or quantized by sakura-quant's ``quantize_model`` (int8, nf4); its blocks
  resident, streamed from host RAM or from disk (``WeightPaging``); the optimizer AdamW on
  the device or ``OffloadAdamW`` with float32 / bfloat16 / int8 moments; the activations
  planned for what the device budget leaves (``MemoryPlanner``) or all recomputed.  Those
  whose accounted bytes exceed a budget are listed as infeasible with the reason and not
  run; a disk plan whose blocks all fit host RAM is the host plan and not run twice;
* then, on a model that fits, ``fit`` with generous budgets against plain training.

Each measurement runs in a fresh process (a forkserver with torch and the packages
imported once), so that its peak anonymous RSS is its own (``benchmarks/_fit_worker.py``:
how the host and device peaks are taken, ``sakura_offload.fit.verify``'s definitions);
trials are interleaved (``sakura_bench.measure.interleaved``).  Reported per contender: step
time (median over trials of the per-trial mean, min-max spread), peak anonymous RSS and the
tracked device peak against the budgets (PASS/FAIL each), and the per-trial ratio of each
contender to the fastest hand-made plan of its precision class (the base's format: fp32,
int8, nf4) that passed both budgets.  ``fit`` keeps an fp32 base when one fits, so it is
held against the fastest fp32 plan; ``fit`` with ``quantize="nf4"`` (the user's choice)
against the fastest nf4 plan (target <= 1.10 each); ``fit`` against the fastest plan of
any class is printed too.  Then ``fit`` / plain (target <= 1.02); the CPU and the load
(``uptime``) before and after.
Run: ``python benchmarks/fit.py`` (``--quick``: a tiny model in seconds; ``--help``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import write_json

from sakura_bench.measure import (
    interleaved,
    load_average,
    machine_note,
    ratio_summary,
    summary,
)

FORMATS = ("fp32", "int8", "nf4")
WEIGHTS = ("resident", "host", "disk")
OPTIMIZERS = ("adamw", "float32", "bfloat16", "int8")
ACTIVATIONS = ("planner", "recompute")
SMALL_GRID_OPTIMIZERS = ("adamw", "float32")
"""--quick runs these optimizers with the planned activations only (the rest listed)."""
TARGET_VS_HAND = 1.10
TARGET_VS_PLAIN = 1.02

QUICK = {
    "hidden": 256, "intermediate": 512, "layers": 8, "heads": 4, "kv_heads": 4, "vocab": 512,
    "batch": 1, "seq": 16, "device_budget": 7 * 2**20, "host_budget": 14 * 2**20,
    "trials": 1, "steps": 2, "warmup": 1,
}  # fmt: skip
NORMAL = {
    "hidden": 384, "intermediate": 1024, "layers": 10, "heads": 6, "kv_heads": 6,
    "vocab": 2048, "batch": 1, "seq": 64, "device_budget": 24 * 2**20,
    "host_budget": 48 * 2**20, "trials": 3, "steps": 3, "warmup": 2,
}  # fmt: skip


def llama_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(64, args.seq),
        "use_cache": False,
    }


def write_checkpoint(config: dict[str, Any], path: Path) -> None:
    """The model's random fp32 weights (seed 0), written once; every process mmaps them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    torch.save(model.state_dict(), path)


@dataclasses.dataclass
class Candidate:
    """A hand-made combination and its accounted bytes (``fit``'s accounting)."""

    name: str
    hand: dict[str, Any]
    device_bytes: int
    host_bytes: int
    why_not: str | None = None


def hand_candidates(
    spec: dict[str, Any], device_budget: int, host_budget: int, small: bool = False
) -> list[Candidate]:
    """Every combination of FORMATS x WEIGHTS x OPTIMIZERS x ACTIVATIONS, each with the
    bytes ``fit``'s accounting (:func:`sakura_offload.fit.decide.candidates`) gives it and,
    when it cannot hold the budgets, why."""
    import torch
    from _fit_worker import load_model

    from sakura_offload.fit import Budgets, fit_choices, measure
    from sakura_offload.fit.decide import candidates
    from sakura_offload.host_optimizer.placement import moment_bytes

    model = load_model(spec)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    sizes = measure(model, optimizer)
    options = {o.name: o for o in fit_choices(["quantize_base"])["quantize_base"].estimate(model)}
    out: list[Candidate] = []
    for fmt in FORMATS:
        option = options.get(fmt)
        shrunk = sizes if option is None else sizes.shrunk(option)
        for opt in OPTIMIZERS:
            dtype = "float32" if opt == "adamw" else opt
            budgets = Budgets(device=device_budget, host=host_budget, disk=2**50,
                              moment_dtype=dtype)  # fmt: skip
            plans = {
                p.weights: p for p in candidates(shrunk, budgets, option) if p.optimizer == "host"
            }
            for weights in WEIGHTS:
                plan = plans[weights]
                device, host = plan.device_bytes, plan.host_bytes
                if opt == "adamw":  # the optimizer's state on the device, none on the host
                    device += shrunk.optimizer_bytes
                    host -= moment_bytes(dtype, shrunk.trainable_numel) + shrunk.master_bytes
                for act in ACTIVATIONS:
                    name = f"{fmt}/{weights}/{'adamw-device' if opt == 'adamw' else 'host-' + opt}/{act}"
                    hand = {
                        "format": fmt, "weights": weights, "optimizer": opt, "activations": act,
                        "host_weight_bytes": plan.host_weight_bytes,
                        "activation_budget": device_budget - device,
                        "activation_host_budget": max(0, host_budget - host),
                    }  # fmt: skip
                    why = None
                    if device > device_budget:
                        why = f"needs {device / 2**20:.1f} MiB on the device before activations"
                    elif host > host_budget:
                        why = f"needs {host / 2**20:.1f} MiB of host RAM"
                    elif weights == "disk" and "disk" not in plan.block_tiers:
                        why = f"same as {fmt}/host: every block fits host RAM"
                    elif small and (opt not in SMALL_GRID_OPTIMIZERS or act != "planner"):
                        why = "feasible; not in --quick's grid"
                    out.append(Candidate(name, hand, device, host, why))
    return out


def _context() -> Any:
    context = multiprocessing.get_context("forkserver")
    from _fit_worker import PRELOAD

    context.set_forkserver_preload(PRELOAD)
    return context


def _in_fresh_process(context: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """``_fit_worker.measure(spec)`` in a process of its own (it ends with the call)."""
    from _fit_worker import measure

    with concurrent.futures.ProcessPoolExecutor(
        1, mp_context=context, max_tasks_per_child=1
    ) as pool:
        result: dict[str, Any] = pool.submit(measure, spec).result()
    return result


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as error:
        return f"uptime unavailable ({error})"


def run_contenders(
    context: Any,
    base: dict[str, Any],
    variants: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """Interleaved trials of ``variants`` (each call: one fresh process); a variant that
    errors in its first trial is not run again."""
    failed: dict[str, dict[str, Any]] = {}
    workdir = Path(base["directory"])

    def contender(name: str) -> Any:
        def call(trial: int) -> dict[str, Any]:
            if name in failed:
                return failed[name]
            directory = workdir / f"{name.replace('/', '_')}-{trial}"
            spec = {**base, **variants[name], "directory": str(directory)}
            try:
                result = _in_fresh_process(context, spec)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            if result["error"] is not None:
                failed[name] = result
            if args.verbose:
                shown = result["error"] or f"{statistics.fmean(result['step_s']) * 1e3:.0f} ms"
                print(f"  trial {trial} {name}: {shown}", file=sys.stderr, flush=True)
            return result

        return call

    return interleaved({name: contender(name) for name in variants}, args.trials)


FORCED = "fit (quantize=nf4)"
"""fit with the user forcing an NF4 base (``wrap(..., quantize="nf4")``)."""


def precision_class(name: str, row: dict[str, Any]) -> str:
    """The frozen base's format of a contender: the first part of a hand-made plan's name;
    for ``fit``, that of the hand-made twin of its plan."""
    twin = row.get("same_by_hand") if name.startswith("fit") else name
    return str(twin or "fp32").split("/")[0]


def fastest_hand_made(rows: dict[str, Any]) -> dict[str, str]:
    """Per base format, the fastest hand-made plan (median step) that passed both budgets."""
    best: dict[str, str] = {}
    for name, row in rows.items():
        if name.startswith("fit") or row["error"] is not None:
            continue
        if not (row["device_ok"] and row["host_ok"]):
            continue
        klass = precision_class(name, row)
        if klass not in best or row["step_s"].median < rows[best[klass]]["step_s"].median:
            best[klass] = name
    return best


def _verdict(value: int, cap: int) -> str:
    return "PASS" if value <= cap else "FAIL"


def summarise(
    runs: dict[str, list[dict[str, Any]]], device_budget: int, host_budget: int
) -> dict[str, Any]:
    """Per variant: the step time over trials, the peaks (the most over trials) and the
    verdicts.  Device: the tracked peak against ``device_budget``.  Host: the host state the
    parts hold against ``host_budget``, and the peak anonymous RSS against ``host_budget +
    device_budget``: on a CPU the simulated device's tensors are anonymous RAM too."""
    out: dict[str, Any] = {}
    for name, results in runs.items():
        if results[0]["error"] is not None:
            out[name] = {"error": results[0]["error"]}
            continue
        device = max(r["device_peak"] for r in results)
        rss = max(r["host_used"] for r in results)
        host_state = max(r["host_state_peak"] for r in results)
        out[name] = {
            "error": None,
            "plan": results[0]["plan"],
            "same_by_hand": results[0].get("same_by_hand"),
            "replans": [r.get("replans", []) for r in results],
            "step_s": summary([statistics.fmean(r["step_s"]) for r in results]),
            "device_peak": device,
            "host_state_peak": host_state,
            "rss_peak": rss,
            "device_ok": device <= device_budget,
            "host_ok": host_state <= host_budget and rss <= host_budget + device_budget,
            "final_loss": results[0]["losses"][-1],
        }
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def table(rows: dict[str, Any], device_budget: int, host_budget: int, reference: str) -> list[str]:
    both = device_budget + host_budget
    lines = [
        f"| variant | step time (median, min-max) | vs {reference} | device peak, tracked "
        f"(budget {_mib(device_budget)}) | host state, tracked (budget {_mib(host_budget)}) | "
        f"peak anonymous RSS (host + device {_mib(both)}) | final loss |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        if r["error"] is not None:
            lines.append(f"| {name} | did not run: {r['error'][:300]} | | | | | |")
            continue
        ratio = r.get("ratio")
        lines.append(
            f"| {name} | {r['step_s'].format(0, ' ms', scale=1e3)} | "
            f"{'-' if ratio is None else ratio.format(2, 'x')} | "
            f"{_mib(r['device_peak'])} {_verdict(r['device_peak'], device_budget)} | "
            f"{_mib(r['host_state_peak'])} {_verdict(r['host_state_peak'], host_budget)} | "
            f"{_mib(r['rss_peak'])} {_verdict(r['rss_peak'], both)} | "
            f"{r['final_loss']:.4f} |"
        )
    return lines


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    import torch

    root = Path(tempfile.mkdtemp(prefix="sakura-fit-bench-"))
    lines: list[str] = []
    try:
        config = llama_config(args)
        checkpoint = root / "weights.pt"
        write_checkpoint(config, checkpoint)
        base = {
            "config": config, "checkpoint": str(checkpoint), "seed": 0, "lora_rank": 8,
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "threads": args.threads, "directory": str(root / "work"),
        }  # fmt: skip
        device_budget, host_budget = args.device_budget, args.host_budget
        from _fit_worker import load_model

        from sakura_offload.fit import measure

        sizes = measure(load_model(base))
        frozen = sizes.frozen_bytes
        lines += [
            f"LlamaForCausalLM {args.layers} layers x hidden {args.hidden} (intermediate "
            f"{args.intermediate}, vocab {args.vocab}), LoRA r=8; fp32 frozen weights "
            f"{_mib(frozen)}, trainable {_mib(sizes.trainable_bytes)}; batch {args.batch} x "
            f"{args.seq} tokens; {args.trials} trials x {args.steps} timed steps after "
            f"{args.warmup} warm-up, each measurement in a fresh process; torch "
            f"{torch.__version__}, {args.threads or torch.get_num_threads()} threads",
            f"budgets: device {_mib(device_budget)} (frozen = {frozen / device_budget:.2f}x), "
            f"host {_mib(host_budget)} (frozen = {frozen / host_budget:.2f}x); disk tier in "
            f"{root}",
        ]
        if frozen < 3 * device_budget or frozen < 1.5 * host_budget:
            raise SystemExit(
                f"the model does not exceed the budgets as it must (frozen {frozen} bytes; "
                f"needs >= 3x device_budget={device_budget} and >= 1.5x "
                f"host_budget={host_budget}): larger model or smaller budgets"
            )
        uptime_before = _uptime()
        load_before = load_average()
        context = _context()

        # Part 1: fit against every feasible hand-made plan.
        found = hand_candidates(base, device_budget, host_budget, small=args.quick)
        feasible = {c.name: c for c in found if c.why_not is None}
        budgets = {"device_budget": device_budget, "host_budget": host_budget}
        variants: dict[str, dict[str, Any]] = {
            "fit": {"kind": "fit", "fit_disk": True, "fit": budgets},
            FORCED: {"kind": "fit", "fit_disk": True, "fit": {**budgets, "quantize": "nf4"}},
        }  # fmt: skip
        for c in feasible.values():
            variants[c.name] = {"kind": "hand", "hand": c.hand}
        runs = run_contenders(context, base, variants, args)
        rows = summarise(runs, device_budget, host_budget)
        fastest_by_class = fastest_hand_made(rows)
        fastest = min(fastest_by_class.values(), key=lambda n: rows[n]["step_s"].median,
                      default=None)  # fmt: skip
        times = {
            n: [statistics.fmean(r["step_s"]) for r in rs]
            for n, rs in runs.items() if rows[n]["error"] is None
        }  # fmt: skip
        for name, row in rows.items():
            reference = fastest_by_class.get(precision_class(name, row))
            if row["error"] is None and reference is not None:
                row["ratio"] = ratio_summary(times[name], times[reference])
        lines += ["", "## fit against the hand-made plans", ""]
        lines += table(rows, device_budget, host_budget, "the fastest of its class")
        infeasible = [c for c in found if c.why_not is not None]
        warm = [r["runtime_warmup"] for rs in runs.values() for r in rs if r["error"] is None]
        warm = warm or [0]
        lines += [
            "",
            "Host: the state the parts hold (streamed blocks in RAM, OffloadAdamW's moments and "
            "masters) against the host budget; the process's peak anonymous RSS above its level "
            "before loading against host + device budget (on a CPU the simulated device is "
            "anonymous RAM too; the weights are mmapped from the checkpoint, file-backed). "
            "host PASS = both. The baseline is taken after a warm-up step of a tiny model of "
            "its own (the libraries' one-time allocations, "
            f"{_mib(int(statistics.median(warm)))} median per process, are not the model's).",
            "",
            f"Not run ({len(infeasible)} of {len(found)} hand-made combinations):",
        ]
        lines += [f"- {c.name}: {c.why_not}" for c in infeasible]
        verdicts: dict[str, Any] = {}
        fit_row = rows["fit"]
        for name in ("fit", FORCED):
            row = rows[name]
            if row["error"] is not None:
                verdicts[f"{name}_vs_class"] = "FAIL"
                continue
            klass = precision_class(name, row)
            lines += ["", f"{name}'s plan: {row['plan']}"]
            for trial, replans in enumerate(row["replans"]):
                lines += [f"  trial {trial}: {line}" for line in replans]
            twin = rows.get(row["same_by_hand"] or "")
            if twin is not None and twin["error"] is None:
                gap = abs(row["final_loss"] - twin["final_loss"])
                lines.append(
                    f"the same choices by hand: {row['same_by_hand']}; final losses differ "
                    f"by {gap:.2e}"
                )
            reference = fastest_by_class.get(klass)
            if reference is None:
                lines.append(f"no hand-made {klass} plan passed both budgets: no ratio")
                continue
            ratio = row["ratio"]
            verdict = "PASS" if ratio.median <= TARGET_VS_HAND else "FAIL"
            verdicts[f"{name}_vs_class"] = verdict
            lines.append(
                f"{name} / fastest feasible hand-made {klass} plan ({reference}): "
                f"{ratio.format(3, 'x')} (target <= {TARGET_VS_HAND:.2f}): {verdict}"
            )
        if fit_row["error"] is None:
            verdicts["fit_device"] = _verdict(fit_row["device_peak"], device_budget)
            verdicts["fit_host"] = "PASS" if fit_row["host_ok"] else "FAIL"
            if fastest is not None:
                overall = ratio_summary(times["fit"], times[fastest])
                lines.append(
                    f"fit / fastest feasible hand-made plan of any class ({fastest}): "
                    f"{overall.format(3, 'x')} (for information: fit quantizes only when "
                    "nothing fits otherwise, a quantized base trades quality for speed)"
                )
        else:
            verdicts["fit_device"] = verdicts["fit_host"] = "FAIL"
        lines.append(
            f"fit within the device budget: {verdicts['fit_device']}; within the host budget: "
            f"{verdicts['fit_host']}"
        )

        # Part 2: a model that fits anyway: fit must get out of the way.
        generous = {"device_budget": args.generous_device, "host_budget": args.generous_host}
        plain_runs = run_contenders(
            context,
            base,
            {"plain": {"kind": "plain"}, "fit (generous)": {"kind": "fit", "fit": generous}},
            args,
        )
        plain_rows = summarise(plain_runs, args.generous_device, args.generous_host)
        lines += [
            "",
            f"## a model that fits: fit with device {_mib(args.generous_device)}, host "
            f"{_mib(args.generous_host)} against plain training",
            "",
        ]
        if all(r["error"] is None for r in plain_rows.values()):
            plain_times = {
                n: [statistics.fmean(r["step_s"]) for r in rs] for n, rs in plain_runs.items()
            }
            plain_rows["fit (generous)"]["ratio"] = ratio_summary(
                plain_times["fit (generous)"], plain_times["plain"]
            )
        lines += table(plain_rows, args.generous_device, args.generous_host, "plain")
        generous_fit = plain_rows["fit (generous)"]
        if generous_fit["error"] is None:
            ratio = generous_fit["ratio"]
            verdicts["fit_vs_plain"] = "PASS" if ratio.median <= TARGET_VS_PLAIN else "FAIL"
            lines += [
                "",
                f"fit's plan: {generous_fit['plan']}",
                f"fit / plain: {ratio.format(3, 'x')} (target <= {TARGET_VS_PLAIN:.2f}): "
                f"{verdicts['fit_vs_plain']}",
                "(plain has no activation planner, so its device peak counts no activations)",
            ]
        lines += [
            "",
            machine_note(load_before),
            f"uptime before: {uptime_before}",
            f"uptime after:  {_uptime()}",
        ]
        result = {
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "frozen_bytes": frozen,
            "variants": rows,
            "infeasible": {c.name: c.why_not for c in infeasible},
            "fastest_hand_made": fastest,
            "fastest_by_class": fastest_by_class,
            "fits_anyway": plain_rows,
            "verdicts": verdicts,
            "machine": machine_note(load_before),
        }
        return result, lines
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _size(text: str) -> int:
    from sakura_offload.planner.plan import parse_bytes

    value = parse_bytes("size", text, minimum=1, owner=None)
    assert value is not None
    return int(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, one trial (seconds)")
    for key, value in NORMAL.items():
        flag = "--" + key.replace("_", "-")
        kind = _size if key.endswith("budget") else int
        parser.add_argument(
            flag, type=kind, default=None, help=f"default {value} ({QUICK[key]} with --quick)"
        )
    parser.add_argument("--generous-device", type=_size, default=_size("8GiB"))
    parser.add_argument("--generous-host", type=_size, default=_size("8GiB"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--verbose", action="store_true", help="a line per measurement")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else NORMAL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    result, lines = run(args)
    print("\n".join(lines))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
