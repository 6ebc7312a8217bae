"""Fused LoRA over sakura-quant bases (int8, NF4): the same outputs, gradients and trained
adapters as stock PEFT over the same QuantizedLinear layers.

Tolerances (relative, ``|a - b| / |b|`` over the whole tensor): fp32 1e-5 (both expand the
same codes to the same weight; only the order of rounding in the products differs); a bf16
model, and an fp32 model whose frozen products run in bf16 (``matmul_dtype="bf16"``): 2e-2
against PEFT, and no farther from an fp32 computation than 1.5x PEFT's own distance plus
1e-3 (the fused adapter products run in the output's dtype).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from sakura_kernels.lora import FusedLoraFunction, fuse_lora, unfuse_lora
from sakura_quant import QuantizedLinear, quantize_model

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N_LAYERS = 2 * len(PROJECTIONS)
FP32_TOL = 1e-5
BF16_VS_PEFT = 2e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def quantized_lora(fmt: str, dtype: torch.dtype, matmul_dtype: Any = None) -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    model = LlamaForCausalLM(config).to(dtype)
    quantize_model(model, fmt, targets=PROJECTIONS, freeze=True, matmul_dtype=matmul_dtype)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS))
    gen = torch.Generator().manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    base = peft_model.base_model.model.model.layers[0].mlp.down_proj.base_layer
    assert isinstance(base, QuantizedLinear) and base.format == fmt
    return peft_model


def pair(fmt: str, dtype: torch.dtype, matmul_dtype: Any = None, **options: Any) -> Any:
    ref = quantized_lora(fmt, dtype, matmul_dtype)
    fused = copy.deepcopy(ref)
    report = fuse_lora(fused, **options)
    assert len(report.fused) == N_LAYERS and not report.skipped, report
    return ref, fused


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))


def step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    (logits.square().mean() + logits[..., 0].mean()).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = FusedLoraFunction.apply

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(FusedLoraFunction, "apply", counted)
    return calls


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_fp32_outputs_and_gradients_match_peft(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, fused = pair(fmt, torch.float32)
    calls = counting(monkeypatch)
    ids = batch()
    ref_logits, ref_grads = step(ref, ids)
    logits, grads = step(fused, ids)
    assert calls[0] == N_LAYERS
    assert rel(logits, ref_logits) <= FP32_TOL
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * N_LAYERS
    for name, grad in grads.items():
        assert rel(grad, ref_grads[name]) <= FP32_TOL, name


def fp32_exact(model: Any) -> Any:
    """The same quantized weights expanded to fp32 in plain nn.Linear layers, adapters and
    everything else in fp32: the yardstick of the bf16 runs."""
    twin = copy.deepcopy(model)
    for module in list(twin.modules()):
        base = getattr(module, "base_layer", None)
        if isinstance(base, QuantizedLinear):
            plain = nn.Linear(base.in_features, base.out_features, bias=False)
            plain.weight = nn.Parameter(base.dequantize(torch.float32), requires_grad=False)
            module.base_layer = plain
    return twin.float()


@pytest.mark.parametrize(
    ("fmt", "dtype", "matmul_dtype"),
    [
        ("nf4", torch.bfloat16, None),
        ("int8", torch.bfloat16, "bf16"),
        ("nf4", torch.float32, "bf16"),
    ],
    ids=["nf4-bf16", "int8-bf16-bf16matmul", "nf4-fp32-bf16matmul"],
)
def test_bf16_close_to_peft(fmt: str, dtype: torch.dtype, matmul_dtype: Any) -> None:
    ref, fused = pair(fmt, dtype, matmul_dtype)
    exact = fp32_exact(ref)
    ids = batch()
    exact_logits, exact_grads = step(exact, ids)
    ref_logits, ref_grads = step(ref, ids)
    logits, grads = step(fused, ids)
    assert rel(logits, ref_logits) <= BF16_VS_PEFT
    assert rel(logits, exact_logits) <= 1.5 * rel(ref_logits, exact_logits) + 1e-3
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel(grad, ref_grads[name]) <= BF16_VS_PEFT, name
        peft_error = rel(ref_grads[name], exact_grads[name])
        assert rel(grad, exact_grads[name]) <= 1.5 * peft_error + 1e-3, name


def test_autocast_bf16_over_nf4_close_to_peft() -> None:
    ref, fused = pair("nf4", torch.float32)
    ids = batch()
    exact_logits, _ = step(ref, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits, ref_grads = step(ref, ids)
        logits, grads = step(fused, ids)
    assert rel(logits, ref_logits) <= BF16_VS_PEFT
    assert rel(logits, exact_logits) <= 1.5 * rel(ref_logits, exact_logits) + 1e-3
    for name, grad in grads.items():
        assert rel(grad, ref_grads[name]) <= BF16_VS_PEFT, name


def test_keep_expanded_gives_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping the forward's expansion for backward changes memory and time, not values; and
    the layers expand once per step instead of twice."""
    _, per_call = pair("nf4", torch.float32)
    _, kept = pair("nf4", torch.float32, keep_expanded=True)
    expansions = [0]
    original = QuantizedLinear.dequantize

    def counted(self: QuantizedLinear, dtype: torch.dtype | None = None) -> torch.Tensor:
        expansions[0] += 1
        return original(self, dtype)

    monkeypatch.setattr(QuantizedLinear, "dequantize", counted)
    # sakura-quant versions with dequantize_into (expansion into a reused buffer) take that path
    # when the expansion is not kept: counted alike.
    original_into = getattr(QuantizedLinear, "dequantize_into", None)
    if original_into is not None:

        def counted_into(self: QuantizedLinear, out: torch.Tensor) -> torch.Tensor:
            expansions[0] += 1
            result: torch.Tensor = original_into(self, out)
            return result

        monkeypatch.setattr(QuantizedLinear, "dequantize_into", counted_into)
    ids = batch()
    logits, grads = step(per_call, ids)
    # Backward expands again where the input needs a gradient: not in layer 0's q/k/v, which
    # read the (frozen) embeddings.
    assert expansions[0] == N_LAYERS + N_LAYERS - 3
    expansions[0] = 0
    kept_logits, kept_grads = step(kept, ids)
    assert expansions[0] == N_LAYERS
    assert torch.equal(logits, kept_logits)
    assert all(torch.equal(grads[n], kept_grads[n]) for n in grads)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_five_adamw_steps_train_the_same_adapters(fmt: str) -> None:
    ref, fused = pair(fmt, torch.float32)

    def train(model: Any) -> dict[str, torch.Tensor]:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        gen = torch.Generator().manual_seed(3)
        for _ in range(5):
            ids = torch.randint(0, 256, (2, 12), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    start = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    ref_after, after = train(ref), train(fused)
    assert after.keys() == ref_after.keys() and len(after) == 2 * N_LAYERS
    for name, value in after.items():
        assert not torch.equal(value, start[name]), name
        assert rel(value, ref_after[name]) <= FP32_TOL, name


def test_disable_adapter_and_unfuse_over_quantized_bases() -> None:
    ref, fused = pair("nf4", torch.float32)
    ids = batch()
    with torch.no_grad():
        with ref.disable_adapter():
            base_ref = ref(input_ids=ids).logits
        with fused.disable_adapter():
            base = fused(input_ids=ids).logits
        adapted_ref = ref(input_ids=ids).logits
        adapted = fused(input_ids=ids).logits
        assert len(unfuse_lora(fused)) == N_LAYERS
        unfused = fused(input_ids=ids).logits
    assert torch.equal(base, base_ref)
    assert rel(adapted, adapted_ref) <= FP32_TOL
    assert torch.equal(unfused, adapted_ref)
