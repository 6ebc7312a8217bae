"""The kernel's per-step hyperparameters for the host AdamW speed-path tests (AdamW with
lr 1e-2, betas (0.9, 0.99), weight decay 0.05, eps 1e-8), shared by the tests that run the
vector and portable builds of the kernel side by side."""

from __future__ import annotations

from sakura_offload.host_optimizer import moments as fmt
from sakura_offload.host_optimizer.backends import Hyper


def adamw_hyper(step: int, index: int, grad_scale: float = 1.0) -> Hyper:
    """The :class:`Hyper` of optimizer step ``step`` for tensor ``index``."""
    lr, beta1, beta2 = 1e-2, 0.9, 0.99
    return Hyper(
        decay=1 - lr * 0.05,
        w1=1 - beta1,
        beta2=beta2,
        c2=1 - beta2,
        eps=1e-8,
        neg_step=-lr / (1 - beta1**step),
        bc2_sqrt=(1 - beta2**step) ** 0.5,
        grad_scale=grad_scale,
        key=fmt.stream_key(0, step, index),
    )
