"""The fused CPU attention (``attn_implementation="sakura"``) against transformers' eager
attention on tiny Llama / Mistral / Qwen2 models: loss and every gradient, fp32 and bf16,
causal-only and padded batches; the cases it hands to SDPA."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from sakura_kernels.blocks import attention
from sakura_kernels.blocks.attention import ATTENTION_NAME, register_attention


def loss_and_grads(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None
) -> list[torch.Tensor]:
    labels = ids.masked_fill(mask == 0, -100) if mask is not None else ids
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    params = [p for p in model.parameters() if p.requires_grad]
    return [loss.detach().double(), *(g.double() for g in torch.autograd.grad(loss, params))]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("padded", [False, True])
def test_equals_eager_attention_fp32(
    make_model: Callable[..., torch.nn.Module], family: str, padded: bool
) -> None:
    register_attention()
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = None
    if padded:  # left padding on the first row: a boolean mask, not the causal-only path
        mask = torch.ones(2, 13, dtype=torch.long)
        mask[0, :4] = 0
    eager = make_model(family)
    ours = make_model(family)
    ours.set_attn_implementation(ATTENTION_NAME)
    calls = []
    original = attention.FusedAttention.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention.FusedAttention, "apply", lambda *a: calls.append(1) or original(*a))
        got = loss_and_grads(ours, ids, mask)
    assert len(calls) == 2  # both layers took the fused path
    want = loss_and_grads(eager, ids, mask)
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) <= 2e-5


def test_bf16_is_as_close_to_fp64_as_eager(make_model: Callable[..., torch.nn.Module]) -> None:
    register_attention()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    exact = loss_and_grads(make_model("llama", torch.float64), ids, None)
    eager = loss_and_grads(make_model("llama", torch.bfloat16), ids, None)
    model = make_model("llama", torch.bfloat16)
    model.set_attn_implementation(ATTENTION_NAME)
    got = loss_and_grads(model, ids, None)
    for g, e, x in zip(got, eager, exact, strict=True):
        assert rel(g, x) <= 1.5 * rel(e, x) + 1e-3, (rel(g, x), rel(e, x))


def test_what_it_does_not_handle_goes_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    class Module(torch.nn.Module):
        is_causal = True

    q = torch.randn(1, 4, 6, 8, dtype=torch.float16)
    k = v = torch.randn(1, 2, 6, 8, dtype=torch.float16)
    seen = []
    monkeypatch.setattr(
        "transformers.integrations.sdpa_attention.sdpa_attention_forward",
        lambda *a, **kw: seen.append(kw) or (torch.zeros(1), None),
    )
    attention.sakura_attention_forward(Module(), q, k, v, None, scaling=0.3)  # fp16
    attention.sakura_attention_forward(Module(), q.float(), k.float(), v.float(), None, dropout=0.1)
    attention.sakura_attention_forward(
        Module(), q.float(), k.float(), v.float(), None, sliding_window=3
    )  # shorter than the 6 keys
    assert len(seen) == 3 and seen[1]["dropout"] == 0.1 and seen[2]["sliding_window"] == 3


class _Causal(torch.nn.Module):
    is_causal = True


def test_fp32_inputs_under_bf16_autocast_run_in_bf16_like_eager() -> None:
    """fp32 query/key/value under CPU bf16 autocast: eager attention's matmuls run in bf16, so
    do ours.  Before the fix the scores came out of autocast in bf16 while the kernel was told
    fp32 by the query's dtype: it wrote past the buffer (glibc aborted the process)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 9, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 9, 16, generator=gen, requires_grad=True)
    module = _Causal()
    module.num_key_value_groups = 2
    module.training = False
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = attention.sakura_attention_forward(module, q, k, v, None, scaling=0.25)
        want, _ = eager_attention_forward(module, q, k, v, causal, scaling=0.25)
    assert got.dtype == torch.bfloat16
    exact, _ = eager_attention_forward(
        module, q.double(), k.double(), v.double(), causal.double(), scaling=0.25
    )
    assert rel(got.detach().double(), exact) <= 1.5 * rel(want.detach().double(), exact) + 1e-3
    (dq, dk, dv) = torch.autograd.grad(got.float().sum(), (q, k, v))
    (eq, ek, ev) = torch.autograd.grad(want.float().sum(), (q, k, v))
    for g, e in ((dq, eq), (dk, ek), (dv, ev)):
        assert g.dtype == torch.float32 and rel(g.double(), e.double()) <= 2e-2


def test_buffers_that_do_not_match_the_call_are_refused_before_the_kernel() -> None:
    """The C++ softmax works in place on a buffer it cannot measure: a scores tensor of
    another dtype or a mask with too few batches raises instead of reading past its end."""
    q = torch.randn(2, 2, 12, 8)
    k = v = torch.randn(2, 2, 6, 8)
    one_batch_mask = torch.zeros(1, 6, 6)
    out = attention.FusedAttention.apply(q, k, v, one_batch_mask, False, 6, 0.3)
    assert out.shape == (2, 2, 12, 8)  # one mask for every batch is accepted
    with pytest.raises(RuntimeError, match="attention mask"):
        attention.FusedAttention.apply(q, k, v, torch.zeros(3, 6, 6), False, 6, 0.3)
    with pytest.raises(RuntimeError, match="attention mask"):
        attention.FusedAttention.apply(q, k, v, torch.zeros(2, 6, 6).bfloat16(), False, 6, 0.3)
    with pytest.raises(RuntimeError, match="attention scores"):
        attention._check_scores(torch.zeros(2, 2, 6, 12).transpose(2, 3), 12, 6, None, 6)
    # a mask of the wrong batch from transformers goes to SDPA, never to the kernel
    seen = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            "transformers.integrations.sdpa_attention.sdpa_attention_forward",
            lambda *a, **kw: seen.append(1) or (torch.zeros(1), None),
        )
        bad = torch.ones(3, 1, 6, 6, dtype=torch.bool)
        attention.sakura_attention_forward(_Causal(), q.view(2, 4, 6, 8), k, v, bad)
    assert seen == [1]
