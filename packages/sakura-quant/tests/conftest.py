from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def _one_thread_and_seed() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)


class TinyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.v_proj(self.norm(x))) * torch.sigmoid(self.q_proj(x))


class TinyLM(nn.Module):
    """An embedding, two blocks and an lm_head: the shape of a decoder, 64 wide."""

    def __init__(self, vocab: int = 32, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([TinyBlock(dim) for _ in range(2)])
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


@pytest.fixture
def make_tiny_lm() -> Callable[[], TinyLM]:
    """Builds a fresh TinyLM (seeded by the autouse fixture)."""
    return TinyLM
