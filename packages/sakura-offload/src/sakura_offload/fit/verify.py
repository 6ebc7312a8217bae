"""``sakura-offload-verify`` (``python -m sakura_offload.fit.verify``): train a model a few
steps under ``fit``'s memory caps and say where the memory lived, with a PASS/FAIL verdict
(the reference's ``examples/verify_ram_offload.py``).

The model is a Hugging Face causal LM built from its config with random weights (no
checkpoint is read): ``--model tiny-llama`` (built in), a directory holding a
``config.json``, or a model name resolved from the local Hugging Face cache (offline).  It is
wrapped by :func:`sakura_offload.wrap` with ``--device-budget`` / ``--host-budget`` and trained
``--steps`` steps on random tokens.  Measured:

- host: the process's anonymous resident memory (``RssAnon`` of ``/proc/self/status``),
  sampled after building the model and after every forward, backward and optimizer step;
  the peak less the baseline taken before the model was built is held against
  ``--host-budget`` (the interpreter and its libraries are not the model's: peft's
  back-ends, loaded by its first ``get_peft_model``, are loaded before the baseline, and
  the C heap is trimmed, :mod:`.heap`);
- device: on CUDA, ``torch.cuda.max_memory_allocated``; on a CPU (a simulated device), what
  ``fit`` accounts for: the model's device state from
  :func:`~sakura_offload.memory_report` after each step (before gradients are cleared),
  plus the most streamed weight bytes live at once, plus the activation planner's estimated
  peak.  Held against ``--device-budget``.

Exit status: 0 PASS; 1 FAIL (a peak over its cap, or no plan fits: ``fit``'s error, naming
the smallest budget that would, is printed); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
"""``--model tiny-llama``: a Llama-shaped model of about 1 M parameters."""


class ArgumentError(ValueError):
    """A bad argument (exit status 2)."""


def rss_anon() -> int:
    """The process's anonymous resident bytes (``RssAnon``; ``VmRSS`` where the kernel has
    no ``RssAnon``)."""
    fields: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "VmRSS"):
                fields[key] = int(rest.split()[0]) * 1024
    return fields.get("RssAnon", fields.get("VmRSS", 0))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sakura-offload-verify",
        description="Train a model a few steps under fit's memory caps; PASS/FAIL with where "
        "the memory lived.",
    )
    parser.add_argument(
        "--model",
        default="tiny-llama",
        help="'tiny-llama' (built in), a directory with a config.json, or a model name in "
        "the local Hugging Face cache (random weights from its config)",
    )
    parser.add_argument("--device-budget", required=True, help="e.g. 64MiB (bytes or a size)")
    parser.add_argument("--host-budget", required=True, help="e.g. 1GiB (bytes or a size)")
    parser.add_argument("--disk-offload", default=None, help="a directory: the disk tier")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    parser.add_argument("--batch", type=int, default=2, help="rows per batch (default 2)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row (default 64)")
    parser.add_argument(
        "--trainable",
        default="lora",
        choices=("lora", "all"),
        help="'lora' (peft adapters on a frozen base; default) or 'all'",
    )
    parser.add_argument("--device", default="cpu", help="'cpu' (default) or 'cuda[:N]'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")
    return parser


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ArgumentError(f"--{name}={value} is not accepted; accepted: an int >= 1")
    return value


def _config(name: str) -> Any:
    from transformers import AutoConfig, LlamaConfig

    if name == "tiny-llama":
        fields = dict(TINY_LLAMA)
        del fields["model_type"]
        return LlamaConfig(**fields)
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ArgumentError(f"--model={name!r}: the directory has no config.json")
        return AutoConfig.from_pretrained(str(path))
    if path.exists():
        raise ArgumentError(f"--model={name!r}: not a directory with a config.json")
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except OSError as error:
        raise ArgumentError(
            f"--model={name!r} is not accepted; accepted: 'tiny-llama', a directory with a "
            f"config.json, or a model name in the local Hugging Face cache ({error})"
        ) from error


def _build(args: argparse.Namespace) -> tuple[Any, int]:
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(args.model)
    config.use_cache = False
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    if args.trainable == "lora":
        from peft import LoraConfig, get_peft_model

        model.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0))
    model.train()
    return model.to(args.device), int(config.vocab_size)


def _warm_peft() -> None:
    """peft's first ``get_peft_model`` loads its optional back-ends (bitsandbytes' CPU
    kernels among them): ~55 MiB of anonymous memory once per process, measured; the
    library's, not the model's, so it happens before the baseline (on a model of its own,
    freed)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    tiny = LlamaForCausalLM(LlamaConfig(**{**fields, "num_hidden_layers": 1}))
    get_peft_model(tiny.requires_grad_(False), LoraConfig(r=2, target_modules=["q_proj"]))


def _device_state(report: dict[str, Any]) -> int:
    device = report["device"]
    return sum(int(device[k]) for k in ("trainable", "gradients", "frozen", "optimizer"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build, wrap and train; the measurements (see the module docstring)."""
    import torch

    import sakura_offload
    from sakura_offload.fit.heap import trim_heap
    from sakura_offload.planner.plan import parse_bytes

    device_cap = int(parse_bytes("--device-budget", args.device_budget, minimum=1, owner=None) or 0)
    host_cap = int(parse_bytes("--host-budget", args.host_budget, minimum=1, owner=None) or 0)
    for name in ("steps", "batch", "seq"):
        _positive(name, getattr(args, name))
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        raise ArgumentError(f"--device={args.device!r} is not accepted: {error}") from error
    if device.type not in ("cpu", "cuda"):
        raise ArgumentError(f"--device={args.device!r} is not accepted; accepted: cpu, cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(f"--device={args.device!r}: CUDA is not available here")
    # Imported before the baseline: the libraries' memory is not the model's.
    import transformers  # noqa: F401

    if args.trainable == "lora":
        try:
            import peft  # noqa: F401
        except ImportError as error:
            raise ArgumentError(
                "--trainable=lora needs peft (pip install peft); or pass --trainable all"
            ) from error
        _warm_peft()

    gc.collect()
    trim_heap()
    baseline = rss_anon()
    host_peak = baseline
    model: Any
    model, vocab = _build(args)
    host_peak = max(host_peak, rss_anon())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = sakura_offload.wrap(
        model,
        optimizer,
        device_budget=device_cap,
        host_budget=host_cap,
        disk_offload=args.disk_offload,
        report=False,
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator().manual_seed(args.seed)
    state_peak = 0
    losses = []
    report: dict[str, Any] = {}
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        host_peak = max(host_peak, rss_anon())
        loss.backward()
        host_peak = max(host_peak, rss_anon())
        optimizer.step()
        host_peak = max(host_peak, rss_anon())
        report = sakura_offload.memory_report(model)
        state_peak = max(state_peak, _device_state(report))
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    state = model.sakura_fit
    weights_live = 0 if state.paging is None else int(state.paging.stats.max_live_bytes)
    applied = getattr(state.planner, "applied", None)
    activations = 0 if applied is None else int(applied.estimated_peak)
    if device.type == "cuda":
        device_peak = int(torch.cuda.max_memory_allocated(device))
        how = "torch.cuda.max_memory_allocated"
    else:
        device_peak = state_peak + weights_live + activations
        how = "fit's accounting (simulated device)"
    host_used = host_peak - baseline
    return {
        "model": args.model,
        "plan": state.plan.summary(),
        "report": report,
        "losses": losses,
        "device_budget": device_cap,
        "host_budget": host_cap,
        "device_peak": device_peak,
        "device_peak_from": how,
        "device_state_peak": state_peak,
        "weights_live_peak": weights_live,
        "activations_peak": activations,
        "host_baseline": baseline,
        "host_peak": host_peak,
        "host_used": host_used,
        "passed": device_peak <= device_cap and host_used <= host_cap,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:10.2f} MiB"


def table(result: dict[str, Any]) -> str:
    """Where the memory lived (bytes by place and category), the bytes moved per step and
    the peaks against the caps."""
    report = result["report"]
    rows = [f"model: {result['model']}", f"plan: {result['plan']}", ""]
    rows.append(f"{'where':<8} {'category':<24} {'bytes':>14}")
    for place in ("device", "host", "disk"):
        for category, value in report[place].items():
            rows.append(f"{place:<8} {category:<24} {_mib(value):>14}")
    for key, value in report["moved"].items():
        shown = _mib(value) if key.endswith("bytes") or "bytes_" in key else f"{value:>14}"
        rows.append(f"{'moved':<8} {key:<24} {shown:>14}")
    rows.append("")
    rows.append(
        f"device peak {_mib(result['device_peak'])} of {_mib(result['device_budget'])} "
        f"({result['device_peak_from']})"
    )
    rows.append(
        f"host peak   {_mib(result['host_used'])} of {_mib(result['host_budget'])} "
        f"(anonymous RSS {_mib(result['host_peak'])} less {_mib(result['host_baseline'])} "
        f"before the model)"
    )
    rows.append("PASS" if result["passed"] else "FAIL")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """The command; returns its exit status (module docstring)."""
    from sakura.options import OptionError

    parser = _parser()
    args = parser.parse_args(argv)  # exits 2 on a malformed command line
    try:
        from sakura_offload.fit.decide import FitError

        try:
            result = run(args)
        except FitError as error:
            print(f"FAIL: no plan fits: {error}", file=sys.stderr)
            return 1
    except (ArgumentError, OptionError) as error:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:
        print(f"{parser.prog}: error: {error} (the command needs transformers)", file=sys.stderr)
        return 2
    print(table(result))
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "report"} | result["report"]))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
