"""Crafted and fuzzed quantized weights, run in a child process by test_untrusted.py (so a
native crash -- SIGSEGV, SIGFPE -- fails the test instead of killing pytest).

``python _crafted.py MODE OUT_DIR``; MODE is ``fuzz`` (a seeded corpus of mutated
safetensors headers and sakura_quant layouts, loaded the way a pre-quantized checkpoint
is), ``hand`` (``QuantizedLinear(QuantizedWeight(...))`` built with inconsistent metadata)
or ``hf`` (crafted folders through transformers' ``from_pretrained``).  Prints one JSON
object: the outcome of every case.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sakura_quant import QuantizedLinear, QuantizedWeight, quantize_model
from sakura_quant._kernel import NO_KERNEL_ENV
from sakura_quant.hf.layout import METADATA_KEY, install_skeletons, layout_metadata

SIZES = (32, 48, 32, 32, 16, 16, 16)
FORMATS: list[tuple[str, dict[str, Any]]] = [
    ("nf4", {"error_rank": 4}),
    ("nf4", {"double_quant": True, "block_size": 32}),
    ("int8", {"double_quant": True}),
    ("fp8", {}),
    ("nvfp4", {}),
    ("nf4", {"block_size": 2}),
]
DTYPES = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F16": 2, "BF16": 2, "F32": 4, "I64": 8, "BOOL": 1}


def plain_model() -> nn.Module:
    layers = [nn.Linear(SIZES[i], SIZES[i + 1], bias=i % 2 == 0) for i in range(len(SIZES) - 1)]
    return nn.Sequential(*layers).requires_grad_(False)


def quantized_file() -> bytes:
    from safetensors.torch import save

    torch.manual_seed(0)
    model = plain_model()
    for i, (fmt, options) in enumerate(FORMATS):
        quantize_model(model, fmt, targets=[str(i)], **options)
    return save(model.state_dict(), metadata=layout_metadata(model))


def parse(blob: bytes) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors of a safetensors file as ``{key: [dtype, shape, bytes]}`` and its metadata."""
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    data = blob[8 + length :]
    meta = header.pop("__metadata__", {})
    tensors = {}
    for key, entry in header.items():
        start, end = entry["data_offsets"]
        tensors[key] = [entry["dtype"], list(entry["shape"]), data[start:end]]
    return tensors, meta


def build(tensors: dict[str, Any], meta: dict[str, str], skew: int = 0) -> bytes:
    """A safetensors file from :func:`parse`'s pieces; ``skew`` shifts one end offset."""
    header: dict[str, Any] = {"__metadata__": meta}
    data = b""
    for i, (key, (dtype, shape, raw)) in enumerate(tensors.items()):
        end = len(data) + len(raw) + (skew if i == 0 else 0)
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), end]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


ODD_VALUES: list[Any] = [
    0, -2, 1, 3, -64, 2**31 + 2, 10**12, 2**63, "64", None, 64.0, True, [64], 2, 4, 16, 32,
    128, 256, 4096,
]  # fmt: skip
FIELD_VALUES: dict[str, list[Any]] = {
    "block_size": ODD_VALUES,
    "format": ["nf4", "int8", "fp8", "nvfp4", "nf5", "", 1, None],
    "dtype": ["float32", "bfloat16", "float16", "int8", "uint8", "float64", None, 3],
    "error_iters": [0, -1, 1, 2, "1", None, 1.5],
    "tensors": [[], ["data"], ["data", "scales"], ["data", "scales", "global_scale"], "data",
                ["data", "scales", "scales_scale", "scales_offset"], [1, 2], None],
}  # fmt: skip


def mutate(rng: random.Random, tensors: dict[str, Any], meta: dict[str, str]) -> tuple[int, str]:
    """Apply one random mutation in place; returns (offset skew, what was done)."""
    try:
        layout = json.loads(meta[METADATA_KEY])
        layers = layout["layers"]
        if not layers or not all(isinstance(e, dict) for e in layers.values()):
            raise TypeError("no layer entries left to mutate")
        kind = rng.randrange(10)
    except (ValueError, KeyError, TypeError):  # an earlier mutation broke it: tensors only
        layout, layers, kind = None, {}, rng.randrange(5, 9)
    if kind <= 2:  # a field of one layer's entry
        name = rng.choice(sorted(layers))
        field = rng.choice(sorted(FIELD_VALUES))
        layers[name][field] = rng.choice(FIELD_VALUES[field])
        what = f"{name}.{field}={layers[name][field]!r}"
    elif kind == 3:  # the entry's structure
        name = rng.choice(sorted(layers))
        choice = rng.randrange(4)
        if choice == 0:
            layers[name].pop(rng.choice(sorted(layers[name])))
        elif choice == 1:
            layers[name]["extra"] = 1
        elif choice == 2:
            layers["no.such.layer"] = layers[name]
        else:
            layers[name] = rng.choice([None, [], "nf4", 7])
        what = f"{name} entry structure {choice}"
    elif kind == 4:  # the whole layout
        choice = rng.randrange(5)
        text = [
            "not json {",
            "[]",
            json.dumps({"version": 2, "layers": layers}),
            json.dumps({"version": 1, "layers": []}),
            json.dumps({"version": 1}),
        ][choice]
        meta[METADATA_KEY] = text
        return 0, f"layout {choice}"
    elif kind <= 6:  # a stored tensor of another element count (shape and bytes agree)
        key = rng.choice(sorted(tensors))
        dtype, shape, raw = tensors[key]
        size = DTYPES.get(dtype, 1)
        count = len(raw) // size
        new = rng.choice(
            [0, 1, max(count - 1, 0), count + 1, 2 * count, rng.randrange(4 * count + 2)]
        )
        tensors[key] = [dtype, [new], bytes(rng.randrange(256) for _ in range(new * size))]
        what = f"{key}: {count} -> {new} elements"
    elif kind == 7:  # another dtype, the bytes kept (the shape follows where it can)
        key = rng.choice(sorted(tensors))
        dtype, shape, raw = tensors[key]
        new_dtype = rng.choice(sorted(DTYPES))
        count = len(raw) // DTYPES[new_dtype]
        exact = count * DTYPES[new_dtype] == len(raw)
        tensors[key] = [new_dtype, [count] if exact else shape, raw]
        what = f"{key}: dtype {dtype} -> {new_dtype}"
    elif kind == 8:  # a shape the bytes do not hold, or a dropped tensor
        key = rng.choice(sorted(tensors))
        if rng.random() < 0.5:
            tensors[key][1] = [rng.choice([1, 2, 7, 10**6, 2**40])]
            what = f"{key}: shape {tensors[key][1]}"
        else:
            del tensors[key]
            what = f"{key} dropped"
    else:  # an offset that does not match
        return rng.choice([-3, -1, 1, 5, 10**9]), "skewed offsets"
    if layout is not None:
        meta[METADATA_KEY] = json.dumps(layout)
    return 0, what


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def load_and_run(path: Path) -> str:
    """Load ``path`` as a pre-quantized checkpoint (the layout's skeletons, then the tensors)
    and run the model; "ok" only if every layer expands to the same bits through the C++
    kernel and through the pure-torch path (an out-of-bounds read would differ)."""
    from safetensors.torch import load_file

    model = plain_model()
    install_skeletons(model, [path])
    model.load_state_dict(load_file(str(path)), strict=True, assign=True)
    out = model(torch.ones(3, SIZES[0]))
    if out.shape != (3, SIZES[-1]):
        return f"BAD: output shape {tuple(out.shape)}"
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        for dtype in (torch.float32, torch.bfloat16):
            os.environ[NO_KERNEL_ENV] = "0"
            kernel = layer.dequantize(dtype)
            os.environ[NO_KERNEL_ENV] = "1"
            reference = layer.dequantize(dtype)
            os.environ[NO_KERNEL_ENV] = "0"
            if not torch.equal(_bits(kernel), _bits(reference)):
                return f"BAD: {name} expands differently through the kernel"
    return "ok"


def classify(exc: BaseException) -> str:
    from safetensors import SafetensorError

    if isinstance(exc, SafetensorError):
        return "SafetensorError"  # safetensors' own header checks
    if isinstance(exc, RuntimeError) and str(exc).startswith("Error(s) in loading state_dict"):
        return "load_state_dict"  # torch's own key / size checks (a plain layer's keys)
    if isinstance(exc, ValueError):
        return "ValueError"
    return f"BAD: {type(exc).__name__}: {exc}"


def fuzz(out_dir: Path, cases: int = 300, seed: int = 19) -> dict[str, Any]:
    original = quantized_file()
    assert load_and_run(_write(out_dir, original)) == "ok"
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    bad: list[str] = []
    for case in range(cases):
        tensors, meta = parse(original)
        tensors, meta = copy.deepcopy(tensors), dict(meta)
        skew, what = 0, []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            shift, text = mutate(rng, tensors, meta)
            skew = skew or shift
            what.append(text)
        path = _write(out_dir, build(tensors, meta, skew))
        try:
            result = load_and_run(path)
        except Exception as exc:
            result = classify(exc)
        outcomes[result.split(":")[0]] = outcomes.get(result.split(":")[0], 0) + 1
        if result.startswith("BAD"):
            bad.append(f"case {case} ({'; '.join(what)}): {result}")
    return {"outcomes": outcomes, "bad": bad}


def _write(out_dir: Path, blob: bytes) -> Path:
    path = out_dir / "model.safetensors"
    path.write_bytes(blob)
    return path


def hand() -> dict[str, Any]:
    """``QuantizedLinear`` built by hand from metadata that disagrees with its tensors."""
    from sakura_quant import quantize_weight

    good = quantize_weight(torch.randn(64, 64), "nf4")
    t = good.tensors
    crafted = {
        "shape larger than the codes": ("nf4", (256, 256), torch.float32, 64, t),
        "1-element scales": ("nf4", (64, 64), torch.float32, 64, {**t, "scales": t["scales"][:1]}),
        "int8 dtype": ("nf4", (64, 64), torch.int8, 64, t),
        "block_size 0": ("nf4", (64, 64), torch.float32, 0, t),
        "block_size -64": ("nf4", (64, 64), torch.float32, -64, t),
        "block_size 1e12": ("nf4", (64, 64), torch.float32, 10**12, t),
        "odd block_size": ("nf4", (64, 64), torch.float32, 63, t),
        "int8 codes as nf4": ("nf4", (64, 64), torch.float32, 64, {**t, "data": t["data"].to(torch.int8)}),
        "unknown format": ("nf5", (64, 64), torch.float32, 64, t),
        "missing scales": ("nf4", (64, 64), torch.float32, 64, {"data": t["data"]}),
        "format int8 on nf4 codes": ("int8", (64, 64), torch.float32, 64, t),
        "wide crafted layer": ("nf4", (4096, 4096), torch.float32, 64, t),
    }  # fmt: skip
    outcomes = {}
    for label, (fmt, shape, dtype, block, tensors) in crafted.items():
        try:
            layer = QuantizedLinear(QuantizedWeight(fmt, shape, dtype, block, dict(tensors)))
            layer(torch.ones(1, shape[1]))
            outcomes[label] = "BAD: built and ran"
        except ValueError as exc:
            outcomes[label] = f"ValueError: {exc}"
        except Exception as exc:
            outcomes[label] = f"BAD: {type(exc).__name__}: {exc}"
    return outcomes


def hf(out_dir: Path) -> dict[str, Any]:
    """Crafted pre-quantized folders through transformers' ``from_pretrained``."""
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from sakura_quant import SakuraQuantConfig

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out_dir / "fp")
    auto = transformers.AutoModelForCausalLM
    auto.from_pretrained(
        out_dir / "fp", quantization_config=SakuraQuantConfig("nf4")
    ).save_pretrained(out_dir / "q")
    layer = "model.layers.0.self_attn.q_proj"

    def with_block(block: Any) -> Any:
        def change(sd: dict[str, torch.Tensor], layout: dict[str, Any]) -> None:
            layout["layers"][layer]["block_size"] = block

        return change

    def one_byte(sd: dict[str, torch.Tensor], layout: dict[str, Any]) -> None:
        sd[f"{layer}.weight"] = torch.zeros(1, dtype=torch.uint8)

    def one_scale(sd: dict[str, torch.Tensor], layout: dict[str, Any]) -> None:
        sd[f"{layer}.weight_scales"] = sd[f"{layer}.weight_scales"][:1].clone()

    def half_scales(sd: dict[str, torch.Tensor], layout: dict[str, Any]) -> None:
        sd[f"{layer}.weight_scales"] = sd[f"{layer}.weight_scales"].half()

    cases = {
        "1-byte q_proj.weight": one_byte,
        "1-element scales": one_scale,
        "fp16 scales": half_scales,
        "block_size 0": with_block(0),
        "block_size -2": with_block(-2),
        "block_size 10**12": with_block(10**12),
        "block_size 4096": with_block(4096),
    }
    outcomes = {}
    for label, change in cases.items():
        folder = out_dir / "case"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(out_dir / "q", folder)
        file = folder / "model.safetensors"
        with safe_open(str(file), "pt") as handle:
            meta = dict(handle.metadata())
        sd = load_file(str(file))
        layout = json.loads(meta[METADATA_KEY])
        change(sd, layout)
        meta[METADATA_KEY] = json.dumps(layout)
        save_file(sd, str(file), metadata=meta)
        try:
            model = auto.from_pretrained(folder)
            model(torch.zeros(1, 4, dtype=torch.long))
            outcomes[label] = "BAD: loaded and ran"
        except ValueError as exc:
            outcomes[label] = f"ValueError: {exc}"
        except Exception as exc:
            outcomes[label] = f"BAD: {type(exc).__name__}: {exc}"
    return outcomes


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, directory = sys.argv[1], Path(sys.argv[2])
    result = {"fuzz": lambda: fuzz(directory), "hand": hand, "hf": lambda: hf(directory)}[mode]()
    print(json.dumps(result))
