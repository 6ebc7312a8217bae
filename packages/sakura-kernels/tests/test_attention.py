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
