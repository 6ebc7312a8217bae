"""ZeRO on 2 gloo ranks: sakura's ZeRO1 / ZeRO2 against torch's ZeroRedundancyOptimizer.

One run, same model, same data, same AdamW settings, variants interleaved trial by trial
(``sakura_bench.measure.interleaved``) so they share the machine's state:

* ``unsharded``        AdamW + DDP (the reference: every rank holds all optimizer state)
* ``torch-zero``       ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)`` + DDP
* ``sakura-zero1``     AdamW sharded in place by sakura's ZeRO1 + DDP
* ``sakura-zero2-ddp`` sakura's ZeRO2 under DDP (gradients reduced to owners by a comm hook)
* ``sakura-zero2``     sakura's ZeRO2 without DDP (gradients reduced to owners in backward,
                       non-owned gradients freed)

Reported per variant: the optimizer step (``optimizer.step()``: the shard's update plus the
parameter broadcast; for ``sakura-zero2`` also the wait for the gradient reduction that
backward launched) and the whole iteration (forward, backward, gradient communication,
step), each the median over trials of the per-trial mean, with the min-max spread; the
optimizer-state bytes on each rank; gradient bytes held at step time; and the largest
parameter difference from ``unsharded`` at the end (all variants run the same AdamW code,
so 0 is expected).

Run: ``python benchmarks/zero.py`` (spawns 2 ranks itself; ``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sakura_bench.measure import interleaved, load_average, machine_note, ratio_summary, summary

VARIANTS = ("unsharded", "torch-zero", "sakura-zero1", "sakura-zero2-ddp", "sakura-zero2")
EXTRA_VARIANTS = ("sakura-zero1-no-overlap", "sakura-zero1-greedy", "sakura-zero1-contiguous")


def build_model(args: argparse.Namespace) -> Any:
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.d_model)
            layer = nn.TransformerEncoderLayer(
                args.d_model, args.heads, 4 * args.d_model, dropout=0.0, batch_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, args.vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.blocks(self.embed(tokens))))

    torch.manual_seed(0)
    return TinyLM()


def _bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


class Variant:
    def __init__(self, name: str, base: Any, args: argparse.Namespace) -> None:
        import torch
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        from sakura import SakuraRuntime
        from sakura_zero import ZeRO1, ZeRO2

        self.name = name
        self.net = copy.deepcopy(base)
        self.rt = None
        kwargs = dict(lr=1e-4, weight_decay=0.01)
        if name == "sakura-zero2":
            self.model = self.net
        else:
            self.model = DDP(self.net, bucket_cap_mb=25)
        if name == "torch-zero":
            self.optimizer = ZeroRedundancyOptimizer(
                self.net.parameters(), optimizer_class=torch.optim.AdamW, **kwargs
            )
            self.state_of = lambda: self.optimizer.optim.state
        else:
            self.optimizer = torch.optim.AdamW(self.net.parameters(), **kwargs)
            self.state_of = lambda: self.optimizer.state
        if name.startswith("sakura"):
            if name.startswith("sakura-zero1"):
                options: dict[str, Any] = {}
                if name.endswith("no-overlap"):
                    options["overlap_mb"] = 0
                elif name.endswith(("greedy", "contiguous")):
                    options["partition"] = name.rsplit("-", 1)[1]
                service = ZeRO1(**options)
            else:
                service = ZeRO2()
            self.rt = SakuraRuntime([service], strict=True, history=False).start()
            self.model, self.optimizer = self.rt.prepare(self.model, self.optimizer)
            self.service = service
        self.step_times: list[float] = []
        self.iter_times: list[float] = []
        self.grad_bytes = 0

    def iteration(self, tokens: Any, timed: bool) -> None:
        import torch

        t0 = time.perf_counter()
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        t1 = time.perf_counter()
        self.optimizer.step()
        t2 = time.perf_counter()
        self.grad_bytes = sum(_bytes(p.grad) for p in self.net.parameters() if p.grad is not None)
        self.optimizer.zero_grad(set_to_none=True)
        if timed:
            self.step_times.append(t2 - t1)
            self.iter_times.append(t2 - t0)

    def state_bytes(self) -> int:
        return sum(_bytes(s) for s in self.state_of().values())


def collectives(rank: int, world: int, out: str, args: argparse.Namespace) -> None:
    """``--collectives``: how fast gloo moves ``--collective-mb`` of fp32 with each
    collective ZeRO could use (why sakura broadcasts parameters and reduces gradients to
    owners rather than all-gathering and reduce-scattering on gloo)."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor renamed in 2.13
    n = int(args.collective_mb * 2**20 / 4) // world * world
    full = torch.randn(n)
    part = torch.empty(n // world)

    def per_owner(op: Any) -> None:
        works = [op(chunk, i) for i, chunk in enumerate(full.chunk(world))]
        for work in works:
            work.wait()

    cases = {
        "all_reduce (DDP)": lambda: dist.all_reduce(full),
        "reduce to each owner": lambda: per_owner(
            lambda t, i: dist.reduce(t, dst=i, async_op=True)
        ),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, full),
        "broadcast from each owner": lambda: per_owner(
            lambda t, i: dist.broadcast(t, src=i, async_op=True)
        ),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, part),
    }

    def timed(fn: Any) -> Any:
        def run(_: int) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return run

    times = interleaved({name: timed(fn) for name, fn in cases.items()}, args.trials, warmup=1)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"collectives": times}))


def worker(rank: int, world: int, init: str, out: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        if args.collectives:
            collectives(rank, world, out, args)
            return
        base = build_model(args)
        n_params = sum(p.numel() for p in base.parameters())
        variants = [Variant(name, base, args) for name in args.variants]
        g = torch.Generator().manual_seed(100 + rank)
        data = [
            torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
            for _ in range(args.warmup + args.trials * args.steps)
        ]
        it = iter(data)
        for _ in range(args.warmup):
            tokens = next(it)
            for v in variants:
                v.iteration(tokens, timed=False)
        trial_batches = [[next(it) for _ in range(args.steps)] for _ in range(args.trials)]

        def trial_of(v: Variant) -> Any:
            def run(trial: int) -> tuple[float, float]:
                dist.barrier()
                v.step_times.clear()
                v.iter_times.clear()
                for tokens in trial_batches[trial]:
                    v.iteration(tokens, timed=True)
                return statistics.fmean(v.step_times), statistics.fmean(v.iter_times)

            return run

        # interleaved: every trial runs every variant in turn, starting from a different
        # one each time so that no variant always follows the same neighbour (both ranks
        # run the same order: the rotation depends on the trial only)
        runs = interleaved({v.name: trial_of(v) for v in variants}, args.trials)
        per_trial = {
            name: {"step": [s for s, _ in r], "iter": [i for _, i in r]} for name, r in runs.items()
        }
        reference = variants[0].net if variants[0].name == "unsharded" else None
        result: dict[str, Any] = {"rank": rank, "params": n_params, "variants": {}}
        for v in variants:
            diff = None
            if reference is not None:
                diff = max(
                    float((a.detach() - b.detach()).abs().max())
                    for a, b in zip(v.net.parameters(), reference.parameters(), strict=True)
                )
            entry = {
                "step_s": per_trial[v.name]["step"],
                "iter_s": per_trial[v.name]["iter"],
                "state_bytes": v.state_bytes(),
                "grad_bytes": v.grad_bytes,
                "max_diff_vs_unsharded": diff,
            }
            if v.name.startswith("sakura"):
                sharding = v.service.shardings[0]
                entry["imbalance"] = sharding.imbalance
                entry["broadcasts"] = sharding._broadcast.num_collectives
            result["variants"][v.name] = entry
            if v.rt is not None:
                v.rt.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def launch(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        argv = [a for a in sys.argv[1:]]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, *argv, "--_rank", str(r), "--_dir", tmp],
                env={**env, "RANK": str(r), "WORLD_SIZE": str(args.world)},
            )
            for r in range(args.world)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]


def _fmt_ms(values: list[float]) -> str:
    return summary(values).format(1, " ms", scale=1e3)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"ZeRO benchmark: {results[0]['params'] / 1e6:.1f} M parameters, AdamW, {args.world} "
        f"gloo ranks on loopback, 1 thread per rank, {args.trials} trials x {args.steps} steps "
        f"(median of per-trial means, min-max across trials; times are the slower rank's)",
        "",
        f"{'variant':18s} {'optimizer step':>28s} {'iteration':>28s} "
        f"{'opt state / rank (MB)':>24s} {'grads held (MB)':>16s} {'max |diff|':>10s}",
    ]
    names = list(results[0]["variants"])
    per_trial: dict[str, dict[str, list[float]]] = {}
    for name in names:
        # per trial, the slower rank defines the time
        step = [
            max(vals)
            for vals in zip(*(r["variants"][name]["step_s"] for r in results), strict=True)
        ]
        it = [
            max(vals)
            for vals in zip(*(r["variants"][name]["iter_s"] for r in results), strict=True)
        ]
        states = [r["variants"][name]["state_bytes"] / 2**20 for r in results]
        grads = [r["variants"][name]["grad_bytes"] / 2**20 for r in results]
        diff = results[0]["variants"][name]["max_diff_vs_unsharded"]
        per_trial[name] = {"step": step, "iter": it}
        lines.append(
            f"{name:18s} {_fmt_ms(step):>28s} {_fmt_ms(it):>28s} "
            f"{' / '.join(f'{s:.1f}' for s in states):>24s} "
            f"{' / '.join(f'{g:.1f}' for g in grads):>16s} "
            f"{'n/a' if diff is None else f'{diff:.1e}':>10s}"
        )
    lines.append(
        "grads held: bytes of the parameters' .grad tensors at step time; under DDP its "
        "buckets (one more full copy of the gradients) are not counted"
    )
    lines.append("")
    if "torch-zero" in per_trial:
        lines.append(
            "speed-up over torch-zero, median of per-trial ratios (paired: same trial, same "
            "machine state), min-max across trials; > 1 means sakura is faster:"
        )
        base = per_trial["torch-zero"]
        for name in names:
            if not name.startswith("sakura"):
                continue
            step = ratio_summary(base["step"], per_trial[name]["step"])
            it = ratio_summary(base["iter"], per_trial[name]["iter"])
            lines.append(
                f"  {name:24s} optimizer step {step.format(2, 'x')}, iteration {it.format(2, 'x')}"
            )
    for name in names:
        extra = results[0]["variants"][name]
        if "imbalance" in extra:
            lines.append(
                f"{name}: partition imbalance {extra['imbalance'] * 100:.2f} %, "
                f"{extra['broadcasts']} broadcast collectives per step"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--steps", type=int, default=2, help="timed iterations per trial")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA_VARIANTS
    )
    parser.add_argument("--json", type=Path, help="also write the raw per-rank results here")
    parser.add_argument(
        "--collectives",
        action="store_true",
        help="instead: time gloo's collectives on one buffer (see docs/zero.md)",
    )
    parser.add_argument("--collective-mb", type=float, default=50.0)
    parser.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trials < 5:
        parser.error(f"--trials must be >= 5 for an honest median, got {args.trials}")
    if args._rank is not None:
        worker(args._rank, args.world, os.path.join(args._dir, "init"), args._dir, args)
        return
    load_before = load_average()
    results = launch(args)
    if args.collectives:
        print(
            f"gloo collectives, {args.world} ranks on loopback, {args.collective_mb:g} MB of "
            f"fp32 in total, median (min-max) of {args.trials} trials, slower rank:"
        )
        for name in results[0]["collectives"]:
            per = [max(v) for v in zip(*(r["collectives"][name] for r in results), strict=True)]
            print(f"  {name:28s} {_fmt_ms(per)}")
    else:
        print(report(results, args))
    print(
        f"machine: {machine_note(load_before)} (other processes share the machine"
        + ("" if args.collectives else "; the paired ratios compare variants under the same load")
        + ")"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
