"""The moment formats: tables, rounding and the random streams."""

from __future__ import annotations

import pytest
import torch

from sakura_offload.host_optimizer import moments as fmt


def test_tables_are_monotonic_and_topped_at_one() -> None:
    signed = fmt.SIGNED_TABLE[:128]
    assert torch.all(signed[1:] > signed[:-1])
    assert signed[127].item() == fmt.SIGNED_MAX
    assert torch.equal(fmt.SIGNED_TABLE[128:], -signed)
    unsigned = fmt.UNSIGNED_TABLE
    assert torch.all(unsigned[1:] > unsigned[:-1])
    assert unsigned[255].item() == fmt.UNSIGNED_MAX
    assert unsigned[1].item() == 2.0**-18


@pytest.mark.parametrize("top", [fmt.SIGNED_MAX, 2.0**-13])  # 2**-13: the subnormal codes
def test_signed_rounds_to_the_nearest_code(top: float) -> None:
    values = torch.linspace(-top, top, 20001)
    codes = fmt.encode_signed_nearest(values)
    decoded = fmt.SIGNED_TABLE[codes.long()]
    table = fmt.SIGNED_TABLE
    best = (values[:, None] - table[None, :]).abs().min(dim=1).values
    assert torch.allclose((values - decoded).abs(), best, rtol=0, atol=1e-7 * top)
    # ties go to the even code (an even mantissa): 1 + 1/16 lies between 1 and 1 + 1/8
    ties = torch.tensor([1 + 1 / 16, 1 + 3 / 16, -(1 + 1 / 16), 2.0**-17 / 2, 3 * 2.0**-18])
    assert fmt.SIGNED_TABLE[fmt.encode_signed_nearest(ties).long()].tolist() == [
        1.0,
        1.25,
        -1.0,
        0.0,
        2 * 2.0**-17,
    ]


@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e9])
def test_quantize_blocks_relative_error(magnitude: float) -> None:
    # 1e9: blocks past SIGNED_MAX * 2**14, which take the scale in two multiplications
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1000, generator=g) * torch.logspace(-3, 0, 1000) * magnitude
    codes, absmax = fmt.quantize_blocks(values, signed=True)
    assert codes.numel() == 1024 and absmax.numel() == 4
    second = fmt.encode_scale(absmax, fmt.SIGNED_MAX)[1]
    assert torch.all(second == (1.0 if magnitude < 1e4 else fmt.CODE_SHIFT))
    decoded = fmt.decode_signed(codes, absmax, values.numel())
    big = values.abs() > 1e-3 * absmax.repeat_interleave(256)[:1000]
    rel = ((decoded - values).abs() / values.abs())[big]
    assert rel.max().item() <= 1 / 16 + 1e-6  # 3 mantissa bits: half a step is 1/16


def test_codes_round_trip_and_pad_with_zeros() -> None:
    # Every code decodes and re-encodes to itself (any absmax, both scale paths); the
    # padding past the values is code 0.
    for absmax in (1e-3, 1.0, 3e5):
        for signed, table, top in (
            (True, fmt.SIGNED_TABLE, fmt.SIGNED_MAX),
            (False, fmt.UNSIGNED_TABLE, fmt.UNSIGNED_MAX),
        ):
            values = table * (absmax / top)
            values = values[values.abs().argsort(descending=True, stable=True)][:250]
            bits = fmt.pair_bits(99, 1)
            codes, got = fmt.quantize_blocks(values, signed=signed, bits=bits)
            assert got.item() == values.abs().max().item()
            assert torch.all(codes[250:] == 0)
            decode = fmt.decode_signed if signed else fmt.decode_unsigned
            assert torch.equal(decode(codes, got, 250), values)


def test_non_finite_values_stay_out_of_the_absmax() -> None:
    # An Inf or NaN taken into a block's absmax made all 256 values decode non-finite.
    g = torch.Generator().manual_seed(5)
    values = torch.randn(600, generator=g)
    bad = values.clone()
    bad[[3, 7, 300]] = torch.tensor([float("inf"), float("nan"), float("-inf")])
    keep = torch.ones(600, dtype=torch.bool)
    keep[[3, 7, 300]] = False
    clean = torch.where(keep, values, torch.zeros(()))
    codes, absmax = fmt.quantize_blocks(bad, signed=True)
    ref_codes, ref_absmax = fmt.quantize_blocks(clean, signed=True)
    assert torch.equal(absmax, ref_absmax) and torch.equal(codes, ref_codes)  # stored as 0
    bits = fmt.pair_bits(9, fmt.blocks_for(600))
    s_codes, s_absmax = fmt.quantize_blocks(bad.abs(), signed=False, bits=bits)
    ref_s_codes, ref_s_absmax = fmt.quantize_blocks(clean.abs(), signed=False, bits=bits)
    assert torch.equal(s_absmax, ref_s_absmax)
    decoded = fmt.decode_unsigned(s_codes, s_absmax, 600)
    assert decoded.isfinite().all()
    assert torch.equal(s_codes[:600][keep], ref_s_codes[:600][keep])
    assert (decoded[[3, 7]] == s_absmax[0]).all() and decoded[300] == s_absmax[1]  # saturated


def test_unsigned_stochastic_rounding_is_unbiased() -> None:
    value = torch.full((200_192,), 0.3 * fmt.UNSIGNED_MAX)  # between two codes
    bits = fmt.pair_bits(12345, fmt.blocks_for(value.numel()))
    codes = fmt.encode_unsigned_stochastic(value, bits)
    assert len(torch.unique(codes)) == 2
    mean = fmt.UNSIGNED_TABLE[codes.long()].mean().item()
    assert abs(mean - value[0].item()) < 1e-4 * value[0].item() * 10


def test_unsigned_stochastic_rounding_over_every_random_value() -> None:
    # All 2**16 values of the random bits: the mean code value is the input within
    # 2**-17 of a code step (16 random bits for 19 truncated ones), for normal and
    # subnormal codes and values just above a code or just below the next one.
    table = fmt.UNSIGNED_TABLE.double()
    bits = torch.arange(2**16, dtype=torch.int64)
    for low in (1, 5, 40, 100, 200, 254):
        step = (table[low + 1] - table[low]).item()
        for fraction in (2.0**-20, 0.1, 1 / 3, 0.5, 0.77, 1 - 2.0**-20):
            value = torch.tensor(table[low].item() + fraction * step, dtype=torch.float32)
            codes = fmt.encode_unsigned_stochastic(value.expand(bits.numel()), bits)
            assert set(codes.unique().tolist()) <= {low, low + 1}
            mean = table[codes.long()].mean().item()
            assert abs(mean - value.item()) <= step * 2.0**-17 + 1e-12, (low, fraction)


def test_bf16_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((200_000,), 1.0 + 2.0**-10)  # between two bf16 values
    bits = fmt.element_bits(7, x.numel()) & 0xFFFF
    rounded = fmt.bf16_stochastic(x, bits)
    assert set(rounded.float().unique().tolist()) == {1.0, 1.0078125}
    assert abs(rounded.float().mean().item() - x[0].item()) < 2e-5


def test_random_bits_match_the_scalar_hash() -> None:
    key = fmt.stream_key(3, 17, 5)
    bits = fmt.element_bits(key, 64)
    expected = [fmt.mix32((i * 0x9E3779B9 + key) & 0xFFFFFFFF) for i in range(64)]
    assert bits.tolist() == expected
    assert fmt.stream_key(3, 18, 5) != key
    # int8: one hash per pair of values j, j + 128 of a block, its halves split between them
    pairs = fmt.pair_bits(key, 3).view(3, fmt.BLOCK)
    for b, j in ((0, 0), (0, 127), (1, 5), (2, 100)):
        h = fmt.mix32(((b * 128 + j) * 0x9E3779B9 + key) & 0xFFFFFFFF)
        assert (pairs[b, j].item(), pairs[b, j + 128].item()) == (h & 0xFFFF, h >> 16)


def test_kernel_decodes_every_code_as_the_tables() -> None:
    from sakura_offload.host_optimizer.kernel import load_kernel

    kernel = load_kernel(required=True)
    assert kernel is not None
    signed, unsigned = torch.empty(256), torch.empty(256)
    kernel.decode_tables(signed.data_ptr(), unsigned.data_ptr())
    assert torch.equal(signed, fmt.SIGNED_TABLE)
    assert torch.equal(unsigned, fmt.UNSIGNED_TABLE)
