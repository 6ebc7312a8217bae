"""``load_model``: build a model from a safetensors checkpoint, quantizing while reading.

Each tensor is read on its own (``safetensors.safe_open``): a target ``nn.Linear`` weight is
quantized as soon as it is read and only its codes and scales are kept, so the peak memory
is the quantized model plus the working copies of one tensor, never the full-precision model.
Where the model and its tensors come from (a path, a cached model name, config overrides,
random weights) is :mod:`sakura_quant.load.source`; ``quantize="auto"``'s sizes and choice
are :mod:`sakura_quant.load.budget`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sakura.errors import nearest
from sakura.options import check_bool, check_choice, check_int, check_number, option_error
from sakura_quant.codec import encode
from sakura_quant.formats import QuantizedWeight
from sakura_quant.linear import QuantizedLinear
from sakura_quant.load.budget import (
    LoadChoice,
    available_ram,
    choose,
    quantized_nbytes,
    release_freed_heap,
)
from sakura_quant.load.source import RandomWeights, build_skeleton, resolve
from sakura_quant.loftq import check_error_rank
from sakura_quant.options import DEFAULT_SKIP, QuantOptions, WeightSpec
from sakura_quant.quantize import build_layer, find_targets, relative_error, select_precise

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


_SAFETENSORS_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4}
"""Bytes per element of safetensors dtype names (the others are 2 or 1: see ``_stored_size``)."""


class _Checkpoint:
    """Reads single tensors from a set of safetensors files, by key."""

    def __init__(self, files: list[Path], stack: ExitStack, root: Path) -> None:
        safe_open = _safetensors().safe_open
        self.root = root
        self._where: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                self._where[key] = handle

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def read(self, key: str, expected: torch.Tensor | None) -> torch.Tensor:
        """The tensor stored as ``key``, checked against the model's (``_checked``)."""
        tensor: torch.Tensor = self._where[key].get_tensor(key)
        return _checked(tensor, expected, key, self.root)

    def element_size(self, key: str, expected: torch.Tensor) -> int:
        """Bytes per element of ``key`` as stored (read from the file's header only); the
        model's own for a key the checkpoint lacks."""
        if key not in self._where:
            return expected.element_size()
        name = str(self._where[key].get_slice(key).get_dtype())
        if name in _SAFETENSORS_SIZES:
            return _SAFETENSORS_SIZES[name]
        return 2 if name in ("F16", "BF16", "I16", "U16") else 1

    def weight(
        self, name: str, linear: nn.Linear, *, bias: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A target ``nn.Linear``'s weight and (with ``bias``) bias as stored; ``(None,
        None)`` when the checkpoint lacks the weight (tied, or reported missing later)."""
        key = f"{name}.weight"
        if key not in self:
            return None, None
        weight = self.read(key, linear.weight)
        stored_bias = None
        if bias and linear.bias is not None:
            stored_bias = self.read(f"{name}.bias", linear.bias)
        return weight, stored_bias

    def fill(
        self,
        model: nn.Module,
        dtype: torch.dtype | None,
        offload: Callable[[str, torch.Tensor], torch.Tensor] | None,
    ) -> None:
        """Every parameter and persistent buffer the checkpoint has, quantized layers
        excepted, read into ``model`` (cast to ``dtype``, then through ``offload``)."""
        for key, module, attr, is_param in _own_tensors(model):
            if isinstance(module, QuantizedLinear) or key not in self:
                continue
            current = module._parameters[attr] if is_param else module._buffers[attr]
            tensor = _cast(self.read(key, current), dtype)
            if offload is not None:
                tensor = offload(key, tensor)
            if is_param:
                module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                module._buffers[attr] = tensor


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


_LOAD_OPTIONS = (
    "quantize",
    "model",
    "dtype",
    "block_size",
    "double_quant",
    "targets",
    "skip",
    "trust_remote_code",
    "keep_precise",
    "error_rank",
    "error_iters",
    "matmul_dtype",
    "random_weights",
    "disk_offload",
    "ram_fraction",
    "host_budget",
)
"""load_model's own options: what an unknown keyword (a config override) is compared with."""


def load_model(
    name_or_path: str | os.PathLike[str],
    quantize: Any = "nf4",
    *,
    model: nn.Module | None = None,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    double_quant: bool = False,
    targets: Any = None,
    skip: Any = DEFAULT_SKIP,
    trust_remote_code: bool = False,
    keep_precise: Any = 0,
    error_rank: Any = 0,
    error_iters: Any = 1,
    matmul_dtype: Any = None,
    random_weights: bool = False,
    disk_offload: str | os.PathLike[str] | None = None,
    ram_fraction: float = 0.85,
    host_budget: int | None = None,
    **config_overrides: Any,
) -> nn.Module:
    """Build a frozen model from a safetensors checkpoint, quantizing while it reads.

    Args:
        name_or_path: a ``.safetensors`` file, or a folder of them (sharded, with or without
            ``model.safetensors.index.json``; with ``config.json`` when ``model`` is None),
            or a Hugging Face model name (``"org/name"``) found in the local cache
            (``HF_HUB_CACHE``; never downloaded).
        quantize: ``"nf4"``, ``"int8"``, ``"fp8"``, ``"nvfp4"``, ``None`` / ``False`` /
            ``"none"`` to load without quantizing, or ``"auto"``: unquantized if that fits
            the host-RAM budget, else int8 if that does, else nf4 (an error naming the
            smallest budget that would work when even nf4 does not fit).
        model: the module to fill (its parameters may be on the meta device); ``None``
            builds a transformers ``AutoModelForCausalLM`` from ``config.json``.
        dtype: ``None`` (as stored), ``torch.float32``, ``torch.bfloat16``, ``torch.float16``:
            the dtype of the tensors kept and the compute dtype of the quantized layers.
        block_size, double_quant, targets, skip, keep_precise, error_rank, error_iters,
            matmul_dtype: as for :func:`~sakura_quant.quantize_model`, with the same
            results on the same weights (``keep_precise`` measures every target in a first
            pass over the checkpoint and reads the chosen ones again; LoftQ factors are kept
            in each quantized layer: start PEFT adapters at them with
            :func:`~sakura_quant.init_lora_from_error`).  With ``quantize="auto"``,
            ``keep_precise`` applies when nf4 is chosen.
        trust_remote_code: passed to transformers when ``model`` is None.
        random_weights: build the shapes without reading a checkpoint: each module is
            initialised by the model's own initialisation under a seed drawn from torch's
            generator (deterministic under ``torch.manual_seed``), then quantized as if read.
        disk_offload: ``None`` or a directory: the decoder layers' matrices that are not
            quantized are written to memory-mapped files in a private folder there as they
            are read (:class:`sakura_torch.disk.TensorFileStore`, kept as
            ``model.sakura_disk_offload``), so a base larger than RAM loads: their pages
            are the page cache's, read again from the disk when RAM runs short.  The folder
            goes when the store is closed or collected, at exit, and when the load fails; a
            folder that cannot be made or written is an error naming ``disk_offload``.
        ram_fraction: with ``quantize="auto"`` and no ``host_budget``: the budget is this
            fraction of the RAM available now (default 0.85).
        host_budget: with ``quantize="auto"``: the budget in bytes.
        config_overrides: fields of ``config.json`` replaced before the model is built
            (``num_hidden_layers=2``); an unknown one is an error naming the nearest field.

    The checkpoint is untrusted: a tensor whose shape differs from the model's, a target
    weight holding NaN or ±Inf (named, with the count), or an ``error_rank`` larger than a
    target allows is a ``ValueError``.
    Every parameter comes back frozen (``requires_grad=False``): put LoRA on it with PEFT.
    A key the model has and the checkpoint lacks is an error, unless the model ties it to
    another (``tie_weights()`` runs for transformers models).  What was chosen is recorded
    as ``model.sakura_quant_load`` (a :class:`~sakura_quant.load.budget.LoadChoice`).
    """
    auto = isinstance(quantize, str) and quantize == "auto"
    unquantized = any(quantize is v for v in (None, False)) or quantize == "none"
    # Checked once: without quantizing, the format-dependent block_size goes unread (and
    # double_quant need only be a bool), the other options are still held to their rules.
    # "auto" is checked as nf4, whose rules int8's equal but for keep_precise (nf4 only).
    options = QuantOptions.from_kwargs(
        owner=_OWNER,
        format_option="quantize",
        also_accepted=("auto", *_NO_QUANT_SPELLINGS),
        format="nf4" if unquantized or auto else quantize,
        block_size=None if unquantized else block_size,
        double_quant=False if unquantized else double_quant,
        targets=targets,
        skip=skip,
        keep_precise=0 if unquantized else keep_precise,
        error_rank=error_rank,
        error_iters=error_iters,
        matmul_dtype=matmul_dtype,
    )
    if unquantized:
        check_bool("double_quant", double_quant, owner=_OWNER)
        QuantOptions.from_kwargs(owner=_OWNER, keep_precise=keep_precise)
    check_choice("dtype", dtype, _DTYPES, owner=_OWNER)
    check_bool("trust_remote_code", trust_remote_code, owner=_OWNER)
    random = check_bool("random_weights", random_weights, owner=_OWNER)
    fraction = check_number(
        "ram_fraction", ram_fraction, minimum=0.0, maximum=1.0, min_inclusive=False, owner=_OWNER
    )
    if host_budget is not None:
        check_int("host_budget", host_budget, minimum=0, owner=_OWNER)
    if disk_offload is not None and not isinstance(disk_offload, (str, os.PathLike)):
        raise option_error("disk_offload", disk_offload, "None or a directory", owner=_OWNER)
    if model is not None and not isinstance(model, nn.Module):
        raise option_error("model", model, "None or a torch.nn.Module", owner=_OWNER)
    if model is not None and config_overrides:
        key = sorted(config_overrides)[0]
        close = nearest(key, _LOAD_OPTIONS)
        raise option_error(
            key,
            config_overrides[key],
            "no config overrides with model= (they change the config load_model builds the "
            "model from)" + (f"; did you mean {close!r}?" if close else ""),
            owner=_OWNER,
        )
    root = resolve(name_or_path)
    files = [] if random else checkpoint_files(root)
    if model is None:
        folder = root if root.is_dir() else root.parent
        model = build_skeleton(folder, trust_remote_code, config_overrides, _LOAD_OPTIONS)

    budget = None
    if auto:  # measured once, before anything is read
        budget = int(fraction * available_ram()) if host_budget is None else host_budget
    store, offload = (None, None) if disk_offload is None else _disk_tier(disk_offload, model)
    try:
        choice = _fill(model, random, files, root, unquantized, budget, options, dtype, offload)
        _finish(model, root, choice)
    except BaseException:
        if store is not None:
            store.close()  # the folder and every file in it go: nothing half-written is used
        raise
    # The store lives as long as the model (its folder goes at close(), garbage collection
    # or exit); a plain attribute, not a submodule.
    model.__dict__["sakura_disk_offload"] = store
    return model


def _disk_tier(
    directory: str | os.PathLike[str], model: nn.Module
) -> tuple[Any, Callable[[str, torch.Tensor], torch.Tensor]]:
    """``disk_offload``: a :class:`sakura_torch.disk.TensorFileStore` in ``directory`` and
    the function that writes a tensor there as it is read (returning it mapped back from its
    file) when it is a matrix of a decoder layer (``sakura_torch.blocks.find_blocks``), and
    returns any other tensor as it is."""
    from sakura_torch.blocks import find_blocks
    from sakura_torch.disk import TensorFileStore

    prefixes = tuple(f"{name}." for name, _ in find_blocks(model, owner=_OWNER))
    store = TensorFileStore(directory, option="disk_offload", owner=_OWNER, prefix="sakura-load-")

    def offload(key: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() >= 2 and tensor.is_floating_point() and key.startswith(prefixes):
            mapped: torch.Tensor = store.put(key, tensor)
            del tensor
            release_freed_heap()  # the copy read (or cast) is gone: its pages too
            return mapped
        return tensor

    return store, offload


def _fill(
    model: nn.Module,
    random: bool,
    files: list[Path],
    root: Path,
    unquantized: bool,
    budget: int | None,
    options: QuantOptions,
    dtype: torch.dtype | None,
    offload: Callable[[str, torch.Tensor], torch.Tensor] | None,
) -> LoadChoice:
    """The load itself: with a ``budget`` (``quantize="auto"``) the format chosen first,
    then the targets quantized as read, then every other tensor read (or initialised), each
    passed through ``offload`` (``disk_offload``) when there is one."""
    with ExitStack() as stack:
        source: RandomWeights | _Checkpoint = (
            RandomWeights(model) if random else _Checkpoint(files, stack, root)
        )
        found = [] if unquantized else find_targets(model, options.targets, options.skip)
        for name, linear in found:  # before anything is read or quantized
            check_error_rank(
                options.error_rank, tuple(linear.weight.shape), name=name, owner=_OWNER
            )
        choice = LoadChoice("none" if unquantized else options.format, None, {})
        if budget is not None:
            choice = choose(_sizes(model, found, source, dtype, options), budget)
            if choice.quantize == "none":
                found = []
            elif choice.quantize == "int8":
                spec = WeightSpec("int8", options.block_size, options.double_quant)
                options = replace(options, spec=spec, keep_precise=0.0)
        precise = _precise_names(found, source, dtype, options) if options.keep_precise else set()
        for name, linear in found:
            weight, bias = source.weight(name, linear)
            if weight is None:
                continue  # tied or missing: reported below
            spec = options.spec.precise() if name in precise else options.spec
            layer = build_layer(
                _cast(weight, dtype), spec, options, name=f"{name}.weight", owner=_OWNER
            )
            del weight
            release_freed_heap()
            if bias is not None:
                layer.bias = nn.Parameter(_cast(bias, dtype), requires_grad=False)
            layer.requires_grad_(False)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
        source.fill(model, dtype, offload)
    return choice


def _finish(model: nn.Module, root: Path, choice: LoadChoice) -> None:
    """Ties, the check that nothing is left on the meta device, frozen, the choice kept."""
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
    model.__dict__["sakura_quant_load"] = choice  # a plain attribute, not a submodule


def _precise_names(
    found: list[tuple[str, nn.Linear]],
    source: RandomWeights | _Checkpoint,
    dtype: torch.dtype | None,
    options: QuantOptions,
) -> set[str]:
    """``keep_precise``'s choice, streamed: each target read, quantized in both formats and
    measured, then dropped (only the sizes of its precise form are kept, as meta tensors);
    :func:`~sakura_quant.quantize.select_precise` then chooses as ``quantize_model`` does
    on the same weights.  The chosen ones are read again by the load pass."""
    spec, better = options.spec, options.spec.precise()
    measured: list[tuple[float, str, int]] = []
    shells: dict[str, QuantizedWeight] = {}
    for name, linear in found:
        weight, _ = source.weight(name, linear, bias=False)
        if weight is None:
            continue
        weight = _cast(weight, dtype)
        key = f"{name}.weight"
        base = encode(weight, spec, name=key)
        measured.append((relative_error(weight, base), name, base.nbytes))
        stored = encode(weight, better, name=key)
        shells[name] = replace(
            stored,
            tensors={k: torch.empty_like(t, device="meta") for k, t in stored.tensors.items()},
        )
        del weight, base, stored
        release_freed_heap()
    return set(select_precise(measured, options.keep_precise, shells.__getitem__))


def _sizes(
    model: nn.Module,
    found: list[tuple[str, nn.Linear]],
    source: RandomWeights | _Checkpoint,
    dtype: torch.dtype | None,
    options: QuantOptions,
) -> dict[str, int]:
    """Estimated bytes of the loaded model unquantized, in int8 and in nf4 (every tensor
    counted once, in ``dtype`` or as stored; LoftQ factors in fp32; ``keep_precise`` as its
    whole share)."""
    targets = {f"{name}.weight" for name, _ in found}
    seen: set[int] = set()
    total = target_bytes = 0
    for key, module, attr, is_param in _own_tensors(model):
        tensor = module._parameters[attr] if is_param else module._buffers[attr]
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        size = _element_size(dtype) if dtype and tensor.is_floating_point() else None
        nbytes = tensor.numel() * (size or source.element_size(key, tensor))
        total += nbytes
        target_bytes += nbytes if key in targets else 0
    factors = options.error_rank * sum(4 * (lin.in_features + lin.out_features) for _, lin in found)
    sizes = {"none": total}
    for fmt in ("int8", "nf4"):
        spec = WeightSpec(fmt, options.block_size, options.double_quant)
        stored = sum(quantized_nbytes(lin.weight.numel(), spec) for _, lin in found)
        if fmt == "nf4":
            stored += int(options.keep_precise * stored)
        sizes[fmt] = total - target_bytes + stored + factors
    return sizes


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
