"""Chunked causal-LM loss: equal to the full-logits loss, and no tokens x vocab tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sakura.options import OptionError
from sakura_kernels.losses.chunked import (
    causal_lm_loss,
    chunked_causal_lm_loss,
    matmul_dtype,
    shift_causal_labels,
)

TOL = 1e-6
BATCH, SEQ, HIDDEN, VOCAB = 2, 23, 16, 61


def inputs(bias: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    b = torch.randn(VOCAB, generator=g) if bias else None
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, :5] = -100  # a prompt that is not scored
    labels[1, 9:12] = -100
    return hidden, weight, b, labels  # type: ignore[return-value]


def full_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    reduction: str = "mean",
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(
        logits.view(-1, weight.shape[0]), targets.view(-1), ignore_index=-100, reduction=reduction
    )


def grads(loss: torch.Tensor, *tensors: torch.Tensor | None) -> list[torch.Tensor]:
    present = [t for t in tensors if t is not None]
    return list(torch.autograd.grad(loss, present))


def leaves(*tensors: torch.Tensor | None) -> list[Any]:
    return [t.clone().requires_grad_(True) if t is not None else None for t in tensors]


@pytest.mark.parametrize("chunk_size", [1, 5, 7, SEQ, 2 * SEQ - 1, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_full_cross_entropy(chunk_size: int, bias: bool) -> None:
    hidden, weight, b, labels = inputs(bias)
    h1, w1, b1 = leaves(hidden, weight, b)
    h2, w2, b2 = leaves(hidden, weight, b)
    ref = full_loss(h1, w1, b1, shift_causal_labels(labels))
    got = chunked_causal_lm_loss(h2, w2, labels, chunk_size=chunk_size, bias=b2)
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(got.item() - ref.item()) <= TOL
    for a, r in zip(grads(got, h2, w2, b2), grads(ref, h1, w1, b1), strict=True):
        assert a.shape == r.shape and a.dtype == r.dtype
        assert (a - r).abs().max().item() <= TOL


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_other_reductions(reduction: str) -> None:
    hidden, weight, _, labels = inputs()
    h1, w1 = leaves(hidden, weight)
    h2, w2 = leaves(hidden, weight)
    ref = full_loss(h1, w1, None, shift_causal_labels(labels), reduction)
    got = chunked_causal_lm_loss(h2, w2, labels, chunk_size=9, reduction=reduction)
    if reduction == "none":
        assert got.shape == labels.shape
        assert torch.all(got[0, :4] == 0)  # positions whose target is ignored
        got_flat = got.reshape(-1)
        assert (got_flat - ref).abs().max().item() <= TOL
        # An uneven upstream gradient per position reaches the right tokens.
        upstream = torch.linspace(-1.0, 2.0, ref.numel())
        got_grads = torch.autograd.grad(got_flat, [h2, w2], upstream)
        ref_grads = torch.autograd.grad(ref, [h1, w1], upstream)
    else:
        assert abs(got.item() - ref.item()) <= TOL * abs(ref.item())
        got_grads = torch.autograd.grad(got, [h2, w2])
        ref_grads = torch.autograd.grad(ref, [h1, w1])
    for a, r in zip(got_grads, ref_grads, strict=True):
        assert (a - r).abs().max().item() <= TOL * max(1.0, r.abs().max().item())


def test_matches_transformers_loss_with_num_items_and_shift_labels() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, weight, _, labels = inputs()
    for kwargs in ({}, {"num_items_in_batch": 57}, {"num_items_in_batch": torch.tensor(57)}):
        h1, w1 = leaves(hidden, weight)
        h2, w2 = leaves(hidden, weight)
        ref = ForCausalLMLoss(F.linear(h1, w1), labels, VOCAB, **kwargs)
        got = chunked_causal_lm_loss(h2, w2, labels, chunk_size=6, **kwargs)
        assert abs(got.item() - ref.item()) <= TOL
        for a, r in zip(grads(got, h2, w2), grads(ref, h1, w1), strict=True):
            assert (a - r).abs().max().item() <= TOL
    # Already shifted labels are not shifted again.
    shifted = shift_causal_labels(labels)
    ref = ForCausalLMLoss(F.linear(hidden, weight), None, VOCAB, shift_labels=shifted)
    got = chunked_causal_lm_loss(hidden, weight, None, shift_labels=shifted, chunk_size=4)
    assert abs(got.item() - ref.item()) <= TOL


def test_bf16_autocast_rounds_like_the_full_loss() -> None:
    hidden, weight, b, labels = inputs(bias=True)
    h0, w0, b0 = leaves(hidden, weight, b)
    exact = grads(full_loss(h0, w0, b0, shift_causal_labels(labels)), h0, w0, b0)
    h1, w1, b1 = leaves(hidden, weight, b)
    h2, w2, b2 = leaves(hidden, weight, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = full_loss(h1, w1, b1, shift_causal_labels(labels))
        got = chunked_causal_lm_loss(h2, w2, labels, chunk_size=7, bias=b2)
    assert abs(got.item() - ref.item()) <= TOL  # bf16 logits, upcast: the same numbers
    got_grads, ref_grads = grads(got, h2, w2, b2), grads(ref, h1, w1, b1)
    assert all(g.dtype == torch.float32 for g in got_grads)
    assert torch.allclose(got_grads[0], ref_grads[0], rtol=0, atol=TOL)
    # Weight and bias gradients: summed over the tokens in bf16 by autograd, per chunk here
    # (then in fp32): as far from the fp32 gradient as autograd's own, within bf16 rounding.
    for a, r, e in zip(got_grads[1:], ref_grads[1:], exact[1:], strict=True):
        assert (a - e).norm() <= 1.1 * (r - e).norm()
        assert (a - r).abs().max() <= 2e-2 * r.abs().max()


def test_bf16_head_runs_the_matmul_in_bf16_with_an_fp32_log_sum_exp() -> None:
    # fp32 hidden states (a norm kept in fp32) into a bf16 head, no autocast: the matmul runs
    # in bf16, the log-sum-exp and the loss in fp32; as the full loss on bf16-cast inputs.
    hidden, weight, _, labels = inputs()
    weight = weight.bfloat16()
    assert matmul_dtype(hidden, weight) == torch.bfloat16
    assert matmul_dtype(hidden, weight.float()) == torch.float32
    h1, w1 = leaves(hidden, weight)
    h2, w2 = leaves(hidden, weight)
    ref = full_loss(h1.bfloat16(), w1, None, shift_causal_labels(labels))
    got = chunked_causal_lm_loss(h2, w2, labels, chunk_size=5)
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) <= TOL
    got_grads, ref_grads = grads(got, h2, w2), grads(ref, h1, w1)
    assert got_grads[0].dtype == torch.float32 and got_grads[1].dtype == torch.bfloat16
    assert torch.allclose(got_grads[0], ref_grads[0], rtol=0, atol=1e-5)
    assert (got_grads[1].float() - ref_grads[1].float()).abs().max() <= 2e-2 * ref_grads[
        1
    ].float().abs().max()


def test_gradient_accumulation_with_num_items_in_batch_equals_the_whole_batch() -> None:
    hidden, weight, _, labels = inputs()
    h, w = leaves(hidden, weight)
    whole = chunked_causal_lm_loss(h, w, labels, chunk_size=8)
    whole.backward()
    scored = int((shift_causal_labels(labels) != -100).sum())
    hm, wm = leaves(hidden, weight)
    total = 0.0
    for row in range(BATCH):  # one micro-batch per row, gradients accumulated
        loss = chunked_causal_lm_loss(
            hm[row : row + 1], wm, labels[row : row + 1], chunk_size=8, num_items_in_batch=scored
        )
        loss.backward()
        total += loss.item()
    assert abs(total - whole.item()) <= TOL
    assert hm.grad is not None and h.grad is not None and wm.grad is not None
    assert (hm.grad - h.grad).abs().max().item() <= TOL
    assert (wm.grad - w.grad).abs().max().item() <= TOL


def test_every_label_ignored_gives_nan_like_cross_entropy_and_zero_gradients() -> None:
    hidden, weight, _, labels = inputs()
    labels.fill_(-100)
    h = hidden.clone().requires_grad_(True)
    got = chunked_causal_lm_loss(h, weight, labels, chunk_size=8)
    assert torch.isnan(got) and torch.isnan(full_loss(hidden, weight, None, labels))
    got.backward()
    assert h.grad is not None and torch.all(h.grad == 0)


@pytest.mark.parametrize("bad", [-5, VOCAB])
def test_a_label_out_of_the_vocabulary_raises_like_cross_entropy(bad: int) -> None:
    """Before: the C++ pass took a negative label for an ignored one (a silently wrong
    mean) where F.cross_entropy raises."""
    hidden, weight, _, labels = inputs()
    labels[1, 7] = bad
    with pytest.raises(IndexError, match=f"label {bad} is out of range for a vocabulary of 61"):
        chunked_causal_lm_loss(hidden, weight, labels, chunk_size=8)
    with pytest.raises(IndexError):
        full_loss(hidden, weight, None, labels)


def test_frozen_head_gets_no_gradient_and_only_hidden_is_computed() -> None:
    hidden, weight, _, labels = inputs()
    h = hidden.clone().requires_grad_(True)
    got = chunked_causal_lm_loss(h, weight, labels, chunk_size=8)  # weight: no grad (LoRA)
    (gh,) = torch.autograd.grad(got, [h])
    h1 = hidden.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(full_loss(h1, weight, None, shift_causal_labels(labels)), [h1])
    assert (gh - ref).abs().max().item() <= TOL


class _LargestAllocation(TorchDispatchMode):
    """Records the element count of the largest tensor any operator produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _peaks(compute: Any) -> tuple[int, int]:
    """(largest tensor saved for backward, largest tensor produced in forward + backward)."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    mode = _LargestAllocation()
    with mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = compute()
        loss.backward()
    return max(saved), mode.largest


def test_no_tokens_by_vocab_tensor_is_saved_or_allocated() -> None:
    tokens, vocab, hidden_size, chunk = 2 * 96, 500, 8, 16
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 96, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g)
    labels = torch.randint(0, vocab, (2, 96), generator=g)

    def chunked() -> torch.Tensor:
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        return chunked_causal_lm_loss(h, w, labels, chunk_size=chunk)

    def full() -> torch.Tensor:
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        return full_loss(h, w, None, shift_causal_labels(labels))

    saved, allocated = _peaks(chunked)
    full_saved, full_allocated = _peaks(full)
    assert full_saved >= tokens * vocab and full_allocated >= tokens * vocab  # the check sees them
    # Saved: the hidden states, the weight, per-token targets and log-sum-exp; nothing per vocab
    # entry per token.  Allocated: the weight (and its gradient) and one chunk's logits.
    assert saved == max(tokens * hidden_size, vocab * hidden_size)
    assert allocated <= max(chunk * vocab, vocab * hidden_size)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (-1, "-1"),
        (0, "0"),
        (True, "True"),
        (2.5, "2.5"),
        (torch.tensor(-3), "-3"),
        (torch.tensor(0.0), "0.0"),
        (torch.tensor(float("nan")), "nan"),
        (torch.tensor([4, 4]), r"\[4, 4\]"),
        (torch.tensor(True), "True"),
    ],
)
def test_num_items_in_batch_must_be_a_positive_count(value: object, shown: str) -> None:
    # -1 gave a negative loss, 0 an infinite one.
    hidden, weight, _, labels = inputs()
    with pytest.raises(OptionError, match=rf"num_items_in_batch={shown} is not accepted") as info:
        chunked_causal_lm_loss(hidden, weight, labels, num_items_in_batch=value)  # type: ignore[arg-type]
    assert "a positive int" in info.value.accepted
    for good in (7, torch.tensor(7), torch.tensor([7.0])):
        loss = chunked_causal_lm_loss(hidden, weight, labels, num_items_in_batch=good)
        assert loss.item() > 0


def test_options_are_validated() -> None:
    hidden, weight, _, labels = inputs()
    with pytest.raises(OptionError, match="chunk_size=0 is not accepted; accepted: an int >= 1"):
        chunked_causal_lm_loss(hidden, weight, labels, chunk_size=0)
    with pytest.raises(OptionError, match="reduction='avg'"):
        chunked_causal_lm_loss(hidden, weight, labels, reduction="avg")
    with pytest.raises(OptionError, match=r"num_items_in_batch=5 .*unless reduction='mean'"):
        chunked_causal_lm_loss(hidden, weight, labels, reduction="sum", num_items_in_batch=5)
    with pytest.raises(OptionError, match="lm_head_weight"):
        chunked_causal_lm_loss(hidden, weight.t(), labels)
    with pytest.raises(OptionError, match="bias"):
        chunked_causal_lm_loss(hidden, weight, labels, bias=torch.zeros(3))
    with pytest.raises(OptionError, match="exactly one of labels and shift_labels"):
        chunked_causal_lm_loss(hidden, weight, labels, shift_labels=labels)
    with pytest.raises(OptionError, match="labels=\\(2, 22\\)"):
        chunked_causal_lm_loss(hidden, weight, labels[:, 1:])
    with pytest.raises(OptionError, match="an integer tensor"):
        chunked_causal_lm_loss(hidden, weight, labels.float())


# --- transformers ----------------------------------------------------------------------


def tiny_llama(tie: bool = False) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).eval()  # eval: no dropout, the two runs see the same model


def llama_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 97, (2, 19), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[0, :6] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _compare(model: Any, trainable: list[torch.nn.Parameter], **extra: Any) -> None:
    batch = llama_batch()
    ref = model(**batch, **extra).loss
    ref_grads = torch.autograd.grad(ref, trainable)
    got = causal_lm_loss(model, chunk_size=5, **batch, **extra)
    got_grads = torch.autograd.grad(got, trainable)
    assert abs(got.item() - ref.item()) <= TOL
    for a, r in zip(got_grads, ref_grads, strict=True):
        assert (a - r).abs().max().item() <= TOL


@pytest.mark.parametrize("tie", [False, True])
def test_llama_loss_and_gradients_equal_the_models_own(tie: bool) -> None:
    model = tiny_llama(tie)
    _compare(model, list(model.parameters()))
    _compare(model, list(model.parameters()), num_items_in_batch=torch.tensor(40))


def test_peft_lora_llama_equals_the_models_own() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters something to do
            torch.nn.init.normal_(p, std=0.1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and len(trainable) < len(list(model.parameters()))
    _compare(model, trainable)


def test_llama_head_that_is_not_a_linear_is_refused() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(NotImplementedError, match=r"not a plain torch\.nn\.Linear"):
        causal_lm_loss(model, **llama_batch())
    with pytest.raises(OptionError, match="a transformers \\*ForCausalLM"):
        causal_lm_loss(torch.nn.Linear(2, 2), **llama_batch())


def test_frozen_bf16_head_gradient_from_the_forward_is_as_close_to_fp64_as_autograd() -> None:
    """A frozen bf16 head (QLoRA): the gradient comes from the forward (the C++ pass over the
    bf16 logits); loss as the full loss, hidden gradient as close to fp64 as autograd's."""
    hidden, weight, _, labels = inputs()
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    targets = shift_causal_labels(labels)
    h0 = hidden.double().requires_grad_(True)
    exact_loss = full_loss(h0, weight.double(), None, targets)
    (exact,) = torch.autograd.grad(exact_loss, [h0])
    h1, h2 = leaves(hidden, hidden)
    ref = full_loss(h1, weight, None, targets)
    (ref_grad,) = torch.autograd.grad(ref, [h1])
    got = chunked_causal_lm_loss(h2, weight, labels, chunk_size=7)
    (got_grad,) = torch.autograd.grad(got, [h2])
    assert got_grad.dtype == torch.bfloat16
    assert abs(got.item() - ref.item()) <= 1e-5
    got_err = (got_grad.double() - exact).norm()
    ref_err = (ref_grad.double() - exact).norm()
    assert got_err <= 1.5 * ref_err + 1e-6, (float(got_err), float(ref_err))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_kernel_equals_the_torch_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sakura_kernels.blocks._native import CPU_LIBRARY, NO_KERNEL_ENV
    from sakura_kernels.losses.chunked import _xent_chunk

    assert CPU_LIBRARY.load(required=True) is not None
    g = torch.Generator().manual_seed(5)
    raw = (torch.randn(9, 1003, generator=g) * 4).to(dtype)  # 1003: vector lanes and a tail
    targets = torch.randint(0, 1003, (9,), generator=g)
    valid = torch.ones(9, dtype=torch.bool)
    valid[3] = False
    native = _xent_chunk(raw.clone(), targets, valid, want_grad=True)
    monkeypatch.setenv(NO_KERNEL_ENV, "1")
    fallback = _xent_chunk(raw.clone(), targets, valid, want_grad=True)
    assert native[2] is not None and fallback[2] is not None
    assert native[2].dtype == dtype and torch.all(native[2][3] == 0)
    assert torch.allclose(native[0], fallback[0], rtol=0, atol=2e-6)  # log-sum-exp
    assert torch.equal(native[1][valid], fallback[1][valid])  # the picked logits
    tol = 2e-6 if dtype == torch.float32 else 4e-3  # softmax - onehot: one bf16 rounding
    assert (native[2].float() - fallback[2].float()).abs().max() <= tol


def test_a_frozen_head_keeps_only_a_tokens_by_hidden_gradient() -> None:
    tokens, vocab, hidden_size, chunk = 2 * 96, 500, 8, 16
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 96, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g)
    labels = torch.randint(0, vocab, (2, 96), generator=g)

    def chunked() -> torch.Tensor:
        return chunked_causal_lm_loss(
            hidden.clone().requires_grad_(True), weight, labels, chunk_size=chunk
        )

    saved, allocated = _peaks(chunked)
    assert saved == tokens * hidden_size  # the gradient per unit loss; no logits
    assert allocated <= max(chunk * vocab, vocab * hidden_size)
