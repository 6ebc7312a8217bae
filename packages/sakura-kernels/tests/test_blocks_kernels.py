"""The fused block kernels against the Hugging Face code they replace and against an fp64
reference: values and gradients, on the C++ path and the torch fallback; the RMSNorm
weight gradient's bits across runs and thread counts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from sakura_kernels.blocks import fused_glu, fused_rms_norm, fused_rotary
from sakura_kernels.blocks._native import CPU_LIBRARY, NO_KERNEL_ENV

DTYPES = [torch.float32, torch.bfloat16]
# Ours against HF's own code (max abs difference relative to the largest reference value).
AGAINST_HF = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
# Ours against fp64 may be at most this many times HF's own error against fp64 (+ a floor
# of one fp32 rounding, for when HF happens to be exact).
FACTOR = 1.5
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-6}


@pytest.fixture(params=["cpp", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":
        monkeypatch.setenv(NO_KERNEL_ENV, "1")
    else:
        assert CPU_LIBRARY.load(required=True) is not None
    return str(request.param)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def run(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor
) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *[t.grad for t in leaves if t.grad is not None]]


def compare(
    ours: list[torch.Tensor], hf: list[torch.Tensor], exact: list[torch.Tensor], dtype: torch.dtype
) -> None:
    assert len(ours) == len(hf) == len(exact)
    for o, h, e in zip(ours, hf, exact, strict=True):
        assert o.dtype == h.dtype and o.shape == h.shape
        against_hf, ours_err, hf_err = rel(o, h), rel(o, e), rel(h, e)
        print(f"{dtype}: vs HF {against_hf:.2e}, vs fp64 ours {ours_err:.2e} HF {hf_err:.2e}")
        assert against_hf <= AGAINST_HF[dtype]
        assert ours_err <= FACTOR * hf_err + FLOOR[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf_and_fp64(path: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hidden = 96
    norm = LlamaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(hidden))
    x = torch.randn(3, 37, hidden) * 2
    grad = torch.randn(3, 37, hidden)

    def ours_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, w, 1e-6)

    def hf_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(norm, {"weight": w}, (x,))
        return out

    def exact_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # HF's casts would be fp32
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    inputs = [x.to(dtype), norm.weight.detach().to(dtype)]
    ours = run(ours_fn, inputs, grad)
    hf = run(hf_fn, inputs, grad)
    exact = run(exact_fn, [t.double() for t in inputs], grad.to(dtype))
    compare(ours, hf, exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_hf_and_fp64(path: str, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    b, h, s, d = 2, 3, 11, 16
    q = torch.randn(b, h, s, d)
    angles = torch.rand(b, s, d // 2) * 20
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grad = torch.randn(b, h, s, d)

    def hf_fn(q: torch.Tensor) -> torch.Tensor:
        out, _ = apply_rotary_pos_emb(q, q[:, :1], cos.to(q.dtype), sin.to(q.dtype))
        return out

    ours = run(lambda q: fused_rotary(q, cos, sin), [q.to(dtype)], grad)
    hf = run(hf_fn, [q.to(dtype)], grad)
    exact = run(hf_fn, [q.to(dtype).double()], grad.to(dtype))
    compare(ours, hf, [e.to(torch.float64) for e in exact], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("activation", "hf_name"), [("silu", "silu"), ("gelu_tanh", "gelu_pytorch_tanh")]
)
def test_gated_activation_matches_hf_and_fp64(
    path: str, dtype: torch.dtype, activation: str, hf_name: str
) -> None:
    torch.manual_seed(2)
    gate, up = torch.randn(4, 33, 70) * 3, torch.randn(4, 33, 70)
    grad = torch.randn(4, 33, 70)
    act = ACT2FN[hf_name]

    def hf_fn(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = act(g) * u
        return out

    ours = run(lambda g, u: fused_glu(g, u, activation), [gate.to(dtype), up.to(dtype)], grad)
    hf = run(hf_fn, [gate.to(dtype), up.to(dtype)], grad)
    exact = run(hf_fn, [gate.to(dtype).double(), up.to(dtype).double()], grad.to(dtype))
    compare(ours, hf, exact, dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_is_right_far_from_zero(path: str, activation: str) -> None:
    """The C++ path's own vector exp (AVX-512) clamps its argument: gates out to +-120 (exp
    over- and underflowing) still give fp64's values and gradients, no NaN or inf."""
    gate = torch.linspace(-120, 120, 4099).view(1, -1)  # 4099: vector chunks and a tail
    up, grad = torch.ones_like(gate) * 0.5, torch.ones_like(gate)
    hf_name = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[activation]
    act = ACT2FN[hf_name]
    ours = run(lambda g, u: fused_glu(g, u, activation), [gate, up], grad)
    exact = run(lambda g, u: act(g) * u, [gate.double(), up.double()], grad.double())
    for o, e in zip(ours, exact, strict=True):
        assert torch.isfinite(o).all()
        # absolute, scaled per element by max(1, |exact|): tiny values count absolutely
        err = ((o.double() - e).abs() / e.abs().clamp(min=1.0)).max()
        assert err <= 2e-6, (activation, float(err))


def test_the_cpp_path_and_the_torch_fallback_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    x, w = torch.randn(50, 40, dtype=torch.float64), 1 + 0.2 * torch.randn(40, dtype=torch.float64)
    g, u = torch.randn(50, 40, dtype=torch.float64), torch.randn(50, 40, dtype=torch.float64)
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    ang = torch.rand(2, 5, 4, dtype=torch.float64) * 9
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):

        def all_ops(dtype: torch.dtype = dtype) -> list[torch.Tensor]:
            leaves = [t.to(dtype).requires_grad_() for t in (x, w, g, u, q)]
            xs, ws, gs, us, qs = leaves
            y = fused_rms_norm(xs, ws, 1e-5).float().sum() * 0
            outs = [fused_rms_norm(xs, ws, 1e-5), fused_glu(gs, us, "silu"),
                    fused_glu(gs, us, "gelu_tanh"), fused_rotary(qs, cos.to(dtype), sin.to(dtype))]  # fmt: skip
            total = sum(
                (o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs
            )
            (total + y).backward()
            return [o.detach() for o in outs] + [t.grad for t in leaves]

        native = all_ops()
        monkeypatch.setenv(NO_KERNEL_ENV, "1")
        fallback = all_ops()
        monkeypatch.delenv(NO_KERNEL_ENV)
        for a, b in zip(native, fallback, strict=True):
            assert a.dtype == b.dtype and rel(a, b) <= tol, (dtype, rel(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_weight_gradient_has_the_same_bits_every_run_and_thread_count(
    path: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(4)
    x = (torch.randn(300, 128) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(128)).to(dtype)
    grad = torch.randn(300, 128).to(dtype)

    def weight_grad() -> torch.Tensor:
        leaf = w.clone().requires_grad_()
        fused_rms_norm(x, leaf, 1e-6).backward(grad)
        assert leaf.grad is not None
        return leaf.grad.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first, second = weight_grad(), weight_grad()
        torch.set_num_threads(1)
        single = weight_grad()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, second) and torch.equal(first, single)


def test_fp16_runs_the_torch_path_and_is_close_to_fp64() -> None:
    torch.manual_seed(5)
    x, w = torch.randn(8, 32), 1 + 0.1 * torch.randn(32)
    out = fused_rms_norm(x.half(), w.half(), 1e-6)
    exact = fused_rms_norm(x.half().double(), w.half().double(), 1e-6)
    assert out.dtype == torch.float16 and rel(out, exact) <= 1e-3


def test_shapes_the_kernels_cannot_read_are_refused_before_native_code() -> None:
    """The C++ kernels read ``hidden`` weights per row and ``gate.numel()`` elements of
    ``up``: a smaller weight or ``up`` raises (before: read past their end)."""
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match=r"weight of shape \(8,\).*expected \(16,\)"):
        fused_rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"gate \(3, 16\) and up \(3, 1\) differ"):
        fused_glu(x, torch.randn(3, 1), "silu")
