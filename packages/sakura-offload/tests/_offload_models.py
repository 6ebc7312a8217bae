"""Small models and data shared by the tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

BATCHES = 30


def mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 10))
    return model.to(dtype)


def batches(n: int = BATCHES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 10, generator=g)) for _ in range(n)]


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def train(
    make: Callable[[Iterable[torch.nn.Parameter]], Any],
    steps: int = 20,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.nn.Module, Any]:
    model = mlp(dtype)
    optimizer = make(model.parameters())
    for batch in batches(steps):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    return model, optimizer


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (x.detach().float() - y.detach().float()).abs().max().item()
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def drift(candidate: torch.nn.Module, reference: torch.nn.Module) -> float:
    """||candidate - reference|| / ||reference - start||: how far the candidate's weights
    are from the reference's, as a fraction of how far the reference moved them."""
    start = mlp()
    num = sum(
        ((x.detach().float() - y.detach()) ** 2).sum()
        for x, y in zip(candidate.parameters(), reference.parameters(), strict=True)
    )
    den = sum(
        ((x.detach() - y.detach()) ** 2).sum()
        for x, y in zip(start.parameters(), reference.parameters(), strict=True)
    )
    return float((num / den) ** 0.5)


def tiny_llama() -> torch.nn.Module:
    """A config-built 4-layer Llama (vocab 96, hidden 32) in train mode, seed 0; needs
    transformers (the caller skips without it)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


NON_FINITE_TOLERANCE = {"float32": 1e-6, "bf16": 1e-3, "int8": 1e-2}
"""How close the finite parameters stay to torch's AdamW, per moment dtype, in
:func:`assert_non_finite_stays_local` (int8: its usual drift over six steps)."""


def assert_non_finite_stays_local(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    hyper: dict[str, Any],
    tolerance: float,
) -> None:
    """Six steps of ``make``'s optimizer and of ``torch.optim.AdamW(**hyper)`` on the same
    1000 values (four int8 blocks) and gradients, with one +Inf (step 1), NaN (step 3) and
    -Inf (step 4) element, two of them in the same block: after every step exactly the
    elements torch's AdamW makes non-finite are non-finite, and the others agree within
    ``tolerance``."""
    g = torch.Generator().manual_seed(4)
    start = torch.randn(1000, generator=g)
    grads = [torch.randn(1000, generator=g) for _ in range(6)]
    grads[1][10] = float("inf")
    grads[3][300] = float("nan")
    grads[4][20] = float("-inf")
    ours, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    optimizer, reference = make([ours]), torch.optim.AdamW([ref], **hyper)
    for step, grad in enumerate(grads):
        ours.grad, ref.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
        expected = ref.detach().isfinite()
        assert torch.equal(ours.detach().isfinite(), expected), (
            f"step {step}: non-finite at {(~ours.detach().isfinite()).nonzero().view(-1)[:8]}, "
            f"torch's AdamW at {(~expected).nonzero().view(-1)}"
        )
        diff = (ours.detach() - ref.detach())[expected].abs().max().item()
        assert diff <= tolerance, f"step {step}: {diff}"
    assert (~expected).sum().item() == 3  # the three elements, and only them
