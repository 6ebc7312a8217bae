"""Preference losses from hidden states: sequence log-probabilities in chunks, and DPO.

:func:`sequence_logprobs` sums each sequence's token log-probabilities straight from the
decoder's last hidden states, ``chunk_size`` tokens at a time (through the chunked
cross-entropy of :mod:`sakura_kernels.losses.chunked`), so the ``tokens x vocab`` logits
never exist: a DPO step holds no logits of its chosen and rejected sequences, for the
policy nor for the reference.

:func:`dpo_loss` is sigmoid DPO (Rafailov et al., 2023) in TRL's argument order and with
what TRL's ``DPOTrainer.dpo_loss`` returned (TRL <= 0.2x; TRL 1.x computes the same numbers
inside ``DPOTrainer._compute_loss``): per-pair losses, and the chosen / rejected rewards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sakura.options import check_bool, check_int, check_number, option_error
from sakura_kernels.losses.chunked import chunked_causal_lm_loss

__all__ = ["dpo_loss", "head_weight_and_bias", "sequence_logprobs"]

IGNORE_INDEX = -100


def head_weight_and_bias(
    lm_head: Any, owner: str = "sequence_logprobs"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` of an output layer: a ``torch.nn.Linear`` (bias allowed) or its
    weight, a ``(vocab, hidden)`` tensor."""
    if isinstance(lm_head, nn.Linear):
        return lm_head.weight, lm_head.bias
    if isinstance(lm_head, torch.Tensor) and lm_head.dim() == 2:
        return lm_head, None
    shown = tuple(lm_head.shape) if isinstance(lm_head, torch.Tensor) else type(lm_head).__name__
    raise option_error(
        "lm_head", shown, "a torch.nn.Linear or its weight, a (vocab, hidden) tensor", owner=owner
    )


def sequence_logprobs(
    hidden_states: torch.Tensor,
    lm_head: Any,
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    average: bool = False,
) -> torch.Tensor:
    """Per-sequence log-probabilities of ``labels`` under ``lm_head(hidden_states)``.

    Args:
        hidden_states: ``(batch, seq, hidden)``, the decoder's last hidden states.
        lm_head: the output layer, a ``torch.nn.Linear`` (with or without bias) or its
            weight ``(vocab, hidden)``.
        labels: ``(batch, seq)`` token ids as the model takes them (shifted here by one:
            position ``t`` scores ``labels[:, t + 1]``); ``-100`` marks tokens not scored
            (the prompt, padding).
        chunk_size: tokens per chunk: the logits of this many tokens exist at a time.
        average: divide each sum by its number of scored tokens (IPO-style length
            normalisation); a sequence with none gives NaN then, 0 when summing.

    Returns:
        ``(batch,)`` fp32: ``sum_t log p(labels[t + 1] | hidden[t])`` over scored tokens.
        Gradients flow to ``hidden_states`` and to the head's weight (and bias) when they
        require them; the matmul runs in bf16 where the head is bf16 or under autocast,
        the log-sum-exp in fp32 (see :func:`~sakura_kernels.chunked_causal_lm_loss`).
    """
    owner = "sequence_logprobs"
    chunk_size = check_int("chunk_size", chunk_size, minimum=1, owner=owner)
    average = check_bool("average", average, owner=owner)
    weight, bias = head_weight_and_bias(lm_head, owner)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        shown = (
            tuple(hidden_states.shape)
            if isinstance(hidden_states, torch.Tensor)
            else type(hidden_states).__name__
        )
        raise option_error("hidden_states", shown, "a tensor (batch, seq, hidden)", owner=owner)
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(
        hidden_states.shape[:2]
    ):
        shown = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise option_error(
            "labels", shown, f"a tensor {tuple(hidden_states.shape[:2])} of token ids", owner=owner
        )
    token_losses = chunked_causal_lm_loss(
        hidden_states,
        weight,
        labels,
        chunk_size=chunk_size,
        reduction="none",
        bias=bias,
        ignore_index=IGNORE_INDEX,
    )
    logps = -token_losses.sum(-1)
    if average:
        scored = (labels[:, 1:] != IGNORE_INDEX).sum(-1).to(logps.device)
        logps = logps / scored
    return logps


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    *,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid DPO from sequence log-probabilities, in TRL's argument order.

    ``logits = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)``;
    ``losses = -logsigmoid(beta * logits)`` per pair.  With ``label_smoothing = eps`` (the
    probability that a pair's preference is flipped: conservative DPO, as TRL's sigmoid
    loss before 1.0 and its ``aot`` losses) ``losses = -(1 - eps) logsigmoid(beta *
    logits) - eps logsigmoid(-beta * logits)``.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(batch,)``: the unreduced
        losses (take ``.mean()`` as TRL does) and ``beta * (policy - reference)`` of the
        chosen and rejected sequences, detached (for logging reward margins / accuracy).
    """
    owner = "dpo_loss"
    beta = float(check_number("beta", beta, minimum=0.0, min_inclusive=False, owner=owner))
    label_smoothing = float(
        check_number(
            "label_smoothing",
            label_smoothing,
            minimum=0.0,
            maximum=0.5,
            max_inclusive=False,
            owner=owner,
        )
    )
    names = (
        "policy_chosen_logps",
        "policy_rejected_logps",
        "reference_chosen_logps",
        "reference_rejected_logps",
    )
    values = (
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
    )
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise option_error(name, shown, "a 1-D tensor, one log-probability a pair", owner=owner)
        if value.shape != policy_chosen_logps.shape:
            raise option_error(
                name,
                tuple(value.shape),
                f"the shape of policy_chosen_logps, {tuple(policy_chosen_logps.shape)}",
                owner=owner,
            )
    device = policy_chosen_logps.device
    reference_chosen_logps = reference_chosen_logps.to(device)
    reference_rejected_logps = reference_rejected_logps.to(device)
    chosen_logratios = policy_chosen_logps - reference_chosen_logps
    rejected_logratios = policy_rejected_logps - reference_rejected_logps
    logits = chosen_logratios - rejected_logratios
    losses = -F.logsigmoid(beta * logits)
    if label_smoothing:
        losses = losses * (1.0 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return losses, chosen_rewards, rejected_rewards
