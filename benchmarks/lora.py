"""Fused LoRA (``sakura_kernels.lora.fuse_lora``) against stock PEFT, one adapted linear layer
at a time, at SmolLM2-135M's shapes, in one run.

Each layer is PEFT's ``lora.Linear`` (r=16, alpha 32, no dropout) over a frozen base of one of
SmolLM2-135M's projection shapes (in -> out): 576 -> 576 (q_proj, o_proj), 576 -> 192
(k_proj, v_proj), 576 -> 1536 (gate_proj, up_proj), 1536 -> 576 (down_proj); the input is
``--batch`` x ``--seq`` tokens (2 x 256).  Configurations: fp32 and bf16 weights (bf16 with
PEFT's default fp32 adapters), each over a plain ``nn.Linear`` base and an NF4
``QuantizedLinear`` base (sakura-quant).  Contenders, side by side on the same layer, weights
and input:

* ``peft``        stock PEFT (the reference of the ratios)
* ``fused``       the same layer after ``fuse_lora``
* ``fused-keep``  (NF4) ``fuse_lora(keep_expanded=True)``: the forward's expansion kept for
                  backward instead of expanded again

Timed: one forward + backward (the input requires a gradient; a fixed output gradient), each
trial the median of ``--repeat`` calls, the contenders interleaved trial by trial
(``sakura_bench.measure.interleaved``) after a warm-up; reported: median ms with min-max
and ``peft / contender`` (> 1: faster than PEFT; the median of per-trial ratios, min-max).

Memory, from one more untimed call of each, two figures: ``saved`` -- the bytes autograd keeps
from forward to backward (``saved_tensors_hooks``; distinct storages, the layer's own weights
not counted), which is what a model's activation memory adds up; and ``peak`` -- the highest
sum of live tensor bytes torch allocated during the call (``torch.profiler`` memory events),
above what was live before it.

``--expansion`` (on by default): how long expanding an NF4 weight takes beside the matmul that
reads it, per shape and dtype: ``dequantize(dtype)`` (a fresh tensor), ``dequantize_into``
(into a reused buffer, where sakura-quant has it), and ``x @ W.T`` with the weight already
expanded.  Fusing the expansion into the matmul could save at most the expansion time, twice
per forward + backward.

Run: ``python benchmarks/lora.py`` (about 2 minutes, 1 thread, on an idle 2-core machine);
``--trials``, ``--repeat``, ``--threads``, ``--configs fp32-plain,bf16-nf4``,
``--json reports/lora.json``.  ``--help`` for the rest.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import pin_threads, write_json

from sakura_bench.measure import (
    cpu_description,
    interleaved,
    load_average,
    machine_note,
    ratio_summary,
    summary,
)

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64.
SHAPES: dict[str, tuple[int, int]] = {
    "q_proj, o_proj": (576, 576),
    "k_proj, v_proj": (576, 192),
    "gate_proj, up_proj": (576, 1536),
    "down_proj": (1536, 576),
}
CONFIGS = ("fp32-plain", "fp32-nf4", "bf16-plain", "bf16-nf4")
RANK, ALPHA = 16, 32


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=7, help="timed trials per contender (7)")
    p.add_argument("--repeat", type=int, default=3, help="calls per trial, median taken (3)")
    p.add_argument("--threads", type=int, default=1, help="torch / BLAS threads (1)")
    p.add_argument("--batch", type=int, default=2, help="rows (2)")
    p.add_argument("--seq", type=int, default=256, help="tokens per row (256)")
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS)
    )
    p.add_argument(
        "--no-expansion",
        dest="expansion",
        action="store_false",
        help="skip the NF4 expansion timing",
    )
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; accepted: {', '.join(CONFIGS)}")
    return args


def lora_layer(fin: int, fout: int, dtype: Any, nf4: bool) -> Any:
    """A PEFT model holding one adapted linear layer (lora_B non-zero, as after training)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from sakura_quant import QuantizedLinear

    torch.manual_seed(0)
    base: nn.Module = nn.Linear(fin, fout, bias=False).to(dtype).requires_grad_(False)
    if nf4:
        base = QuantizedLinear.from_linear(base, "nf4")
    holder = nn.Sequential(base)
    # PEFT reads the device from the model's first parameter; an NF4 base has none.
    holder.register_parameter("anchor", nn.Parameter(torch.zeros(1), requires_grad=False))
    model = get_peft_model(holder, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["0"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                param.normal_(std=0.02)
    return model


def one_step(model: Any, x: Any, grad: Any) -> None:
    x.grad = None
    model.zero_grad(set_to_none=True)
    model(x).backward(grad)


def timed_step(model: Any, x: Any, grad: Any, repeat: int) -> Callable[[int], float]:
    def run(_: int) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            one_step(model, x, grad)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return run


def memory(model: Any, x: Any, grad: Any) -> dict[str, int]:
    """``saved`` and ``peak`` bytes of one forward + backward (see the module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own and storage.data_ptr() != x.untyped_storage().data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    # The input itself is the caller's (it exists with or without the layer): not counted.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.backward(grad)
    x.grad = None
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        one_step(model, x, grad)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return {"saved": sum(saved.values()), "peak": peak}


def run_config(config: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from sakura_kernels.lora import fuse_lora

    dtype = torch.bfloat16 if config.startswith("bf16") else torch.float32
    nf4 = config.endswith("nf4")
    rows = []
    for names, (fin, fout) in SHAPES.items():
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, args.seq, fin, generator=gen).to(dtype).requires_grad_()
        grad = torch.randn(args.batch, args.seq, fout, generator=gen).to(dtype)
        ref = lora_layer(fin, fout, dtype, nf4)
        contenders = {"peft": ref, "fused": copy.deepcopy(ref)}
        assert fuse_lora(contenders["fused"]).fused == ["base_model.model.0"]
        if nf4:
            contenders["fused-keep"] = copy.deepcopy(ref)
            fuse_lora(contenders["fused-keep"], keep_expanded=True)
        with torch.no_grad():  # the contenders compute the same layer
            expected = ref(x).float()
            for name, model in contenders.items():
                error = float((model(x).float() - expected).norm() / expected.norm())
                if error > (1e-5 if dtype == torch.float32 else 2e-2):
                    raise AssertionError(f"{config} {names} {name}: relative error {error:.2e}")
        times = interleaved(
            {n: timed_step(m, x, grad, args.repeat) for n, m in contenders.items()},
            args.trials,
            warmup=1,
        )
        mem = {n: memory(m, x, grad) for n, m in contenders.items()}
        for name in contenders:
            rows.append(
                {
                    "config": config,
                    "layers": names,
                    "shape": f"{fin}->{fout}",
                    "contender": name,
                    "ms": summary(times[name]).scaled(1e3),
                    "peft_over_this": ratio_summary(times["peft"], times[name]),
                    "saved_mib": mem[name]["saved"] / 2**20,
                    "peak_mib": mem[name]["peak"] / 2**20,
                }
            )
        print_rows(rows[-len(contenders) :])
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        print(
            f"  {row['config']:<10} {row['shape']:>9} {row['contender']:<10} "
            f"{row['ms'].format(2, ' ms'):<24} peft/this {row['peft_over_this'].format(2, 'x'):<20} "
            f"saved {row['saved_mib']:6.2f} MiB  peak {row['peak_mib']:6.2f} MiB",
            flush=True,
        )


def expansion(args: argparse.Namespace) -> list[dict[str, Any]]:
    """NF4 expansion beside the matmul that reads the expanded weight."""
    import torch

    from sakura_quant import QuantizedLinear, codec

    into = getattr(codec, "dequantize_into", None)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for fin, fout in SHAPES.values():
            torch.manual_seed(0)
            layer = QuantizedLinear.from_linear(torch.nn.Linear(fin, fout, bias=False), "nf4")
            x = torch.randn(args.batch * args.seq, fin).to(dtype)
            w = layer.dequantize(dtype)
            buffer = torch.empty_like(w)
            ways: dict[str, Callable[[], Any]] = {
                "matmul": lambda x=x, w=w: torch.mm(x, w.t()),
                "dequantize": lambda layer=layer, dtype=dtype: layer.dequantize(dtype),
            }
            if into is not None:
                ways["dequantize_into"] = lambda layer=layer, buffer=buffer: into(
                    layer.quantized_weight(), buffer
                )

            def clock(fn: Callable[[], Any]) -> Callable[[int], float]:
                def run(_: int) -> float:
                    times = []
                    for _ in range(args.repeat * 3):
                        start = time.perf_counter()
                        fn()
                        times.append(time.perf_counter() - start)
                    return statistics.median(times)

                return run

            times = interleaved({n: clock(f) for n, f in ways.items()}, args.trials, warmup=1)
            for name in ways:
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": f"{fin}->{fout}",
                    "way": name,
                    "ms": summary(times[name]).scaled(1e3),
                    "over_matmul": ratio_summary(times[name], times["matmul"]),
                }
                rows.append(row)
                print(
                    f"  {row['dtype']:<9} {row['shape']:>9} {name:<16} {row['ms'].format(3, ' ms'):<26}"
                    f" / matmul {row['over_matmul'].format(2, 'x')}",
                    flush=True,
                )
    return rows


def main() -> int:
    args = parse_args()
    pin_threads(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    load_before = load_average()
    print(
        f"fused LoRA vs PEFT, per layer at SmolLM2-135M shapes; {args.batch} x {args.seq} "
        f"tokens, r={RANK}; {args.threads} thread(s); {args.trials} trials x {args.repeat}"
    )
    print(f"CPU: {cpu_description()}")
    results: dict[str, Any] = {"args": vars(args), "layers": [], "expansion": []}
    for config in args.configs.split(","):
        print(f"{config}:")
        results["layers"] += run_config(config, args)
    if args.expansion:
        print("NF4 expansion vs the matmul that reads it (per product):")
        results["expansion"] = expansion(args)
    note = machine_note(load_before)
    print(note)
    results["machine"] = note
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
