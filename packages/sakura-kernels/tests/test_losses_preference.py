"""sequence_logprobs against full log-softmax; dpo_loss against TRL's own DPO code."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sakura.options import OptionError
from sakura_kernels.losses.preference import dpo_loss, sequence_logprobs

BATCH, SEQ, HIDDEN, VOCAB = 3, 11, 16, 53


def inputs() -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    head = nn.Linear(HIDDEN, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.3)
        head.bias.copy_(torch.randn(VOCAB, generator=g))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, :4] = -100  # prompt
    labels[2, 7:] = -100  # padding
    return hidden, head, labels


def full_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
) -> torch.Tensor:
    """The unfused form: every logit, log-softmax, gather, mask, sum."""
    logps = F.linear(hidden, weight, bias).float().log_softmax(-1)[:, :-1]
    targets = labels[:, 1:]
    mask = targets != -100
    picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
@pytest.mark.parametrize("module", [True, False])
def test_sequence_logprobs_and_gradients_equal_full_log_softmax(
    chunk_size: int, module: bool
) -> None:
    hidden, head, labels = inputs()
    h1 = hidden.clone().requires_grad_(True)
    h2 = hidden.clone().requires_grad_(True)
    head2 = nn.Linear(HIDDEN, VOCAB, bias=module)
    with torch.no_grad():
        head2.weight.copy_(head.weight)
        if module:
            head2.bias.copy_(head.bias)
    ref = full_logprobs(h1, head2.weight, head2.bias if module else None, labels)
    ref_grads = torch.autograd.grad(ref.sum() * 0.7, [h1, head2.weight])
    w = nn.Parameter(head2.weight.detach().clone())
    lm_head: Any = head2 if module else w
    if module:
        head2.weight.grad = None
    got = sequence_logprobs(h2, lm_head, labels, chunk_size=chunk_size)
    assert got.shape == (BATCH,) and got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=0, atol=1e-5)
    weight = head2.weight if module else w
    got_grads = torch.autograd.grad(got.sum() * 0.7, [h2, weight])
    for a, b in zip(got_grads, ref_grads, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)


def test_average_divides_by_scored_tokens_and_frozen_head_gets_no_gradient() -> None:
    hidden, head, labels = inputs()
    head.requires_grad_(False)
    h = hidden.clone().requires_grad_(True)
    got = sequence_logprobs(h, head, labels, chunk_size=5, average=True)
    counts = (labels[:, 1:] != -100).sum(-1)
    ref = full_logprobs(hidden, head.weight, head.bias, labels) / counts
    assert torch.allclose(got, ref, rtol=0, atol=1e-6)
    got.sum().backward()
    assert h.grad is not None and head.weight.grad is None


def test_no_logits_tensor_is_saved_for_backward() -> None:
    hidden, head, labels = inputs()
    h = hidden.clone().requires_grad_(True)
    largest = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        if t.dim() >= 2 and t.shape[-1] == VOCAB and t is not head.weight:
            largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequence_logprobs(h, head, labels, chunk_size=4).sum().backward()
    assert largest == 0  # nothing of (tokens, vocab): one log-sum-exp per token is kept
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        full_logprobs(h, head.weight, head.bias, labels).sum().backward()
    assert largest >= BATCH * SEQ * VOCAB  # the check sees the unfused form's logits


def test_sequence_logprobs_options_are_validated() -> None:
    hidden, head, labels = inputs()
    with pytest.raises(OptionError, match="sequence_logprobs: chunk_size=0"):
        sequence_logprobs(hidden, head, labels, chunk_size=0)
    with pytest.raises(OptionError, match="average=1"):
        sequence_logprobs(hidden, head, labels, average=1)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=r"lm_head=.*torch.nn.Linear or its weight"):
        sequence_logprobs(hidden, nn.Embedding(VOCAB, HIDDEN), labels)
    with pytest.raises(OptionError, match=r"hidden_states=.*batch, seq, hidden"):
        sequence_logprobs(hidden[0], head, labels)
    with pytest.raises(OptionError, match=r"labels=\(3, 10\)"):
        sequence_logprobs(hidden, head, labels[:, 1:])


def logps(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [-(torch.rand(6, generator=g, dtype=torch.float32) * 40 + 5) for _ in range(4)]


def trl_sigmoid_dpo(values: list[torch.Tensor], beta: float) -> tuple[float, float, float]:
    """TRL's own DPO code on these log-probabilities: ``(mean loss, mean chosen reward,
    mean rejected reward)``.

    TRL before 1.0 exposes ``DPOTrainer.dpo_loss``; TRL 1.x computes the loss inside
    ``DPOTrainer._compute_loss(model, inputs, ...)`` from the model's per-token
    log-probabilities. That method is called here on a stand-in model whose per-token
    log-probabilities sum to the given sequence values (the first position carries it, the
    others 0) and with the reference values precomputed, so TRL's arithmetic runs on
    exactly the same numbers.
    """
    trl = pytest.importorskip("trl")
    trainer_cls = trl.DPOTrainer
    pc, pr, rc, rr = values
    if hasattr(trainer_cls, "dpo_loss"):  # TRL < 1.0
        stand_in = SimpleNamespace(
            beta=beta,
            label_smoothing=0.0,
            loss_type="sigmoid",
            f_divergence_type="reverse_kl",
            use_weighting=False,
            reference_free=False,
            args=SimpleNamespace(use_weighting=False),
            accelerator=SimpleNamespace(device=torch.device("cpu")),
        )
        losses, chosen, rejected = trainer_cls.dpo_loss(stand_in, pc, pr, rc, rr)
        return losses.mean().item(), chosen.mean().item(), rejected.mean().item()
    n, seq = pc.shape[0], 4
    per_token = torch.zeros(2 * n, seq - 1)
    per_token[:, 0] = torch.cat([pc, pr])

    def model(**kwargs: Any) -> Any:
        zeros = torch.zeros(2 * n, seq - 1)
        return SimpleNamespace(
            log_probs=per_token,
            entropy=zeros,
            mean_logits=zeros,
            is_top1=torch.zeros(2 * n, seq - 1, dtype=torch.bool),
        )

    model.training = True  # type: ignore[attr-defined]
    metrics: dict[str, dict[str, list[float]]] = {"train": {}}
    metrics["train"] = _AutoList()
    stand_in = SimpleNamespace(
        model=model,
        beta=beta,
        label_smoothing=0.0,
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        f_divergence_type="reverse_kl",
        f_alpha_divergence_coef=1.0,
        precompute_ref_logps=True,
        ld_alpha=None,
        use_weighting=False,
        aux_loss_enabled=False,
        _metrics=metrics,
        _total_train_tokens=0,
        _tp_size=1,
        accelerator=SimpleNamespace(
            device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t
        ),
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
    )
    batch = {
        "input_ids": torch.ones(2 * n, seq, dtype=torch.long),
        "attention_mask": torch.ones(2 * n, seq, dtype=torch.long),
        "completion_mask": torch.ones(2 * n, seq, dtype=torch.long),
        "ref_chosen_logps": rc,
        "ref_rejected_logps": rr,
    }
    loss = trainer_cls._compute_loss(stand_in, model, batch, return_outputs=False)
    train = metrics["train"]
    return loss.item(), train["rewards/chosen"][-1], train["rewards/rejected"][-1]


class _AutoList(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> list[float]:
        self[key] = []
        return self[key]


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_loss_equals_trls_on_the_same_logprobs(beta: float, seed: int) -> None:
    values = logps(seed)
    losses, chosen, rejected = dpo_loss(*values, beta=beta)
    ref_loss, ref_chosen, ref_rejected = trl_sigmoid_dpo(values, beta)
    assert losses.shape == chosen.shape == rejected.shape == (6,)
    assert abs(losses.mean().item() - ref_loss) <= 1e-6
    assert abs(chosen.mean().item() - ref_chosen) <= 1e-6
    assert abs(rejected.mean().item() - ref_rejected) <= 1e-6


def test_dpo_loss_values_label_smoothing_and_gradients_against_fp64() -> None:
    pc, pr, rc, rr = logps(3)
    pc.requires_grad_(True)
    beta, eps = 0.2, 0.1
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta, label_smoothing=eps)
    for i in range(6):
        z = beta * ((pc[i].item() - pr[i].item()) - (rc[i].item() - rr[i].item()))
        expected = (1 - eps) * math.log1p(math.exp(-z)) + eps * math.log1p(math.exp(z))
        assert abs(losses[i].item() - expected) <= 1e-6
    assert torch.allclose(chosen, beta * (pc - rc).detach(), rtol=0, atol=1e-6)
    assert not chosen.requires_grad and not rejected.requires_grad
    (grad,) = torch.autograd.grad(losses.sum(), pc)
    z = beta * ((pc - pr) - (rc - rr)).detach().double()
    expected_grad = beta * (-(1 - eps) * torch.sigmoid(-z) + eps * torch.sigmoid(z))
    assert torch.allclose(grad.double(), expected_grad, rtol=0, atol=1e-6)


def test_dpo_loss_options_are_validated() -> None:
    values = logps(0)
    with pytest.raises(OptionError, match="dpo_loss: beta=0"):
        dpo_loss(*values, beta=0)
    with pytest.raises(OptionError, match=r"label_smoothing=0\.5"):
        dpo_loss(*values, label_smoothing=0.5)
    with pytest.raises(OptionError, match="reference_rejected_logps=\\(5,\\)"):
        dpo_loss(*values[:3], values[3][:5])
    with pytest.raises(OptionError, match="policy_chosen_logps=\\(6, 1\\)"):
        dpo_loss(values[0][:, None], *values[1:])
