"""``quantize_model``: replace a model's frozen ``nn.Linear`` layers by ``QuantizedLinear``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sakura.marks import WEIGHTS_STREAMED, get_mark, has_mark
from sakura.options import check_bool, option_error
from sakura_quant.codec import dequantize_weight, encode
from sakura_quant.formats import QuantizedWeight
from sakura_quant.formats.checks import check_finite
from sakura_quant.fsdp import install_wrap_check
from sakura_quant.linear import QuantizedLinear
from sakura_quant.loftq import check_error_rank, fit_error, init_lora_from_error
from sakura_quant.options import DEFAULT_SKIP, QuantOptions, WeightSpec

__all__ = ["DEFAULT_SKIP", "quantize_model", "quantize_with_options"]

_OWNER = "quantize_model"


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return name in skip or name.rsplit(".", 1)[-1] in skip


def _adapter_names(modules: dict[str, nn.Module]) -> list[str]:
    """Prefixes of the adapter modules inside adapter-wrapped layers (PEFT's ``lora.Linear``
    and its kin hold the original layer as ``base_layer`` beside their trainable ``lora_A`` /
    ``lora_B``): those adapters must never be quantized, only the base layer."""
    prefixes: list[str] = []
    for name, module in modules.items():
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Module):
            prefix = f"{name}." if name else ""
            prefixes.extend(
                f"{prefix}{child}" for child, _ in module.named_children() if child != "base_layer"
            )
    return prefixes


def _in_adapter(name: str, adapters: list[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in adapters)


def find_targets(
    model: nn.Module, targets: tuple[str, ...] | None, skip: tuple[str, ...]
) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules to quantize, by name; errors for a name that is missing, not
    a Linear, or already quantized."""
    modules = dict(model.named_modules())
    adapters = _adapter_names(modules)
    given: list[tuple[str, str, nn.Module]] = []  # (what the caller wrote, name, module)
    if targets is None:
        given = [
            (name, name, m)
            for name, m in modules.items()
            if isinstance(m, nn.Linear)
            and name
            and not _skipped(name, skip)
            and not _in_adapter(name, adapters)
        ]
    else:
        for wanted in targets:
            matches = [
                (wanted, name, m)
                for name, m in modules.items()
                if (name == wanted or name.endswith("." + wanted))
                and not _in_adapter(name, adapters)
            ]
            if not matches:
                raise option_error(
                    "targets",
                    wanted,
                    "names (or name suffixes) of the model's modules",
                    owner=_OWNER,
                )
            given.extend(matches)
    found: dict[str, nn.Linear] = {}
    for wanted, name, module in given:
        if isinstance(module, QuantizedLinear):
            raise option_error(
                "targets",
                wanted,
                f"modules not quantized yet ({name} is already a QuantizedLinear, "
                f"format {module.format!r}); quantizing twice is not supported",
                owner=_OWNER,
            )
        if not isinstance(module, nn.Linear):
            raise option_error(
                "targets",
                wanted,
                f"names of torch.nn.Linear modules ({name} is a {type(module).__name__})",
                owner=_OWNER,
            )
        found[name] = module
    return list(found.items())


def quantize_model(
    model: nn.Module,
    quantize: str = "nf4",
    *,
    block_size: int | None = None,
    double_quant: bool = False,
    targets: Any = None,
    skip: Any = DEFAULT_SKIP,
    freeze: bool = False,
    keep_precise: Any = 0,
    error_rank: Any = 0,
    error_iters: Any = 1,
    matmul_dtype: Any = None,
) -> dict[str, int]:
    """Quantize the weights of ``model``'s ``nn.Linear`` layers in place, one at a time.

    Each target becomes a :class:`~sakura_quant.QuantizedLinear` (its bias kept); a target
    weight holding NaN or ±Inf is a ``ValueError`` naming it and the count, raised before
    any layer changes (no format can store them). Returns
    ``{"tensors": count, "kept_precise": count, "bytes_before": ..., "bytes_after": ...,
    "lora_initialized": count}`` (weight bytes only, LoftQ factors not counted).

    Args:
        quantize: the format: ``"nf4"``, ``"int8"``, ``"fp8"`` or ``"nvfp4"`` (the
            reference's spelling, as for :func:`~sakura_quant.load_model`).
        block_size: values per scale; ``None`` is the format's default (64 for int8 / nf4;
            fp8 and nvfp4 have fixed blocks of 32 / 16); int8 / nf4 take any even int >= 2.
        double_quant: store int8 / nf4 block scales in one byte each.
        targets: ``None`` (every ``nn.Linear`` not in ``skip``) or module names / name
            suffixes, each of which must name an ``nn.Linear``.
        skip: module names (or last name components) left alone when ``targets`` is None;
            default ``("lm_head",)``.
        freeze: the quantized weights are frozen; with ``False`` (default) a target weight
            that still requires grad is an error, with ``True`` it is frozen silently.
        keep_precise: with ``"nf4"`` / ``"nvfp4"``: the weights that lose the most (relative
            error of each, measured one by one) are stored one step more precise (int8 /
            fp8), most-hurt first, as long as the extra bytes stay within this fraction of
            the quantized weights' bytes. ``0`` / ``False`` / ``None``: off; ``"auto"`` /
            ``True``: 0.05; a fraction up to 0.5. While it measures, the original weights
            and their quantized forms are in memory together.
        error_rank: LoftQ (0: off): each weight is stored as ``Q(W - B A)`` with ``B A`` a
            rank-``error_rank`` fit of what quantizing lost, the factors kept in the layer
            (use the LoRA rank), at most ``min(out, in)`` of every target (a larger rank is
            an error naming the layer). PEFT LoRA adapters then start at them with
            :func:`~sakura_quant.init_lora_from_error`; adapters already on the model when
            it is quantized are started here (counted in ``"lora_initialized"``).
        error_iters: LoftQ rounds (>= 1): alternate quantizing ``W - B A`` and fitting
            ``B A`` to what that lost.
        matmul_dtype: the dtype the quantized layers expand their weight to and multiply
            in (bitsandbytes' ``compute_dtype``): ``None`` (default) the input's dtype;
            ``"bf16"`` / ``"fp32"`` / ``"fp16"`` (or the torch dtype). ``"bf16"`` under an
            fp32 model runs the frozen matmuls in bf16 (about 2x on CPUs with AVX512-BF16).
    """
    options = QuantOptions.from_kwargs(
        owner=_OWNER,
        format_option="quantize",
        format=quantize,
        block_size=block_size,
        double_quant=double_quant,
        targets=targets,
        skip=skip,
        keep_precise=keep_precise,
        error_rank=error_rank,
        error_iters=error_iters,
        matmul_dtype=matmul_dtype,
    )
    return quantize_with_options(model, options, freeze=check_bool("freeze", freeze, owner=_OWNER))


def quantize_with_options(
    model: nn.Module, options: QuantOptions, *, freeze: bool
) -> dict[str, int]:
    """:func:`quantize_model` with its options already checked (the ``quant`` service calls
    this with the options it checked when it was built); returns the same counts.  What
    depends on the model (the targets, the frozen weights, ``error_rank`` against each
    layer's shape, non-finite weights) is checked here, before any layer changes."""
    if not isinstance(model, nn.Module):
        raise option_error("model", model, "a torch.nn.Module", owner=_OWNER)
    rank = options.error_rank
    found = find_targets(model, options.targets, options.skip)
    for name, module in found:  # before any layer changes: the model stays as it was
        _check_not_streamed(model, name)
        _check_not_sharded(module, name)
        check_error_rank(rank, tuple(module.weight.shape), name=name, owner=_OWNER)
        check_finite(module.weight, name=f"{name}.weight")
    if not freeze:
        for name, module in found:
            if module.weight.requires_grad:
                raise option_error(
                    "freeze",
                    freeze,
                    f"True, or a frozen base ({name}.weight requires grad; quantized weights "
                    "cannot train: call model.requires_grad_(False) first or pass freeze=True)",
                    owner=_OWNER,
                )
    chosen = (
        _choose_precise(found, options.spec, options.keep_precise) if options.keep_precise else {}
    )
    stats = {"tensors": 0, "kept_precise": 0, "bytes_before": 0, "bytes_after": 0}
    for name, module in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight = module.weight
        qweight = chosen.get(name)
        spec = options.spec if qweight is None else weight_spec(qweight)
        quantized = build_layer(
            weight.detach(), spec, options, qweight=qweight, name=name, owner=_OWNER
        )
        quantized.bias = module.bias
        setattr(parent, attr, quantized)
        stats["tensors"] += 1
        stats["kept_precise"] += name in chosen
        stats["bytes_before"] += weight.numel() * weight.element_size()
        stats["bytes_after"] += quantized.quantized_nbytes
    stats["lora_initialized"] = init_lora_from_error(model) if rank else 0
    # A later fully_shard without sakura_quant.fsdp.shardable is refused on the first forward.
    install_wrap_check(model)
    return stats


def _check_not_sharded(module: nn.Linear, name: str) -> None:
    """Refuse a weight that FSDP2's ``fully_shard`` already sharded (a DTensor): each rank
    holds a slice, and quantizing slices would give every rank a different layer."""
    from torch.distributed.tensor import DTensor

    if isinstance(module.weight, DTensor):
        raise ValueError(
            f"{_OWNER}: {name}.weight is sharded by fully_shard (a DTensor); quantize the "
            "model before fully_shard, then call sakura_quant.fsdp.shardable(model) so that "
            "FSDP2 shards the quantized base"
        )


def _check_not_streamed(model: nn.Module, name: str) -> None:
    """Refuse to replace a layer inside a block whose weights are streamed (the
    :data:`sakura.marks.WEIGHTS_STREAMED` mark, e.g. sakura-offload's ``WeightPaging``):
    the streamer holds the old weights and would not stream the new codes."""
    parts = name.split(".")
    for depth in range(len(parts)):
        prefix = ".".join(parts[:depth])
        holder = model.get_submodule(prefix) if prefix else model
        if has_mark(holder, WEIGHTS_STREAMED):
            raise ValueError(
                f"{_OWNER}: {name} is in {prefix or 'the model'}, whose weights are "
                f"streamed by {get_mark(holder, WEIGHTS_STREAMED)!r} (its "
                "sakura.marks.WEIGHTS_STREAMED mark): quantize the base before streaming it "
                "(WeightPaging after quantize_model or the quant service), or remove the "
                "streaming first"
            )


def build_layer(
    weight: torch.Tensor,
    spec: WeightSpec,
    options: QuantOptions,
    *,
    qweight: QuantizedWeight | None = None,
    name: str = "weight",
    owner: str = _OWNER,
) -> QuantizedLinear:
    """A bias-less :class:`QuantizedLinear` storing ``weight`` as ``spec`` says, with
    ``options``' LoftQ rank / rounds and ``matmul_dtype`` (all checked already): with a LoftQ
    fit when ``error_rank`` is set (a plain ``qweight`` made earlier is then replaced), else
    ``qweight`` when given (it must be ``weight`` quantized so), else quantized now.
    ``name`` (the layer's) and ``owner`` are what errors cite."""
    factors = None
    if options.error_rank:
        qweight, error_a, error_b = fit_error(
            weight, spec, options.error_rank, options.error_iters, name=name, owner=owner
        )
        factors = (error_a, error_b)
    elif qweight is None:
        qweight = encode(weight, spec, name=name)
    return QuantizedLinear.from_options(qweight, options, error_factors=factors)


def select_precise(
    measured: list[tuple[float, str, int]],
    share: float,
    precise: Callable[[str], QuantizedWeight],
) -> dict[str, QuantizedWeight]:
    """The weights ``keep_precise`` stores more precisely, by name.

    ``measured`` holds ``(relative error, name, bytes in the format)`` in model order;
    ``precise(name)`` is that weight in the more precise format. Most-hurt first, a weight is
    taken while its extra bytes fit in ``share`` of the bytes of all of them; only the
    taken ones are kept."""
    budget = 0.0
    for _, _, base_bytes in measured:
        budget += share * base_bytes
    chosen: dict[str, QuantizedWeight] = {}
    spent = 0.0
    for _, name, base_bytes in sorted(measured, key=lambda m: -m[0]):
        better = precise(name)
        extra = better.nbytes - base_bytes
        if spent + extra > budget:
            continue
        spent += extra
        chosen[name] = better
    return chosen


def weight_spec(qweight: QuantizedWeight) -> WeightSpec:
    """The spec a weight was quantized with."""
    return WeightSpec(qweight.format, qweight.block_size, "scales_offset" in qweight.tensors)


def relative_error(weight: torch.Tensor, qweight: QuantizedWeight) -> float:
    w = weight.detach().float()
    err = (dequantize_weight(qweight, torch.float32) - w).norm() / w.norm().clamp(min=1e-30)
    return float(err)


def _choose_precise(
    found: list[tuple[str, nn.Linear]], spec: WeightSpec, share: float
) -> dict[str, QuantizedWeight]:
    """The weights ``keep_precise`` stores in the more precise format, quantized so."""
    precise_spec = spec.precise()
    modules = dict(found)
    measured = []
    for name, module in found:
        base = encode(module.weight.detach(), spec, name=name)
        measured.append((relative_error(module.weight, base), name, base.nbytes))

    def precise(name: str) -> QuantizedWeight:
        return encode(modules[name].weight.detach(), precise_spec, name=name)

    return select_precise(measured, share, precise)
