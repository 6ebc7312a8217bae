"""The CUDA kernels of sakura-quant and sakura-offload timed beside their rivals, in one run.

* NF4 dequantize of one 4096 x 4096 weight to bf16 (fp32 scales, and double-quantized):
  sakura's CUDA kernel, sakura's torch path on the same device, bitsandbytes'
  ``dequantize_4bit`` when it is installed with CUDA support.  The kernel's bytes are
  checked against the torch path's first.
* One AdamW step of a 50 M-parameter fp32 tensor on the GPU: ``OffloadAdamW(backend="cuda")``
  (the CUDA kernel, moments in page-locked host RAM) for fp32 / bf16 / int8 moments,
  ``OffloadAdamW(backend="cpp")`` (gradient to the host, C++ kernel, weights back) and
  ``torch.optim.AdamW(fused=True)`` with its state on the device.

Each way is timed ``--trials`` times (CUDA events around ``--repeat`` calls), the ways of a
group interleaved trial by trial (``sakura_bench.measure.interleaved``) after one warm-up
call each; the table gives the median per call with min-max, and the ratio to the first row
of its group (the median of the per-trial ratios, with min-max).
Without a CUDA device it says so and exits 0 (``nox -s bench`` runs it everywhere).

    python benchmarks/gpu_kernels.py [--trials 7] [--repeat 10] [--params 50_000_000]
        [--json reports/gpu-check/gpu_kernels.json]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import write_json

from sakura_bench.measure import interleaved, machine_note, ratio_summary, summary


def _timed(fn: Callable[[], Any], repeat: int) -> Callable[[int], float]:
    """A contender of :func:`interleaved`: seconds per call of ``fn`` over ``repeat`` calls,
    between two CUDA events."""
    import torch

    def run(_: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat

    return run


def _group(
    title: str, ways: dict[str, Callable[[], Any]], trials: int, repeat: int
) -> list[dict[str, Any]]:
    import torch

    rows: dict[str, dict[str, Any]] = {}
    runnable: dict[str, Callable[[int], float]] = {}
    for name, fn in ways.items():
        try:  # the warm-up call; a rival that cannot run here is reported, not fatal
            fn()
            torch.cuda.synchronize()
        except Exception as exc:
            rows[name] = {"group": title, "way": name, "error": f"{type(exc).__name__}: {exc}"}
            continue
        rows[name] = {"group": title, "way": name}
        runnable[name] = _timed(fn, repeat)
    times = interleaved(runnable, trials) if runnable else {}
    first = next(iter(times.values()), None)
    for name, ts in times.items():
        rows[name].update(
            seconds=summary(ts),
            ratio_to_first=ratio_summary(ts, first) if first is not None else None,
        )
    print(f"\n{title}")
    for r in rows.values():
        if "error" in r:
            print(f"  {r['way']:<44} not run: {r['error'][:120]}")
            continue
        print(
            f"  {r['way']:<44} {r['seconds'].format(3, ' ms', scale=1e3):>28}  "
            f"x{r['ratio_to_first'].format(2)}"
        )
    return list(rows.values())


def nf4(trials: int, repeat: int) -> list[dict[str, Any]]:
    import os

    import torch

    from sakura_quant import _kernel
    from sakura_quant.codec import dequantize_weight, quantize_weight

    rows: list[dict[str, Any]] = []
    w = torch.randn(4096, 4096, dtype=torch.bfloat16)
    for dq in (False, True):
        q = quantize_weight(w, "nf4", double_quant=dq)
        q.tensors = {k: v.cuda() for k, v in q.tensors.items()}

        def torch_path(q: Any = q) -> Any:
            os.environ[_kernel.NO_KERNEL_ENV] = "1"
            try:
                return dequantize_weight(q)
            finally:
                os.environ.pop(_kernel.NO_KERNEL_ENV, None)

        assert _kernel.CUDA_LIBRARY.load(required=True) is not None
        kernel_out, torch_out = dequantize_weight(q), torch_path()
        assert torch.equal(kernel_out.view(torch.int16), torch_out.view(torch.int16)), "bits differ"
        ways: dict[str, Callable[[], Any]] = {
            "sakura CUDA kernel": lambda q=q: dequantize_weight(q),
            "sakura torch path (same device)": torch_path,
        }
        try:
            import bitsandbytes.functional as bnbf

            packed, state = bnbf.quantize_4bit(
                w.cuda(), blocksize=64, quant_type="nf4", compress_statistics=dq
            )
            ways["bitsandbytes dequantize_4bit"] = lambda packed=packed, state=state: (
                bnbf.dequantize_4bit(packed, state)
            )
        except Exception as exc:
            print(f"(bitsandbytes not timed: {type(exc).__name__}: {exc})")
        title = f"NF4 dequantize 4096x4096 -> bf16, {'double-quantized' if dq else 'fp32'} scales"
        rows += _group(title, ways, trials, repeat)
    return rows


def adamw(trials: int, repeat: int, n: int) -> list[dict[str, Any]]:
    import torch

    from sakura_offload import OffloadAdamW

    def stepper(
        make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    ) -> Callable[[], None]:
        p = torch.nn.Parameter(torch.randn(n, device="cuda"))
        p.grad = torch.randn(n, device="cuda") * 1e-3
        opt = make([p])

        def step() -> None:
            opt.step()  # the gradient stays; OffloadAdamW does not need a fresh one

        return step

    hyper = {"lr": 1e-3, "weight_decay": 0.01}
    ways: dict[str, Callable[[], None]] = {
        "torch.optim.AdamW(fused=True), state on GPU": stepper(
            lambda ps: torch.optim.AdamW(ps, **hyper, fused=True)
        ),
    }
    for dtype in ("float32", "bf16", "int8"):
        ways[f"OffloadAdamW cuda, {dtype} moments in host RAM"] = stepper(
            lambda ps, d=dtype: OffloadAdamW(ps, **hyper, moment_dtype=d, backend="cuda")
        )
    ways["OffloadAdamW cpp (host kernel), fp32 moments"] = stepper(
        lambda ps: OffloadAdamW(ps, **hyper, backend="cpp")
    )
    return _group(
        f"AdamW step, {n / 1e6:.0f} M fp32 parameters on the GPU", ways, trials, max(1, repeat // 5)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here; nothing to time")
        return 0
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda})"
        f"\n{machine_note()}"
    )
    rows = nf4(args.trials, args.repeat) + adamw(args.trials, args.repeat, args.params)
    if args.json is not None:
        write_json(
            args.json,
            {"device": torch.cuda.get_device_name(), "machine": machine_note(), "rows": rows},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
