"""Attention for Hugging Face decoders on the CPU: the two batched matmuls in the model's
dtype (bf16: AMX), the softmax and its backward fused in C++ (fp32 math, rounded once), and
no copy of the keys and values per query head.

transformers' eager attention copies the keys and values ``num_key_value_groups`` times
(``repeat_kv``), rounds the scores to bf16 twice (the product, then ``* scaling``), adds the
mask in bf16, runs the softmax in fp32 and casts it back (a copy each way, and the same in
backward).  Here the query heads that share a key/value head are stacked as rows of one
matmul against that head (a view: ``(batch, kv_heads, group * q_len, head_dim)``), the C++
kernel turns the scores into probabilities in place (scale, mask or causal limit, softmax),
and backward is ``dV = P^T dO``, ``dP = dO V^T``, ``dS = scale * P * (dP - rowsum(P dP))``
(C++, in place; after a causal forward the zero probabilities past each query's limit
are skipped), ``dQ = dS K``, ``dK = dS^T Q``: the sums over a group's query heads come out
of the matmuls.  Kept for backward: Q, K, V and P (as eager keeps P too).

Use it with :func:`register_attention` and ``attn_implementation="sakura"``
(``from_pretrained(..., attn_implementation="sakura")`` or
``model.set_attn_implementation("sakura")``).  Masks come from transformers' SDPA mask
builder (None when the batch needs only the causal mask, else a boolean or float mask).
Anything this function does not handle (a GPU, fp16, dropout, logit
soft-capping, attention sinks, a sliding window shorter than the keys, no C++ kernels) goes to transformers' SDPA attention instead.

Under CPU autocast the two matmuls run in the autocast dtype, as they would in eager
attention: fp32 query, key and value (or a mix of fp32 and bf16, as fused LoRA's
``fp32_outputs`` gives when only some projections are adapted) are cast once and autocast is
off inside.  The C++ kernel works in place on a buffer whose element type and extent it
cannot see, so every call first checks that the buffer's dtype, contiguity and shape are the
ones the call describes (:func:`_check_scores`); a mismatch raises instead of reaching
native code.
"""

from __future__ import annotations

from typing import Any

import torch

from sakura_kernels.blocks._native import CPU_LIBRARY

__all__ = ["ATTENTION_NAME", "FusedAttention", "register_attention", "sakura_attention_forward"]

ATTENTION_NAME = "sakura"
"""The ``attn_implementation`` name :func:`register_attention` registers."""

_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _library() -> Any:
    return CPU_LIBRARY.load(required=True)


def _check_scores(
    scores: torch.Tensor, rows: int, k_len: int, mask: torch.Tensor | None, q_len: int
) -> int:
    """The kernel's dtype code for ``scores`` after checking that it is a contiguous CPU
    ``(..., rows, k_len)`` fp32 or bf16 buffer, and that ``mask`` (when given) is a
    contiguous fp32 ``(1 or batches, q_len, k_len)`` one whose batches match ``scores``'."""
    if (
        scores.device.type != "cpu"
        or scores.dtype not in _CODES
        or not scores.is_contiguous()
        or scores.dim() != 4
        or tuple(scores.shape[2:]) != (rows, k_len)
    ):
        raise RuntimeError(
            "sakura-kernels: attention scores of dtype "
            f"{scores.dtype}, shape {tuple(scores.shape)} do not suit the C++ kernel "
            f"(expected a contiguous CPU fp32/bf16 (b, kv_heads, {rows}, {k_len}) tensor)"
        )
    if mask is not None and (
        mask.dtype != torch.float32
        or not mask.is_contiguous()
        or mask.dim() != 3
        or tuple(mask.shape[1:]) != (q_len, k_len)
        or mask.shape[0] not in (1, scores.shape[0])
    ):
        raise RuntimeError(
            f"sakura-kernels: attention mask of dtype {mask.dtype}, shape {tuple(mask.shape)} "
            f"does not suit the C++ kernel (expected contiguous fp32 (1 or {scores.shape[0]}, "
            f"{q_len}, {k_len}))"
        )
    return _CODES[scores.dtype]


def _status(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"sakura-kernels: the C++ attention {what} refused its arguments")


class FusedAttention(torch.autograd.Function):
    """``softmax(Q K^T * scale + mask) V`` for ``q`` ``(b, kv_heads, group * q_len, d)`` (the
    query heads of each key/value head stacked), ``k`` / ``v`` ``(b, kv_heads, k_len, d)``;
    ``mask`` None or an fp32 additive ``(b or 1, q_len, k_len)``; ``causal``: keys after a
    query's position (aligned at the end) are masked."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        q_len: int,
        scale: float,
    ) -> torch.Tensor:
        b, kvh, inner, _ = q.shape
        k_len = k.shape[2]
        scores = torch.matmul(q, k.transpose(2, 3)).contiguous()  # (b, kvh, inner, k_len)
        code = _check_scores(scores, inner, k_len, mask, q_len)
        if scores.shape[:2] != (b, kvh) or inner % q_len:
            raise RuntimeError(
                f"sakura-kernels: attention scores {tuple(scores.shape)} for queries "
                f"{tuple(q.shape)} and {q_len} positions"
            )
        lib = _library()
        mask_ptr, per_batch, stride = 0, 1, 0
        if mask is not None:
            mask_ptr = mask.data_ptr()
            stride = q_len * k_len if mask.shape[0] > 1 else 0
            per_batch = kvh
        _status(
            lib.sakura_attn_softmax_forward(
                code, scores.data_ptr(), b * kvh, inner, q_len, k_len,
                mask_ptr, per_batch, stride, int(causal), scale,
            ),
            "softmax",
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, scores)
        ctx.scale = scale
        ctx.causal_q_len = q_len if causal else 0
        return torch.matmul(scores, v)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, probs = ctx.saved_tensors
        grad = grad.to(q.dtype).contiguous()
        grad_v = torch.matmul(probs.transpose(2, 3), grad)
        grad_s = torch.matmul(grad, v.transpose(2, 3)).contiguous()
        code = _check_scores(grad_s, probs.shape[2], probs.shape[3], None, 1)
        if grad_s.dtype != probs.dtype or grad_s.shape != probs.shape or not probs.is_contiguous():
            raise RuntimeError(
                f"sakura-kernels: attention backward got {grad_s.dtype} {tuple(grad_s.shape)} "
                f"gradients for {probs.dtype} {tuple(probs.shape)} probabilities"
            )
        lib = _library()
        rows, k_len = grad_s.numel() // grad_s.shape[-1], grad_s.shape[-1]
        if ctx.causal_q_len:  # the zero probabilities past the causal limits are skipped
            status = lib.sakura_attn_softmax_backward_causal(
                code,
                probs.data_ptr(),
                grad_s.data_ptr(),
                rows,
                ctx.causal_q_len,
                k_len,
                ctx.scale,
            )
        else:
            status = lib.sakura_attn_softmax_backward(
                code, probs.data_ptr(), grad_s.data_ptr(), rows, k_len, ctx.scale
            )
        _status(status, "softmax backward")
        grad_q = torch.matmul(grad_s, k)
        grad_k = torch.matmul(grad_s.transpose(2, 3), q)
        return grad_q, grad_k, grad_v, None, None, None, None


def _additive_mask(mask: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor | None:
    """An fp32 ``(b or 1, q_len, k_len)`` additive mask from transformers' 4-D mask (boolean:
    True attends; float: added), or None where its shape is not one that is understood."""
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (q_len, k_len):
        return None
    if mask.dtype == torch.bool:
        low = torch.finfo(torch.float32).min  # as transformers' eager masks: no NaN rows
        out = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, low)
    else:
        out = mask.to(torch.float32)
    return out[:, 0].contiguous()


def sakura_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``(b, heads, q_len, d)``,
    ``key`` / ``value`` ``(b, kv_heads, k_len, d)``; returns ``((b, q_len, heads, d), None)``."""
    b, heads, q_len, d = query.shape
    kvh, k_len = key.shape[1], key.shape[2]
    dtype = query.dtype
    autocast = query.device.type == "cpu" and torch.is_autocast_enabled("cpu")
    if autocast:  # eager attention's matmuls would run in it, whatever the inputs' dtypes
        dtype = torch.get_autocast_dtype("cpu")
    window = kwargs.get("sliding_window")
    unusual = any(kwargs.get(name) is not None for name in ("softcap", "s_aux")) or (
        window is not None and window < k_len  # a window that reaches past every key is none
    )
    suitable = (
        query.device.type == "cpu"
        and dtype in _CODES
        and (autocast or key.dtype == query.dtype == value.dtype)
        and all(t.dtype in _CODES for t in (query, key, value))
        and key.dim() == value.dim() == 4
        and key.shape[0] == value.shape[0] == b
        and value.shape[1:3] == key.shape[1:3]
        and key.shape[-1] == d
        and dropout == 0.0
        and not unusual
        and heads % kvh == 0
        and value.shape[-1] == d
        and CPU_LIBRARY.load() is not None
    )
    mask: torch.Tensor | None = None
    causal = False
    if suitable and attention_mask is not None:
        mask = _additive_mask(attention_mask, q_len, k_len)
        suitable = mask is not None and mask.shape[0] in (1, b)
    elif suitable:
        causal = bool(getattr(module, "is_causal", True)) and q_len > 1
        suitable = q_len <= k_len
    if not suitable:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        result: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        return result
    scale = float(scaling) if scaling is not None else d**-0.5
    group = heads // kvh
    # the query heads of one key/value head are consecutive: stack them as rows (a view)
    q = query.to(dtype).contiguous().view(b, kvh, group * q_len, d)
    with torch.autocast("cpu", enabled=False):  # the dtype is chosen above
        out: torch.Tensor = FusedAttention.apply(  # type: ignore[no-untyped-call]
            q, key.to(dtype).contiguous(), value.to(dtype).contiguous(), mask, causal, q_len, scale
        )
    return out.view(b, heads, q_len, d).transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register :func:`sakura_attention_forward` (and transformers' SDPA mask builder for it)
    under :data:`ATTENTION_NAME` with transformers; returns the name.  Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, sakura_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
