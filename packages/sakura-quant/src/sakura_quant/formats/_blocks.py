"""Blockwise helpers shared by the formats: split a weight into blocks and take their absmax."""

from __future__ import annotations

import torch


def as_blocks(weight: torch.Tensor, block_size: int) -> torch.Tensor:
    """``weight`` flattened to fp32 and viewed as ``(blocks, block_size)``.

    A last, partial block is padded with zeros: zeros change neither a block's absmax nor any
    other value, and the padding is cut off again when the codes are stored.
    """
    flat = weight.detach().reshape(-1).float()
    rem = flat.numel() % block_size
    if rem:
        flat = torch.nn.functional.pad(flat, (0, block_size - rem))
    return flat.view(-1, block_size)


def block_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """The absolute maximum of each row of ``blocks`` (fp32)."""
    return blocks.abs().amax(dim=1)


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale``, the scale first clamped to 1e-38 as bitsandbytes does: a block whose
    scale is zero holds only zeros, and ``0 * 1e38`` is still zero."""
    return scale.clamp(min=1e-38).reciprocal()


def scale_blocks(
    values: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int
) -> torch.Tensor:
    """Flat fp32 ``values`` (at least ``numel`` of them) times the scale of their block."""
    full = (numel // block_size) * block_size
    if full == numel:
        return (values[:numel].view(-1, block_size) * scales.view(-1, 1)).view(-1)
    out = torch.empty(numel, dtype=torch.float32, device=values.device)
    if full:
        out[:full] = (values[:full].view(-1, block_size) * scales[:-1].view(-1, 1)).view(-1)
    out[full:] = values[full:numel] * scales[-1]
    return out
