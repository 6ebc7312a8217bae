"""Payload encoding: cloudpickle + zstandard for objects, tensors kept out of the pickle.

Tensors are never pickled through torch's own reducer (which would copy their bytes into
the pickle stream).  :class:`Encoder` replaces each CPU tensor by a small reference:

* ``shm`` mode (a local worker): the tensor's bytes live in a shared-memory segment the
  worker maps; tensors already inside one of the dispatcher's segments (snapshot buffers
  from ``dispatcher.empty``) are referenced in place, others are copied once into a
  transient segment for this task.
* ``inline`` mode (a remote worker, results coming back): the bytes travel as pickle
  protocol-5 out-of-band buffers, sent raw after the compressed pickle (trained weights
  barely compress, so they are not run through zstd unless asked).

A frame body is::

    u32 nbuf | u64 len(zstd pickle) | u64 len(buffer) * nbuf | zstd pickle | buffers
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle  # type: ignore[import-untyped,unused-ignore]
import zstandard

__all__ = ["Decoder", "Encoder", "pack_frame", "unpack_frame"]

_ZSTD_LEVEL = 1
_COUNT = struct.Struct("!I")
_LEN = struct.Struct("!Q")

# Rebuilders referenced by the pickle stream (module-level so they pickle by name).


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _finish(t: Any, requires_grad: bool, parameter: bool) -> Any:
    import torch

    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _rebuild_inline(
    buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool, parameter: bool
) -> Any:
    import torch

    dt = _dtype(dtype)
    if len(memoryview(buf)) == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        raw = torch.frombuffer(
            bytearray(buf) if memoryview(buf).readonly else buf, dtype=torch.uint8
        )
        t = raw.view(dt).reshape(shape)
    return _finish(t, requires_grad, parameter)


def _rebuild_shm(
    seg: int,
    offset: int,
    nbytes: int,
    dtype: str,
    shape: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
) -> Any:
    import torch

    dt = _dtype(dtype)
    if nbytes == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        mm = _CURRENT.segments[seg]
        t = (
            torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
            .view(dt)
            .reshape(shape)
        )
    return _finish(t, requires_grad, parameter)


_CURRENT = threading.local()
"""``segments``: seg id -> mmap, set by the decoding thread (a worker) before unpickling."""


def _plain_tensor(obj: Any) -> bool:
    import torch

    if not isinstance(obj, torch.Tensor):
        return False
    if type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return obj.layout == torch.strided and not obj.is_quantized and obj.device.type != "meta"


# Placement: (tensor) -> (seg, offset, nbytes) for shm mode.
Placer = Callable[[Any], tuple[int, int, int]]


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    def __init__(self, file: Any, *, placer: Placer | None, buffers: list[Any]) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._placer = placer

    def reducer_override(self, obj: Any) -> Any:
        if _plain_tensor(obj):
            import torch

            t = obj.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            requires_grad = bool(obj.requires_grad)
            parameter = isinstance(obj, torch.nn.Parameter)
            dtype = str(t.dtype).removeprefix("torch.")
            shape = tuple(t.shape)
            if self._placer is not None:
                seg, offset, nbytes = self._placer(t)
                return _rebuild_shm, (seg, offset, nbytes, dtype, shape, requires_grad, parameter)
            t = t.contiguous()
            flat = (
                t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            )
            buf = pickle.PickleBuffer(flat.numpy())  # type: ignore[arg-type]
            return _rebuild_inline, (buf, dtype, shape, requires_grad, parameter)
        return super().reducer_override(obj)


class Encoder:
    """Encode one object into a frame body (see the module docstring)."""

    def __init__(self, placer: Placer | None = None, *, compress_buffers: bool = False) -> None:
        self.placer = placer
        self.compress_buffers = compress_buffers

    def encode(self, obj: Any) -> list[Any]:
        """Return the body as a list of bytes-like chunks (send them in order)."""
        buffers: list[Any] = []
        stream = io.BytesIO()
        _Pickler(stream, placer=self.placer, buffers=buffers).dump(obj)
        packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(stream.getbuffer())
        raws = [b.raw() for b in buffers]
        return pack_frame(packed, raws)


def pack_frame(packed: bytes, raws: Sequence[Any]) -> list[Any]:
    head = bytearray(_COUNT.pack(len(raws)))
    head += _LEN.pack(len(packed))
    for raw in raws:
        head += _LEN.pack(memoryview(raw).nbytes)
    return [bytes(head), packed, *raws]


def unpack_frame(body: Any) -> tuple[bytes, list[memoryview]]:
    view = memoryview(body)
    (count,) = _COUNT.unpack_from(view, 0)
    pos = _COUNT.size
    (plen,) = _LEN.unpack_from(view, pos)
    pos += _LEN.size
    lengths = []
    for _ in range(count):
        (n,) = _LEN.unpack_from(view, pos)
        lengths.append(n)
        pos += _LEN.size
    packed = view[pos : pos + plen]
    pos += plen
    raws = []
    for n in lengths:
        raws.append(view[pos : pos + n])
        pos += n
    return zstandard.ZstdDecompressor().decompress(packed), raws


class Decoder:
    """Decode a frame body; ``segments`` maps shm segment ids to mmaps (worker side)."""

    def __init__(self, segments: dict[int, Any] | None = None) -> None:
        self.segments = segments if segments is not None else {}

    def decode(self, body: Any) -> Any:
        data, raws = unpack_frame(body)
        _CURRENT.segments = self.segments
        try:
            return pickle.loads(data, buffers=raws)  # noqa: S301 - authenticated peer only
        finally:
            _CURRENT.segments = {}
