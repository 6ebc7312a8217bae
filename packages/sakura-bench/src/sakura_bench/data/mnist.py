"""MNIST: the IDX file reader and synthetic digits with MNIST's shapes.

IDX (http://yann.lecun.com/exdb/mnist/): two zero bytes, a type code (0x08 = unsigned
byte), the number of dimensions, each dimension as a big-endian int32, then the data.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import torch

from sakura_bench.data.files import find_file, read_bytes
from sakura_bench.errors import BenchError

__all__ = ["MNIST_MEAN", "MNIST_STD", "load_mnist", "read_idx", "synthetic_digits"]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
_IDX_TYPES = {
    0x08: torch.uint8,
    0x09: torch.int8,
    0x0B: torch.int16,
    0x0C: torch.int32,
    0x0D: torch.float32,
    0x0E: torch.float64,
}
_SUBDIRS = ("MNIST/raw", "mnist", "raw")


def read_idx(path: str | Path) -> torch.Tensor:
    """Read an IDX file (optionally gzipped) into a tensor of its shape and type."""
    path = Path(path)
    data = read_bytes(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise BenchError(f"{path} is not an IDX file (it must start with two zero bytes)")
    dtype = _IDX_TYPES.get(data[2])
    if dtype is None:
        raise BenchError(f"{path}: unknown IDX type code 0x{data[2]:02x}")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise BenchError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}i", data[4:header])
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = itemsize
    for dim in shape:
        expected *= dim
    if len(data) - header != expected:
        raise BenchError(
            f"{path}: IDX header says shape {tuple(shape)} ({expected} bytes of data) but the "
            f"file holds {len(data) - header}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8)
    if itemsize > 1 and sys.byteorder == "little":  # IDX numbers are big-endian
        raw = raw.view(-1, itemsize).flip(1).contiguous().view(-1)
    return raw.view(dtype).reshape(shape)


def _pair(data_dir: str | Path, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    images = read_idx(
        find_file(
            data_dir, [f"{prefix}-images-idx3-ubyte", f"{prefix}-images.idx3-ubyte"], _SUBDIRS
        )
    )
    labels = read_idx(
        find_file(
            data_dir, [f"{prefix}-labels-idx1-ubyte", f"{prefix}-labels.idx1-ubyte"], _SUBDIRS
        )
    )
    if images.dim() != 3 or images.dtype != torch.uint8:
        raise BenchError(
            f"MNIST {prefix} images must be uint8 N x H x W, got {tuple(images.shape)}"
        )
    if labels.dim() != 1 or labels.shape[0] != images.shape[0]:
        raise BenchError(
            f"MNIST {prefix}: {images.shape[0]} images but labels of shape {tuple(labels.shape)}"
        )
    if int(labels.max()) > 9:
        raise BenchError(f"MNIST {prefix} labels must be 0-9, found {int(labels.max())}")
    return normalize(images), labels.long()


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 N x 28 x 28 -> float N x 1 x 28 x 28, standardised as usual for MNIST."""
    return ((images.float() / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)


def load_mnist(
    data_dir: str | Path,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((train_x, train_y), (test_x, test_y))`` from the four IDX files in ``data_dir``."""
    return _pair(data_dir, "train"), _pair(data_dir, "t10k")


def synthetic_digits(
    n: int,
    seed: int,
    split: int,
    *,
    shape: tuple[int, ...] = (1, 28, 28),
    classes: int = 10,
    signal: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` learnable synthetic images: a faint fixed random prototype per class under
    strong noise (``signal`` of the pixel intensity), standardised, so that a model learns
    over several epochs rather than at once.  The prototypes depend on ``seed`` only, so the splits (``split`` 0 for
    training, 1 for evaluation) share them; the samples differ per split."""
    prototypes = torch.rand((classes, *shape), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 7919 + 101 * (split + 1))
    labels = torch.randint(0, classes, (n,), generator=g)
    noise = torch.rand((n, *shape), generator=g)
    images = signal * prototypes[labels] + (1.0 - signal) * noise
    return (images - images.mean()) / images.std(), labels
