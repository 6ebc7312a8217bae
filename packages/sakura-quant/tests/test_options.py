"""sakura-quant's options are declared once (QuantOptions) and checked once per call path,
with the same error text from every entry point."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sakura import SakuraRuntime
from sakura.errors import SpecError
from sakura.options import OptionError
from sakura.plugins import get_plugin_manager
from sakura_quant import (
    Quantization,
    QuantizedLinear,
    QuantOptions,
    load_model,
    quantize_model,
)
from sakura_quant import options as quant_options
from sakura_quant.options import WeightSpec

# Every validator of an option value (the stored-layout checks of a built weight are not
# option validation and are not counted).
_VALIDATORS = (
    "_check_double_quant",
    "_check_keep_precise",
    "_check_error_options",
    "_check_names",
    "check_matmul_dtype",
)


@pytest.fixture
def count_checks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the calls of every option validator, wherever it is called from."""
    calls: Counter[str] = Counter()

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in _VALIDATORS:
        monkeypatch.setattr(quant_options, name, counting(name, getattr(quant_options, name)))
    import sakura_quant.linear

    monkeypatch.setattr(
        sakura_quant.linear,
        "check_matmul_dtype",
        counting("check_matmul_dtype", sakura_quant.linear.check_matmul_dtype),
    )
    for cls, method in ((QuantOptions, "from_kwargs"), (WeightSpec, "check")):
        original = getattr(cls, method).__func__
        wrapped = counting(f"{cls.__name__}.{method}", original)
        monkeypatch.setattr(cls, method, classmethod(wrapped))
    return calls


_ONCE = {
    "QuantOptions.from_kwargs": 1,
    "WeightSpec.check": 1,
    "_check_double_quant": 1,
    "_check_keep_precise": 1,
    "_check_error_options": 1,
    "_check_names": 2,  # targets, skip
    "check_matmul_dtype": 1,
}


def test_a_spec_string_checks_each_option_once(
    count_checks: Counter[str], make_tiny_lm: Callable[[], nn.Module]
) -> None:
    # spec string -> the service -> rt.prepare -> quantize_with_options -> every layer
    service = get_plugin_manager().create(
        "service", "quant:nf4,block_size=32,double_quant=true,matmul_dtype=bf16,keep_precise=0.2"
    )
    model = make_tiny_lm().requires_grad_(False)
    with SakuraRuntime(strict=True) as rt:
        rt.install(service)
        rt.prepare(model)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 and all(m.matmul_dtype == torch.bfloat16 for m in layers)
    assert {m.block_size for m in layers} == {32}
    assert dict(count_checks) == _ONCE


def test_quantize_model_and_load_model_check_each_option_once(
    count_checks: Counter[str], make_tiny_lm: Callable[[], nn.Module], tmp_path: Path
) -> None:
    model = make_tiny_lm().requires_grad_(False)
    stats = quantize_model(model, "int8", error_rank=2, error_iters=2, matmul_dtype="fp32")
    assert stats["tensors"] == 4 and stats["lora_initialized"] == 0
    assert dict(count_checks) == _ONCE

    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(make_tiny_lm().state_dict(), str(tmp_path / "m.safetensors"))
    count_checks.clear()
    loaded = load_model(
        tmp_path / "m.safetensors",
        "nf4",
        model=make_tiny_lm(),
        error_rank=2,
        error_iters=2,
        matmul_dtype="bf16",
    )
    layers = [m for m in loaded.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 and all(m.matmul_dtype == torch.bfloat16 for m in layers)
    assert all(m.error_factors is not None and m.error_iters == 2 for m in layers)
    assert dict(count_checks) == _ONCE


BAD = [
    ({"format": "q4"}, "format"),
    ({"block_size": 7}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"format": "fp8", "block_size": 64}, "block_size"),
    ({"format": "fp8", "double_quant": True}, "double_quant"),
    ({"double_quant": 1}, "double_quant"),
    ({"targets": "q_proj"}, "targets"),
    ({"skip": None}, "skip"),
    ({"format": "int8", "keep_precise": 0.1}, "keep_precise"),
    ({"keep_precise": 0.9}, "keep_precise"),
    ({"error_rank": -1}, "error_rank"),
    ({"error_rank": 0, "error_iters": 2}, "error_iters"),
    ({"matmul_dtype": "fp64"}, "matmul_dtype"),
]


def _entry_points() -> dict[str, Callable[[dict[str, Any]], Any]]:
    model = nn.Sequential(nn.Linear(4, 4)).requires_grad_(False)

    def call_quantize_model(kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        return quantize_model(model, kwargs.pop("format", "nf4"), **kwargs)

    def call_load_model(kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        return load_model("unused.safetensors", kwargs.pop("format", "nf4"), model=model, **kwargs)

    def call_spec(kwargs: dict[str, Any]) -> Any:
        # What a spec string gives is a string: only the values a spec can spell.
        return Quantization(**kwargs)

    entries: dict[str, Callable[[dict[str, Any]], Any]] = {
        "quantize_model": call_quantize_model,
        "load_model": call_load_model,
        "Quantization": call_spec,
        "QuantOptions": lambda kwargs: QuantOptions.from_kwargs(owner="QuantOptions", **kwargs),
    }
    try:
        from sakura_quant import SakuraQuantConfig
    except ImportError:
        pass
    else:
        entries["SakuraQuantConfig"] = lambda kwargs: SakuraQuantConfig(**kwargs)
    return entries


@pytest.mark.parametrize(("kwargs", "option"), BAD)
def test_every_entry_point_rejects_a_bad_value_with_the_same_text(
    kwargs: dict[str, Any], option: str
) -> None:
    texts = {}
    for owner, call in _entry_points().items():
        if owner == "load_model" and "keep_precise" in kwargs:
            continue  # load_model has no keep_precise (it reads each weight once)
        with pytest.raises(OptionError) as error:
            call(kwargs)
        assert error.value.option in (option, "quantize")
        text = str(error.value)
        assert text.startswith(f"{owner}: "), text
        # quantize_model / load_model spell the format quantize=, as the reference does
        texts[owner] = text.removeprefix(f"{owner}: ").replace("quantize=", "format=")
    if (
        "load_model" in texts and option == "format"
    ):  # load_model also takes quantize="auto" / "none" / None / False
        texts["load_model"] = texts["load_model"].replace(", 'auto', 'none', None, False", "")
    assert len(set(texts.values())) == 1, texts


def test_spec_strings_are_checked_by_the_same_options() -> None:
    manager = get_plugin_manager()
    with pytest.raises(SpecError) as error:
        manager.create("service", "quant:nf4,keep_precise=0.9")
    with pytest.raises(OptionError) as direct:
        Quantization("nf4", keep_precise=0.9)
    assert str(direct.value) in str(error.value)


def test_options_are_frozen_and_round_trip() -> None:
    options = QuantOptions.from_kwargs(
        owner="test", format="nf4", double_quant=True, keep_precise="auto", matmul_dtype="bf16"
    )
    assert (options.format, options.block_size, options.double_quant) == ("nf4", 64, True)
    assert options.keep_precise == 0.05 and options.matmul_dtype is torch.bfloat16
    assert options.spec.precise() == WeightSpec("int8", 64, True)
    assert QuantOptions.from_kwargs(owner="test", **options.to_kwargs()) == options
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.error_rank = 3  # type: ignore[misc]
    service = Quantization("fp8", matmul_dtype=torch.float16)
    assert service.options == QuantOptions.from_kwargs(owner="x", format="fp8", matmul_dtype="fp16")
    assert service.block_size == 32 and service.skip == ("lm_head",)
