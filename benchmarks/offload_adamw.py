"""Host AdamW step time: sakura-offload's OffloadAdamW against its rivals, in one run.

Variants, interleaved trial by trial (``sakura_bench.measure.interleaved``) over the same
parameters and gradients (each optimizer keeps its own state):

* ``torch-foreach``   ``torch.optim.AdamW(foreach=True)``
* ``torch-fused``     ``torch.optim.AdamW(fused=True)`` (torch's fused CPU kernel) — the
                      reference of the ratios
* ``deepspeed``       ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)`` when deepspeed
                      imports and its op builds (the reason is printed otherwise)
* ``bnb-8bit``        ``bitsandbytes.optim.AdamW8bit`` on CPU, when it imports
* ``sakura-fp32`` / ``sakura-bf16`` / ``sakura-int8``  ``OffloadAdamW`` (C++ kernel) with
                      that ``moment_dtype``

A STREAM-like triad (``a = b + k * c`` over three arrays as large as the parameters, with
the same threads) is measured in the same run; each variant's step is also reported as the
fraction of that bandwidth it reaches, counting the bytes AdamW must move per parameter:
28 with fp32 moments (read weight, gradient, two moments; write weight and two moments),
20 with bf16 moments, 16 with 8-bit moments (the absmax per 256 values is ignored).

Reported: the CPU first (model, usable CPUs, SIMD flags: figures from different machines are
not to be mixed), the host kernel's vector width (16: its AVX-512 loops), then per variant
the median over trials of the per-trial mean step time, the min-max spread, the ratios to
``torch-fused``, to ``torch-foreach`` and to the faster of the two in that trial (torch at
its best; > 1: slower; each the median of the per-trial ratios, with their spread) and the
bandwidth fraction; the load average before and after.  Then, each in a fresh process, the host memory OffloadAdamW's
state takes per parameter for each moment format (RSS growth after one step over bf16
weights, which get fp32 masters as a GPU model's would, and the peak growth during it):
the reference states about 12 bytes with fp32 moments and 6 with 8-bit ones.  Run: ``python benchmarks/offload_adamw.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import require_status_kib, write_json

from sakura_bench.measure import (
    cpu_description,
    interleaved,
    load_average,
    load_note,
    machine_note,
    ratio_summary,
    summary,
)

BYTES_PER_PARAM = {"fp32": 28, "bf16": 20, "int8": 16}
VARIANTS = (
    "torch-foreach",
    "torch-fused",
    "deepspeed",
    "bnb-8bit",
    "sakura-fp32",
    "sakura-bf16",
    "sakura-int8",
)
REFERENCE = "torch-fused"
RIVALS = ("torch-fused", "torch-foreach")
BEST_TORCH = "best torch"
TRIAD = "(triad)"


def make_tensors(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    sizes = [args.params // args.tensors] * args.tensors
    sizes[-1] += args.params - sum(sizes)
    params = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params, [p.grad for p in params]


def build(name: str, params: list[Any]) -> tuple[Any, str]:
    """(optimizer, bytes key) for ``name``; raises with the reason when unavailable."""
    import torch

    hyper: dict[str, Any] = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    if name == "torch-foreach":
        return torch.optim.AdamW(params, foreach=True, **hyper), "fp32"
    if name == "torch-fused":
        return torch.optim.AdamW(params, fused=True, **hyper), "fp32"
    if name == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **hyper), "fp32"
    if name == "bnb-8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **hyper), "int8"
    from sakura_offload import OffloadAdamW

    dtype = name.removeprefix("sakura-")
    return OffloadAdamW(params, moment_dtype=dtype, backend="cpp", **hyper), dtype


def state_bytes_child(moment_dtype: str, params: int) -> None:
    """In a fresh process: ``params`` bf16 weights (standing for a GPU model's, so the host
    holds fp32 masters as it would for one), one OffloadAdamW step; print the RSS growth
    and peak growth the optimizer's state caused, per parameter, as JSON."""
    import gc

    import torch

    from sakura_offload import OffloadAdamW

    torch.set_num_threads(1)
    warm = torch.nn.Parameter(torch.zeros(8))  # loads the kernel before the measurement
    warm.grad = torch.ones(8)
    OffloadAdamW([warm], moment_dtype=moment_dtype).step()
    weight = torch.nn.Parameter(torch.zeros(params, dtype=torch.bfloat16))
    weight.grad = torch.full_like(weight, 1e-3)
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    before = require_status_kib("VmRSS")
    optimizer = OffloadAdamW([weight], moment_dtype=moment_dtype)
    optimizer.step()
    after, peak = require_status_kib("VmRSS"), require_status_kib("VmHWM")
    result = {
        "moment_dtype": moment_dtype,
        "params": params,
        "state_bytes_per_param": (after - before) * 1024 / params,
        "peak_bytes_per_param": (peak - before) * 1024 / params,
    }
    print(json.dumps(result))


def state_bytes(params: int) -> list[dict[str, Any]]:
    """``state_bytes_child`` for each moment format, each in its own process."""
    import subprocess

    rows = []
    for dtype in ("float32", "bfloat16", "int8"):
        out = subprocess.run(
            [sys.executable, __file__, "--state-bytes-child", dtype, str(params)],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def time_steps(optimizer: Any, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps


def triad(n: int, threads: int, trials: int) -> dict[str, float]:
    """Best-of-trials bandwidth (GB/s) of a = b + k*c, by torch and by sakura's kernel."""
    import torch

    from sakura_offload.host_optimizer.kernel import load_kernel

    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    kernel = load_kernel(required=True)
    assert kernel is not None
    ways: dict[str, Callable[[], None]] = {
        "torch": lambda: torch.add(b, c, alpha=3.0, out=a),
        "sakura": lambda: kernel.triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), 3.0, n, threads),
    }

    def timed(run: Callable[[], None]) -> Callable[[int], float]:
        def once(_: int) -> float:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start

        return once

    times = interleaved({name: timed(run) for name, run in ways.items()}, trials, warmup=1)
    return {name: 12 * n / min(ts) / 1e9 for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="parameters in all")
    parser.add_argument("--tensors", type=int, default=8, help="split into this many tensors")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trial")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--no-state-bytes",
        dest="state_bytes",
        action="store_false",
        help="skip the host bytes per parameter of each moment format",
    )
    parser.add_argument("--state-bytes-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.state_bytes_child:
        state_bytes_child(args.state_bytes_child[0], int(args.state_bytes_child[1]))
        return 0

    import torch

    from sakura_offload.host_optimizer.kernel import load_kernel

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load_before = load_average()
    kernel = load_kernel(required=True)
    assert kernel is not None
    print(f"CPU: {cpu_description()}; sakura kernel vector width {kernel.vector_width}")
    params, _ = make_tensors(args)

    optimizers: dict[str, tuple[Any, str]] = {}
    skipped: dict[str, str] = {}
    for name in args.variants:
        try:
            optimizers[name] = build(name, params)
        except Exception as exc:  # a rival that does not install or build here
            skipped[name] = (
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            )
    for optimizer, _ in optimizers.values():
        time_steps(optimizer, args.warmup)

    # The triad is measured in every trial too, in the same rotation: the bandwidth the
    # machine gives while the optimizers are timed.
    contenders: dict[str, Callable[[int], Any]] = {
        name: lambda _, opt=opt: time_steps(opt, args.steps)
        for name, (opt, _) in optimizers.items()
    }
    contenders[TRIAD] = lambda _: triad(args.params, threads, 3)
    samples = interleaved(contenders, args.trials)
    bandwidth: list[dict[str, float]] = samples.pop(TRIAD)
    best_bw = max(max(b.values()) for b in bandwidth)

    references = {name: samples[name] for name in RIVALS if name in samples}
    if references:  # per trial, torch's faster configuration
        references[BEST_TORCH] = [min(t) for t in zip(*references.values(), strict=True)]
    results: dict[str, Any] = {}
    for name, times in samples.items():
        step = summary(times)
        moved = BYTES_PER_PARAM[optimizers[name][1]] * args.params
        versus = {ref: ratio_summary(times, ref_times) for ref, ref_times in references.items()}
        results[name] = {
            "step_ms": step.scaled(1e3),
            "vs_fused": versus.get(REFERENCE),
            "vs": versus,
            "bandwidth_fraction": moved / step.median / 1e9 / best_bw,
            "bytes_per_param": BYTES_PER_PARAM[optimizers[name][1]],
        }
    report = {
        "params": args.params,
        "tensors": args.tensors,
        "threads": threads,
        "cpu": cpu_description(),
        "kernel_vector_width": kernel.vector_width,
        "trials": args.trials,
        "steps_per_trial": args.steps,
        "triad_gb_s": {
            "best": best_bw,
            "torch": summary(b["torch"] for b in bandwidth),
            "sakura": summary(b["sakura"] for b in bandwidth),
        },
        "load_before": load_note(load_before),
        "load_after": load_note(),
        "results": results,
        "skipped": skipped,
        "state_bytes": state_bytes(args.params) if args.state_bytes else [],
    }
    print(
        f"host AdamW step, {args.params / 1e6:.0f} M parameters, {threads} thread(s), "
        f"{args.trials} trials x {args.steps} steps; triad {best_bw:.1f} GB/s"
    )
    columns = [(REFERENCE, "x fused"), ("torch-foreach", "x foreach"), (BEST_TORCH, "x best torch")]
    columns = [(ref, title) for ref, title in columns if ref in references]
    print(
        f"{'variant':<15}{'step ms, median (min-max)':>28}"
        + "".join(f"{title + ' (min-max)':>24}" for _, title in columns)
        + f"{'B/param':>9}{'of triad':>10}"
    )
    for name, r in results.items():
        ratios = "".join(f"{r['vs'][ref].format(2):>24}" for ref, _ in columns)
        print(
            f"{name:<15}{r['step_ms'].format(1):>28}{ratios}"
            f"{r['bytes_per_param']:>9}{r['bandwidth_fraction']:>10.0%}"
        )
    for name, why in skipped.items():
        print(f"{name:<15} skipped: {why}")
    for row in report["state_bytes"]:
        print(
            f"host bytes per parameter, bf16 weights with fp32 masters, {row['moment_dtype']} "
            f"moments: {row['state_bytes_per_param']:.2f} after a step "
            f"(peak {row['peak_bytes_per_param']:.2f})"
        )
    print(machine_note(load_before))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
