"""FSDP2 QLoRA on 2 gloo ranks: memory per rank and step time, sharded against unsharded.

A Llama-shaped model built from a ``LlamaConfig`` (random weights), quantized NF4 with
double quant by ``sakura_quant.quantize_model``, LoRA r=16 on every projection (peft),
AdamW on the adapters.  Variants, same model and the same global batch:

* ``unsharded``        one process, the whole global batch (the reference)
* ``fsdp2-shardable``  ``sakura_quant.fsdp.shardable`` then ``fully_shard`` on 2 ranks,
                       each rank half the batch: the quantized base is sharded
* ``fsdp2-naive``      ``fully_shard`` on 2 ranks without ``shardable``: the quantized
                       tensors are buffers, so every rank holds the whole quantized base
* ``bnb-fsdp2``        the accelerate + bitsandbytes FSDP-QLoRA recipe (``from_pretrained``
                       with 4-bit NF4 + double quant stored as bf16 via
                       ``bnb_4bit_quant_storage``, LoRA, FSDP2).  accelerate is asked first
                       (``Accelerator(cpu=True, fsdp_plugin=...)``) and its verdict printed:
                       it enables FSDP only for accelerator devices (``DistributedType.FSDP``
                       is never set for ``MULTI_CPU``), so the variant calls ``fully_shard``
                       itself.  When it cannot run, the table prints why.

``fsdp2-naive`` switches off sakura's one-shot check that refuses exactly this setup (a
quantized base of buffers under ``fully_shard``) so that its cost can be measured.

Memory: each variant once in fresh processes (so peak RSS is its own): the peak RSS of
each rank (``ru_maxrss``) and the bytes each rank holds, read from its local shards
(quantized base, other parameters, optimizer state).  Time: all variants in one pair of
processes, trials interleaved (``sakura_bench.measure.interleaved``); a trial's time is the
mean of ``--steps`` steps (forward, backward, FSDP all-gathers / reduce-scatters, AdamW),
the slower rank's; medians, min-max spreads and paired per-trial ratios.

Run: ``python benchmarks/scale_out.py`` (spawns the ranks itself; ``--quick`` for a
seconds-long smoke run; ``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from sakura.testing import launch_ranks
from sakura_bench.measure import load_average, machine_note, ratio_summary, summary

WORKER = Path(__file__).with_name("_scale_out_worker.py")
VARIANTS = ("unsharded", "fsdp2-shardable", "fsdp2-naive", "bnb-fsdp2")
WORLD = 2

FULL = dict(hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=4, vocab=8192, seq=64)
QUICK = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=1024, seq=32)


def _launch(mode: str, world: int, cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        launch_ranks(WORKER, world, tmp, mode, json.dumps(cfg), timeout=timeout)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def measure_memory(cfg: dict[str, Any], variants: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each variant in fresh processes: ``unsharded`` on 1 rank, the others on ``WORLD``."""
    return {
        name: _launch(
            "memory", 1 if name == "unsharded" else WORLD, {**cfg, "variant": name}, 600.0
        )
        for name in variants
    }


def measure_time(cfg: dict[str, Any], variants: list[str]) -> list[dict[str, Any]]:
    return _launch("timing", WORLD, {**cfg, "variants": variants}, 1800.0)


def _ms(values: list[float]) -> str:
    return summary(values).format(1, " ms", scale=1e3)


def _mb(ranks: list[dict[str, Any]], key: str) -> str:
    return " / ".join(f"{r[key] / 2**20:.2f}" for r in ranks)


def per_trial_times(timing: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per trial, the slower active rank (``unsharded`` runs on rank 0 only)."""
    names = list(timing[0]["step_s"])
    out: dict[str, list[float]] = {}
    for name in names:
        columns = [r["step_s"][name] for r in timing]
        out[name] = [max(v for v in trial if v is not None) for trial in zip(*columns, strict=True)]
    return out


def report(
    cfg: dict[str, Any],
    memory: dict[str, list[dict[str, Any]]],
    times: dict[str, list[float]],
) -> tuple[str, dict[str, Any]]:
    lines = [
        f"FSDP2 QLoRA scale-out: Llama hidden={cfg['hidden']} intermediate="
        f"{cfg['intermediate']} layers={cfg['layers']} vocab={cfg['vocab']}, NF4 + double "
        f"quant, LoRA r=16 on every projection, AdamW; global batch {cfg['batch']} x "
        f"{cfg['seq']} tokens ({WORLD} gloo ranks on loopback get {cfg['batch'] // WORLD} "
        f"each), 1 thread per rank, {cfg['trials']} interleaved trials x {cfg['steps']} steps "
        f"(median of per-trial means, min-max across trials; the slower rank's)",
        "",
        "| variant | ranks | step time | peak RSS / rank (MB) | quantized base / rank (MB) "
        "| other params / rank (MB) | optimizer state / rank (MB) | first-step loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    figures: dict[str, Any] = {"config": cfg, "variants": {}}
    for name, ranks in memory.items():
        errors = {f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if "error" in r}
        failed = "; ".join(sorted(errors)) if errors else None
        if failed is not None:
            lines.append(f"| {name} | {len(ranks)} | cannot run: {failed} | | | | | |")
            figures["variants"][name] = {"error": failed}
            continue
        live = [r for r in ranks if not r.get("idle")]
        step = _ms(times[name]) if name in times else "not timed"
        lines.append(
            f"| {name} | {len(live)} | {step} | "
            + " / ".join(f"{r['peak_rss_mb']:.0f}" for r in live)
            + f" | {_mb(live, 'quantized_bytes')} | {_mb(live, 'param_bytes')} "
            f"| {_mb(live, 'optimizer_bytes')} "
            f"| {sum(r['first_loss'] for r in live) / len(live):.4f} |"
        )
        figures["variants"][name] = {"ranks": live, "step_s": times.get(name)}
    lines.append(
        "first-step loss: the mean over ranks (each rank a slice of the same global batch), "
        "so the sakura variants must agree with unsharded; bnb-fsdp2 quantizes with "
        "bitsandbytes and computes in bf16 (its unquantized weights are bf16 too)"
    )
    notes = {
        k: v for ranks in memory.values() for r in ranks for k, v in r.get("notes", {}).items()
    }
    for key, note in notes.items():
        lines.append(f"{key}: {note}")
    lines.append("")
    lines.append(
        "ratios (memory: the per-rank mean against the other's; time: median of paired "
        "per-trial ratios, min-max across trials; < 1 means fsdp2-shardable is smaller / faster):"
    )
    figures["ratios"] = {}
    ok = figures["variants"]
    for other in ("unsharded", "fsdp2-naive"):
        if "error" in ok.get("fsdp2-shardable", {"error": 1}) or "error" in ok.get(
            other, {"error": 1}
        ):
            lines.append(f"  fsdp2-shardable / {other}: not measured (a variant did not run)")
            continue
        mine, theirs = ok["fsdp2-shardable"]["ranks"], ok[other]["ranks"]
        parts, entry = [], {}
        for key, label in (
            ("quantized_bytes", "quantized base"),
            ("peak_rss_mb", "peak RSS"),
            ("param_bytes", "other params"),
            ("optimizer_bytes", "optimizer state"),
        ):
            a = sum(r[key] for r in mine) / len(mine)
            b = sum(r[key] for r in theirs) / len(theirs)
            entry[key] = a / b
            parts.append(f"{label} {a / b:.3f}")
        if "fsdp2-shardable" in times and other in times:
            r = ratio_summary(times["fsdp2-shardable"], times[other])
            entry["step_time"] = r.as_dict()
            parts.append(f"step time {r.format(2, 'x')}")
        lines.append(f"  fsdp2-shardable / {other}: " + ", ".join(parts))
        figures["ratios"][other] = entry
    return "\n".join(lines), figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 5 trials (seconds)")
    parser.add_argument("--trials", type=int, default=None, help="timed trials (default 15)")
    parser.add_argument("--steps", type=int, default=2, help="steps per trial")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--hidden", type=int, help="override the model's hidden size")
    parser.add_argument("--layers", type=int, help="override the number of layers")
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="what to run"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    trials = args.trials if args.trials is not None else (5 if args.quick else 15)
    if trials < 5:
        parser.error(f"--trials must be >= 5 for an honest median, got {trials}")
    for option in ("steps", "batch"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be >= 1, got {getattr(args, option)}")
    if args.batch % WORLD:
        parser.error(f"--batch must be a multiple of {WORLD} (the ranks), got {args.batch}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    cfg: dict[str, Any] = dict(QUICK if args.quick else FULL)
    if args.hidden is not None:
        cfg["hidden"] = args.hidden
    if args.layers is not None:
        cfg["layers"] = args.layers
    cfg.update(
        batch=args.batch, trials=trials, steps=args.steps, warmup=args.warmup, memory_steps=2
    )

    load_before = load_average()
    memory = measure_memory(cfg, args.variants)
    runnable = [n for n in args.variants if not any("error" in r for r in memory[n])]
    times = per_trial_times(measure_time(cfg, runnable)) if runnable else {}
    text, figures = report(cfg, memory, times)
    print(text)
    note = machine_note(load_before)
    print(
        f"machine: {note} (other processes share the machine; the paired ratios compare "
        "variants under the same load)"
    )
    figures["machine"] = note
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
