"""Moment storage formats, in torch: the single definition the pure-torch update, the
state_dict conversion and the C++ kernel's decode tables all use.

* ``bf16``: stochastic rounding — add 16 random bits to the fp32 bit pattern, keep the top
  16 bits.  Unbiased, so moments do not drift the way round-to-nearest makes small updates
  vanish.
* ``int8``: blocks of :data:`BLOCK` values share an fp32 absmax; each value is one byte, a
  small float relative to it.  ``exp_avg``: sign + E4M3 (exponent bias 15, subnormals),
  rounded to nearest even.  ``exp_avg_sq`` is stored as its square root (halving its
  dynamic range in log space) as unsigned E4M4 (bias 15, subnormals), stochastically
  rounded.  The absmax maps to the largest code (1.875, 1.9375).

Random bits are a counter-based hash of (key, element index), so the kernel and this
module produce the same bits on any thread count.  ``key`` mixes the optimizer's seed, the
step and the tensor's index (:func:`stream_key`).
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK",
    "SIGNED_MAX",
    "SIGNED_TABLE",
    "UNSIGNED_MAX",
    "UNSIGNED_TABLE",
    "bf16_stochastic",
    "blocks_for",
    "decode_signed",
    "decode_unsigned",
    "element_bits",
    "encode_signed_nearest",
    "encode_unsigned_stochastic",
    "mix32",
    "quantize_blocks",
    "stream_key",
]

BLOCK = 256
SIGNED_MAX = 1.875
UNSIGNED_MAX = 1.9375
_MASK = 0xFFFFFFFF


def mix32(x: int) -> int:
    """A 32-bit integer hash (Wellons' lowbias32), on a Python int."""
    x &= _MASK
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    x ^= x >> 16
    return x


def stream_key(seed: int, step: int, index: int) -> int:
    """The 32-bit key of the random stream for tensor ``index`` at ``step``."""
    return mix32(mix32(seed * 0x9E3779B1 + index) ^ (step * 0x85EBCA77))


def _mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    # int64 holding values < 2**32; products wrap in two's complement and only the low 32
    # bits are kept, which is exactly uint32 arithmetic.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def element_bits(key: int, n: int) -> torch.Tensor:
    """32 random bits for each of the elements ``0 .. n-1`` (int64 tensor)."""
    index = torch.arange(n, dtype=torch.int64)
    return _mix32_tensor((index * 0x9E3779B9 + key) & _MASK)


def _table(signed: bool) -> torch.Tensor:
    mantissa_bits = 3 if signed else 4
    values = []
    for mag in range(128 if signed else 256):
        exponent, mantissa = mag >> mantissa_bits, mag & ((1 << mantissa_bits) - 1)
        if exponent == 0:
            value = mantissa * 2.0 ** (-14 - mantissa_bits)
        else:
            value = (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - 15)
        values.append(value)
    if signed:
        values += [-v for v in values]
    return torch.tensor(values, dtype=torch.float32)


SIGNED_TABLE = _table(signed=True)
"""Code -> value for ``exp_avg`` (256 float32, up to :data:`SIGNED_MAX`); a value is
``SIGNED_TABLE[code] * (absmax / SIGNED_MAX)``."""
UNSIGNED_TABLE = _table(signed=False)
"""Code -> value for ``sqrt(exp_avg_sq)`` (256 float32, up to :data:`UNSIGNED_MAX`)."""


def blocks_for(numel: int) -> int:
    """How many int8 blocks a tensor of ``numel`` values takes."""
    return (numel + BLOCK - 1) // BLOCK


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK


def encode_signed_nearest(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of ``x`` (float32, already scaled so the absmax is :data:`SIGNED_MAX`)."""
    a = x.abs()
    b = _bits(a)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - (112 << 3)
    sub = torch.round(a * 2.0**17).to(torch.int64)
    mag = torch.where(a < 2.0**-14, sub, normal).clamp_(max=127)
    return (mag | ((x < 0).to(torch.int64) << 7)).to(torch.uint8)


def encode_unsigned_stochastic(a: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """uint8 codes of ``a >= 0`` (float32, scaled so the absmax is :data:`UNSIGNED_MAX`),
    stochastically rounded with the 32 random ``bits`` per element."""
    b = _bits(a)
    normal = ((b + (bits & 0x7FFFF)) >> 19) - (112 << 4)
    u = (bits >> 8).to(torch.float32) * 2.0**-24
    sub = torch.floor(a * 2.0**18 + u).to(torch.int64)
    return torch.where(a < 2.0**-14, sub, normal).clamp_(max=255).to(torch.uint8)


def decode_signed(codes: torch.Tensor, absmax: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 values (first ``numel``) of padded ``codes`` with one absmax per block."""
    scale = (absmax / SIGNED_MAX).view(-1, 1)
    values = SIGNED_TABLE[codes.to(torch.int64)].view(-1, BLOCK) * scale
    return values.reshape(-1)[:numel]


def decode_unsigned(codes: torch.Tensor, absmax: torch.Tensor, numel: int) -> torch.Tensor:
    """As :func:`decode_signed`, for the unsigned (square-root) codes."""
    scale = (absmax / UNSIGNED_MAX).view(-1, 1)
    values = UNSIGNED_TABLE[codes.to(torch.int64)].view(-1, BLOCK) * scale
    return values.reshape(-1)[:numel]


def quantize_blocks(
    values: torch.Tensor, *, signed: bool, bits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded uint8 codes, absmax per block) of a flat float32 tensor: signed values
    rounded to nearest; non-negative ones (``signed=False``) stochastically with ``bits``
    (32 random bits per padded element, required then)."""
    numel = values.numel()
    padded = torch.zeros(blocks_for(numel) * BLOCK, dtype=torch.float32)
    padded[:numel] = values.reshape(-1)
    grid = padded.view(-1, BLOCK)
    absmax = grid.abs().amax(dim=1) if signed else grid.amax(dim=1)
    top = SIGNED_MAX if signed else UNSIGNED_MAX
    inv = torch.where(absmax > 0, top / absmax, torch.zeros_like(absmax))
    scaled = (grid * inv.view(-1, 1)).reshape(-1)
    if signed:
        return encode_signed_nearest(scaled), absmax
    if bits is None:
        raise ValueError("quantize_blocks(signed=False) needs the random bits")
    return encode_unsigned_stochastic(scaled, bits), absmax


def bf16_stochastic(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 stochastically with 16 random bits per element."""
    rounded = (((_bits(x) + bits16) >> 16) & 0xFFFF).to(torch.int16)
    return rounded.view(torch.bfloat16).view(x.shape)
