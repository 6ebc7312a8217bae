"""``load_model``: build a model from a safetensors checkpoint, quantizing while reading.

Each tensor is read on its own (``safetensors.safe_open``): a target ``nn.Linear`` weight is
quantized as soon as it is read and only its codes and scales are kept, so the peak memory
is the quantized model plus the working copies of one tensor, never the full-precision model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sakura.options import check_bool, check_choice, option_error
from sakura_quant.codec import encode
from sakura_quant.linear import QuantizedLinear
from sakura_quant.loftq import check_error_rank, fit_error
from sakura_quant.options import DEFAULT_SKIP, QuantOptions
from sakura_quant.quantize import find_targets

__all__ = ["load_model"]

_OWNER = "load_model"
_NO_QUANT_SPELLINGS = ("none", None, False)
"""``quantize=`` values that load without quantizing."""
_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError as exc:  # pragma: no cover - the hf extra installs it
        raise ImportError(
            "load_model reads safetensors checkpoints: pip install 'sakura-quant[hf]'"
        ) from exc
    return safetensors


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: a file, or a folder's ``*.safetensors`` (in the
    order of its ``model.safetensors.index.json`` when there is one)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise option_error("path", str(path), "a .safetensors file or a folder", owner=_OWNER)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise option_error("path", str(path), "a folder holding *.safetensors files", owner=_OWNER)
    return files


def _hf_skeleton(path: Path, trust_remote_code: bool) -> nn.Module:
    """A transformers causal LM from ``path``'s config, its parameters on the meta device
    (no memory) and its non-persistent buffers (rotary tables) real."""
    try:
        from accelerate import init_empty_weights  # type: ignore[import-untyped]
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - the hf extra installs them
        raise ImportError(
            "load_model without model= builds a transformers model: "
            "pip install 'sakura-quant[hf]' (transformers, accelerate)"
        ) from exc
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model: nn.Module = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, trust_remote_code=trust_remote_code
        )
    return model


class _Reader:
    """Reads single tensors from a set of safetensors files, by key."""

    def __init__(self, files: list[Path], stack: ExitStack) -> None:
        safe_open = _safetensors().safe_open
        self._where: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                self._where[key] = handle

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def read(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self._where[key].get_tensor(key)
        return tensor


def _own_tensors(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, bool]]:
    """(key, module, attribute, is_parameter) for every parameter and persistent buffer."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for attr, value in list(module._parameters.items()):
            if value is not None:
                yield prefix + attr, module, attr, True
        for attr, value in list(module._buffers.items()):
            if value is not None and attr not in module._non_persistent_buffers_set:
                yield prefix + attr, module, attr, False


def load_model(
    path: str | Path,
    quantize: Any = "nf4",
    *,
    model: nn.Module | None = None,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    double_quant: bool = False,
    targets: Any = None,
    skip: Any = DEFAULT_SKIP,
    trust_remote_code: bool = False,
    error_rank: Any = 0,
    error_iters: Any = 1,
    matmul_dtype: Any = None,
) -> nn.Module:
    """Build a frozen model from a safetensors checkpoint, quantizing while it reads.

    Args:
        path: a ``.safetensors`` file, or a folder of them (sharded, with or without
            ``model.safetensors.index.json``; with ``config.json`` when ``model`` is None).
        quantize: ``"nf4"``, ``"int8"``, ``"fp8"``, ``"nvfp4"``, or ``None`` / ``False`` /
            ``"none"`` to load without quantizing.
        model: the module to fill (its parameters may be on the meta device); ``None``
            builds a transformers ``AutoModelForCausalLM`` from ``path/config.json``.
        dtype: ``None`` (as stored), ``torch.float32``, ``torch.bfloat16``, ``torch.float16``:
            the dtype of the tensors kept and the compute dtype of the quantized layers.
        block_size, double_quant, targets, skip: as for :func:`~sakura_quant.quantize_model`.
        trust_remote_code: passed to transformers when ``model`` is None.
        error_rank, error_iters: LoftQ, as for :func:`~sakura_quant.quantize_model`: the
            factors are kept in each quantized layer; start PEFT LoRA adapters at them with
            :func:`~sakura_quant.init_lora_from_error` once they are on the model.
        matmul_dtype: as for :func:`~sakura_quant.quantize_model`.

    The checkpoint is untrusted: a tensor whose shape differs from the model's, a target
    weight holding NaN or ±Inf (named, with the count), or an ``error_rank`` larger than a
    target allows is a ``ValueError``.
    Every parameter comes back frozen (``requires_grad=False``): put LoRA on it with PEFT.
    A key the model has and the checkpoint lacks is an error, unless the model ties it to
    another (``tie_weights()`` runs for transformers models).
    """
    unquantized = any(quantize is v for v in (None, False)) or quantize == "none"
    # Checked once: without quantizing, the format-dependent block_size goes unread (and
    # double_quant need only be a bool), the other options are still held to their rules.
    options = QuantOptions.from_kwargs(
        owner=_OWNER,
        format_option="quantize",
        also_accepted=_NO_QUANT_SPELLINGS,
        format="nf4" if unquantized else quantize,
        block_size=None if unquantized else block_size,
        double_quant=False if unquantized else double_quant,
        targets=targets,
        skip=skip,
        error_rank=error_rank,
        error_iters=error_iters,
        matmul_dtype=matmul_dtype,
    )
    if unquantized:
        check_bool("double_quant", double_quant, owner=_OWNER)
    check_choice("dtype", dtype, _DTYPES, owner=_OWNER)
    check_bool("trust_remote_code", trust_remote_code, owner=_OWNER)
    if model is not None and not isinstance(model, nn.Module):
        raise option_error("model", model, "None or a torch.nn.Module", owner=_OWNER)
    root = Path(path)
    files = checkpoint_files(root)
    if model is None:
        model = _hf_skeleton(root if root.is_dir() else root.parent, trust_remote_code)

    with ExitStack() as stack:
        reader = _Reader(files, stack)
        if not unquantized:
            rank = options.error_rank
            found = find_targets(model, options.targets, options.skip)
            for name, linear in found:  # before anything is read or quantized
                check_error_rank(rank, tuple(linear.weight.shape), name=name, owner=_OWNER)
            for name, linear in found:
                weight_key = f"{name}.weight"
                if weight_key not in reader:
                    continue  # tied or missing: reported below
                weight = _checked(reader.read(weight_key), linear.weight, weight_key, root)
                if dtype is not None:
                    weight = weight.to(dtype)
                factors = None
                if rank:
                    qweight, error_a, error_b = fit_error(
                        weight,
                        options.spec,
                        rank,
                        options.error_iters,
                        name=weight_key,
                        owner=_OWNER,
                    )
                    factors = (error_a, error_b)
                else:
                    qweight = encode(weight, options.spec, name=weight_key)
                del weight
                bias = None
                if linear.bias is not None:
                    bias_key = f"{name}.bias"
                    bias = _cast(
                        _checked(reader.read(bias_key), linear.bias, bias_key, root), dtype
                    )
                layer = QuantizedLinear.from_options(
                    qweight, options, bias=bias, error_factors=factors
                )
                layer.requires_grad_(False)
                parent_name, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
        for key, module, attr, is_param in _own_tensors(model):
            if isinstance(module, QuantizedLinear) or key not in reader:
                continue
            current = module._parameters[attr] if is_param else module._buffers[attr]
            tensor = _cast(_checked(reader.read(key), current, key, root), dtype)
            if is_param:
                module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                module._buffers[attr] = tensor
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    missing = [key for key, m, a, p in _own_tensors(model) if _is_meta(m, a, p)]
    if missing:
        raise KeyError(
            f"load_model: the checkpoint at {root} lacks {missing[:8]}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    model.requires_grad_(False)
    return model


def _checked(
    tensor: torch.Tensor, expected: torch.Tensor | None, key: str, root: Path
) -> torch.Tensor:
    """``tensor`` as read for ``key``, if it has the shape of the model's tensor (a checkpoint
    is untrusted: a wrong shape is an error here, not a wrong model later) and, where the
    model's is floating point, a floating dtype too."""
    if expected is None:
        return tensor
    if tuple(tensor.shape) != tuple(expected.shape) or (
        expected.is_floating_point() and not tensor.is_floating_point()
    ):
        raise ValueError(
            f"load_model: the checkpoint at {root} stores {key} as {tuple(tensor.shape)} "
            f"{tensor.dtype}; the model's {key} is {tuple(expected.shape)} {expected.dtype}"
        )
    return tensor


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


def _is_meta(module: nn.Module, attr: str, is_param: bool) -> bool:
    value = module._parameters[attr] if is_param else module._buffers[attr]
    return value is not None and value.is_meta
