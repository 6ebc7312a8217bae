"""The moment formats: tables, rounding and the random streams."""

from __future__ import annotations

import torch

from sakura_offload import _formats as fmt


def test_tables_are_monotonic_and_topped_at_one() -> None:
    signed = fmt.SIGNED_TABLE[:128]
    assert torch.all(signed[1:] > signed[:-1])
    assert signed[127].item() == fmt.SIGNED_MAX
    assert torch.equal(fmt.SIGNED_TABLE[128:], -signed)
    unsigned = fmt.UNSIGNED_TABLE
    assert torch.all(unsigned[1:] > unsigned[:-1])
    assert unsigned[255].item() == fmt.UNSIGNED_MAX
    assert unsigned[1].item() == 2.0**-18


def test_signed_rounds_to_the_nearest_code() -> None:
    values = torch.linspace(-fmt.SIGNED_MAX, fmt.SIGNED_MAX, 20001)
    codes = fmt.encode_signed_nearest(values)
    decoded = fmt.SIGNED_TABLE[codes.long()]
    table = fmt.SIGNED_TABLE
    best = (values[:, None] - table[None, :]).abs().min(dim=1).values
    assert torch.allclose((values - decoded).abs(), best, rtol=0, atol=1e-7)


def test_quantize_blocks_relative_error() -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1000, generator=g) * torch.logspace(-3, 0, 1000)
    codes, absmax = fmt.quantize_blocks(values, signed=True)
    assert codes.numel() == 1024 and absmax.numel() == 4
    decoded = fmt.decode_signed(codes, absmax, values.numel())
    big = values.abs() > 1e-3 * absmax.repeat_interleave(256)[:1000]
    rel = ((decoded - values).abs() / values.abs())[big]
    assert rel.max().item() <= 1 / 16 + 1e-6  # 3 mantissa bits: half a step is 1/16


def test_unsigned_stochastic_rounding_is_unbiased() -> None:
    value = torch.full((200_000,), 0.3 * fmt.UNSIGNED_MAX)  # between two codes
    bits = fmt.element_bits(12345, value.numel())
    codes = fmt.encode_unsigned_stochastic(value, bits)
    assert len(torch.unique(codes)) == 2
    mean = fmt.UNSIGNED_TABLE[codes.long()].mean().item()
    assert abs(mean - value[0].item()) < 1e-4 * value[0].item() * 10


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


def test_kernel_decodes_every_code_as_the_tables() -> None:
    from sakura_offload._kernel import load_kernel

    kernel = load_kernel(required=True)
    assert kernel is not None
    signed, unsigned = torch.empty(256), torch.empty(256)
    kernel.decode_tables(signed.data_ptr(), unsigned.data_ptr())
    assert torch.equal(signed, fmt.SIGNED_TABLE)
    assert torch.equal(unsigned, fmt.UNSIGNED_TABLE)
