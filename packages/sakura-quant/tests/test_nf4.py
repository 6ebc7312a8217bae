"""NF4 against a written-out reference and against bitsandbytes (CPU), bit for bit."""

from __future__ import annotations

import pytest
import torch

from sakura_quant.codec import dequantize_weight, quantize_weight
from sakura_quant.formats.double_quant import dynamic_map
from sakura_quant.formats.nf4 import NF4_CODE


def test_hand_computed_block() -> None:
    # One block of 4 (absmax 2.0, so the scaled values are x / 2):
    #   x = -2.0 -> -1.0       -> code 0  (-1.0)
    #   x =  0.0 ->  0.0       -> code 7  (0.0)
    #   x =  1.0 ->  0.5       -> code 13 (0.5626...: 0.5 is above the 12/13 midpoint 0.50166?
    #                              no: the midpoint is (0.4407 + 0.5626) / 2 = 0.5017, so code 12)
    #   x =  2.0 ->  1.0       -> code 15 (1.0)
    w = torch.tensor([[-2.0, 0.0, 1.0, 2.0]])
    q = quantize_weight(w, "nf4", block_size=4)
    assert q.tensors["data"].tolist() == [0x07, 0xCF]
    assert q.tensors["scales"].tolist() == [2.0]
    expected = torch.tensor([[-2.0, 0.0, NF4_CODE[12] * 2.0, 2.0]])
    assert torch.equal(dequantize_weight(q), expected)


def test_tie_goes_to_lower_code() -> None:
    # A value exactly on the midpoint between codes 7 (0.0) and 8 (0.0796...) goes to code 7;
    # one ulp above it goes to code 8.  absmax 1.0 makes the scaled value the value itself.
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    mid = float((code[7] + code[8]) / 2)
    above = float(torch.nextafter(torch.tensor(mid), torch.tensor(1.0)))
    w = torch.tensor([mid, above, 1.0, 0.0])
    q = quantize_weight(w, "nf4", block_size=4)
    assert q.tensors["data"].tolist() == [(7 << 4) | 8, (15 << 4) | 7]


def test_odd_count_pads_the_low_nibble_with_the_zero_code() -> None:
    w = torch.tensor([1.0, -1.0, 0.5])
    q = quantize_weight(w, "nf4", block_size=4)
    assert q.tensors["data"].tolist() == [(15 << 4) | 0, (12 << 4) | 7]
    assert dequantize_weight(q).shape == (3,)


def test_all_zero_block_is_zero() -> None:
    w = torch.zeros(2, 64)
    w[1] = torch.randn(64)
    q = quantize_weight(w, "nf4")
    out = dequantize_weight(q)
    assert torch.equal(out[0], torch.zeros(64))
    assert q.tensors["scales"][0].item() == 0.0


bnb_functional = pytest.importorskip("bitsandbytes.functional")


def _expand_bnb(packed: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
    """bitsandbytes' bytes expanded by hand: high nibble first, code value times absmax."""
    code = bnb_functional.get_4bit_type("nf4", device="cpu")
    flat = packed.view(-1)
    index = torch.stack((flat >> 4, flat & 15), dim=1).view(-1).long()
    values = code[index]
    values = torch.nn.functional.pad(values, (0, (-values.numel()) % block_size))
    return (values.view(-1, block_size) * absmax.view(-1, 1)).view(-1)


@pytest.mark.parametrize(
    ("shape", "block_size", "dtype"),
    [
        ((64, 64), 64, torch.float32),
        ((96, 256), 128, torch.float32),
        ((33, 50), 64, torch.float32),  # a partial last block and an odd count
        ((64, 128), 32, torch.bfloat16),
        ((128, 512), 256, torch.float16),
        ((96, 80), 128, torch.float32),  # blocks that cross rows
    ],
)
def test_bit_identical_to_bitsandbytes(
    shape: tuple[int, int], block_size: int, dtype: torch.dtype
) -> None:
    w = (torch.randn(shape) * torch.rand(shape[0], 1) * 3).to(dtype)
    w[0, :5] = 0.0
    packed, state = bnb_functional.quantize_4bit(w, blocksize=block_size, quant_type="nf4")
    q = quantize_weight(w, "nf4", block_size=block_size)
    assert torch.equal(q.tensors["data"], packed.view(-1))
    assert torch.equal(q.tensors["scales"], state.absmax)
    got = dequantize_weight(q)
    assert got.dtype == dtype
    numel = w.numel()
    by_hand = _expand_bnb(packed, state.absmax, block_size)[:numel].view(shape).to(dtype)
    assert torch.equal(got, by_hand)
    if shape[1] % block_size == 0 and shape[1] % 2 == 0:
        # bitsandbytes' CPU dequantize kernel (0.50) indexes absmax per row, so it is only
        # right when the blocks do not cross rows; there it must agree exactly.
        assert torch.equal(got, bnb_functional.dequantize_4bit(packed, state))


def test_code_table_is_bitsandbytes() -> None:
    bnb_code = bnb_functional.get_4bit_type("nf4", device="cpu")
    assert torch.equal(torch.tensor(NF4_CODE, dtype=torch.float32), bnb_code)


def test_dynamic_map_is_bitsandbytes() -> None:
    assert torch.equal(dynamic_map(), bnb_functional.create_dynamic_map())


@pytest.mark.parametrize("shape", [(64, 512), (256, 512), (70, 100), (300, 448)])
def test_double_quant_matches_bitsandbytes(shape: tuple[int, int]) -> None:
    w = torch.randn(shape) * torch.rand(shape[0], 1)
    packed, state = bnb_functional.quantize_4bit(
        w, blocksize=64, quant_type="nf4", compress_statistics=True
    )
    q = quantize_weight(w, "nf4", double_quant=True)
    assert torch.equal(q.tensors["data"], packed.view(-1))
    assert torch.equal(q.tensors["scales_offset"], state.offset)
    assert torch.equal(q.tensors["scales_scale"], state.state2.absmax)
    ours, theirs = q.tensors["scales"].long(), state.absmax.long()
    differ = ours != theirs
    # Codes agree except where bitsandbytes' CPU binary search returns the farther of two
    # codes for a value almost exactly between them: there ours is the nearer one.
    assert differ.float().mean().item() < 0.01
    code = dynamic_map()
    plain = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4")[1].absmax
    normed = (plain - state.offset) / state.state2.absmax.repeat_interleave(256)[: plain.numel()]
    assert torch.all((ours[differ] - theirs[differ]).abs() == 1)
    our_dist = (normed[differ] - code[ours[differ]]).abs()
    their_dist = (normed[differ] - code[theirs[differ]]).abs()
    assert torch.all(our_dist <= their_dist)
    gap = (code[ours[differ]] - code[theirs[differ]]).abs()
    # Measured: bitsandbytes' choice is at most ~8 % of the code gap farther than ours.
    assert torch.all(their_dist - our_dist <= 0.1 * gap)
    # Where the codes agree, the decoded weights agree bit for bit.
    if not differ.any():
        assert torch.equal(dequantize_weight(q), bnb_functional.dequantize_4bit(packed, state))
