"""Stock PEFT LoRA on quantized layers (QLoRA), with no step beyond get_peft_model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from sakura_quant import QuantizedLinear, quantize_model

peft = pytest.importorskip("peft")


def _train(model: nn.Module, steps: int) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (4, 12), generator=gen)
    losses = []
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fmt", ["nf4", "int8", "fp8", "nvfp4"])
def test_lora_trains_on_a_quantized_base(fmt: str, make_tiny_lm: Callable[[], nn.Module]) -> None:
    model = make_tiny_lm().requires_grad_(False)
    quantize_model(model, fmt)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    lora = peft.get_peft_model(model, config)
    wrapped = [m for m in lora.modules() if isinstance(m, peft.tuners.lora.Linear)]
    assert len(wrapped) == 4
    assert all(isinstance(m.base_layer, QuantizedLinear) for m in wrapped)

    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    losses = _train(lora, 15)
    assert losses[-1] < losses[0] * 0.9
    for name, param in lora.named_parameters():
        if "lora_" in name:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name
    # The quantized base did not move: every stored tensor is as it was.
    after = lora.get_base_model().state_dict()
    for key, value in base.items():
        peft_key = key.replace("q_proj.", "q_proj.base_layer.").replace(
            "v_proj.", "v_proj.base_layer."
        )
        assert torch.equal(after[peft_key], value), key


def test_lora_output_is_base_plus_adapter(make_tiny_lm: Callable[[], nn.Module]) -> None:
    model = make_tiny_lm().requires_grad_(False)
    quantize_model(model, "nf4")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    layer = lora.base_model.model.layers[0].q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    x = torch.randn(3, 64)
    base = layer.base_layer
    scale = layer.scaling["default"]
    expected = F.linear(x, base.dequantize(), base.bias) + scale * layer.lora_B["default"](
        layer.lora_A["default"](x)
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_quantizing_after_get_peft_model_quantizes_only_the_base(
    make_tiny_lm: Callable[[], nn.Module],
) -> None:
    model = make_tiny_lm()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    stats = quantize_model(lora, "nf4")
    # q_proj base layers (2) and v_proj (2); the adapters and lm_head stay as they are.
    assert stats["tensors"] == 4
    q = lora.base_model.model.layers[0].q_proj
    assert isinstance(q.base_layer, QuantizedLinear)
    assert type(q.lora_A["default"]) is nn.Linear
    assert q.lora_A["default"].weight.requires_grad
    losses = _train(lora, 10)
    assert losses[-1] < losses[0]
