"""Chunked causal-LM loss: cross-entropy over the vocabulary without the full logits.

A causal LM's head turns ``tokens x hidden`` into ``tokens x vocab`` logits, and for a long
sequence and a large vocabulary that one tensor (kept for backward, in fp32) is often the
largest of the step.  :func:`chunked_causal_lm_loss` computes the logits of ``chunk_size``
tokens at a time and keeps of each chunk only one number per token (its log-sum-exp), so
at most one chunk's logits (and the temporaries of one chunk) exist at any time.

When the head is frozen (its weight and bias need no gradient: LoRA, QLoRA) and the hidden
states need one, the gradient is computed in the forward, chunk by chunk, as Liger Kernel's
fused linear cross-entropy does: ``d loss_i / d hidden_i = g_i * (softmax(logits_i) -
onehot(t_i)) @ W`` is linear in the incoming per-token gradient ``g_i``, so the forward keeps
``(softmax - onehot) @ W`` (``tokens x hidden``) and the backward only scales its rows: no
logits are recomputed.  Otherwise (a trained head) the backward recomputes each chunk's
logits.  On the CPU the log-sum-exp, the picked logit and ``softmax - onehot`` of a chunk
come from one C++ pass over its logits in the matmul's dtype (``sakura_xent_rows`` in
``csrc/blocks_cpu.cpp``: fp32 math, AVX-512, written over the logits), not from an fp32
copy of them.

Semantics are those of transformers' ``ForCausalLMLoss``:

* ``labels`` are the model's input labels, not shifted: position ``t`` is scored against
  ``labels[..., t + 1]`` and the last position against nothing (as if ``ignore_index``).
  Pass ``shift_labels=`` instead when the labels are already aligned with the positions
  (packed sequences, sequence parallelism);
* the head's matmul runs in bf16 (or fp16) when the head's weight is bf16 (fp16) or an
  autocast to that dtype is on, with fp32 accumulation; otherwise in the promoted dtype of
  the hidden states and the weight. Its logits are upcast to fp32 before the log-sum-exp
  and the softmax, so the loss and every reduction are fp32;
* ``reduction="mean"`` divides the summed loss by the number of scored tokens, or by
  ``num_items_in_batch`` when given (gradient accumulation: the Trainer passes the number
  of scored tokens of all the micro-batches of one optimizer step).

:func:`causal_lm_loss` applies it to a Hugging Face ``*ForCausalLM`` (or a PEFT model
wrapping one): it runs the decoder, then this loss with the model's ``lm_head``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from sakura.options import check_choice, check_int, option_error

__all__ = [
    "REDUCTIONS",
    "causal_lm_loss",
    "chunked_causal_lm_loss",
    "matmul_dtype",
    "shift_causal_labels",
]

_OWNER = "chunked_causal_lm_loss"
REDUCTIONS = ("mean", "sum", "none")


_HALF = (torch.bfloat16, torch.float16)


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: the autocast dtype when an autocast is on for
    the hidden states' device, else the head weight's dtype when it is bf16 / fp16 (a bf16
    model, or fp32 hidden states from a norm kept in fp32), else the promoted dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if weight.dtype in _HALF:
        return weight.dtype
    return torch.promote_types(hidden.dtype, weight.dtype)


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> Any:
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


def _no_autocast(device_type: str) -> torch.autocast:
    """The matmul's dtype is chosen explicitly (:func:`matmul_dtype`); autocast stays out."""
    return torch.autocast(device_type, enabled=False)


def shift_causal_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``labels[..., 1:]`` padded with ``ignore_index``: the target of every position."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def _xent_chunk(
    raw: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lse, picked, grad)`` of one chunk of logits ``raw`` (rows x vocab, the matmul's
    dtype): the fp32 log-sum-exp and target logit of each row and, with ``want_grad``,
    ``softmax - onehot(target)`` in ``raw``'s dtype (zero rows where not ``valid``; ``raw``'s
    storage may be reused for it).  ``targets`` are valid indices everywhere (0 where not
    ``valid``)."""
    lib = _xent_library(raw)
    if lib is not None:
        raw = raw.contiguous()
        rows, vocab = raw.shape
        marked = torch.where(valid, targets, torch.full_like(targets, -1)).contiguous()
        lse = torch.empty(rows, dtype=torch.float32, device=raw.device)
        picked = torch.empty(rows, dtype=torch.float32, device=raw.device)
        status = lib.sakura_xent_rows(
            0 if raw.dtype == torch.float32 else 1,
            raw.data_ptr(),
            rows,
            vocab,
            marked.data_ptr(),
            lse.data_ptr(),
            picked.data_ptr(),
            int(want_grad),
        )
        if status != 0:
            raise RuntimeError("sakura-kernels: the C++ cross-entropy kernel refused its arguments")
        return lse, picked, raw if want_grad else None
    dtype = raw.dtype
    logits = raw.float()
    del raw
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    if not want_grad:
        return lse, picked, None
    probs = logits.sub_(lse.unsqueeze(1)).exp_()
    probs.scatter_add_(1, targets.unsqueeze(1), torch.full_like(picked, -1.0).unsqueeze(1))
    probs.mul_(valid.unsqueeze(1))
    return lse, picked, probs.to(dtype)


def _xent_library(raw: torch.Tensor) -> Any:
    """The C++ kernels when ``raw`` suits them (2-D, CPU, fp32 or bf16), else None."""
    if raw.device.type != "cpu" or raw.dtype not in (torch.float32, torch.bfloat16):
        return None
    if raw.dim() != 2:
        return None
    from sakura_kernels.blocks._native import CPU_LIBRARY

    return CPU_LIBRARY.load()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward: per-token losses (unreduced, fp32) and nothing of size tokens x vocab saved.

    Inputs: hidden ``(N, H)``, weight ``(V, H)``, bias ``(V,)`` or None, targets ``(N,)``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        compute = matmul_dtype(hidden, weight)
        weight_c, bias_c = _cast(weight, compute), _cast(bias, compute)
        valid = targets != ignore_index
        out_of_range = valid & ((targets < 0) | (targets >= weight.shape[0]))
        if bool(out_of_range.any()):  # as F.cross_entropy: never a silently ignored label
            bad = int(targets[out_of_range][0])
            raise IndexError(
                f"chunked cross-entropy: label {bad} is out of range for a vocabulary of "
                f"{weight.shape[0]} (labels are 0..{weight.shape[0] - 1} or ignore_index="
                f"{ignore_index})"
            )
        safe = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        # A frozen head: the hidden states' gradient per unit of each token's loss, now.
        early = ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3])
        unit = (
            torch.empty(n, hidden.shape[1], dtype=compute, device=hidden.device) if early else None
        )
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            with _no_autocast(hidden.device.type):
                raw = F.linear(_cast(hidden[start:stop], compute), weight_c, bias_c)
            chunk_lse, picked, grad = _xent_chunk(
                raw, safe[start:stop, 0], valid[start:stop], want_grad=early
            )
            del raw
            lse[start:stop] = chunk_lse
            # -log_softmax(x)[t] = logsumexp(x) - x[t]; 0 for ignored targets (as F.cross_entropy).
            losses[start:stop] = torch.where(
                valid[start:stop], chunk_lse - picked, torch.zeros_like(picked)
            )
            if unit is not None and grad is not None:
                with _no_autocast(hidden.device.type):
                    torch.mm(grad, weight_c, out=unit[start:stop])
            del grad
        ctx.compute = compute
        ctx.chunk_size = chunk_size
        ctx.early = early
        if early:
            ctx.hidden_dtype = hidden.dtype
            ctx.save_for_backward(unit, valid)
        else:
            ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.early:  # the gradient per unit of each token's loss, from the forward
            unit, valid = ctx.saved_tensors
            row_scale = torch.where(valid, grad_losses.float(), torch.zeros_like(grad_losses))
            grad_h = (unit.float() * row_scale.unsqueeze(1)).to(ctx.hidden_dtype)
            return grad_h, None, None, None, None, None
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        compute = ctx.compute
        n = hidden.shape[0]
        # d loss_i / d logits_i = softmax(logits_i) - onehot(t_i), times the incoming gradient
        # of token i (0 for ignored tokens).  As in autograd through F.linear(...).float(),
        # that gradient is cast to the dtype the matmul ran in before the two matmuls.
        row_scale = torch.where(valid, grad_losses.float(), torch.zeros_like(lse))
        grad_h = torch.empty_like(hidden) if need_h else None
        # Weight and bias gradients are summed over the chunks in fp32 and cast once.
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = (
            torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        )
        weight_c, bias_c = _cast(weight, compute), _cast(bias, compute)
        for start in range(0, n, ctx.chunk_size):
            stop = min(start + ctx.chunk_size, n)
            h_c = _cast(hidden[start:stop], compute)
            with _no_autocast(hidden.device.type):
                raw = F.linear(h_c, weight_c, bias_c)
            probs = raw.float()
            del raw
            probs.sub_(lse[start:stop].unsqueeze(1)).exp_()
            probs.scatter_add_(
                1,
                safe[start:stop],
                torch.full((stop - start, 1), -1.0, dtype=probs.dtype, device=probs.device),
            )
            probs.mul_(row_scale[start:stop].unsqueeze(1))
            g = probs.to(compute)
            del probs
            if grad_h is not None:
                grad_h[start:stop] = (g @ weight_c).to(hidden.dtype)
            if grad_w is not None:
                if compute == torch.float32:
                    grad_w.addmm_(g.t(), h_c)
                else:
                    grad_w += (g.t() @ h_c).float()
            if grad_b is not None:
                grad_b += g.sum(0).float()
            del g
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    reduction: str = "mean",
    bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal-LM cross-entropy of ``hidden_states @ lm_head_weight.T (+ bias)`` in chunks.

    Args:
        hidden_states: ``(..., hidden)``, the decoder's last hidden states (every position).
        lm_head_weight: ``(vocab, hidden)``, the output projection (``model.lm_head.weight``).
        labels: ``(...)`` token ids as the model takes them; shifted here by one as
            transformers does.  ``None`` when ``shift_labels`` is given.
        chunk_size: tokens per chunk (the logits of this many tokens exist at a time).
        ignore_index: targets with this value are not scored.
        reduction: ``"mean"`` (over scored tokens, or ``num_items_in_batch``), ``"sum"``,
            or ``"none"`` (a loss per position, shaped like the labels; 0 where ignored).
        bias: ``(vocab,)``, the head's bias if it has one.
        num_items_in_batch: with ``reduction="mean"``: divide the summed loss by this
            instead of this batch's number of scored tokens (as transformers' Trainer does
            under gradient accumulation).  A positive int or a one-element tensor of a
            positive count (its value is checked on the CPU; on an accelerator only its
            shape and dtype, as reading it would synchronise).
        shift_labels: targets already aligned with the positions (not shifted again).

    Returns:
        an fp32 loss: a scalar, or per position for ``reduction="none"``.
    """
    chunk_size = check_int("chunk_size", chunk_size, minimum=1, owner=_OWNER)
    ignore_index = check_int("ignore_index", ignore_index, owner=_OWNER)
    check_choice("reduction", reduction, REDUCTIONS, owner=_OWNER)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        raise option_error(
            "hidden_states", type(hidden_states).__name__, "a tensor (..., hidden)", owner=_OWNER
        )
    hidden_size = hidden_states.shape[-1]
    if (
        not isinstance(lm_head_weight, torch.Tensor)
        or lm_head_weight.dim() != 2
        or lm_head_weight.shape[1] != hidden_size
    ):
        shape = tuple(lm_head_weight.shape) if isinstance(lm_head_weight, torch.Tensor) else None
        raise option_error(
            "lm_head_weight", shape, f"a tensor (vocab, {hidden_size})", owner=_OWNER
        )
    vocab = lm_head_weight.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (vocab,)):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise option_error("bias", shape, f"None or a tensor ({vocab},)", owner=_OWNER)
    if labels is not None and shift_labels is None:
        targets = shift_causal_labels(labels, ignore_index)
    elif shift_labels is not None and labels is None:
        targets = shift_labels
    else:
        raise option_error(
            "shift_labels",
            None if shift_labels is None else "a tensor",
            "exactly one of labels and shift_labels",
            owner=_OWNER,
        )
    if tuple(targets.shape) != tuple(hidden_states.shape[:-1]):
        raise option_error(
            "labels" if labels is not None else "shift_labels",
            tuple(targets.shape),
            f"a tensor shaped like hidden_states without its last dimension, "
            f"{tuple(hidden_states.shape[:-1])}",
            owner=_OWNER,
        )
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise option_error("labels", str(targets.dtype), "an integer tensor", owner=_OWNER)
    if num_items_in_batch is not None:
        if reduction != "mean":
            raise option_error(
                "num_items_in_batch",
                num_items_in_batch,
                "None unless reduction='mean'",
                owner=_OWNER,
            )
        _check_num_items(num_items_in_batch)
    flat_targets = targets.reshape(-1).to(device=hidden_states.device, dtype=torch.int64)
    losses: torch.Tensor = _ChunkedCrossEntropy.apply(  # type: ignore[no-untyped-call]
        hidden_states.reshape(-1, hidden_size),
        lm_head_weight,
        bias,
        flat_targets,
        chunk_size,
        ignore_index,
    )
    if reduction == "none":
        return losses.view(targets.shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is None:
        return total / (flat_targets != ignore_index).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        return total / num_items_in_batch.to(total.device)
    return total / num_items_in_batch


_NUM_ITEMS_TEXT = "None, a positive int, or a one-element tensor of a positive count"


def _check_num_items(value: object) -> None:
    """A divisor that is a count: a positive int, or a one-element real tensor whose value
    (on the CPU; on an accelerator reading it would be a host-device sync on every step,
    so only its shape and dtype are checked there) is positive and finite."""
    if isinstance(value, torch.Tensor):
        real = not (value.dtype == torch.bool or value.is_complex())
        ok = real and value.numel() == 1
        if ok and value.device.type == "cpu":
            count = float(value.reshape(()))
            ok = math.isfinite(count) and count > 0
        if not ok:
            shown = value.tolist() if value.device.type == "cpu" and value.numel() <= 8 else value
            raise option_error("num_items_in_batch", shown, _NUM_ITEMS_TEXT, owner=_OWNER)
    elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise option_error("num_items_in_batch", value, _NUM_ITEMS_TEXT, owner=_OWNER)


def _causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """The decoder and the ``lm_head`` of a transformers ``*ForCausalLM`` (PEFT unwrapped)."""
    owner = "causal_lm_loss"
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and type(model).__module__.startswith("peft"):
        model = get_base()
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    decoder = getattr(model, "base_model", None)
    if head is None or decoder is None or decoder is model:
        raise option_error(
            "model",
            type(model).__name__,
            "a transformers *ForCausalLM model (or a PEFT model wrapping one)",
            owner=owner,
        )
    if not isinstance(head, nn.Linear):
        raise NotImplementedError(
            f"{owner}: the output layer of {type(model).__name__} is a {type(head).__name__}, "
            f"not a plain torch.nn.Linear (an adapted or quantized lm_head); the chunked loss "
            f"uses lm_head.weight directly, so compute this loss through the model instead"
        )
    config = getattr(model, "config", None)
    for attribute in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attribute, None) not in (None, 1.0):
            raise NotImplementedError(
                f"{owner}: {type(model).__name__} transforms its logits "
                f"(config.{attribute}={getattr(config, attribute)!r}), which the chunked loss "
                f"does not reproduce; compute this loss through the model instead"
            )
    return decoder, head


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """The loss ``model(input_ids, labels=labels).loss`` would give, without its logits.

    ``model`` is a transformers ``*ForCausalLM`` with a plain ``nn.Linear`` head (tied or
    not), or a PEFT model wrapping one (LoRA layers inside the decoder are used as the
    model uses them).  ``model_kwargs`` (``attention_mask``, ``position_ids``,
    ``inputs_embeds`` ...) go to the decoder.  ``num_items_in_batch`` and ``shift_labels``
    mean what they mean to transformers' loss; see :func:`chunked_causal_lm_loss`.
    """
    decoder, head = _causal_lm_parts(model)
    model_kwargs.setdefault("use_cache", False)
    outputs = decoder(input_ids=input_ids, **model_kwargs)
    hidden = outputs[0] if isinstance(outputs, tuple) else outputs.last_hidden_state
    return chunked_causal_lm_loss(
        hidden,
        head.weight,
        labels,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        bias=head.bias,
        num_items_in_batch=num_items_in_batch,
        shift_labels=shift_labels,
    )
