"""The C++ block kernels' explicit AVX-512 paths (``csrc/blocks_cpu.cpp``, ``*_avx512``)
against fp64 references and against the same source built without AVX-512 (the generic
loops), at sizes that exercise the masked tails: hidden sizes that are not multiples of 16,
row counts that are not multiples of the weight gradient's 32-row blocks, head dims whose
half is not a multiple of 16, key lengths that are not, fp32 and bf16 storage.

Tolerances: fp32 results within 2e-6 of the fp64 reference relative to the largest
magnitude (the existing tests' bound); bf16 results within one bf16 rounding (2**-8
relative, per element) plus 1e-5 of the largest magnitude.  The RMSNorm weight gradient is
compared bit for bit: with the generic build, across thread counts, and with its
documented order of additions done one at a time."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sakura_kernels.blocks._native import CPU_LIBRARY

CODES = {torch.float32: 0, torch.bfloat16: 1}
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def vector() -> ctypes.CDLL:
    """The kernels as built for this CPU (AVX-512 paths where it has AVX-512)."""
    lib = CPU_LIBRARY.load(required=True)
    assert lib is not None
    return lib


def _built_with(flag: str, folder: Path) -> Iterator[ctypes.CDLL]:
    """The same source built with one more compiler flag, cached in ``folder``."""
    library = CPU_LIBRARY.replace(cflags=(*CPU_LIBRARY.cflags, flag))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(library.cache_env, str(folder))
        lib = library.load(required=True)
        assert lib is not None
        yield lib


@pytest.fixture(scope="module")
def generic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ctypes.CDLL]:
    """The same source built without AVX-512: the generic loops only."""
    yield from _built_with("-mno-avx512f", tmp_path_factory.mktemp("generic"))


@pytest.fixture(scope="module")
def no_bf16(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ctypes.CDLL]:
    """The AVX-512 paths without AVX-512-BF16: bf16 rounded by the integer code."""
    yield from _built_with("-mno-avx512bf16", tmp_path_factory.mktemp("no_bf16"))


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, scale: float = 0.0) -> None:
    """``out`` (fp32 or bf16) against the fp64 ``ref`` at the module's tolerances; ``scale``:
    the size of the terms that cancel into ``ref``, where it is larger than ``ref``'s."""
    o, r = out.double(), ref.double()
    top = max(float(r.abs().max()) if r.numel() else 0.0, scale)
    if out.dtype == torch.float32:
        bound = torch.full_like(r, 2e-6 * top + 1e-30)
    else:
        bound = 2.0**-8 * r.abs() + 1e-5 * top + 1e-30
    bad = ((o - r).abs() > bound) | (o.isnan() != r.isnan())
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} elements out of tolerance, "
        f"max error {float((o - r).abs().nan_to_num().max()):.3e} (largest |ref| {top:.3e})"
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


# ---- RMSNorm ----------------------------------------------------------------------------


def _rmsnorm(
    lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float
) -> tuple[torch.Tensor, ...]:
    rows, h = x.shape
    y, dx = torch.empty_like(x), torch.empty_like(x)
    rstd, dw = torch.empty(rows), torch.empty(h)
    code = CODES[x.dtype]
    status = lib.sakura_blocks_rmsnorm_forward(
        code, x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, h, eps
    )
    assert status == 0
    status = lib.sakura_blocks_rmsnorm_backward(
        code, dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
        dw.data_ptr(), rows, h,
    )  # fmt: skip
    assert status == 0
    return y, rstd, dx, dw


def _rmsnorm_reference(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float
) -> tuple[torch.Tensor, ...]:
    xd, wd, gd = x.double(), w.double(), dy.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xd * rstd
    dxhat = gd * wd
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return wd * xhat, rstd.squeeze(-1), dx, (gd * xhat).sum(0)


RMS_SHAPES = [(45, 37), (33, 300), (1, 1), (70, 592), (32, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "h"), RMS_SHAPES)
def test_rmsnorm_odd_shapes_match_fp64_and_the_generic_build(
    vector: ctypes.CDLL, generic: ctypes.CDLL, dtype: torch.dtype, rows: int, h: int
) -> None:
    x = _rand(rows, h, dtype=dtype, seed=1, scale=3.0)
    w = (1 + _rand(h, dtype=torch.float64, seed=2, scale=0.3)).to(dtype)
    dy = _rand(rows, h, dtype=dtype, seed=3)
    eps = 1e-5
    y, rstd, dx, dw = _rmsnorm(vector, x, w, dy, eps)
    ry, rrstd, rdx, rdw = _rmsnorm_reference(x, w, dy, eps)
    _assert_close(y, ry, "y")
    _assert_close(rstd, rrstd, "rstd")
    terms = float((rrstd[:, None] * (dy.double() * w.double()).abs()).max())  # dx cancels
    _assert_close(dx, rdx, "dx", terms)
    _assert_close(dw, rdw, "dw")
    gy, grstd, gdx, gdw = _rmsnorm(generic, x, w, dy, eps)
    _assert_close(gy, ry, "generic y")
    _assert_close(gdx, rdx, "generic dx", terms)
    # Same 1/rms to the last bit is not promised (double sums in another lane order), but
    # given the same rstd the weight gradient's fixed-order sum is bit for bit the same.
    _, _, _, dw_from_generic_rstd = _rmsnorm_backward_only(vector, x, w, dy, grstd)
    assert torch.equal(_bits(dw_from_generic_rstd), _bits(gdw))
    xhat = x.float() * rstd[:, None]
    assert torch.equal(_bits(dw), _bits(_documented_order_sum(dy.float() * xhat)))


def _documented_order_sum(values: torch.Tensor) -> torch.Tensor:
    """The weight gradient's documented order, one addition at a time: fp32 running sums
    over blocks of 32 rows in row order, then the blocks' sums in order in double."""
    total = torch.zeros(values.shape[1], dtype=torch.float64)
    for start in range(0, values.shape[0], 32):
        block = torch.zeros(values.shape[1], dtype=torch.float32)
        for row in values[start : start + 32]:
            block = block + row
        total = total + block.double()
    return total.float()


def _rmsnorm_backward_only(
    lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    rows, h = x.shape
    dx, dw = torch.empty_like(x), torch.empty(h)
    status = lib.sakura_blocks_rmsnorm_backward(
        CODES[x.dtype], dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr(),
        dx.data_ptr(), dw.data_ptr(), rows, h,
    )  # fmt: skip
    assert status == 0
    return x, rstd, dx, dw


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_weight_gradient_bits_do_not_depend_on_threads(
    vector: ctypes.CDLL, dtype: torch.dtype
) -> None:
    x = _rand(101, 75, dtype=dtype, seed=4)
    w = _rand(75, dtype=dtype, seed=5)
    dy = _rand(101, 75, dtype=dtype, seed=6)
    _, _, dx1, dw1 = _rmsnorm(vector, x, w, dy, 1e-6)
    torch.set_num_threads(2)
    try:
        _, _, dx2, dw2 = _rmsnorm(vector, x, w, dy, 1e-6)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(_bits(dw1), _bits(dw2))
    assert torch.equal(_bits(dx1), _bits(dx2))


# ---- rotary -----------------------------------------------------------------------------


def _rope(
    lib: ctypes.CDLL, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> torch.Tensor:
    out = torch.empty_like(q)
    b, h, s, d = q.shape
    status = lib.sakura_blocks_rope(
        CODES[q.dtype], q.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        b, h, s, d, int(backward),
    )  # fmt: skip
    assert status == 0
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [2, 6, 40, 64, 96])
def test_rotary_odd_head_dims_match_fp64_and_the_generic_build_bit_for_bit(
    vector: ctypes.CDLL, generic: ctypes.CDLL, dtype: torch.dtype, dim: int
) -> None:
    q = _rand(2, 3, 5, dim, dtype=dtype, seed=7)
    angles = torch.rand(2, 5, dim // 2, generator=torch.Generator().manual_seed(8)) * 50
    full = torch.cat((angles, angles), -1).double()
    cos, sin = full.cos().to(dtype).contiguous(), full.sin().to(dtype).contiguous()
    qd, cd, sd = q.double(), cos.double()[:, None], sin.double()[:, None]
    half = dim // 2
    rotated = torch.cat((-qd[..., half:], qd[..., :half]), -1)
    forward_ref = qd * cd + rotated * sd
    qs = qd * sd
    backward_ref = qd * cd - torch.cat((-qs[..., half:], qs[..., :half]), -1)
    for backward, ref in ((False, forward_ref), (True, backward_ref)):
        out = _rope(vector, q, cos, sin, backward)
        _assert_close(out, ref, f"rotary backward={backward}")
        assert torch.equal(_bits(out), _bits(_rope(generic, q, cos, sin, backward)))


# ---- gated activations --------------------------------------------------------------------


def _glu(
    lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, kind: int
) -> tuple[torch.Tensor, ...]:
    out, dgate, dup = torch.empty_like(gate), torch.empty_like(gate), torch.empty_like(gate)
    code, n = CODES[gate.dtype], gate.numel()
    assert lib.sakura_blocks_glu_forward(code, kind, gate.data_ptr(), up.data_ptr(),
                                         out.data_ptr(), n) == 0  # fmt: skip
    assert lib.sakura_blocks_glu_backward(
        code, kind, grad.data_ptr(), gate.data_ptr(), up.data_ptr(), dgate.data_ptr(),
        dup.data_ptr(), n,
    ) == 0  # fmt: skip
    return out, dgate, dup


def _glu_reference(
    gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, kind: int
) -> tuple[torch.Tensor, ...]:
    g = gate.double().requires_grad_(True)
    if kind == 0:
        act = torch.nn.functional.silu(g)
    else:
        act = torch.nn.functional.gelu(g, approximate="tanh")
    (slope,) = torch.autograd.grad(act.sum(), g)
    act, u, d = act.detach(), up.double(), grad.double()
    return act * u, d * u * slope, d * act


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("n", [1, 33, 4096 * 2 + 7])
def test_glu_odd_lengths_match_fp64_and_the_generic_build(
    vector: ctypes.CDLL, generic: ctypes.CDLL, dtype: torch.dtype, kind: int, n: int
) -> None:
    gate = _rand(n, dtype=dtype, seed=9, scale=3.0)
    up = _rand(n, dtype=dtype, seed=10)
    grad = _rand(n, dtype=dtype, seed=11)
    refs = _glu_reference(gate, up, grad, kind)
    # gelu's slope holds 1 + tanh(z), which cancels for negative gates: its error is a few
    # ulps of 1 times |g d u| (the old kernel's too), so that is its scale.
    scales = (0.0, float((gate.double() * grad.double() * up.double()).abs().max()) * kind, 0.0)
    for lib, name in ((vector, "vector"), (generic, "generic")):
        outs = _glu(lib, gate, up, grad, kind)
        for out, ref, scale, what in zip(outs, refs, scales, ("out", "dgate", "dup"), strict=True):
            _assert_close(out, ref, f"{name} {what}", scale)


@pytest.mark.parametrize("kind", [0, 1])
def test_glu_extreme_gates_stay_finite_and_exact_enough(vector: ctypes.CDLL, kind: int) -> None:
    """Gates past the clamped exp arguments (|g| up to 1e4): the values are 0 or g and the
    slopes 0 or 1 to fp32 precision; a NaN gate gives NaN."""
    values = [-1e4, -200.0, -90.0, -87.5, -30.0, 30.0, 87.5, 90.0, 200.0, 1e4]
    gate = torch.tensor(values + [0.5] * 7, dtype=torch.float32)  # 17: one masked tail
    up, grad = torch.ones_like(gate), torch.ones_like(gate)
    out, dgate, dup = _glu(vector, gate, up, grad, kind)
    ref_out, ref_dgate, _ = _glu_reference(gate, up, grad, kind)
    assert bool(out.isfinite().all()) and bool(dgate.isfinite().all())
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(dgate.double(), ref_dgate, rtol=0, atol=2e-6)
    assert torch.equal(dup, out)
    nan_gate = gate.clone()
    nan_gate[3] = float("nan")
    out, dgate, _ = _glu(vector, nan_gate, up, grad, kind)
    assert bool(out[3].isnan()) and bool(dgate[3].isnan())
    assert bool(out[torch.arange(17) != 3].isfinite().all())


# ---- attention softmax --------------------------------------------------------------------


def _softmax_reference(
    s: torch.Tensor, q_len: int, mask: torch.Tensor | None, causal: bool, scale: float
) -> torch.Tensor:
    """s: (b, kvh, inner, k); mask: (1 or b, q_len, k) additive."""
    b, kvh, inner, k = s.shape
    z = s.double() * scale
    if mask is not None:
        z = z + mask.double().repeat(1, inner // q_len, 1)[:, None].expand(b, kvh, inner, k)
    if causal:
        i = torch.arange(inner)[:, None] % q_len
        j = torch.arange(k)[None, :]
        z = z.masked_fill(j > i + k - q_len, float("-inf"))
    return torch.softmax(z, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_len", "k", "causal", "masked"), [
    (5, 37, True, False), (37, 37, True, False), (3, 16, False, True), (7, 50, False, False),
    (1, 1, True, False),
])  # fmt: skip
def test_attention_softmax_odd_key_lengths_match_fp64_and_the_generic_build(
    vector: ctypes.CDLL,
    generic: ctypes.CDLL,
    dtype: torch.dtype,
    q_len: int,
    k: int,
    causal: bool,
    masked: bool,
) -> None:
    b, kvh, group, scale = 2, 2, 3, 0.125
    inner = group * q_len
    scores = _rand(b, kvh, inner, k, dtype=dtype, seed=12, scale=8.0)
    mask = None
    if masked:
        mask = _rand(b, q_len, k, dtype=torch.float32, seed=13)
        mask[:, :, ::3] = float("-inf")
    ref = _softmax_reference(scores, q_len, mask, causal, scale)
    dp = _rand(b, kvh, inner, k, dtype=dtype, seed=14)
    for lib, name in ((vector, "vector"), (generic, "generic")):
        probs = scores.clone()
        status = lib.sakura_attn_softmax_forward(
            CODES[dtype], probs.data_ptr(), b * kvh, inner, q_len, k,
            mask.data_ptr() if mask is not None else None, kvh,
            q_len * k if mask is not None else 0, int(causal), scale,
        )  # fmt: skip
        assert status == 0
        _assert_close(probs, ref, f"{name} probabilities")
        pd = probs.double()
        ref_ds = scale * pd * (dp.double() - (pd * dp.double()).sum(-1, keepdim=True))
        ds = dp.clone()
        status = lib.sakura_attn_softmax_backward(
            CODES[dtype], probs.data_ptr(), ds.data_ptr(), b * kvh * inner, k, scale
        )
        assert status == 0
        _assert_close(ds, ref_ds, f"{name} score gradient")
        if causal:  # the backward that skips the zeros past the causal limits
            ds_causal = dp.clone()
            status = lib.sakura_attn_softmax_backward_causal(
                CODES[dtype], probs.data_ptr(), ds_causal.data_ptr(), b * kvh * inner, q_len, k,
                scale,
            )  # fmt: skip
            assert status == 0
            _assert_close(ds_causal, ref_ds, f"{name} causal score gradient")
            assert bool((ds_causal[probs == 0] == 0).all())


# ---- cross-entropy rows -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 37, 1000, 64])
def test_cross_entropy_rows_match_fp64_and_the_generic_build(
    vector: ctypes.CDLL, generic: ctypes.CDLL, dtype: torch.dtype, vocab: int
) -> None:
    """``sakura_xent_rows``: log-sum-exp, picked logit and softmax - onehot written over the
    logits (rows whose target is -1 ignored: zeros), vocabularies with masked tails, an
    -inf logit."""
    rows = 7
    logits = _rand(rows, vocab, dtype=dtype, seed=15, scale=6.0)
    if vocab > 1:
        logits[2, 1] = float("-inf")
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(16))
    targets[4] = -1
    if vocab > 1:
        targets[2] = 0
    x = logits.double()
    ref_lse = torch.logsumexp(x, -1)
    keep = targets >= 0
    ref_picked = torch.where(keep, x.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    ref_grad = torch.softmax(x, -1)
    ref_grad[keep, targets[keep]] -= 1.0
    ref_grad[~keep] = 0.0
    for lib, name in ((vector, "vector"), (generic, "generic")):
        grad = logits.clone()
        lse, picked = torch.empty(rows), torch.empty(rows)
        status = lib.sakura_xent_rows(
            CODES[dtype], grad.data_ptr(), rows, vocab, targets.data_ptr(), lse.data_ptr(),
            picked.data_ptr(), 1,
        )  # fmt: skip
        assert status == 0
        torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-6, atol=0)
        assert torch.equal(picked.double(), ref_picked)
        _assert_close(grad, ref_grad, f"{name} gradient")


def test_attention_softmax_refuses_rows_that_are_not_whole_query_groups(
    vector: ctypes.CDLL, generic: ctypes.CDLL
) -> None:
    """inner rows are (group member, query position) pairs: 7 rows for 3 positions are not."""
    scores = torch.zeros(1, 1, 7, 4)
    for lib in (vector, generic):
        status = lib.sakura_attn_softmax_forward(
            0, scores.data_ptr(), 1, 7, 3, 4, None, 1, 0, 0, 1.0
        )
        assert status == -1
    assert bool((scores == 0).all())
    for rows, q_len, k in ((7, 3, 4), (6, 5, 4), (6, 0, 4)):  # partial group, q_len > k, 0
        for lib in (vector, generic):
            status = lib.sakura_attn_softmax_backward_causal(
                0, scores.data_ptr(), scores.data_ptr(), rows, q_len, k, 1.0
            )
            assert status == -1


def test_bf16_rounding_without_avx512_bf16_gives_the_same_bits(
    vector: ctypes.CDLL, no_bf16: ctypes.CDLL
) -> None:
    """vcvtneps2bf16 / vcvtne2ps2bf16 and the integer round-to-nearest-even agree on every
    normal value: the kernels' bf16 outputs are bit for bit the same from both builds
    (odd lengths: the paired 32-element loop, the 16-lane loop and a masked tail)."""
    n = 4096 + 32 * 3 + 16 + 5
    gate = _rand(n, dtype=torch.bfloat16, seed=17, scale=3.0)
    up = _rand(n, dtype=torch.bfloat16, seed=18)
    grad = _rand(n, dtype=torch.bfloat16, seed=19)
    for kind in (0, 1):
        for a, b in zip(
            _glu(vector, gate, up, grad, kind), _glu(no_bf16, gate, up, grad, kind), strict=True
        ):
            assert torch.equal(_bits(a), _bits(b))
    x = _rand(45, 37, dtype=torch.bfloat16, seed=20)
    w = _rand(37, dtype=torch.bfloat16, seed=21)
    dy = _rand(45, 37, dtype=torch.bfloat16, seed=22)
    for a, b in zip(
        _rmsnorm(vector, x, w, dy, 1e-5), _rmsnorm(no_bf16, x, w, dy, 1e-5), strict=True
    ):
        assert torch.equal(_bits(a), _bits(b))
