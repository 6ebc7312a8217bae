"""Moment storage formats, in torch: the single definition the pure-torch update, the
state_dict conversion and the C++ kernel's decode tables all use.

* ``bf16``: stochastic rounding — add 16 random bits to the fp32 bit pattern, keep the top
  16 bits.  Unbiased, so moments do not drift the way round-to-nearest makes small updates
  vanish.
* ``int8``: blocks of :data:`BLOCK` values share an fp32 absmax; each value is one byte, a
  small float relative to it.  ``exp_avg``: sign + E4M3 (exponent bias 15, subnormals),
  rounded to nearest even.  ``exp_avg_sq`` is stored as its square root (halving its
  dynamic range in log space) as unsigned E4M4 (bias 15, subnormals), stochastically
  rounded with 16 random bits.  The absmax maps to the largest code (1.875, 1.9375).
  The absmax is that of the block's finite values: a non-finite ``exp_avg`` is stored as
  0, a non-finite square root as the largest code, so an Inf or NaN gradient element
  spoils its own parameter (as in torch's AdamW) and not the other 255 of its block.
  Encoding multiplies each value by the block's scale and by 2**-112 (one factor,
  :func:`encode_scale`), which puts a code's exponent and mantissa in their float32 bit
  positions, float32's denormals holding the subnormal codes; integer operations on the
  bits then round it (the decode, reversed).

Random bits are a counter-based hash of (key, index), so the kernel and this module
produce the same bits on any thread count: one hash per element for ``bf16``
(:func:`element_bits`), one per pair of values ``j``, ``j + 128`` of an int8 block
(:func:`pair_bits`).  ``key`` mixes the optimizer's seed, the step and the tensor's index
(:func:`stream_key`).
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK",
    "CODE_SHIFT",
    "SIGNED_MAX",
    "SIGNED_TABLE",
    "UNSIGNED_MAX",
    "UNSIGNED_TABLE",
    "bf16_stochastic",
    "blocks_for",
    "decode_signed",
    "decode_unsigned",
    "element_bits",
    "encode_scale",
    "encode_signed_nearest",
    "encode_unsigned_stochastic",
    "mix32",
    "pair_bits",
    "quantize_blocks",
    "stream_key",
]

BLOCK = 256
SIGNED_MAX = 1.875
UNSIGNED_MAX = 1.9375
CODE_SHIFT = 2.0**-112
"""What a scaled value is multiplied by before its bits are rounded to a code."""
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


def pair_bits(key: int, blocks: int) -> torch.Tensor:
    """16 random bits (int64 tensor) for each of the ``blocks * BLOCK`` values of int8
    blocks: hash ``b * 128 + j`` (as :func:`element_bits`) gives value ``j`` of block ``b``
    its low 16 bits and value ``j + 128`` its high 16 bits."""
    pairs = element_bits(key, blocks * (BLOCK // 2)).view(blocks, BLOCK // 2)
    return torch.cat((pairs & 0xFFFF, pairs >> 16), dim=1).reshape(-1)


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


def encode_scale(absmax: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors ``(first, second)`` that take a block's values to the code domain,
    ``(x * first) * second`` (float32): ``first = top / absmax * 2**-112`` and ``second =
    1`` where that product is a normal float (absmax <= top * 2**14), else ``first = top /
    absmax`` and ``second = 2**-112`` (as one factor it would lose bits as a denormal)."""
    inv = torch.where(absmax > 0, top / absmax, torch.zeros_like(absmax))
    one_step = (inv >= 2.0**-14) | (inv == 0)
    first = torch.where(one_step, inv * CODE_SHIFT, inv)
    second = torch.where(one_step, torch.ones_like(inv), torch.full_like(inv, CODE_SHIFT))
    return first, second


def _signed_codes(y: torch.Tensor) -> torch.Tensor:
    # round the magnitude's bits to nearest even at bit 20, saturate, add the sign bit
    b = _bits(y)
    mag = b & 0x7FFFFFFF
    mag = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20).clamp_(max=127)
    return (mag | ((b >> 24) & 0x80)).to(torch.uint8)


def _unsigned_codes(y: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    # 16 random bits stand for the 19 truncated ones: shifted up 3, plus 4 (the middle of
    # the 8 values they cannot tell apart), so rounding up has the truncated fraction's
    # chance within 2**-17
    dither = ((bits16 << 3) & 0x7FFF8) | 4
    return ((_bits(y) + dither) >> 19).clamp_(max=255).to(torch.uint8)


def encode_signed_nearest(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of ``x`` (float32, already scaled so the absmax is :data:`SIGNED_MAX`),
    rounded to nearest even."""
    return _signed_codes(x * CODE_SHIFT)


def encode_unsigned_stochastic(a: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """uint8 codes of ``a >= 0`` (float32, scaled so the absmax is :data:`UNSIGNED_MAX`),
    stochastically rounded with the low 16 of the random ``bits`` of each element."""
    return _unsigned_codes(a * CODE_SHIFT, bits)


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
    rounded to nearest; non-negative ones (``signed=False``; -0.0 counts as 0)
    stochastically with ``bits`` (16 random bits per padded element, :func:`pair_bits`;
    required then).

    Non-finite values stay local: the absmax is that of the finite values, a non-finite
    signed value is stored as 0 and a non-finite unsigned one as the largest code (an Inf
    or NaN in the absmax would make every value of its block non-finite)."""
    numel = values.numel()
    padded = torch.zeros(blocks_for(numel) * BLOCK, dtype=torch.float32)
    padded[:numel] = values.reshape(-1)
    finite = padded.isfinite().view(-1, BLOCK)
    if signed:
        grid = padded.view(-1, BLOCK).masked_fill_(~finite, 0.0)
        absmax = grid.abs().amax(dim=1)
    else:
        # the code takes the sign bit as it is
        grid = padded.clamp_(min=0.0).abs_().view(-1, BLOCK)
        absmax = grid.masked_fill(~finite, 0.0).amax(dim=1)
    first, second = encode_scale(absmax, SIGNED_MAX if signed else UNSIGNED_MAX)
    y = ((grid * first.view(-1, 1)) * second.view(-1, 1)).reshape(-1)
    if signed:
        return _signed_codes(y), absmax
    if bits is None:
        raise ValueError("quantize_blocks(signed=False) needs the random bits")
    return _unsigned_codes(y, bits), absmax


def bf16_stochastic(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 stochastically with 16 random bits per element."""
    rounded = (((_bits(x) + bits16) >> 16) & 0xFFFF).to(torch.int16)
    return rounded.view(torch.bfloat16).view(x.shape)
