"""The fused block kernels (sakura_kernels.blocks) against the Hugging Face code they
replace, at SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 heads of 64, 3 kv
heads, sequence 256, batch 2), fp32 and bf16, on this machine's CPU.

For each kernel (RMSNorm, rotary embedding on q and k, SwiGLU, GeGLU): the forward time,
the forward + backward time, and the bytes the autograd graph keeps for backward (counted
with ``torch.autograd.graph.saved_tensors_hooks``; on a CPU there is no allocator peak to
read, and what the graph keeps is what decides the peak of a training step).  Contenders
run interleaved (``sakura_bench.measure.interleaved``); medians, spreads (min-max) and the
per-trial ratio fused / HF are printed with the CPU and the load.  Liger's kernels are
Triton (CUDA only): they are listed as a rival when ``liger_kernel`` imports and a CUDA
device exists, else the output says why not.

    python benchmarks/block_kernels.py --trials 15
    python benchmarks/block_kernels.py --trials 5 --dtypes bf16 --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from sakura.options import check_int
from sakura_bench.measure import interleaved, load_average, machine_note, ratio_summary, summary
from sakura_kernels.blocks import fused_glu, fused_rms_norm
from sakura_kernels.blocks.functions import fused_rotary

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, SEQ, BATCH = 576, 1536, 9, 3, 64, 256, 2


def cases(dtype: torch.dtype) -> dict[str, dict[str, Callable[[], Sequence[torch.Tensor]]]]:
    """{kernel: {contender: a function building its inputs and returning its outputs}}."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).requires_grad_()

    x, norm = rand(BATCH, SEQ, HIDDEN), LlamaRMSNorm(HIDDEN).to(dtype)
    q, k = rand(BATCH, HEADS, SEQ, HEAD_DIM), rand(BATCH, KV_HEADS, SEQ, HEAD_DIM)
    angles = torch.rand(BATCH, SEQ, HEAD_DIM // 2, generator=gen) * 100
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    gate, up = rand(BATCH, SEQ, INTERMEDIATE), rand(BATCH, SEQ, INTERMEDIATE)
    silu, gelu = ACT2FN["silu"], ACT2FN["gelu_pytorch_tanh"]
    return {
        "rms_norm": {
            "hf": lambda: [norm(x)],
            "fused": lambda: [fused_rms_norm(x, norm.weight, norm.variance_epsilon)],
        },
        "rotary": {
            "hf": lambda: list(apply_rotary_pos_emb(q, k, cos, sin)),
            "fused": lambda: [fused_rotary(q, cos, sin), fused_rotary(k, cos, sin)],
        },
        "swiglu": {
            "hf": lambda: [silu(gate) * up],
            "fused": lambda: [fused_glu(gate, up, "silu")],
        },
        "geglu": {
            "hf": lambda: [gelu(gate) * up],
            "fused": lambda: [fused_glu(gate, up, "gelu_tanh")],
        },
    }


def saved_bytes(fn: Callable[[], Sequence[torch.Tensor]]) -> int:
    """Bytes of the tensors the autograd graph keeps for backward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def timed(fn: Callable[[], Sequence[torch.Tensor]], backward: bool, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        if backward:
            outs = fn()
            torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
        else:
            with torch.no_grad():
                fn()
    return (time.perf_counter() - start) / repeat


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=9, help="interleaved trials (default 9)")
    parser.add_argument("--repeat", type=int, default=5, help="calls per timed trial (default 5)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="fp32,bf16 (default both)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch / OpenMP threads (default: torch's own; 1 as in benchmarks/qlora_step.py)",
    )
    args = parser.parse_args(argv)
    if check_int("--threads", args.threads, minimum=1, allow_none=True) is not None:
        torch.set_num_threads(args.threads)
    load = load_average()
    print(machine_note())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    try:
        import liger_kernel  # noqa: F401

        liger = "imports, but its kernels are Triton (CUDA only): not run on this CPU"
    except ImportError:
        liger = "liger_kernel is not installed here (and its Triton kernels need CUDA): not run"
    print(f"Liger: {liger}")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for label in args.dtypes.split(","):
        dtype = dtypes[label]
        for kernel, contenders in cases(dtype).items():
            memory = {name: saved_bytes(fn) for name, fn in contenders.items()}
            for backward in (False, True):
                results = interleaved(
                    {name: (lambda i, fn=fn, bwd=backward: timed(fn, bwd, args.repeat))
                     for name, fn in contenders.items()},
                    args.trials,
                    warmup=1,
                )  # fmt: skip
                hf, fused = summary(results["hf"]), summary(results["fused"])
                ratio = ratio_summary(results["fused"], results["hf"])
                what = "fwd+bwd" if backward else "fwd"
                print(
                    f"{label} {kernel:8s} {what:7s} HF {hf.median * 1e3:7.3f} ms "
                    f"({hf.min * 1e3:.3f}-{hf.max * 1e3:.3f})  fused {fused.median * 1e3:7.3f} ms "
                    f"({fused.min * 1e3:.3f}-{fused.max * 1e3:.3f})  fused/HF "
                    f"{ratio.median:.2f} ({ratio.min:.2f}-{ratio.max:.2f})"
                )
            print(
                f"{label} {kernel:8s} kept for backward: HF {memory['hf'] / 2**20:.2f} MiB, "
                f"fused {memory['fused'] / 2**20:.2f} MiB"
            )
    print(machine_note(load))


if __name__ == "__main__":
    main()
