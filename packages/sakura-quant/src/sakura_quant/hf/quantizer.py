"""``SakuraHfQuantizer``: sakura-quant inside transformers' ``from_pretrained``.

transformers (5.x) calls a quantizer at three moments of loading:

1. before the weights load (``_process_model_before_weight_loading``), on the skeleton model
   (its parameters on the meta device). A full-precision checkpoint: the target ``nn.Linear``
   modules are chosen here, by :func:`~sakura_quant.quantize.find_targets` with the config's
   ``targets`` / ``skip``, and stay as they are. A checkpoint that sakura-quant wrote
   (``pre_quantized``): each stored layer is replaced by a ``QuantizedLinear`` whose buffers
   have the stored shapes and dtypes (read from the safetensors headers), which the loader
   then fills as stored: nothing is quantized again.
2. per tensor (``get_quantize_ops``): the loader hands each target ``weight``, read from the
   checkpoint, to :class:`QuantizeOnLoad`, which quantizes it as ``quantize_model`` would and
   puts the ``QuantizedLinear`` in the module's place; the full-precision tensor is dropped.
3. after loading (``_process_model_after_weight_loading``): with ``keep_precise``, the weights
   that lose most are swapped for their more precise form (each weight was quantized both
   ways while it was read, and its error measured), with ``quantize_model``'s rule.

``save_pretrained`` then writes the stored tensors (the state dict) and, in each safetensors
header, the layout of the quantized layers (:mod:`sakura_quant.hf.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from sakura.options import option_error
from sakura_quant.codec import encode
from sakura_quant.formats import QuantizedWeight
from sakura_quant.formats.checks import check_quantized_weight
from sakura_quant.hf.config import SakuraQuantConfig
from sakura_quant.hf.layout import install_skeletons, layout_metadata
from sakura_quant.linear import QuantizedLinear
from sakura_quant.loftq import check_error_rank
from sakura_quant.quantize import build_layer, find_targets, relative_error, select_precise

__all__ = ["QuantizeOnLoad", "SakuraHfQuantizer"]

_OWNER = "SakuraQuantConfig"


@dataclass
class _Candidate:
    """A weight measured for ``keep_precise``: its error and bytes in the format, and the
    layer that stores it one step more precise."""

    error: float
    nbytes: int
    precise: QuantizedLinear


def _mark_loaded(layer: nn.Module) -> None:
    """Flag the layer and its tensors as loaded, so transformers' ``_init_weights`` (which sees
    an ``nn.Linear``) never re-initialises them."""
    setattr(layer, "_is_hf_initialized", True)  # noqa: B010 (not an nn.Module attribute)
    for tensor in layer.buffers(recurse=False):
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)


class SakuraHfQuantizer(HfQuantizer):
    """The quantizer transformers builds from a :class:`SakuraQuantConfig` (see the module
    docstring for when each method runs)."""

    requires_calibration = False
    quantization_config: SakuraQuantConfig

    def __init__(self, quantization_config: SakuraQuantConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.targets: set[str] = set()
        self._candidates: dict[str, _Candidate] = {}

    @property
    def quantized_element_size(self) -> float:
        """Bytes per weight once quantized, scales included (what ``device_map="auto"``
        plans with): codes of 4 or 8 bits plus one scale per block (fp32, or one byte with
        ``double_quant``; nvfp4's are e4m3)."""
        spec = self.quantization_config.options.spec
        code = 0.5 if spec.format in ("nf4", "nvfp4") else 1.0
        scale = 1.0 if spec.double_quant or spec.format == "nvfp4" else 4.0
        return code + scale / spec.block_size

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError(
                "SakuraQuantConfig: device_map places modules on 'disk'; quantized layers load "
                "onto the CPU or an accelerator only"
            )

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> None:
        if self.pre_quantized:
            install_skeletons(model, checkpoint_files or [])
            return
        options = self.quantization_config.options
        targets = options.targets
        found = [name for name, _ in find_targets(model, targets, options.skip)]
        kept = self._never_quantized(model)
        for name in found:
            if targets is not None and not should_convert_module(name, kept):
                raise option_error(
                    "targets",
                    list(targets),
                    f"modules transformers lets change ({name} is tied to another module or "
                    "in the model's _keep_in_fp32_modules)",
                    owner="SakuraQuantConfig",
                )
        self.targets = {name for name in found if should_convert_module(name, kept)}
        modules = dict(model.named_modules())
        for name in sorted(self.targets):  # before any weight loads
            shape = tuple(modules[name].weight.shape)
            check_error_rank(options.error_rank, shape, name=name, owner=_OWNER)

    @staticmethod
    def _never_quantized(model: nn.Module) -> list[str]:
        """Modules that share a weight with another (a tied head) and those the model keeps
        in fp32: quantizing them would break the tie or the model's numerics."""
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        names = {key.rpartition(".")[0] for key in (*tied.keys(), *tied.values())}
        names.update(getattr(model, "_keep_in_fp32_modules", None) or ())
        return sorted(n for n in names if n)

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        module_name, _, attr = param_name.rpartition(".")
        return attr == "weight" and module_name in self.targets

    def get_quantize_ops(self) -> QuantizeOnLoad:
        return QuantizeOnLoad(self)

    def quantize_layer(self, model: nn.Module, name: str, weight: torch.Tensor) -> QuantizedLinear:
        """Quantize ``weight``, the full-precision weight of ``model``'s Linear ``name``, and put
        the ``QuantizedLinear`` in its place (its bias, loaded or still to load, kept).

        A ``ValueError`` raised here (a non-finite weight, a wrong shape) is caught by
        transformers, shown in its load report, and raised after the report as its
        ``RuntimeError`` ("issues during automatic conversion").
        """
        options = self.quantization_config.options
        linear = model.get_submodule(name)
        if isinstance(linear, QuantizedLinear) or not isinstance(linear, nn.Linear):
            raise TypeError(f"SakuraHfQuantizer: {name} is a {type(linear).__name__}, not a Linear")
        if tuple(weight.shape) != tuple(linear.weight.shape) or not weight.is_floating_point():
            raise ValueError(
                f"the checkpoint stores {name}.weight as {tuple(weight.shape)} {weight.dtype}; "
                f"the model's is {tuple(linear.weight.shape)} {linear.weight.dtype}"
            )
        spec = options.spec
        base: QuantizedWeight | None = None
        key = f"{name}.weight"
        if options.keep_precise:
            base = encode(weight, spec, name=key)
            precise = build_layer(weight, spec.precise(), options, name=key, owner=_OWNER)
            self._candidates[name] = _Candidate(relative_error(weight, base), base.nbytes, precise)
        layer = build_layer(weight, spec, options, qweight=base, name=key, owner=_OWNER)
        layer.bias = linear.bias
        _mark_loaded(layer)
        _replace(model, name, layer)
        return layer

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        if self._candidates:
            names = [n for n, m in model.named_modules() if n in self._candidates]
            measured = [(self._candidates[n].error, n, self._candidates[n].nbytes) for n in names]
            chosen = select_precise(
                measured,
                self.quantization_config.options.keep_precise,
                lambda n: self._candidates[n].precise.quantized_weight(),
            )
            for name in chosen:
                layer = self._candidates[name].precise
                current: Any = model.get_submodule(name)  # the layer quantize_layer put there
                layer.bias = current.bias
                _mark_loaded(layer)
                _replace(model, name, layer)
            self._candidates.clear()
        options = self.quantization_config.options
        for name, module in model.named_modules():
            if isinstance(module, QuantizedLinear):  # loaded now, or reloaded quantized
                # What the loader put in the buffers, checked again (the skeleton was checked
                # against the headers; this holds the tensors themselves to the layout).
                check_quantized_weight(module.quantized_weight(), name=name)
                module.use_options(options)
        return model

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        """``model.dequantize()``: every ``QuantizedLinear`` becomes an ``nn.Linear`` holding its
        expanded weight (in ``dtype``, default the dtype it was quantized from), so the model
        computes what it computed quantized. LoftQ factors are dropped (they belong to
        adapters)."""
        for name, layer in list(model.named_modules()):
            if isinstance(layer, QuantizedLinear):
                weight = layer.dequantize(dtype)
                linear = nn.Linear(
                    layer.in_features,
                    layer.out_features,
                    bias=layer.bias is not None,
                    device="meta",
                )
                linear.weight = nn.Parameter(weight)
                linear.bias = layer.bias
                _replace(model, name, linear)
        return model

    def get_state_dict_and_metadata(self, model: nn.Module) -> tuple[None, dict[str, str]]:
        """The state dict as it is (the stored tensors) and the layout in the header."""
        return None, layout_metadata(model)

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        """LoRA adapters train on top (the quantized weights are frozen buffers)."""
        return True


class QuantizeOnLoad(ConversionOps):
    """The per-tensor step: a target's full-precision ``weight`` in, its codes out (the other
    stored tensors are already in the new layer)."""

    def __init__(self, quantizer: SakuraHfQuantizer) -> None:
        self.hf_quantizer = quantizer

    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs: Any,
    ) -> dict[str, list[torch.Tensor]]:
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise ValueError("QuantizeOnLoad needs the model being loaded")
        out = {}
        for key, value in input_dict.items():
            weight = value[0] if isinstance(value, list) else value
            layer = self.hf_quantizer.quantize_layer(model, key.rpartition(".")[0], weight)
            out[key] = [layer.weight]
        return out
