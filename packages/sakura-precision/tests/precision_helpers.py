"""Tiny models, data and reference loops shared by the sakura-precision tests.

Imported by name (the tests directory is put on ``sys.path`` by ``conftest.py``, and the
2-rank DDP test runs its workers from this directory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FEATURES = 16
HIDDEN = 32
CLASSES = 4


class Block(nn.Module):
    """A pre-norm residual MLP block: the repeated unit of :class:`TinyStack`."""

    def __init__(self, dim: int = FEATURES, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class TinyStack(nn.Module):
    """Embedding projection, ``depth`` blocks in a ModuleList, a classification head."""

    def __init__(
        self, depth: int = 3, dim: int = FEATURES, hidden: int = HIDDEN, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, dropout) for _ in range(depth))
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_model(seed: int = 0, **kwargs: Any) -> TinyStack:
    torch.manual_seed(seed)
    return TinyStack(**kwargs)


def make_batches(
    steps: int, batch: int = 8, dim: int = FEATURES, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, dim, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
        for _ in range(steps)
    ]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), y)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def runtime_loop(
    rt: Any,
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float = 0.1,
    clip: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[list[float], torch.optim.Optimizer]:
    """A raw loop driven through the runtime's coordinated calls; returns the losses."""
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, optimizer = rt.prepare(model, optimizer)
    losses = []
    for x, y in batches:
        with rt.autocast():
            loss = loss_fn(model(x), y)
        rt.backward(loss)
        if clip is not None:
            rt.clip_grad_norm_(optimizer, clip)
        if not rt.optimizer_step(optimizer):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, optimizer


def grad_scaler_loop(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float = 0.1,
    clip: float | None = None,
    scaler: torch.amp.GradScaler | None = None,
    schedule: Callable[[int], float] | None = None,
) -> tuple[list[float], torch.amp.GradScaler]:
    """The hand-written fp16 loop from torch's AMP recipe (CPU), the reference.

    With ``schedule`` (a LambdaLR factor), the LR scheduler steps after each step that was
    not skipped (the scale did not back off), as the Hugging Face Trainer does."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = scaler or torch.amp.GradScaler("cpu")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule else None
    losses = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scheduler is not None and scaler.get_scale() >= scale:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, scaler


@contextmanager
def count_saved_bytes(model: nn.Module | None = None) -> Iterator[list[int]]:
    """Count the bytes of the activations autograd saves for backward inside the block
    (``saved_tensors_hooks``): storage shared between saved tensors is counted once, and
    the parameters of ``model`` (which exist anyway) are not counted."""
    total = [0]
    seen: set[int] = set()
    if model is not None:
        seen.update(p.untyped_storage().data_ptr() for p in model.parameters())

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
