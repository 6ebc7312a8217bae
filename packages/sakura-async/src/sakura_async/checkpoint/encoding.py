"""Checkpoint file formats: write a state tree to a (hashing) stream, read it back.

* ``torch`` — ``torch.save`` of the tree; loadable with ``torch.load(weights_only=True)``
  as long as the tree holds tensors, containers and plain Python values.
* ``safetensors`` — the safetensors layout (an 8-byte header length, a JSON header, the raw
  tensor bytes), written by streaming each tensor's bytes (no second in-memory copy) and
  read back with the ``safetensors`` library.  The tree's structure and its non-tensor
  values are kept as JSON in the header's ``__metadata__`` (key ``sakura.tree``), so any
  tree of dicts, lists, tuples, tensors and plain values round-trips.
* ``loop`` — the loop's own full checkpoint dict (``LoopContext.checkpoint_state``, in
  whatever layout its framework uses), saved with ``torch.save``.
* ``lightning`` — the same for a Lightning checkpoint dict (what ``Trainer.save_checkpoint``
  writes), so ``Trainer.fit(ckpt_path=...)`` resumes from the file.

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
from functools import cache
from typing import Any, BinaryIO

from sakura_async.errors import CheckpointError

__all__ = [
    "FORMATS",
    "HashingWriter",
    "decode_tree",
    "main_file",
    "read_state",
    "tree_from_json",
    "tree_to_json",
    "write_state",
]

FORMATS = ("torch", "safetensors", "loop", "lightning")

_MAIN_FILE = {
    "torch": "state.pt",
    "safetensors": "state.safetensors",
    "loop": "checkpoint.pt",
    "lightning": "checkpoint.ckpt",
}


def main_file(fmt: str, compress: int | None) -> str:
    name = _MAIN_FILE[fmt]
    return f"{name}.zst" if compress else name


class HashingWriter(io.RawIOBase):
    """A write-only stream that hashes (sha256) and counts what goes through it.

    It remembers the first ``OSError`` of the underlying file (``error``): ``torch.save``
    turns it into a ``RuntimeError`` of its own, and :func:`write_state` raises the OS
    error itself instead."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        try:
            self._raw.write(view)
        except OSError as exc:
            self.error = self.error or exc
            raise
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


_MAX_DEPTH = 100
"""How deeply containers may nest in a safetensors tree (written and read): a real state
tree nests a few levels; a forged one must not exhaust the stack."""
_KEY_TYPES = (str, int, float, bool, type(None))
_NON_FINITE = ("nan", "inf", "-inf")


@cache
def _dtypes() -> dict[str, Any]:
    """The allow-list of ``__dtype__`` values: every ``torch.dtype`` object by its own
    name.  Decoding looks names up here, never with ``getattr(torch, name)``."""
    import torch

    return {
        str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
    }


def tree_to_json(tree: Any, tensors: list[Any], path: str = "state", depth: int = 0) -> Any:
    """Encode ``tree`` as JSON-able data; tensors are appended to ``tensors`` and replaced
    by ``{"__tensor__": index}``.  Dict keys may be str, int, float, bool or None."""
    import torch

    if depth > _MAX_DEPTH:
        raise TypeError(
            f"format='safetensors' stores trees nested at most {_MAX_DEPTH} levels deep; "
            f"{path} is deeper (or the tree contains itself); use format='torch'"
        )
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(tree, Mapping):
        items = []
        for key, value in tree.items():
            if not isinstance(key, _KEY_TYPES):
                raise TypeError(
                    f"format='safetensors' stores dict keys of type str, int, float, bool or None; "
                    f"{path} has a key of type {type(key).__name__}; use format='torch'"
                )
            items.append([key, tree_to_json(value, tensors, f"{path}[{key!r}]", depth + 1)])
        kind = "odict" if isinstance(tree, OrderedDict) else "dict"
        return {f"__{kind}__": items}
    if isinstance(tree, tuple):
        encoded = [tree_to_json(v, tensors, f"{path}[{i}]", depth + 1) for i, v in enumerate(tree)]
        return {"__tuple__": encoded}
    if isinstance(tree, list):
        return [tree_to_json(v, tensors, f"{path}[{i}]", depth + 1) for i, v in enumerate(tree)]
    if isinstance(tree, float) and not math.isfinite(tree):
        return {"__float__": repr(tree)}
    if isinstance(tree, _KEY_TYPES):
        return tree
    if isinstance(tree, torch.dtype):
        return {"__dtype__": str(tree).removeprefix("torch.")}
    raise TypeError(
        f"format='safetensors' stores tensors, dicts, lists, tuples and plain Python values; "
        f"{path} is a {type(tree).__module__}.{type(tree).__qualname__}; use format='torch'"
    )


def _corrupt(path: str, problem: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint's tree is malformed at {path}: {problem}")


def tree_from_json(data: Any, tensors: Mapping[str, Any]) -> Any:
    """Decode what :func:`tree_to_json` wrote.  The data is untrusted: anything but the
    exact shapes it writes (one marker key per object, dict keys of plain types, tensor
    indices present in ``tensors``, dtype names of real ``torch.dtype`` objects, at most
    ``_MAX_DEPTH`` levels) raises :class:`~sakura_async.errors.CheckpointError`, and the
    result holds only containers, plain values, dtypes and the tensors of ``tensors``."""
    return _decode(data, tensors, _dtypes(), "state", 0)


def _decode(
    data: Any, tensors: Mapping[str, Any], dtypes: dict[str, Any], path: str, depth: int
) -> Any:
    if depth > _MAX_DEPTH:
        raise _corrupt(path, f"containers nest deeper than {_MAX_DEPTH} levels")
    if isinstance(data, list):
        return [_decode(v, tensors, dtypes, f"{path}[{i}]", depth + 1) for i, v in enumerate(data)]
    if not isinstance(data, dict):
        if isinstance(data, _KEY_TYPES):
            return data
        raise _corrupt(path, f"a value of type {type(data).__name__}")
    if len(data) != 1:
        raise _corrupt(
            path, f"an object with keys {sorted(map(str, data))[:8]} (one marker expected)"
        )
    ((marker, value),) = data.items()
    if marker == "__tensor__":
        name = f"t{value}" if isinstance(value, int) and not isinstance(value, bool) else None
        if name is None or name not in tensors:
            raise _corrupt(path, f"tensor {value!r} is not in the file")
        return tensors[name]
    if marker in ("__dict__", "__odict__"):
        if not isinstance(value, list):
            raise _corrupt(path, f"{marker} holds a {type(value).__name__}, not a list of pairs")
        items = []
        for pair in value:
            if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], _KEY_TYPES):
                raise _corrupt(path, f"{marker} holds {_short(pair)}, not a [key, value] pair")
            key = pair[0]
            items.append((key, _decode(pair[1], tensors, dtypes, f"{path}[{key!r}]", depth + 1)))
        return dict(items) if marker == "__dict__" else OrderedDict(items)
    if marker == "__tuple__":
        if not isinstance(value, list):
            raise _corrupt(path, f"__tuple__ holds a {type(value).__name__}, not a list")
        return tuple(
            _decode(v, tensors, dtypes, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)
        )
    if marker == "__float__":
        if value not in _NON_FINITE:
            raise _corrupt(path, f"__float__ {_short(value)} is not one of {_NON_FINITE}")
        return float(value)
    if marker == "__dtype__":
        dtype = dtypes.get(value) if isinstance(value, str) else None
        if dtype is None:
            raise _corrupt(path, f"__dtype__ {_short(value)} is not a torch dtype")
        return dtype
    raise _corrupt(path, f"unknown marker {_short(marker)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def decode_tree(text: Any, tensors: Mapping[str, Any]) -> Any:
    """Parse the JSON ``text`` of a tree (``sakura.tree``) and decode it; anything
    malformed raises :class:`~sakura_async.errors.CheckpointError`."""
    if not isinstance(text, (str, bytes)):
        raise CheckpointError(f"the checkpoint's tree is a {type(text).__name__}, not JSON text")
    try:
        skeleton = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, int digits, nesting
        raise CheckpointError(f"the checkpoint's tree is not valid JSON ({_short(exc)})") from None
    return tree_from_json(skeleton, tensors)


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


def _read_safetensors(data: bytes | None, path: str) -> Any:
    """The tree of a safetensors checkpoint: from ``data`` (decompressed) or the file."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load, load_file

    try:
        if data is not None:
            tensors = load(data)
            (size,) = struct.unpack("<Q", data[:8])
            # safetensors checked the header against the data already
            metadata = json.loads(data[8 : 8 + size]).get("__metadata__")
        else:
            tensors = load_file(path)
            with safe_open(path, framework="pt") as f:
                metadata = f.metadata()
    except (SafetensorError, ValueError, struct.error, AttributeError) as exc:
        raise CheckpointError(f"not a readable safetensors file ({_short(exc)})") from None
    if not isinstance(metadata, dict) or "sakura.tree" not in metadata:
        raise CheckpointError("the safetensors file holds no sakura.tree metadata")
    return decode_tree(metadata["sakura.tree"], tensors)


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
        try:
            torch.save(tree, sink)
        except RuntimeError:
            if hashing.error is None:
                raise
            # torch reports a failed write as "[enforce fail ...] unexpected pos": the
            # disk's error (ENOSPC, EFBIG, EIO) is the one that says what happened.
            raise hashing.error from None
    if compress:
        sink.flush(zstandard.FLUSH_FRAME)
        sink.close()
    else:
        sink.flush()
        sink.detach()
    return hashing


def read_state(path: str, fmt: str, *, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """Read the state tree of a checkpoint file written by :func:`write_state`.

    The file is untrusted: content that does not decode (a malformed tree, a pickle that
    ``torch.load`` rejects or that fails, broken compression) raises
    :class:`~sakura_async.errors.CheckpointError`; an ``OSError`` reading the file is
    raised as itself."""
    import torch

    source: Any = path
    if path.endswith(".zst"):
        import zstandard

        with open(path, "rb") as f:
            try:
                source = zstandard.ZstdDecompressor().stream_reader(f).read()
            except zstandard.ZstdError as exc:
                raise CheckpointError(f"{path} does not decompress ({_short(exc)})") from None
    if fmt == "safetensors":
        tree = _read_safetensors(source if isinstance(source, bytes) else None, path)
        if map_location not in (None, "cpu"):
            from sakura_async.snapshot import map_tensors

            tree = map_tensors(tree, lambda t: t.to(map_location))
        return tree
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only)
    except OSError:
        raise
    except Exception as exc:  # an untrusted pickle can fail in any way: corrupt, not a crash
        raise CheckpointError(f"{path} does not load with torch.load ({_short(exc)})") from exc
