"""CIFAR-10: the binary-batch reader and synthetic images with CIFAR-10's shapes.

The binary version (``cifar-10-batches-bin/``): ``data_batch_1.bin`` ... ``data_batch_5.bin``
and ``test_batch.bin``, each a sequence of 3073-byte records: the label byte (0-9), then
1024 red, 1024 green and 1024 blue bytes of a 32x32 image, row by row.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sakura_bench.data.files import find_file, read_bytes
from sakura_bench.data.mnist import synthetic_digits
from sakura_bench.errors import BenchError

__all__ = ["CIFAR_MEAN", "CIFAR_STD", "load_cifar10", "read_cifar_batch", "synthetic_cifar"]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
_RECORD = 1 + 3 * 32 * 32
_SUBDIRS = ("cifar-10-batches-bin",)


def read_cifar_batch(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images uint8 N x 3 x 32 x 32, labels int64 N)`` of one binary batch file."""
    path = Path(path)
    data = read_bytes(path)
    if not data or len(data) % _RECORD:
        raise BenchError(
            f"{path}: {len(data)} bytes is not a whole number of {_RECORD}-byte CIFAR-10 records"
        )
    records = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, _RECORD)
    labels = records[:, 0].long()
    if int(labels.max()) > 9:
        raise BenchError(f"{path}: CIFAR-10 labels must be 0-9, found {int(labels.max())}")
    return records[:, 1:].reshape(-1, 3, 32, 32).clone(), labels


def normalize(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std


def load_cifar10(
    data_dir: str | Path,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((train_x, train_y), (test_x, test_y))``: every ``data_batch_*.bin`` found (at
    least ``data_batch_1.bin``) and ``test_batch.bin``."""
    first = find_file(data_dir, ["data_batch_1.bin"], _SUBDIRS)
    parts = [read_cifar_batch(first)]
    for i in range(2, 6):
        candidate = first.parent / first.name.replace("_1.bin", f"_{i}.bin")
        if candidate.is_file():
            parts.append(read_cifar_batch(candidate))
    test_x, test_y = read_cifar_batch(find_file(data_dir, ["test_batch.bin"], _SUBDIRS))
    train_x = torch.cat([p[0] for p in parts])
    train_y = torch.cat([p[1] for p in parts])
    return (normalize(train_x), train_y), (normalize(test_x), test_y)


def synthetic_cifar(n: int, seed: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` learnable synthetic 3 x 32 x 32 images in 10 classes."""
    return synthetic_digits(n, seed, split, shape=(3, 32, 32))
