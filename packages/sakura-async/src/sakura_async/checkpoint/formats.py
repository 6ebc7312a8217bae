"""Checkpoint file formats: write a state tree to a (hashing) stream, read it back.

* ``torch`` — ``torch.save`` of the tree; loadable with ``torch.load(weights_only=True)``
  as long as the tree holds tensors, containers and plain Python values.
* ``safetensors`` — the safetensors layout (an 8-byte header length, a JSON header, the raw
  tensor bytes), written by streaming each tensor's bytes (no second in-memory copy) and
  read back with the ``safetensors`` library.  The tree's structure and its non-tensor
  values are kept as JSON in the header's ``__metadata__`` (key ``sakura.tree``), so any
  tree of dicts, lists, tuples, tensors and plain values round-trips.
* ``lightning`` — a Lightning checkpoint dict (what ``Trainer.save_checkpoint`` writes),
  saved with ``torch.save`` so ``Trainer.fit(ckpt_path=...)`` resumes from it.

Optional zstd compression (``compress=<level>``) wraps the stream; it is measured in
``benchmarks/checkpoint_stall.py`` before anyone makes it a default (trained fp32 weights
compress ~1.08×).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, BinaryIO

__all__ = [
    "FORMATS",
    "HashingWriter",
    "main_file",
    "read_state",
    "tree_from_json",
    "tree_to_json",
    "write_state",
]

FORMATS = ("torch", "safetensors", "lightning")

_MAIN_FILE = {
    "torch": "state.pt",
    "safetensors": "state.safetensors",
    "lightning": "checkpoint.ckpt",
}


def main_file(fmt: str, compress: int | None) -> str:
    name = _MAIN_FILE[fmt]
    return f"{name}.zst" if compress else name


class HashingWriter(io.RawIOBase):
    """A write-only stream that hashes (sha256) and counts what goes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self._raw.write(view)
        self.bytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()


# --- safetensors --------------------------------------------------------------------------

_ST_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "complex64": "C64",
}


def tree_to_json(tree: Any, tensors: list[Any], path: str = "state") -> Any:
    """Encode ``tree`` as JSON-able data; tensors are appended to ``tensors`` and replaced
    by ``{"__tensor__": index}``.  Dict keys may be str, int, float, bool or None."""
    import torch

    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(tree, Mapping):
        items = []
        for key, value in tree.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise TypeError(
                    f"format='safetensors' stores dict keys of type str, int, float, bool or None; "
                    f"{path} has a key of type {type(key).__name__}; use format='torch'"
                )
            items.append([key, tree_to_json(value, tensors, f"{path}[{key!r}]")])
        kind = "odict" if isinstance(tree, OrderedDict) else "dict"
        return {f"__{kind}__": items}
    if isinstance(tree, tuple):
        return {"__tuple__": [tree_to_json(v, tensors, f"{path}[{i}]") for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [tree_to_json(v, tensors, f"{path}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, float) and not math.isfinite(tree):
        return {"__float__": repr(tree)}
    if isinstance(tree, (str, int, float, bool, type(None))):
        return tree
    if isinstance(tree, torch.dtype):
        return {"__dtype__": str(tree).removeprefix("torch.")}
    raise TypeError(
        f"format='safetensors' stores tensors, dicts, lists, tuples and plain Python values; "
        f"{path} is a {type(tree).__module__}.{type(tree).__qualname__}; use format='torch'"
    )


def tree_from_json(data: Any, tensors: Mapping[str, Any]) -> Any:
    import torch

    if isinstance(data, list):
        return [tree_from_json(v, tensors) for v in data]
    if isinstance(data, dict):
        if "__tensor__" in data:
            return tensors[f"t{data['__tensor__']}"]
        if "__dict__" in data:
            return {k: tree_from_json(v, tensors) for k, v in data["__dict__"]}
        if "__odict__" in data:
            return OrderedDict((k, tree_from_json(v, tensors)) for k, v in data["__odict__"])
        if "__tuple__" in data:
            return tuple(tree_from_json(v, tensors) for v in data["__tuple__"])
        if "__float__" in data:
            return float(data["__float__"])
        if "__dtype__" in data:
            return getattr(torch, data["__dtype__"])
        raise ValueError(f"unknown encoded value {data!r}")
    return data


def _write_safetensors(tree: Any, out: Any) -> None:
    import torch

    tensors: list[Any] = []
    skeleton = tree_to_json(tree, tensors)
    header: dict[str, Any] = {}
    offset = 0
    flat: list[Any] = []
    for i, t in enumerate(tensors):
        dtype = str(t.dtype).removeprefix("torch.")
        code = _ST_DTYPES.get(dtype)
        if code is None:
            raise TypeError(
                f"format='safetensors' cannot store dtype {t.dtype}; use format='torch'"
            )
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        header[f"t{i}"] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        flat.append(t)
    header["__metadata__"] = {"sakura.tree": json.dumps(skeleton), "format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    out.write(struct.pack("<Q", len(encoded)))
    out.write(encoded)
    for t in flat:
        if t.numel():
            out.write(t.reshape(-1).view(torch.uint8).numpy().data)


def _read_safetensors(data: bytes | None, path: str | None) -> Any:
    from safetensors.torch import load, load_file

    tensors = load(data) if data is not None else load_file(path)  # type: ignore[arg-type]
    if data is None:
        with open(path, "rb") as f:  # type: ignore[arg-type]
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    else:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
    skeleton = json.loads(header["__metadata__"]["sakura.tree"])
    return tree_from_json(skeleton, tensors)


# --- entry points -----------------------------------------------------------------------


def write_state(tree: Any, raw: BinaryIO, fmt: str, compress: int | None) -> HashingWriter:
    """Write ``tree`` to ``raw`` in ``fmt``; return the hashing writer (hash and size of the
    bytes that reached ``raw``)."""
    import torch

    hashing = HashingWriter(raw)
    if compress:
        import zstandard

        sink: Any = zstandard.ZstdCompressor(level=compress).stream_writer(hashing, closefd=False)  # type: ignore[arg-type]
    else:
        sink = io.BufferedWriter(hashing, buffer_size=1 << 20)
    if fmt == "safetensors":
        _write_safetensors(tree, sink)
    else:
        torch.save(tree, sink)
    if compress:
        sink.flush(zstandard.FLUSH_FRAME)
        sink.close()
    else:
        sink.flush()
        sink.detach()
    return hashing


def read_state(path: str, fmt: str, *, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """Read the state tree of a checkpoint file written by :func:`write_state`."""
    import torch

    if path.endswith(".zst"):
        import zstandard

        with open(path, "rb") as f:
            data = zstandard.ZstdDecompressor().stream_reader(f).read()
        if fmt == "safetensors":
            return _read_safetensors(data, None)
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    if fmt == "safetensors":
        tree = _read_safetensors(None, path)
        if map_location not in (None, "cpu"):
            from sakura_async.snapshot import map_tensors

            tree = map_tensors(tree, lambda t: t.to(map_location))
        return tree
    return torch.load(path, map_location=map_location, weights_only=weights_only)
