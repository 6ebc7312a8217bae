"""LoftQ: error_rank / error_iters and init_lora_from_error, on values."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sakura.options import OptionError
from sakura_quant import (
    Quantization,
    QuantizedLinear,
    dequantize_weight,
    init_lora_from_error,
    load_model,
    quantize_model,
    quantize_weight,
)
from sakura_quant.loftq import quantize_with_error_fit

peft = pytest.importorskip("peft")


def _trained_like_weight(out: int = 256, inn: int = 192) -> torch.Tensor:
    """A weight whose singular values decay (1/k), as trained layers' do."""
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(out, inn, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(inn, inn, generator=gen))
    w = (u * torch.arange(1, inn + 1).float().reciprocal()) @ v.T
    return w / w.std() * 0.02


def _rel(approx: torch.Tensor, w: torch.Tensor) -> float:
    return float((approx - w).detach().norm() / w.detach().norm())


def test_error_fit_beats_plain_nf4_and_rounds_reduce_it() -> None:
    w = _trained_like_weight()
    plain = _rel(dequantize_weight(quantize_weight(w, "nf4"), torch.float32), w)
    errors = []
    for iters in (1, 2, 3, 5):
        q, a, b = quantize_with_error_fit(
            w, "nf4", block_size=None, double_quant=False, rank=16, iters=iters
        )
        assert a.shape == (16, 192) and b.shape == (256, 16)
        errors.append(_rel(dequantize_weight(q, torch.float32) + b @ a, w))
    # Measured: plain 0.0918; rounds 1, 2, 3, 5: 0.0740, 0.0697, 0.0677, 0.0664.
    assert errors[0] < 0.85 * plain
    assert all(later < earlier for earlier, later in itertools.pairwise(errors))
    assert errors[-1] < 0.93 * errors[0]


def test_matches_peft_loftq_algorithm_with_bitsandbytes_nf4() -> None:
    """PEFT's own ``loftq_init`` moves the weight to CUDA unconditionally, so it cannot run
    here; this is its loop, step for step, on PEFT's ``_low_rank_decomposition`` and
    bitsandbytes' NF4 (blocks of 64, fp32 absmax, as ``Params4bit`` without compressed
    statistics; rows a multiple of the block, where bitsandbytes' CPU dequantize is right)."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    from peft.utils.loftq_utils import _low_rank_decomposition

    w = _trained_like_weight(192, 128)
    rank, iters = 8, 3
    res = w.clone()
    for i in range(iters):
        packed, state = bnb.quantize_4bit(res, blocksize=64, quant_type="nf4")
        deq = bnb.dequantize_4bit(packed, state)
        out = _low_rank_decomposition(w - deq, reduced_rank=rank)
        big_l, big_r = out["L"], out["R"]
        if i + 1 == iters:
            break
        res = w - big_l @ big_r
    q, a, b = quantize_with_error_fit(
        w, "nf4", block_size=64, double_quant=False, rank=rank, iters=iters
    )
    assert torch.equal(dequantize_weight(q, torch.float32), deq)
    torch.testing.assert_close(b @ a, big_l @ big_r[:rank], atol=1e-6, rtol=1e-5)


def _peft_lora(model: nn.Module, r: int) -> Any:
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config)


def _effective(layer: Any) -> torch.Tensor:
    """What a PEFT LoRA layer multiplies by: the base weight plus scaling * B @ A."""
    base = layer.base_layer
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    return base.dequantize(torch.float32) + layer.scaling["default"] * delta


def test_peft_adapters_start_at_the_error(make_tiny_lm: Callable[[], nn.Module]) -> None:
    original = make_tiny_lm().requires_grad_(False)
    ids = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(3))
    want = original(ids)
    plain = make_tiny_lm().requires_grad_(False)
    plain.load_state_dict(original.state_dict())
    quantize_model(plain, "nf4", block_size=16)
    loftq = make_tiny_lm().requires_grad_(False)
    loftq.load_state_dict(original.state_dict())
    stats = quantize_model(loftq, "nf4", block_size=16, error_rank=8, error_iters=2)
    assert stats["lora_initialized"] == 0  # no adapters yet
    lora = _peft_lora(loftq, r=8)
    assert init_lora_from_error(lora) == 4
    weights = {n: m.weight for n, m in original.named_modules() if isinstance(m, nn.Linear)}
    for name, layer in lora.named_modules():
        if isinstance(layer, peft.tuners.lora.Linear):
            a, b = layer.base_layer.error_factors
            fitted = layer.base_layer.dequantize(torch.float32) + b @ a
            torch.testing.assert_close(_effective(layer), fitted, atol=1e-6, rtol=1e-5)
            w = weights[name.removeprefix("base_model.model.")]
            plain_layer = plain.get_submodule(name.removeprefix("base_model.model."))
            plain_err = _rel(plain_layer.dequantize(torch.float32), w)
            assert _rel(fitted, w) < 0.9 * plain_err, name
    lora.eval()
    err_plain = _rel(plain(ids), want)
    err_loftq = _rel(lora(ids), want)
    assert err_loftq < 0.8 * err_plain, (err_loftq, err_plain)


def test_adapters_already_on_the_model_and_a_larger_rank(
    make_tiny_lm: Callable[[], nn.Module],
) -> None:
    model = make_tiny_lm().requires_grad_(False)
    lora = _peft_lora(model, r=6)
    stats = quantize_model(lora, "nf4", block_size=16, error_rank=4)
    assert stats["lora_initialized"] == 4
    for layer in lora.modules():
        if isinstance(layer, peft.tuners.lora.Linear):
            a, b = layer.base_layer.error_factors
            lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            assert torch.equal(lora_a[:4], a)
            assert torch.equal(lora_b[:, 4:], torch.zeros_like(lora_b[:, 4:]))
            torch.testing.assert_close(layer.scaling["default"] * lora_b[:, :4], b)


def test_keep_precise_layers_get_the_fit_in_their_format(
    make_tiny_lm: Callable[[], nn.Module],
) -> None:
    model = make_tiny_lm().requires_grad_(False)
    stats = quantize_model(model, "nf4", block_size=16, keep_precise=0.5, error_rank=4)
    assert stats["kept_precise"] >= 1
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.format for m in layers} == {"nf4", "int8"}
    assert all(m.error_factors is not None for m in layers)


def test_state_dict_round_trip_and_full_precision_reload(
    make_tiny_lm: Callable[[], nn.Module],
) -> None:
    original = make_tiny_lm().requires_grad_(False)
    source = make_tiny_lm().requires_grad_(False)
    source.load_state_dict(original.state_dict())
    quantize_model(source, "int8", error_rank=3, error_iters=2)
    target = make_tiny_lm().requires_grad_(False)
    quantize_model(target, "int8", error_rank=3, error_iters=2)
    target.load_state_dict(source.state_dict())
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
    # A full-precision weight loaded into a LoftQ layer is fitted again, the same way.
    fresh = make_tiny_lm().requires_grad_(False)
    quantize_model(fresh, "int8", error_rank=3, error_iters=2)
    fresh.load_state_dict(original.state_dict(), strict=False)
    layer = fresh.layers[0].q_proj
    q, a, b = quantize_with_error_fit(
        original.layers[0].q_proj.weight,
        "int8",
        block_size=64,
        double_quant=False,
        rank=3,
        iters=2,
    )
    assert torch.equal(layer.weight, q.tensors["data"])
    assert torch.equal(layer.error_a, a) and torch.equal(layer.error_b, b)


def test_load_model_keeps_the_factors(
    tmp_path: Path, make_tiny_lm: Callable[[], nn.Module]
) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    original = make_tiny_lm()
    safetensors_torch.save_file(original.state_dict(), str(tmp_path / "m.safetensors"))
    loaded = load_model(
        tmp_path / "m.safetensors", "nf4", model=make_tiny_lm(), error_rank=4, error_iters=2
    )
    expected = make_tiny_lm().requires_grad_(False)
    expected.load_state_dict(original.state_dict())
    quantize_model(expected, "nf4", error_rank=4, error_iters=2)
    for key, value in expected.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert "layers.0.v_proj.error_b" in expected.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"error_rank": -1}, "error_rank"),
        ({"error_rank": 2.5}, "error_rank"),
        ({"error_rank": True}, "error_rank"),
        ({"error_rank": 4, "error_iters": 0}, "error_iters"),
        ({"error_rank": 0, "error_iters": 3}, "error_iters"),
    ],
)
def test_bad_options_name_the_option(
    kwargs: dict[str, Any], option: str, make_tiny_lm: Callable[[], nn.Module]
) -> None:
    model = make_tiny_lm().requires_grad_(False)
    with pytest.raises(OptionError, match=f"{option}="):
        quantize_model(model, "nf4", **kwargs)
    with pytest.raises(OptionError, match=f"{option}="):
        Quantization("nf4", **kwargs)
    with pytest.raises(OptionError, match=f"{option}="):
        load_model("unused.safetensors", "nf4", model=model, **kwargs)


def test_an_error_rank_larger_than_a_layer_allows_is_an_error(
    tmp_path: Path, make_tiny_lm: Callable[[], nn.Module]
) -> None:
    # It used to be cut down to min(out, in) silently: the adapters then started with fewer
    # fitted columns than error_rank said.
    model = make_tiny_lm().requires_grad_(False)
    accepted = r"accepted: an int in \[0, 64\] for layers\.0\.q_proj \(its weight is \(64, 64\)"
    with pytest.raises(OptionError, match=r"quantize_model: error_rank=1000000 .*" + accepted):
        quantize_model(model, "nf4", error_rank=10**6)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # left as it was
    quantize_model(model, "nf4", block_size=16, error_rank=64)  # the full rank is allowed
    factors = model.layers[0].q_proj.error_factors
    assert factors is not None and factors[0].shape == (64, 64)

    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(make_tiny_lm().state_dict(), str(tmp_path / "m.safetensors"))
    with pytest.raises(OptionError, match=r"load_model: error_rank=65 .*" + accepted):
        load_model(tmp_path / "m.safetensors", "nf4", model=make_tiny_lm(), error_rank=65)
    with pytest.raises(
        OptionError, match=r"error_rank=9 .* \[0, 8\] for w \(its weight is \(8, 32\)"
    ):
        quantize_with_error_fit(
            torch.randn(8, 32),
            "nf4",
            block_size=None,
            double_quant=False,
            rank=9,
            iters=1,
            name="w",
        )


def test_from_pretrained_checks_error_rank_per_layer(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from sakura_quant import SakuraQuantConfig

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    # k_proj and v_proj are (32, 64): 33 is too large for them only.
    with pytest.raises(
        OptionError,
        match=r"SakuraQuantConfig: error_rank=33 .* \[0, 32\] for model\.layers\.0\.self_attn\.k_proj",
    ):
        transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=SakuraQuantConfig("nf4", error_rank=33)
        )
