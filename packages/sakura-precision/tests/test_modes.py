"""Precision strings, option validation, spec strings and the facade."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sakura
from sakura import SakuraRuntime
from sakura.errors import SpecError
from sakura_precision import (
    ActivationCheckpoint,
    AutocastPrecision,
    Compile,
    FP8Precision,
    LossScaledPrecision,
    MixedPrecision,
    TruePrecision,
)
from sakura_precision.modes import ACCEPTED, cpu_has_native_bf16, resolve_mode


@pytest.mark.parametrize(
    ("value", "mode", "cls", "dtype"),
    [
        ("bf16", "bf16-mixed", AutocastPrecision, torch.bfloat16),
        ("bf16-mixed", "bf16-mixed", AutocastPrecision, torch.bfloat16),
        ("fp16", "16-mixed", LossScaledPrecision, torch.float16),
        ("16-mixed", "16-mixed", LossScaledPrecision, torch.float16),
        (16, "16-mixed", LossScaledPrecision, torch.float16),
        ("16", "16-mixed", LossScaledPrecision, torch.float16),
        ("bf16-true", "bf16-true", TruePrecision, torch.bfloat16),
        ("16-true", "16-true", TruePrecision, torch.float16),
        ("32-true", "32-true", TruePrecision, torch.float32),
        (32, "32-true", TruePrecision, torch.float32),
        ("64-true", "64-true", TruePrecision, torch.float64),
        (64, "64-true", TruePrecision, torch.float64),
        ("fp8", "fp8", FP8Precision, torch.bfloat16),
        (" BF16 ", "bf16-mixed", AutocastPrecision, torch.bfloat16),
        (torch.bfloat16, "bf16-mixed", AutocastPrecision, torch.bfloat16),
    ],
)
def test_precision_strings(value: Any, mode: str, cls: type, dtype: torch.dtype) -> None:
    service = MixedPrecision(value)
    assert type(service) is cls and isinstance(service, MixedPrecision)
    assert service.mode.name == mode and service.dtype == dtype
    assert service.name == "mixed_precision"
    assert MixedPrecision(dtype=value).mode.name == mode


def test_only_the_hooks_a_mode_needs() -> None:
    """The adapters decide from the implemented hooks what a framework must allow."""
    bf16, fp16, true = MixedPrecision("bf16"), MixedPrecision("fp16"), MixedPrecision("bf16-true")
    step_hooks = ("wrap_loss", "unscale_gradients", "optimizer_step", "state_dict")
    assert all(hasattr(fp16, h) for h in step_hooks)
    assert not any(hasattr(bf16, h) for h in step_hooks)
    assert not any(hasattr(true, h) for h in step_hooks)
    with SakuraRuntime([bf16]) as rt:
        assert rt.implements("autocast") == ("mixed_precision",)
        assert rt.implements("optimizer_step") == ()


def test_auto_resolves_for_this_machine() -> None:
    mode = resolve_mode("auto")
    if torch.cuda.is_available():
        expected = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    else:
        expected = "bf16-mixed" if cpu_has_native_bf16() else "32-true"
    assert mode.name == expected
    assert MixedPrecision("auto").requested == "auto"


@pytest.mark.parametrize("value", ["bf17", "fp4", "mixed", 8, True, None, 16.0, "16-bit"])
def test_unknown_precision_lists_what_is_accepted(value: Any) -> None:
    with pytest.raises(ValueError, match=r"dtype=.* is not accepted; accepted: 'bf16'") as info:
        MixedPrecision(value)
    for accepted in ("'bf16-mixed'", "'16-mixed'", "'bf16-true'", "'64-true'", "32", "'auto'"):
        assert accepted in str(info.value)
    assert "auto" in ACCEPTED


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"dtype": "fp16", "device": "tpu"},
            r"device='tpu' is not accepted; accepted: 'cpu', 'cuda'",
        ),
        (
            {"dtype": "fp16", "init_scale": 0},
            r"MixedPrecision: init_scale=0 is not accepted; accepted: a finite number > 0",
        ),
        (
            {"dtype": "fp16", "growth_factor": 1.0},
            r"growth_factor=1.0 is not accepted; accepted: a finite number > 1",
        ),
        (
            {"dtype": "fp16", "backoff_factor": 1.5},
            r"backoff_factor=1.5 is not accepted; accepted: a finite number > 0 and < 1",
        ),
        (
            {"dtype": "fp16", "growth_interval": 0},
            r"growth_interval=0 is not accepted; accepted: an int >= 1",
        ),
        (
            {"dtype": "bf16", "init_scale": 1024.0},
            r"\['init_scale'\] configure the fp16 loss scaler",
        ),
        ({"dtype": "bf16", "emulate": True}, r"\['emulate'\] configure fp8"),
        (
            {"dtype": "fp8", "emulate": "yes"},
            r"emulate='yes' is not accepted; accepted: True or False",
        ),
        (
            {"dtype": "fp8", "fp8_filter": 3},
            r"fp8_filter=3 is not accepted; accepted: a callable \(name, linear\) -> bool, or None",
        ),
    ],
)
def test_bad_options_name_option_value_and_accepted(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MixedPrecision(**kwargs)


def test_subclass_rejects_other_modes() -> None:
    with pytest.raises(ValueError, match=r"AutocastPrecision implements 'mixed' modes"):
        AutocastPrecision("fp16")


def test_spec_strings_build_the_services(tmp_path: Any) -> None:
    rt = SakuraRuntime(
        [
            "mixed_precision:bf16",
            "compile:mode=max-autotune",
            "activation_checkpoint:policy=save_matmuls,every=2",
        ]
    )
    mp, ac, comp = rt.services  # priority order: precision, checkpointing, compile
    assert isinstance(mp, AutocastPrecision) and mp.mode.name == "bf16-mixed"
    assert isinstance(ac, ActivationCheckpoint) and ac.policy == "save_matmuls" and ac.every == 2
    assert isinstance(comp, Compile) and comp.mode == "max-autotune"
    fp16 = SakuraRuntime(["mixed_precision:fp16,growth_interval=10"]).get("mixed_precision")
    assert isinstance(fp16, LossScaledPrecision) and fp16.scale == 2.0**16
    assert isinstance(SakuraRuntime(["mixed_precision:16"]).services[0], LossScaledPrecision)
    plain = SakuraRuntime(["compile", "activation_checkpoint"])
    assert [type(s).__name__ for s in plain.services] == ["ActivationCheckpoint", "Compile"]
    target = SakuraRuntime([f"compile:cache_dir={tmp_path},target=blocks"]).get("compile")
    assert target.cache_dir == tmp_path.resolve() and target.target == "blocks"


def test_bad_spec_strings_are_spec_errors() -> None:
    with pytest.raises(SpecError, match=r"dtype='fp17' is not accepted"):
        SakuraRuntime(["mixed_precision:fp17"])
    with pytest.raises(SpecError, match=r"mode='fastest' is not accepted; accepted: 'default'"):
        SakuraRuntime(["compile:mode=fastest"])
    with pytest.raises(SpecError, match=r"policy='save_all' is not accepted"):
        SakuraRuntime(["activation_checkpoint:policy=save_all"])


def test_facade_exports_the_classes() -> None:
    from sakura.services import ActivationCheckpoint as AC
    from sakura.services import Compile as C
    from sakura.services import MixedPrecision as MP

    assert (MixedPrecision, Compile, ActivationCheckpoint) == (MP, C, AC)
    assert sakura.SakuraRuntime is SakuraRuntime


def test_the_plugin_registers_lazy_targets() -> None:
    """Listing plugins must not import torch-heavy modules: targets are 'module:Class'."""
    from sakura.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("service")
    assert registry["mixed_precision"].target == "sakura_precision.mixed_precision:MixedPrecision"
    assert registry["compile"].target == "sakura_precision.compile:Compile"
    assert registry["activation_checkpoint"].target == (
        "sakura_precision.activation_checkpoint:ActivationCheckpoint"
    )
    assert {registry[n].distribution for n in ("mixed_precision", "compile")} == {
        "sakura-precision"
    }
