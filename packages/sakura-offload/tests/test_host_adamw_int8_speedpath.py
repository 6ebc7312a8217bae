"""The int8 AVX-512 path's block pipeline (a block's codes are written during the next
block's update) against the portable build, bit for bit, on every transition between the
kinds of blocks: fast blocks in a row, a block with two-factor encode scales, a block over
the fold limit (portable), a block with a non-finite gradient (portable finish), a partial
last block, across work items."""

from __future__ import annotations

import pytest
import torch
from _host_adamw_hyper import adamw_hyper

from sakura_offload.host_optimizer import kernel as _kernel
from sakura_offload.host_optimizer import moments as fmt
from sakura_offload.host_optimizer.backends import KernelBackend, Update

BLOCK = 256
ITEM_BLOCKS = 64  # int8 blocks per work item (16384 values)


def _state(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 1e-2
    s = (torch.randn(n, generator=g) * 1e-2).abs()
    codes, absmax = fmt.quantize_blocks(m, signed=True)
    bits = fmt.pair_bits(5, absmax.numel())
    s_codes, s_absmax = fmt.quantize_blocks(s, signed=False, bits=bits)
    return {"p": p, "m": codes, "v": s_codes, "m_absmax": absmax, "v_absmax": s_absmax}


def _grad(n: int, step: int) -> torch.Tensor:
    """Ordinary gradients, with blocks chosen to take each path on the first step:
    block 3 two-factor encode scales (its new absmaxes just under the fold limit, 2^15),
    block 6 over the fold limit, block 9 an Inf, block 10 a NaN, blocks 64-65 (the second
    work item's first) two-factor then over the limit, blocks 12 and 70 an outlier 5e5
    times the rest, so that from step 2 on most of their codes are subnormal (decoded
    without fp32 denormals); the rest fast blocks in a row."""
    g = torch.Generator().manual_seed(100 + step)
    grad = torch.randn(n, generator=g) * 1e-2
    if step == 1:
        # m = 0.1 g and sqrt(v) ~ 0.1 |g| (w1 = 0.1, 1 - beta2 = 0.01): 31800 lies in
        # (1.9375 * 2^14, 2^15), where the encode scale takes two factors
        for block in (3, 64):
            grad[block * BLOCK + 17] = 318_000.0
        for block in (6, 65):
            grad[block * BLOCK + 40] = 1e9
        for block in (12, 70):
            grad[block * BLOCK + 200] = 5_000.0
        grad[9 * BLOCK + 100] = float("inf")
        grad[10 * BLOCK + 3] = float("nan")
    return grad


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _assert_subnormal_codes(state: dict[str, torch.Tensor]) -> None:
    """Blocks 12 and 70 hold many subnormal codes (signed: exponent bits clear, mantissa
    bits not; unsigned: 1..15), which the next step decodes."""
    for block in (12, 70):
        m_codes = state["m"][block * BLOCK : (block + 1) * BLOCK].int()
        s_codes = state["v"][block * BLOCK : (block + 1) * BLOCK].int()
        assert (((m_codes & 0x78) == 0) & ((m_codes & 0x07) != 0)).sum() > 100
        assert ((s_codes >= 1) & (s_codes <= 15)).sum() > 100


@pytest.mark.parametrize(("threads", "flush_denormal"), [(1, False), (2, False), (1, True)])
def test_int8_block_pipeline_equals_the_portable_build_bit_for_bit(
    vector: _kernel.Kernel, portable: _kernel.Kernel, threads: int, flush_denormal: bool
) -> None:
    """flush_denormal: torch.set_flush_denormal(True) for the last step (denormals read and
    written as zero, in this thread, where one thread runs the kernel): both builds decode
    the subnormal codes that step 2 left as zero."""
    if vector.vector_width == 1:
        pytest.skip("this CPU has no AVX-512: the default build is the portable one")
    assert portable.vector_width == 1
    n = 2 * ITEM_BLOCKS * BLOCK + 3 * BLOCK + 101  # three work items, a partial last block
    states = [_state(n) for _ in range(2)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(1, 4):
            if step == 3 and flush_denormal and not torch.set_flush_denormal(True):
                pytest.skip("this CPU cannot flush denormals")
            grad = _grad(n, step)
            for kernel, state in zip((vector, portable), states, strict=True):
                update = Update(
                    state["p"], grad, state["m"], state["v"], adamw_hyper(step, 2),
                    state["m_absmax"], state["v_absmax"],
                )  # fmt: skip
                KernelBackend(kernel).batch("int8", [update])
            for key in states[0]:
                assert torch.equal(_bits(states[0][key]), _bits(states[1][key])), (step, key)
            if step == 2:
                _assert_subnormal_codes(states[0])
    finally:
        torch.set_num_threads(previous)
        torch.set_flush_denormal(False)
    absmax = states[0]["m_absmax"]
    # the other paths were taken: two-factor blocks, blocks over the fold limit, local Inf/NaN
    assert absmax[6] >= 2**15 and absmax[65] >= 2**15
    assert states[0]["p"].isfinite().sum() == n - 2
