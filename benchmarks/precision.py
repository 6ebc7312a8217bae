"""What do sakura-precision's services buy on this machine's CPU?

Three measurements, each side by side in one run, on a small Llama-style decoder written in
plain torch (RMSNorm, causal attention through ``scaled_dot_product_attention``, SwiGLU MLP;
4 layers, width 512, 1024-token vocabulary, batch 4 x 128 tokens: matmul-heavy), trained by
a raw loop driven through ``SakuraRuntime`` with AdamW:

1. **Step time per precision.**  fp32 (no service) against ``MixedPrecision("bf16")``,
   ``MixedPrecision("bf16-true")`` and ``MixedPrecision("fp16")``.  The variants are
   interleaved within each trial (A B C ... A B C ...) so drift in machine speed hits them
   alike; each trial's ratio uses that trial's fp32 time; the median ratio over trials is
   reported with its range, in wall time and in the process's CPU time (less sensitive to
   other processes on a shared machine when torch runs one thread).  The loss curve of bf16 over 20 steps is compared with fp32's
   from the same initial weights and data.  fp16 runs fewer trials: without AVX512-FP16
   this CPU has no fp16 arithmetic, so it is emulated and very slow (reported as such).
2. **Activation checkpointing.**  Saved-tensor bytes of one forward (counted with
   ``torch.autograd.graph.saved_tensors_hooks``; parameters excluded) and step time, for no
   checkpointing, ``ActivationCheckpoint()``, ``policy="save_matmuls"`` and ``every=2``.
3. **Compile cold vs warm start.**  Fresh Python processes, each building the model,
   installing ``Compile(target="blocks", cache_dir=...)`` and timing its first step
   (tracing, compiling, running) and its steady-state step.  Cold: an empty cache
   directory; warm: the directory a previous process filled.  The eager step time of the
   same child is reported next to the compiled one.

Run ``python benchmarks/precision.py`` (about 10 minutes on 2 loaded cores), ``--quick``
for a smoke run, ``--json OUT`` to keep the numbers, ``--compile-modes default,max-autotune``
to add modes.  Threads: torch's default (all cores) unless ``--threads`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import write_json
from torch import nn

from sakura_bench.measure import (
    Summary,
    cpu_description,
    interleaved,
    load_average,
    load_note,
    machine_note,
    ratio_summary,
    summary,
)

BF16_TARGET = 1.5  # MixedPrecision("bf16") step-time speed-up over fp32 (the target)
LOSS_RTOL = 0.02  # bf16's loss within 2 % of fp32's at every one of 20 steps

# --- the workload -----------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(
        self, vocab: int, dim: int, layers: int, heads: int, hidden: int, seq: int
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


CONFIG = {"vocab": 1024, "dim": 512, "layers": 4, "heads": 8, "hidden": 1408, "seq": 128}
QUICK_CONFIG = {"vocab": 256, "dim": 128, "layers": 2, "heads": 4, "hidden": 352, "seq": 64}
BATCH = 4


def make_model(config: dict[str, int], seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama(**config)


def make_batches(config: dict[str, int], n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, config["vocab"], (BATCH, config["seq"] + 1), generator=g) for _ in range(n)
    ]


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


class Trainer:
    """A model, an optimizer and a runtime: ``step()`` is one raw-loop step through it."""

    def __init__(self, config: dict[str, int], services: list[Any]) -> None:
        from sakura import SakuraRuntime

        self.rt = SakuraRuntime(services, strict=True).start()
        model = make_model(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.model, self.optimizer = self.rt.prepare(model, optimizer)
        self.batches = make_batches(config)
        self.i = 0

    def step(self) -> float:
        tokens = self.batches[self.i % len(self.batches)]
        self.i += 1
        rt = self.rt
        with rt.autocast():
            loss = next_token_loss(self.model(tokens[:, :-1]), tokens)
        rt.backward(loss)
        if not rt.optimizer_step(self.optimizer):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def timed(self, steps: int) -> float:
        """Wall seconds per step (CPU seconds of the process in ``self.cpu_seconds``)."""
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        self.cpu_seconds = (time.process_time() - cpu_start) / steps
        return (time.perf_counter() - start) / steps

    def close(self) -> None:
        self.rt.close()


# --- helpers ------------------------------------------------------------------------------------


def fmt_ratio(s: Summary) -> str:
    return s.format(2, "x")


@contextmanager
def saved_bytes(model: nn.Module) -> Iterator[list[int]]:
    """Bytes autograd saves for backward (distinct storages; parameters excluded)."""
    total = [0]
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def timed_trials(
    variants: dict[str, Callable[[], Trainer]], trials: int, steps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-step wall and CPU seconds of each variant per trial, the variants interleaved
    (``sakura_bench.measure.interleaved``, after one untimed round: allocator, oneDNN
    primitive caches)."""
    trainers = {name: make() for name, make in variants.items()}

    def contender(trainer: Trainer) -> Callable[[int], tuple[float, float]]:
        def run(trial: int) -> tuple[float, float]:
            wall = trainer.timed(steps)
            return wall, trainer.cpu_seconds

        return run

    runs = interleaved({name: contender(t) for name, t in trainers.items()}, trials, warmup=1)
    for trainer in trainers.values():
        trainer.close()
    wall = {name: [w for w, _ in r] for name, r in runs.items()}
    cpu = {name: [c for _, c in r] for name, r in runs.items()}
    return wall, cpu


def ratios(times: dict[str, list[float]], base: str, *, inverse: bool = False) -> dict[str, Any]:
    """Per-trial ``base / variant`` (a speed-up; ``variant / base`` with ``inverse``), each
    with its spread."""
    return {
        name: ratio_summary(values, times[base]) if inverse else ratio_summary(times[base], values)
        for name, values in times.items()
    }


# --- 1. precision ----------------------------------------------------------------------------


def bench_precision(config: dict[str, int], trials: int, steps: int) -> dict[str, Any]:
    from sakura_precision import MixedPrecision

    variants = {
        "fp32": lambda: Trainer(config, []),
        "bf16-mixed": lambda: Trainer(config, [MixedPrecision("bf16")]),
        "bf16-true": lambda: Trainer(config, [MixedPrecision("bf16-true")]),
    }
    wall, cpu = timed_trials(variants, trials, steps)
    # fp16: one trial after one warm-up step, next to one more fp32 trial (emulated fp16
    # arithmetic makes a step many seconds long here)
    fp16 = Trainer(config, [MixedPrecision("fp16")])
    fp32 = Trainer(config, [])
    fp16.timed(1)
    fp32.timed(1)
    fp16_wall = fp16.timed(steps)
    fp32_wall = fp32.timed(steps)
    fp16.close()
    fp32.close()
    speedups = ratios(wall, "fp32")
    speedups["16-mixed"] = summary([fp32_wall / fp16_wall])
    cpu_speedups = ratios(cpu, "fp32")
    cpu_speedups["16-mixed"] = summary([fp32.cpu_seconds / fp16.cpu_seconds])
    wall["16-mixed"] = [fp16_wall]
    cpu["16-mixed"] = [fp16.cpu_seconds]
    result: dict[str, Any] = {
        "seconds_per_step": {k: summary(v) for k, v in wall.items()},
        "cpu_seconds_per_step": {k: summary(v) for k, v in cpu.items()},
        "speedup_vs_fp32": speedups,
        "cpu_time_speedup_vs_fp32": cpu_speedups,
        "fp8": "not measured: fp8 matmuls need an NVIDIA GPU with compute capability >= 8.9",
    }

    curves = {}
    for name, services in (("fp32", []), ("bf16-mixed", [MixedPrecision("bf16")])):
        trainer = Trainer(config, services)
        curves[name] = [trainer.step() for _ in range(20)]
        trainer.close()
    worst = max(abs(b - f) / f for f, b in zip(curves["fp32"], curves["bf16-mixed"], strict=True))
    result["loss_curves"] = curves
    result["bf16_max_relative_loss_difference"] = worst
    return result


# --- 2. activation checkpointing -----------------------------------------------------------------


def policy_output_bytes(config: dict[str, int], ops: frozenset[Any]) -> int:
    """Bytes of the outputs of ``ops`` produced inside the decoder layers in one forward."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    inside = [False]
    total = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            if inside[0] and func.overloadpacket in ops:
                total[0] += sum(
                    t.untyped_storage().nbytes()
                    for t in tree_leaves(out)
                    if isinstance(t, torch.Tensor)
                )
            return out

    model = make_model(config)
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    tokens = make_batches(config)[0]
    with Count():
        model(tokens[:, :-1])
    return total[0]


def bench_checkpointing(config: dict[str, int], trials: int, steps: int) -> dict[str, Any]:
    from sakura_precision import ActivationCheckpoint
    from sakura_precision.activation_checkpoint import POLICIES

    variants = {
        "none": lambda: Trainer(config, []),
        "full": lambda: Trainer(config, [ActivationCheckpoint()]),
        "save_matmuls": lambda: Trainer(config, [ActivationCheckpoint(policy="save_matmuls")]),
        "every=2": lambda: Trainer(config, [ActivationCheckpoint(every=2)]),
    }
    memory = {}
    for name, make in variants.items():
        trainer = make()
        tokens = trainer.batches[0]
        with saved_bytes(trainer.model) as counted:
            loss = next_token_loss(trainer.model(tokens[:, :-1]), tokens)
        loss.backward()
        memory[name] = counted[0]
        trainer.close()
    # Selective checkpointing keeps the policy's op outputs in its own storage, which the
    # saved-tensor hooks do not see: add the bytes those ops produce inside the blocks.
    memory["save_matmuls"] += policy_output_bytes(config, POLICIES["save_matmuls"])
    wall, cpu = timed_trials(variants, trials, steps)
    return {
        "saved_bytes": memory,
        "memory_reduction": {k: memory["none"] / v for k, v in memory.items()},
        "seconds_per_step": {k: summary(v) for k, v in wall.items()},
        "cpu_seconds_per_step": {k: summary(v) for k, v in cpu.items()},
        "slowdown_vs_none": ratios(wall, "none", inverse=True),
        "cpu_time_slowdown_vs_none": ratios(cpu, "none", inverse=True),
        "note": "saved bytes: what autograd keeps for backward after one forward, counted with "
        "saved-tensor hooks (parameters excluded); a checkpointed block keeps its input, and "
        "with save_matmuls also its matmul and attention outputs (counted separately: they "
        "live in the checkpoint's own storage)",
    }


# --- 3. compile cold vs warm ------------------------------------------------------------------------


def compile_child(cache_dir: str, mode: str, quick: bool) -> None:
    """Runs in a fresh process: first-step and steady-state times, eager and compiled."""
    from sakura_precision import Compile

    config = QUICK_CONFIG if quick else CONFIG
    start = time.perf_counter()
    trainer = Trainer(config, [Compile(mode=mode, target="blocks", cache_dir=cache_dir)])
    trainer.step()
    first = time.perf_counter() - start
    trainer.step()
    compiled = trainer.timed(3)
    trainer.close()
    eager = Trainer(config, [])
    eager.timed(2)
    eager_step = eager.timed(3)
    eager.close()
    from torch._dynamo.utils import counters

    print(
        json.dumps(
            {
                "first_step_s": first,
                "compiled_step_s": compiled,
                "eager_step_s": eager_step,
                "fxgraph_hits": counters["inductor"].get("fxgraph_cache_hit", 0),
                "fxgraph_misses": counters["inductor"].get("fxgraph_cache_miss", 0),
            }
        )
    )


def run_child(cache_dir: Path, mode: str, quick: bool, threads: int | None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--compile-child", str(cache_dir), "--mode", mode]
    if quick:
        command.append("--quick")
    if threads:
        command += ["--threads", str(threads)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"compile child failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def bench_compile(
    modes: list[str], trials: int, quick: bool, threads: int | None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in modes:
        cold, warm = [], []
        for _ in range(trials):
            with tempfile.TemporaryDirectory(prefix="sakura-compile-") as tmp:
                cold.append(run_child(Path(tmp), mode, quick, threads))
                warm.append(run_child(Path(tmp), mode, quick, threads))
        first_cold = [r["first_step_s"] for r in cold]
        first_warm = [r["first_step_s"] for r in warm]
        out[mode] = {
            "cold_first_step_s": summary(first_cold),
            "warm_first_step_s": summary(first_warm),
            "cold_over_warm": ratio_summary(first_cold, first_warm),
            "cold_process_s": summary([r["process_s"] for r in cold]),
            "warm_process_s": summary([r["process_s"] for r in warm]),
            "compiled_step_s": summary([r["compiled_step_s"] for r in cold + warm]),
            "eager_step_s": summary([r["eager_step_s"] for r in cold + warm]),
            "eager_over_compiled": ratio_summary(
                [r["eager_step_s"] for r in cold + warm],
                [r["compiled_step_s"] for r in cold + warm],
            ),
            "warm_fxgraph_hits": [r["fxgraph_hits"] for r in warm],
            "warm_fxgraph_misses": [r["fxgraph_misses"] for r in warm],
        }
    return out


# --- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few trials")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--compile-modes", default="default")
    parser.add_argument("--compile-trials", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma list of: precision,checkpoint,compile")
    parser.add_argument("--compile-child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile_child:
        compile_child(args.compile_child, args.mode, args.quick)
        return 0

    config = QUICK_CONFIG if args.quick else CONFIG
    trials = 2 if args.quick else args.trials
    steps = 2 if args.quick else 3
    skip = set(filter(None, args.skip.split(",")))
    results: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "cores": os.cpu_count(),
            "cpu": cpu_description(),
            "load_before": load_note(),
        },
        "config": {**config, "batch": BATCH, "trials": trials, "steps_per_trial": steps},
    }
    load_before = load_average()
    print(
        f"# sakura-precision benchmark  (torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, {os.cpu_count()} cores)\n# {machine_note()}"
    )
    print(
        f"workload: TinyLlama {config}, batch {BATCH}, AdamW; medians over {trials} trials "
        f"of {steps} steps, (min-max)\n"
    )

    if "precision" not in skip:
        p = bench_precision(config, trials, steps)
        results["precision"] = p
        print("## 1. step time per precision (CPU)")
        print(
            f"{'variant':<11} {'wall s/step':>11}  {'speed-up (wall)':<20} {'cpu s/step':>10}  "
            "speed-up (cpu)"
        )
        for name, s in p["seconds_per_step"].items():
            cpu = p["cpu_seconds_per_step"][name]
            note = "  (1 trial; no fp16 arithmetic on this CPU)" if name == "16-mixed" else ""
            print(
                f"{name:<11} {s.median:>11.3f}  {fmt_ratio(p['speedup_vs_fp32'][name]):<20} "
                f"{cpu.median:>10.3f}  {fmt_ratio(p['cpu_time_speedup_vs_fp32'][name])}{note}"
            )
        bf16 = p["speedup_vs_fp32"]["bf16-mixed"].median
        bf16_cpu = p["cpu_time_speedup_vs_fp32"]["bf16-mixed"].median
        verdict = "meets" if bf16 >= BF16_TARGET else "MISSES"
        print(
            f"bf16-mixed {bf16:.2f}x in wall time ({bf16_cpu:.2f}x in CPU time) {verdict} the "
            f"{BF16_TARGET}x target; loss over 20 steps "
            f"within {p['bf16_max_relative_loss_difference'] * 100:.2f}% of fp32 "
            f"(tolerance {LOSS_RTOL * 100:.0f}%)"
        )
        print(f"loss fp32: {' '.join(f'{x:.3f}' for x in p['loss_curves']['fp32'][::4])}")
        print(f"loss bf16: {' '.join(f'{x:.3f}' for x in p['loss_curves']['bf16-mixed'][::4])}")
        print(f"fp8: {p['fp8']}\n")

    if "checkpoint" not in skip:
        c = bench_checkpointing(config, trials, steps)
        results["activation_checkpoint"] = c
        print("## 2. activation checkpointing (fp32)")
        print(
            f"{'variant':<13} {'saved MB':>9} {'reduction':>10} {'wall s/step':>11}  "
            f"{'time vs none (wall)':<20} (cpu time)"
        )
        for name, nbytes in c["saved_bytes"].items():
            s = c["seconds_per_step"][name]
            print(
                f"{name:<13} {nbytes / 2**20:>9.1f} {c['memory_reduction'][name]:>9.2f}x "
                f"{s.median:>11.3f}  {fmt_ratio(c['slowdown_vs_none'][name]):<20} "
                f"{fmt_ratio(c['cpu_time_slowdown_vs_none'][name])}"
            )
        print(f"({c['note']})\n")

    if "compile" not in skip:
        modes = [m.strip() for m in args.compile_modes.split(",") if m.strip()]
        k = bench_compile(modes, 1 if args.quick else args.compile_trials, args.quick, args.threads)
        results["compile"] = k
        print("## 3. Compile(target='blocks'): cold vs warm start, fresh processes")
        for mode, r in k.items():
            print(
                f"mode={mode}: first step cold {r['cold_first_step_s'].format(1, 's')}, warm "
                f"{r['warm_first_step_s'].format(1, 's')} -> {fmt_ratio(r['cold_over_warm'])} "
                f"faster warm; whole process cold {r['cold_process_s'].format(1, 's')}, warm "
                f"{r['warm_process_s'].format(1, 's')}"
            )
            print(
                f"  steady state: compiled {r['compiled_step_s'].format(3, 's/step')}, eager "
                f"{r['eager_step_s'].format(3, 's/step')} -> eager/compiled "
                f"{fmt_ratio(r['eager_over_compiled'])}; warm runs: fxgraph hits "
                f"{r['warm_fxgraph_hits']}, misses {r['warm_fxgraph_misses']}"
            )
        print()

    results["machine"]["load_after"] = load_note()
    print(f"# {machine_note(load_before)}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
