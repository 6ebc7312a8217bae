"""``load_model``'s peak memory against the bound it promises: the largest tensor plus the
quantized model.

A Llama-shaped checkpoint (``--layers`` layers of ``--hidden``, ``--vocab`` tokens, stored in
``--dtype``) is written to a temporary folder, then loaded in a fresh process per case:
``nf4``, ``nf4`` with ``keep_precise="auto"`` (its measuring pass reads every target once
more), ``int8``, ``auto`` (a budget that forces int8), ``none`` (unquantized: its tensors stay
views of the checkpoint's memory map), ``none-fp32`` (unquantized, cast to float32: all in
RAM) and ``none-fp32-disk`` (the same with ``disk_offload``: the decoder layers' matrices in
memory-mapped files, not counted in the model's RAM bytes).  Each child reports its peak anonymous memory above what it held
after the imports (``RssAnon``, sampled every millisecond by a thread, so a peak can only be
missed, never invented; the file-backed pages of the memory-mapped checkpoint are the page
cache's, reclaimable, and not counted), its ``VmHWM`` above the imports (which does count
them) and the bytes of the loaded model (its state dict).

Reported per case: ``peak`` (anonymous, above the imports), ``bound`` = largest tensor +
loaded model, ``peak / bound``, and ``peak - bound``; with the CPU and the sizes.  This is a
memory measurement, no timing; the ``test_loading_memory`` test asserts the same bound, with
64 MiB of slack, at a smaller size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from typing import Any

from _common import require_status_kib, write_json

CASES: dict[str, dict[str, Any]] = {
    "nf4": {"quantize": "nf4"},
    "nf4-keep_precise": {"quantize": "nf4", "keep_precise": "auto"},
    "int8": {"quantize": "int8"},
    "auto(int8)": {"quantize": "auto"},  # host_budget set to the int8 size by the parent
    "none": {"quantize": None},
    "none-fp32": {"quantize": None, "dtype": "float32"},
    "none-fp32-disk": {"quantize": None, "dtype": "float32", "disk_offload": True},
}


def child(folder: str, options_json: str) -> None:
    import accelerate  # noqa: F401 - counted in the baseline, as load_model imports them
    import torch
    import transformers
    import transformers.models.llama.modeling_llama  # noqa: F401

    from sakura_quant import load_model

    torch.set_num_threads(1)
    options = json.loads(options_json)
    if "dtype" in options:
        options["dtype"] = getattr(torch, options["dtype"])
    if options.get("disk_offload"):
        options["disk_offload"] = tempfile.mkdtemp(prefix="quant-load-peak-")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")  # reset VmHWM: the peak is the load's own
    base = require_status_kib("VmRSS") * 1024
    anon_base = require_status_kib("RssAnon") * 1024
    anon_peak = [anon_base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            anon_peak[0] = max(anon_peak[0], require_status_kib("RssAnon") * 1024)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = load_model(folder, **options)
    done.set()
    sampler.join(timeout=5)
    anon_peak[0] = max(anon_peak[0], require_status_kib("RssAnon") * 1024)
    store = model.sakura_disk_offload
    on_disk = set() if store is None else set(store.keys())
    kept = sum(
        t.numel() * t.element_size() for k, t in model.state_dict().items() if k not in on_disk
    )
    print(
        json.dumps(
            {
                "anon_peak": anon_peak[0] - anon_base,
                "hwm_peak": require_status_kib("VmHWM") * 1024 - base,
                "model_bytes": kept,
                "disk_bytes": 0 if store is None else store.nbytes,
                "quantize": model.sakura_quant_load.quantize,
            }
        )
    )


def write_checkpoint(folder: str, args: argparse.Namespace) -> dict[str, int]:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=256,
    )
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    return {"checkpoint_bytes": sum(sizes), "largest_tensor_bytes": max(sizes)}


def run_case(folder: str, options: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", folder, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"the child failed:\n{proc.stderr[-4000:]}")
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return
    from sakura_bench.measure import cpu_description

    report: dict[str, Any] = {"cpu": cpu_description(), "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as folder:
        report.update(write_checkpoint(folder, args))
        largest = report["largest_tensor_bytes"]
        cases: dict[str, Any] = {}
        for name, options in CASES.items():
            if name == "auto(int8)":
                options = {**options, "host_budget": cases["int8"]["model_bytes"]}
            row = run_case(folder, options)
            row["bound"] = largest + row["model_bytes"]
            row["ratio"] = row["anon_peak"] / row["bound"]
            row["over_bound"] = row["anon_peak"] - row["bound"]
            cases[name] = row
        report["cases"] = cases
    mib = 1 / 2**20
    print(
        f"{report['cpu']}\ncheckpoint {report['checkpoint_bytes'] * mib:.1f} MiB ({args.dtype}), "
        f"largest tensor {largest * mib:.1f} MiB"
    )
    for name, row in cases.items():
        print(
            f"  {name:17s} model {row['model_bytes'] * mib:7.1f} MiB  peak anon "
            f"{row['anon_peak'] * mib:7.1f} MiB  bound {row['bound'] * mib:7.1f} MiB  "
            f"peak/bound {row['ratio']:.2f}  (VmHWM {row['hwm_peak'] * mib:.1f} MiB)"
        )
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
