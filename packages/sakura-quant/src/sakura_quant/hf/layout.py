"""How a quantized model's layers are described in its safetensors files, and rebuilt.

``save_pretrained`` writes each ``QuantizedLinear``'s stored tensors under its own state-dict
keys (``<layer>.weight`` holds the codes, ``<layer>.weight_scales`` the scales, ...) and one
metadata entry, ``sakura_quant``, in every file's header: per layer, its format, block size,
compute dtype, tensor names and LoftQ rounds. The shapes and dtypes of the tensors are the
header's own. Loading reads only the headers to rebuild each layer on the meta device with
exactly those buffers, so transformers' loader then fills them as stored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sakura_quant.formats import QuantizedWeight
from sakura_quant.formats.checks import check_quantized_weight
from sakura_quant.linear import QuantizedLinear

__all__ = ["METADATA_KEY", "install_skeletons", "layout_metadata", "read_layout"]

METADATA_KEY = "sakura_quant"
_LAYOUT_VERSION = 1

# safetensors' header dtype names, for the dtypes sakura-quant stores.
_HEADER_DTYPES = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
}
_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _buffer(name: str) -> str:
    return "weight" if name == "data" else f"weight_{name}"


def layout_metadata(model: nn.Module) -> dict[str, str]:
    """The safetensors metadata describing every ``QuantizedLinear`` of ``model``."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            layers[name] = {
                "format": module.format,
                "block_size": module.block_size,
                "dtype": str(module.compute_dtype).removeprefix("torch."),
                "tensors": list(module.quantized_weight().tensors),
                "error_iters": module.error_iters,
            }
    return {METADATA_KEY: json.dumps({"version": _LAYOUT_VERSION, "layers": layers})}


def read_layout(files: Iterable[str | Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(layers, headers)`` of a quantized checkpoint: the layer entries of its metadata and,
    for every key of its files, ``(shape, dtype)``, read from the headers only."""
    from safetensors import safe_open

    layers: dict[str, Any] | None = None
    headers: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for file in files:
        if not str(file).endswith(".safetensors"):
            raise ValueError(
                f"SakuraQuantConfig: a quantized checkpoint is read from safetensors files, "
                f"got {file}"
            )
        with safe_open(str(file), framework="pt") as handle:
            meta = (handle.metadata() or {}).get(METADATA_KEY)
            if meta is not None and layers is None:
                try:
                    entry = json.loads(meta)
                except ValueError as exc:
                    raise ValueError(
                        f"{file}: the sakura_quant layout is not JSON ({exc})"
                    ) from None
                if not isinstance(entry, dict) or not isinstance(entry.get("layers"), dict):
                    raise ValueError(
                        f"{file}: the sakura_quant layout must be an object with 'version' "
                        f"and 'layers' (an object), got {meta[:200]!r}"
                    )
                if entry.get("version") != _LAYOUT_VERSION:
                    raise ValueError(
                        f"{file}: sakura_quant layout version {entry.get('version')!r}, this "
                        f"sakura-quant reads version {_LAYOUT_VERSION}"
                    )
                layers = entry["layers"]
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                part = handle.get_slice(key)
                headers[key] = (tuple(part.get_shape()), _HEADER_DTYPES.get(part.get_dtype()))
    if layers is None:
        raise ValueError(
            "the checkpoint's config.json names quant_method 'sakura_quant' but none of its "
            f"safetensors files carries the {METADATA_KEY!r} layout (was it written by "
            "save_pretrained of a model loaded with SakuraQuantConfig?)"
        )
    return layers, headers


def _meta_tensor(headers: dict[str, Any], key: str) -> torch.Tensor:
    if key not in headers:
        raise ValueError(f"the quantized checkpoint lacks {key}")
    shape, dtype = headers[key]
    if dtype is None:
        raise ValueError(
            f"the quantized checkpoint stores {key} in a dtype sakura-quant never writes"
        )
    return torch.empty(shape, dtype=dtype, device="meta")


_ENTRY_KEYS = {"format", "block_size", "dtype", "tensors", "error_iters"}


def _entry_field(name: str, entry: dict[str, Any], key: str, ok: bool, accepted: str) -> None:
    if not ok:
        raise ValueError(
            f"the quantized checkpoint's layout gives {name} {key}={entry.get(key)!r}; "
            f"accepted: {accepted}"
        )


def skeleton(
    name: str, entry: dict[str, Any], headers: dict[str, Any], linear: nn.Linear
) -> QuantizedLinear:
    """The ``QuantizedLinear`` that ``entry`` describes, its buffers on the meta device.

    The entry and the header's shapes and dtypes are untrusted: each field is checked, and
    the stored tensors against what the format, the layer's shape and the block size
    imply (:func:`~sakura_quant.formats.checks.check_quantized_weight`), before any layer
    exists; a mismatch is a ``ValueError`` naming the layer and the sizes.
    """
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise ValueError(
            f"the quantized checkpoint's layout entry for {name} must be an object with the "
            f"keys {sorted(_ENTRY_KEYS)}, got {entry!r:.200}"
        )
    _entry_field(
        name, entry, "dtype", entry["dtype"] in _COMPUTE_DTYPES, str(list(_COMPUTE_DTYPES))
    )
    names = entry["tensors"]
    _entry_field(
        name,
        entry,
        "tensors",
        isinstance(names, list) and all(isinstance(t, str) for t in names),
        "a list of tensor names",
    )
    for key in ("block_size", "error_iters"):
        value = entry[key]
        _entry_field(
            name,
            entry,
            key,
            isinstance(value, int) and not isinstance(value, bool) and value >= 1,
            "an int >= 1",
        )
    tensors = {t: _meta_tensor(headers, f"{name}.{_buffer(t)}") for t in names}
    qweight = QuantizedWeight(
        format=entry["format"],
        shape=(linear.out_features, linear.in_features),
        dtype=_COMPUTE_DTYPES[entry["dtype"]],
        block_size=entry["block_size"],
        tensors=tensors,
    )
    check_quantized_weight(qweight, name=name)
    factors = None
    if f"{name}.error_a" in headers:
        factors = (
            _meta_tensor(headers, f"{name}.error_a"),
            _meta_tensor(headers, f"{name}.error_b"),
        )
    try:
        layer = QuantizedLinear(
            qweight, None, error_factors=factors, error_iters=entry["error_iters"]
        )
    except ValueError as exc:
        raise ValueError(f"the quantized checkpoint's {name}: {exc}") from None
    layer.bias = linear.bias
    return layer


def install_skeletons(model: nn.Module, files: Iterable[str | Path]) -> list[str]:
    """Replace every layer the checkpoint stores quantized by its skeleton; returns the names."""
    layers, headers = read_layout(files)
    if not isinstance(layers, dict):
        raise ValueError(
            f"the quantized checkpoint's layout 'layers' is not an object: {layers!r:.200}"
        )
    for name, entry in layers.items():
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"the quantized checkpoint stores {name!r} as a quantized Linear, but the model "
                "has no such module"
            ) from None
        if not isinstance(linear, nn.Linear):
            raise ValueError(
                f"the quantized checkpoint stores {name} as a quantized Linear, but the model's "
                f"{name} is a {type(linear).__name__}"
            )
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, skeleton(name, entry, headers, linear))
    return list(layers)
