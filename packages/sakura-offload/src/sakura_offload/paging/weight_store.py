"""Which tensors :class:`~sakura_offload.paging.weights.WeightPaging` pages, and where they
live between uses (host RAM, or memory-mapped files under ``disk_offload``).

**Which tensors: every frozen tensor a block holds.**  A block's tensors are found in its
modules, generically (no module class is named): every parameter with
``requires_grad=False`` and every buffer, persistent or not (a quantized layer's codes,
block scales, double-quantization statistics, LoftQ factors are buffers; a frozen LoRA
factor or a frozen bias is a parameter), except

* tensors with no elements, tensors that are not dense strided ones, and buffers with
  ``requires_grad=True`` (trainable: never paged);
* the buffers of a module whose ``track_running_stats`` is ``True`` (torch's BatchNorm and
  InstanceNorm, and any module that follows their convention): its forward updates them in
  place inside native code that autograd's version counter does not see, so they are never
  paged;
* a tensor that a forward *writes* anyway is found as it happens: after each forward of a
  block, every installed tensor's version counter (moved by an in-place write such as
  ``buf.add_(1)``) and its module's entry (changed when the module assigns a new tensor)
  are compared with how they were at install (no data is read).  A written tensor leaves
  paging at once: its device copy, which holds what the forward wrote, stays where the
  module reads it, and ``stats.written`` counts it (a ``RuntimeWarning`` names it once); a
  replaced one is left to the module.  Writes during backward are not checked.

A tensor shared by several blocks is paged with the first.

**Where they live.**  :class:`WeightStore` holds each block's tensors in host RAM
(page-locked for a CUDA device) or, with ``disk_offload=DIR``, for the blocks that
``host_budget`` cannot hold, in memory-mapped files (:class:`sakura_torch.disk.TensorFileStore`
under ``DIR``): written as the block is paged out, mapped zero-copy, read through the OS's
page cache at each use, the folder removed when the paging is removed, at exit, or after
an exception in setup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sakura.options import option_error
from sakura_torch.blocks import find_blocks, validate_selector
from sakura_torch.disk import TensorFileStore

__all__ = ["FrozenTensor", "WeightStore", "frozen_block_bytes", "frozen_tensors"]

TIERS = ("host", "disk")


@dataclass(eq=False)
class FrozenTensor:
    """One paged tensor of a block: the registered object (whose ``.data`` is swapped
    between the host store and device copies) and where the module registers it."""

    key: str
    """Its qualified name inside the block (``"self_attn.q_proj.weight_scales"``)."""
    tensor: torch.Tensor
    module: nn.Module
    local: str
    is_buffer: bool

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def registered(self) -> bool:
        """Whether the module still holds this very tensor under its name."""
        table = self.module._buffers if self.is_buffer else self.module._parameters
        return table.get(self.local) is self.tensor


def writes_buffers(module: nn.Module) -> bool:
    """True for a module that updates its buffers in forward by convention
    (``track_running_stats``: BatchNorm, InstanceNorm and their kin)."""
    return getattr(module, "track_running_stats", False) is True


def _pageable(t: torch.Tensor | None) -> bool:
    return t is not None and t.numel() > 0 and t.layout == torch.strided and not t.requires_grad


def frozen_tensors(block: nn.Module, seen: set[int]) -> list[FrozenTensor]:
    """The tensors of ``block`` that paging takes (the module docstring's rule), skipping
    and adding to ``seen`` (ids of tensors already taken by an earlier block)."""
    found: list[FrozenTensor] = []
    for prefix, module in block.named_modules():
        dot = f"{prefix}." if prefix else ""
        tables: list[tuple[dict[str, Any], bool]] = [(module._parameters, False)]
        if not writes_buffers(module):
            tables.append((module._buffers, True))
        for table, is_buffer in tables:
            for local, t in table.items():
                if not _pageable(t) or id(t) in seen:
                    continue
                seen.add(id(t))
                found.append(FrozenTensor(dot + local, t, module, local, is_buffer))
    return found


def frozen_block_bytes(model: nn.Module, blocks: Any = None) -> list[tuple[str, int]]:
    """``(block name, bytes of its frozen tensors)`` for every block of ``model`` (found as
    :class:`~sakura_offload.paging.weights.WeightPaging` finds them, ``blocks`` as there):
    what paging each would take off the device, frozen parameters and buffers alike.  A
    tensor shared by several blocks counts in the first."""
    validate_selector(blocks, owner="frozen_block_bytes")
    seen: set[int] = set()
    return [
        (name, sum(f.nbytes for f in frozen_tensors(module, seen)))
        for name, module in find_blocks(model, blocks, owner="frozen_block_bytes")
    ]


class WeightStore:
    """Host RAM and, with ``disk_offload``, memory-mapped files for paged frozen tensors.

    ``host_budget``: bytes of frozen tensors kept in host RAM when ``disk_offload`` is
    given; the blocks that would go past it are written to files (whole blocks, in order).
    ``None``: the host budget the memory planner uses
    (:func:`~sakura_offload.planner.default_host_budget`); ``0``: every block on disk.
    """

    def __init__(
        self,
        *,
        pin_memory: bool,
        disk_offload: str | os.PathLike[str] | None,
        host_budget: Any,
        owner: str,
    ) -> None:
        from sakura_offload.planner.decide import default_host_budget
        from sakura_offload.planner.plan import parse_bytes

        self.pin_memory = pin_memory
        budget = parse_bytes("host_budget", host_budget, allow_none=True, owner=owner)
        self.disk: TensorFileStore | None = None
        if disk_offload is None:
            if budget is not None:
                raise option_error(
                    "host_budget",
                    host_budget,
                    "None unless disk_offload= is given (the blocks beyond it go there)",
                    owner=owner,
                )
            self.host_budget: int | None = None
        else:
            self.disk = TensorFileStore(
                disk_offload, option="disk_offload", owner=owner, prefix="sakura-weights-"
            )
            self.host_budget = budget if budget is not None else default_host_budget()
        self.host_bytes = 0
        self.disk_bytes = 0

    def tier_for(self, nbytes: int) -> str:
        """Where a block of ``nbytes`` goes: ``"host"`` while the budget holds it."""
        if self.disk is None or (
            self.host_budget is not None and self.host_bytes + nbytes <= self.host_budget
        ):
            return "host"
        return "disk"

    def put(self, key: str, t: torch.Tensor, tier: str) -> torch.Tensor:
        """Store a copy of ``t`` (same shape, dtype and strides) on ``tier``; return it."""
        nbytes = t.numel() * t.element_size()
        if tier == "disk" and self.disk is not None:
            stored = self.disk.put(key, t.detach())
            self.disk_bytes += nbytes
            return stored
        host = torch.empty_like(t, device="cpu", pin_memory=self.pin_memory)
        host.copy_(t.detach())
        self.host_bytes += nbytes
        return host

    def drop(self, key: str, nbytes: int, tier: str) -> None:
        """Forget a tensor that left paging (its file, on disk, is deleted)."""
        if tier == "disk" and self.disk is not None:
            self.disk.remove(key)
            self.disk_bytes -= nbytes
        else:
            self.host_bytes -= nbytes

    @property
    def root(self) -> Any:
        """The folder of the files (``None`` without ``disk_offload``)."""
        return None if self.disk is None else self.disk.root

    def close(self) -> None:
        """Remove the files and their folder (tensors mapped from them stay readable)."""
        if self.disk is not None:
            self.disk.close()
