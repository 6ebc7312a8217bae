"""Activation paging: bit-exact gradients, broadcast views kept, files freed, bad input."""

from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura.options import OptionError
from sakura_offload.paging.activations import ActivationPaging, is_broadcast, is_dense


class Block(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(self.norm(x)))
        return x + self.down(h) * mask  # mask: a broadcast view, saved by the multiply


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleList([Block() for _ in range(3)])


def run(blocks: torch.nn.Module, paging: ActivationPaging | None) -> tuple[float, list[Any]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 32, 64, generator=g, requires_grad=True)
    mask = (torch.rand(8, 1, 64, generator=g) > 0.2).float().expand(8, 32, 64)
    with paging if paging is not None else torch.enable_grad():
        h = x
        for block in blocks:
            h = block(h, mask)
        loss = h.pow(2).mean()
    loss.backward()
    return loss.item(), [x.grad, *(p.grad for p in blocks.parameters())]


def test_disk_tier_gradients_are_bit_exact(tmp_path: Path) -> None:
    plain, paged_model = model(), model()
    loss_ref, grads_ref = run(plain, None)
    paging = ActivationPaging("disk", directory=tmp_path, min_bytes=1024)
    loss, grads = run(paged_model, paging)
    assert loss == loss_ref
    for a, b in zip(grads, grads_ref, strict=True):
        assert torch.equal(a, b)
    assert paging.stats.paged >= 6 and paging.stats.paged_bytes > 1 << 20
    assert paging.stats.restored == paging.stats.paged
    assert paging.stats.kept_broadcast >= 3  # the expanded mask, once per block
    gc.collect()
    assert paging.root is not None and list(paging.root.iterdir()) == []  # freed with the graph
    assert paging.stats.files_removed == paging.stats.paged


def test_files_live_until_the_graph_is_freed(tmp_path: Path) -> None:
    x = torch.randn(64, 256, requires_grad=True)
    paging = ActivationPaging("disk", directory=tmp_path, min_bytes=0)
    with paging:
        y = torch.tanh(x @ x.t())  # saves x, x.t() (a transposed view) and the tanh output
        loss = y.sum()
    assert paging.root is not None
    files = len(list(paging.root.iterdir()))
    assert files >= 1
    loss.backward(retain_graph=True)
    first = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    loss.backward()  # the retained graph reads the files again
    assert torch.equal(x.grad, first)  # type: ignore[arg-type]
    del y, loss
    gc.collect()
    assert list(paging.root.iterdir()) == []


def test_restored_tensors_keep_their_strides(tmp_path: Path) -> None:
    seen: list[tuple[int, ...]] = []

    class SaveTransposed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
            t = (a + 0).t()  # a new transposed tensor (a view of an input would be kept)
            ctx.save_for_backward(t)
            return a * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (t,) = ctx.saved_tensors
            seen.append(t.stride())
            return grad * 2 + t.t() * 0

    a = torch.randn(40, 30, requires_grad=True)
    with ActivationPaging("disk", directory=tmp_path, min_bytes=0) as paging:
        out = SaveTransposed.apply(a * 1.0)
    out.sum().backward()
    assert paging.stats.paged >= 1
    assert seen == [(1, 30)]


def test_layout_helpers() -> None:
    base = torch.zeros(4, 6)
    assert is_dense(base) and is_dense(base.t()) and not is_broadcast(base)
    assert is_broadcast(torch.zeros(4, 1).expand(4, 6))
    assert not is_dense(base[:, ::2])


def test_host_tier_keeps_cpu_tensors() -> None:
    paging = ActivationPaging("host", min_bytes=0)
    loss, grads = run(model(), paging)
    loss_ref, grads_ref = run(model(), None)
    assert loss == loss_ref and all(
        torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True)
    )
    assert paging.stats.paged == 0 and paging.stats.by_reason["on host"] > 0


def test_bad_options(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="tier='ram'"):
        ActivationPaging("ram")
    with pytest.raises(OptionError, match="min_bytes=-1"):
        ActivationPaging(min_bytes=-1)
    with pytest.raises(OptionError, match="an existing directory"):
        ActivationPaging("disk", directory=tmp_path / "missing")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(OptionError, match="an existing directory"):
        ActivationPaging("disk", directory=a_file)
    with pytest.raises(OptionError, match="None unless tier='disk'"):
        ActivationPaging("host", directory=tmp_path)


def test_a_full_disk_fails_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paging = ActivationPaging("disk", directory=tmp_path, min_bytes=0)
    # /dev/full: every write fails with ENOSPC, as on a full disk.
    monkeypatch.setattr(paging, "_open_for_write", lambda path: open("/dev/full", "wb"))  # noqa: SIM115
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="No space left on device"), paging:
        torch.tanh(x * 1.0)
    assert paging.root is not None and list(paging.root.iterdir()) == []


def test_paging_composes_with_a_copy_of_the_model(tmp_path: Path) -> None:
    # deep-copied modules (e.g. a framework's EMA copy) are unaffected by the hooks
    blocks = model()
    twin = copy.deepcopy(blocks)
    with ActivationPaging("disk", directory=tmp_path):
        pass
    assert run(twin, None)[0] == run(blocks, None)[0]
