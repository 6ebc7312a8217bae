"""Activation memory against step time: keep / page (host) / page (disk) / recompute / the
memory planner, beside transformers' own gradient checkpointing, in one run.

A config-built ``LlamaForCausalLM`` (random weights, nothing downloaded) trains on one
fixed batch; a step is forward + backward (no optimizer).  A budget of saved-activation
bytes is set below what keeping everything needs (``--budget-fraction`` of it), so the
model "does not fit".  Variants, each on its own copy of the model, interleaved trial by
trial (``sakura_bench.measure.interleaved``):

* ``keep``            the unplanned model: every saved activation stays — the reference
* ``page-host``       every block's saved tensors paged to host RAM (``ActivationPaging``
                      on a GPU; on a CPU a copy to a separate buffer and back, the copy a
                      GPU would make, which frees no RAM: the budget is a simulated device)
* ``page-disk``       every block's saved tensors in memory-mapped files (``--directory``)
* ``recompute``       every block recomputed in backward (non-reentrant checkpoint)
* ``planner``         ``MemoryPlanner`` with the budget: its own mix
* ``hf-checkpointing`` transformers' own non-reentrant checkpointing
                      (``activation_checkpointing_enable()``; the rival of ``recompute``)

Reported per variant: the peak of saved-activation bytes (counted by the planner's
tracking hooks on one extra step, beside the planner's estimate; not counted for
``hf-checkpointing``, whose checkpoints hide what they hold from saved-tensor hooks),
whether it meets the budget, the process's peak RSS above its level before the step
(freed heap returned with ``malloc_trim`` first, then ``VmHWM`` reset through
``/proc/self/clear_refs``; Linux), the step time (median over trials of the per-trial
mean, min-max spread) and its ratio to ``keep`` (median and spread of the per-trial
ratios), with the CPU (model, flags) and the load average before and after.  Run: ``python benchmarks/paging.py``
(``--help``).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _common import status_kib, write_json

from sakura_bench.measure import (
    interleaved,
    load_average,
    load_note,
    machine_note,
    ratio_summary,
    summary,
)

VARIANTS = ("keep", "page-host", "page-disk", "recompute", "planner", "hf-checkpointing")
CHOICE = {
    "keep": "keep",
    "page-host": "page_host",
    "page-disk": "page_disk",
    "recompute": "recompute",
}


def _status(field: str) -> int | None:
    kib = status_kib(field)
    return None if kib is None else kib * 1024


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc's ``malloc_trim``), so that RSS measures
    what a step allocates rather than what earlier steps freed but the allocator kept."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def make_model(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(args.device)
    model.train()
    return model


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from sakura_offload.planner import MemoryPlanner

    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)

    def step(model: Any) -> None:
        for p in model.parameters():
            p.grad = None
        model(input_ids=ids, labels=ids).loss.backward()

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    directory = args.directory or tempfile.gettempdir()
    options = {"min_bytes": args.min_bytes, "directory": directory}
    # Measure once, on a model of its own, for the budget.
    probe = make_model(args)
    probe_planner = MemoryPlanner(10**15, **options, cost_trials=0)
    probe_plan = probe_planner.plan(probe, lambda m=probe: m(input_ids=ids, labels=ids).loss)
    keep_peak = probe_plan.keep_peak
    budget = int(keep_peak * args.budget_fraction)
    del probe, probe_planner, probe_plan

    models: dict[str, Any] = {}
    planners: dict[str, MemoryPlanner] = {}
    plans: dict[str, Any] = {}
    for name in args.variants:
        model = make_model(args)
        if name == "hf-checkpointing":
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is None:  # transformers before 5.x
                enable = model.gradient_checkpointing_enable
            enable({"use_reentrant": False})
        elif name == "keep":
            pass  # the plain model
        else:
            planner = MemoryPlanner(
                budget if name == "planner" else 10**15,
                **options,
                cost_trials=3 if name == "planner" else 0,  # the others' choice is forced
            )
            plan = planner.plan(model, lambda m=model: m(input_ids=ids, labels=ids).loss)
            if name != "planner":
                plan = planner.decide(CHOICE[name])
            planners[name], plans[name] = planner, plan
        models[name] = model

    for name in args.variants:  # warm-up
        for _ in range(args.warmup):
            step(models[name])
    load_before = load_average()
    can_reset = reset_peak_rss()

    def timed(model: Any) -> Callable[[int], tuple[float, int | None]]:
        """Seconds per step, and the peak RSS above the start (None: not measurable)."""

        def run(_: int) -> tuple[float, int | None]:
            gc.collect()
            trim_heap()
            base = _status("VmRSS")
            if can_reset:
                reset_peak_rss()
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model)
            sync()
            seconds = (time.perf_counter() - start) / args.steps
            peak = _status("VmHWM")
            if can_reset and base is not None and peak is not None:
                return seconds, peak - base
            return seconds, None

        return run

    runs = interleaved({name: timed(models[name]) for name in args.variants}, args.trials)
    times = {name: [t for t, _ in r] for name, r in runs.items()}
    rss = {name: [b for _, b in r if b is not None] for name, r in runs.items()}

    # Saved-activation peaks: one tracked step per variant.
    saved: dict[str, int | None] = {}
    estimated: dict[str, int] = {}
    for name in args.variants:
        model = models[name]
        if name == "hf-checkpointing":  # its checkpoints hide what they hold from the hooks
            saved[name] = None
            continue
        if name in planners:
            planner = planners[name]
            planner.track = True
            planner.decide(plans[name].choices)
            estimated[name] = plans[name].estimated_peak
        else:
            planner = MemoryPlanner(10**15, **options, track=True, cost_trials=0)
            planner.plan(model, lambda m=model: m(input_ids=ids, labels=ids).loss, trials=1)
            estimated[name] = planner.decide("keep").estimated_peak
        planner.reset_peak()
        step(model)
        saved[name] = planner.measured_peak

    results: dict[str, Any] = {}
    reference = times["keep"]  # always run: main() adds it
    for name in args.variants:
        per_trial = times[name]
        peak = saved[name]
        results[name] = {
            "saved_peak_bytes": peak,
            "estimated_peak_bytes": estimated.get(name),
            "fits_budget": None if peak is None else peak <= budget,
            "step_s": summary(per_trial),
            "vs_keep": ratio_summary(per_trial, reference),
            "peak_rss_above_start_bytes": summary(rss[name]).median if rss[name] else None,
        }
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "torch_threads": torch.get_num_threads(),
        "budget_bytes": budget,
        "keep_peak_estimated_bytes": keep_peak,
        "plan": plans["planner"].table() if "planner" in plans else None,
        "load_average_before": load_note(load_before),
        "load_average_after": load_note(),
        "machine": machine_note(load_before),
        "variants": results,
    }


def report(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"LlamaForCausalLM {c['layers']} layers x hidden {c['hidden']}, batch {c['batch']} x "
        f"{c['seq']} tokens, {c['device']}, {result['torch_threads']} threads; "
        f"{c['trials']} trials x {c['steps']} steps",
        f"budget {result['budget_bytes'] / 1e6:.1f} MB of saved activations "
        f"({c['budget_fraction']:.0%} of the {result['keep_peak_estimated_bytes'] / 1e6:.1f} MB "
        f"keeping everything needs)",
        result["machine"],
        "",
        "| variant | saved activations, peak (estimated) | fits | peak RSS above start | "
        "step time (median, min-max) | vs keep (median, min-max) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in result["variants"].items():
        rss = r["peak_rss_above_start_bytes"]
        rss_text = "n/a" if rss is None else f"{rss / 1e6:.0f} MB"
        ratio = r["vs_keep"].format(2, "x")
        peak, est = r["saved_peak_bytes"], r["estimated_peak_bytes"]
        saved_text = "not counted" if peak is None else f"{peak / 1e6:.1f} MB"
        if est is not None:
            saved_text += f" ({est / 1e6:.1f} MB)"
        fits = {None: "n/a", True: "yes", False: "no"}[r["fits_budget"]]
        lines.append(
            f"| {name} | {saved_text} | {fits} | {rss_text} | "
            f"{r['step_s'].format(0, ' ms', scale=1e3)} | {ratio} |"
        )
    if result["plan"]:
        lines += ["", "The planner's decision:", "", result["plan"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--budget-fraction", type=float, default=0.4)
    parser.add_argument("--min-bytes", type=int, default=1 << 16)
    parser.add_argument("--directory", default=None, help="disk pages (default: temp dir)")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per trial")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if "keep" not in args.variants:
        args.variants.insert(0, "keep")
    result = run(args)
    print(report(result))
    if args.json:
        write_json(args.json, result)


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


if __name__ == "__main__":
    main()
