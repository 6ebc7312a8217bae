"""``patch_model``: swap the fused block kernels into a Hugging Face Llama-family model
(Llama, Mistral, Qwen2, SmolLM2, ...) where, and only where, they agree with its own code.

Three seams, found by what the modules are and checked by what they compute:

* ``rms_norm``: every module whose class name ends in ``RMSNorm`` with a 1-D ``weight`` and
  a ``variance_epsilon`` (or ``eps``); its ``forward`` becomes :func:`fused_rms_norm`.
* ``glu``: every MLP with ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn`` where
  ``act_fn`` computes silu or gelu-tanh; ``act_fn(gate_proj(x)) * up_proj(x)`` becomes
  :func:`fused_glu` (the projections themselves are untouched: a LoRA or quantized layer
  stays what it is).
* ``rotary``: every attention module whose class's ``forward`` calls a module-level
  ``apply_rotary_pos_emb`` (transformers' modeling files).  That function is a module
  global, so it is replaced once per modeling file by a dispatcher that runs the fused
  kernel only inside the ``forward`` of a patched attention module (a context variable
  says which), with ``unsqueeze_dim=1`` and ``cos``/``sin`` needing no gradient; every
  other call runs the original.

Each candidate is checked on the spot: a small random input in the module's dtype and
device goes through the module's own forward and through the fused path, and the module is
patched only when they agree within :data:`TOLERANCE` (relative to the largest output
value).  Anything else is left alone and listed in :class:`PatchReport` with why.
:func:`unpatch_model` restores the original methods and globals exactly.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sakura.options import option_error
from sakura_kernels.blocks.functions import fused_glu, fused_rms_norm, fused_rotary

__all__ = ["KERNELS", "TOLERANCE", "PatchReport", "patch_model", "unpatch_model"]

KERNELS = ("rms_norm", "rotary", "glu")
"""The kernels :func:`patch_model` knows."""

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
"""How far the fused output may be from the module's own, relative to the largest value of
the module's output, on the check input (the fused kernels round once where PyTorch rounds
at every step, so low precision differs by a rounding or two)."""

_OWNER = "patch_model"
_IN_PATCHED_ATTENTION: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "sakura_kernels_in_patched_attention", default=False
)


@dataclasses.dataclass
class PatchReport:
    """What :func:`patch_model` did: ``patched`` ``(module name, kernel)`` pairs and
    ``skipped`` ``(module name, why)`` pairs."""

    patched: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def count(self, kernel: str) -> int:
        """How many modules got ``kernel``."""
        return sum(1 for _, k in self.patched if k == kernel)

    def __str__(self) -> str:
        lines = [f"patched {len(self.patched)} module(s), skipped {len(self.skipped)}"]
        lines += [f"  {name}: {kernel}" for name, kernel in self.patched]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


# model -> undo actions (last first); module -> kernels it has.
_UNDO: weakref.WeakKeyDictionary[nn.Module, list[Callable[[], None]]] = weakref.WeakKeyDictionary()
_PATCHED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
# id(modeling globals) -> [globals, original function, number of patched attention modules]
_ROTARY_GLOBALS: dict[int, list[Any]] = {}


def _error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.detach().float().abs().max().item()
    return float((ours.detach().float() - ref.detach().float()).abs().max().item()) / max(
        scale, 1e-30
    )


def _agrees(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return False, f"output {tuple(ours.shape)} {ours.dtype} against the module's " + (
            f"{tuple(ref.shape)} {ref.dtype}"
        )
    tolerance = TOLERANCE.get(dtype, 1e-4)
    error = _error(ours, ref)
    if not error <= tolerance:
        return False, (
            f"its own forward disagrees with the fused kernel on a check input (relative "
            f"error {error:.3g} > {tolerance:g} for {dtype})"
        )
    return True, ""


def _probe(shape: tuple[int, ...], like: torch.Tensor, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device=like.device, dtype=like.dtype)


def _set_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.__dict__["forward"] = forward

    def undo() -> None:
        if had:
            module.__dict__["forward"] = previous
        else:
            module.__dict__.pop("forward", None)

    return undo


# --- RMSNorm -------------------------------------------------------------------------------


def _rms_norm(name: str, module: nn.Module) -> tuple[Callable[[], None] | None, str]:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None, "no 1-D weight"
    if not isinstance(eps, float):
        return None, "no float variance_epsilon / eps"
    x = _probe((2, 3, weight.shape[0]), weight)
    with torch.no_grad():
        ok, why = _agrees(fused_rms_norm(x, weight, eps), module(x), weight.dtype)
    if not ok:
        return None, why
    ref = weakref.ref(module)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        owner = ref()
        if owner is None:
            raise RuntimeError("the patched RMSNorm module is gone")
        return fused_rms_norm(hidden_states, owner.weight, eps)  # type: ignore[arg-type]

    return _set_forward(module, forward), ""


# --- gated MLP -----------------------------------------------------------------------------


def _activation(act_fn: Any) -> str | None:
    x = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act_fn(x)
    except Exception:  # an activation that cannot take this input is not ours to replace
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    if torch.allclose(y, nn.functional.silu(x), rtol=1e-6, atol=1e-9):
        return "silu"
    if torch.allclose(y, nn.functional.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-9):
        return "gelu_tanh"
    return None


def _glu(name: str, module: nn.Module) -> tuple[Callable[[], None] | None, str]:
    gate: Any = module.gate_proj
    activation = _activation(module.act_fn)
    if activation is None:
        return None, f"act_fn {type(module.act_fn).__name__} is neither silu nor gelu-tanh"
    tensors = [*gate.parameters(), *gate.buffers()]
    weight = next((t for t in tensors if t.is_floating_point()), None)
    in_features = getattr(gate, "in_features", None)
    if weight is None or not isinstance(in_features, int):
        return None, "gate_proj has no floating-point tensor or in_features"
    # A quantized layer (sakura-quant's QuantizedLinear) computes in its compute_dtype.
    dtype = getattr(gate, "compute_dtype", None)
    like = weight.to(dtype) if isinstance(dtype, torch.dtype) else weight
    x = _probe((2, 3, in_features), like)
    ref = weakref.ref(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        owner: Any = ref()
        if owner is None:
            raise RuntimeError("the patched MLP module is gone")
        hidden = fused_glu(owner.gate_proj(x), owner.up_proj(x), activation)
        out: torch.Tensor = owner.down_proj(hidden)
        return out

    with torch.no_grad():
        try:
            ok, why = _agrees(forward(x), module(x), x.dtype)
        except Exception as exc:  # the check input does not fit: leave the module alone
            return None, f"the check failed: {type(exc).__name__}: {exc}"
    if not ok:
        return None, why
    return _set_forward(module, forward), ""


# --- rotary embedding ----------------------------------------------------------------------


def _dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if (
            _IN_PATCHED_ATTENTION.get()
            and unsqueeze_dim == 1
            and len(args) <= 1
            and set(kwargs) <= {"unsqueeze_dim"}
            and q.dim() == 4
            and k.dim() == 4
            and cos.dim() == 3
            and cos.shape == sin.shape
            and cos.shape[-1] == q.shape[-1] == k.shape[-1]
            and not (cos.requires_grad or sin.requires_grad)
        ):
            return fused_rotary(q, cos, sin), fused_rotary(k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._sakura_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _rotary_probes(module: nn.Module) -> list[torch.Tensor]:
    """Tensors whose dtype and device the rotary check probes in: the attention's first
    floating-point parameter; when it has none (every projection quantized, no adapter:
    the activations' dtype is decided outside it), fp32 and bf16 both on its device."""
    tensors = [*module.parameters(), *module.buffers()]
    weight = next((t for t in module.parameters() if t.is_floating_point()), None)
    if weight is not None:
        return [weight]
    device = tensors[0].device if tensors else torch.device("cpu")
    return [torch.empty(1, device=device, dtype=d) for d in (torch.float32, torch.bfloat16)]


def _rotary(name: str, module: nn.Module) -> tuple[Callable[[], None] | None, str]:
    forward = inspect.unwrap(type(module).forward)  # past decorators (deprecate_kwarg)
    namespace = getattr(forward, "__globals__", None)
    if namespace is None or "apply_rotary_pos_emb" not in namespace:
        return None, "its forward does not call a module-level apply_rotary_pos_emb"
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim % 2:
        return None, "no even head_dim"
    key = id(namespace)
    entry = _ROTARY_GLOBALS.get(key)
    original = entry[1] if entry else namespace["apply_rotary_pos_emb"]
    for weight in _rotary_probes(module):
        q, k = _probe((2, 3, 5, head_dim), weight, 1), _probe((2, 1, 5, head_dim), weight, 2)
        angles = _probe((2, 5, head_dim // 2), weight.float(), 3).float() * 3
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(weight.dtype), angles.sin().to(weight.dtype)
        with torch.no_grad():
            q_ref, k_ref = original(q, k, cos, sin)
            ok_q, why_q = _agrees(fused_rotary(q, cos, sin), q_ref, weight.dtype)
            ok_k, why_k = _agrees(fused_rotary(k, cos, sin), k_ref, weight.dtype)
        if not (ok_q and ok_k):
            return None, "apply_rotary_pos_emb: " + (why_q or why_k)
    if entry is None:
        entry = [namespace, original, 0]
        _ROTARY_GLOBALS[key] = entry
        namespace["apply_rotary_pos_emb"] = _dispatcher(original)
    entry[2] += 1
    bound = module.forward

    @functools.wraps(bound)
    def patched_forward(*args: Any, **kwargs: Any) -> Any:
        token = _IN_PATCHED_ATTENTION.set(True)
        try:
            return bound(*args, **kwargs)
        finally:
            _IN_PATCHED_ATTENTION.reset(token)

    undo_forward = _set_forward(module, patched_forward)

    def undo() -> None:
        undo_forward()
        entry[2] -= 1
        if entry[2] == 0:
            namespace["apply_rotary_pos_emb"] = entry[1]
            _ROTARY_GLOBALS.pop(key, None)

    return undo, ""


# --- the model -----------------------------------------------------------------------------


def _candidates(model: nn.Module, kernels: tuple[str, ...]) -> Iterable[tuple[str, str, nn.Module]]:
    for name, module in model.named_modules():
        cls = type(module).__name__
        if "rms_norm" in kernels and cls.endswith("RMSNorm"):
            yield name, "rms_norm", module
        if "glu" in kernels and all(
            hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")
        ):
            yield name, "glu", module
        if "rotary" in kernels and cls.endswith("Attention") and hasattr(module, "head_dim"):
            yield name, "rotary", module


_PATCHERS = {"rms_norm": _rms_norm, "glu": _glu, "rotary": _rotary}


def _kernels_option(kernels: Iterable[str] | str | None) -> tuple[str, ...]:
    if kernels is None:
        return KERNELS
    chosen = (kernels,) if isinstance(kernels, str) else tuple(kernels)
    for kernel in chosen:
        if kernel not in KERNELS:
            raise option_error("kernels", kernel, f"a subset of {list(KERNELS)}", owner=_OWNER)
    return chosen


def patch_model(model: nn.Module, *, kernels: Iterable[str] | str | None = None) -> PatchReport:
    """Swap the fused kernels into ``model`` in place where each agrees with the module it
    replaces (see the module docstring); ``kernels`` picks some of :data:`KERNELS` (default
    all).  Calling it again patches only what is not patched yet."""
    if not isinstance(model, nn.Module):
        raise option_error("model", type(model).__name__, "a torch.nn.Module", owner=_OWNER)
    chosen = _kernels_option(kernels)
    report = PatchReport()
    undo = _UNDO.setdefault(model, [])
    for name, kernel, module in list(_candidates(model, chosen)):
        label = name or type(module).__name__
        if kernel in _PATCHED.get(module, set()):
            continue
        action, why = _PATCHERS[kernel](label, module)
        if action is None:
            report.skipped.append((label, f"{kernel}: {why}"))
            continue
        _PATCHED.setdefault(module, set()).add(kernel)

        def undo_one(action: Callable[[], None] = action, module: nn.Module = module,
                     kernel: str = kernel) -> None:  # fmt: skip
            action()
            _PATCHED.get(module, set()).discard(kernel)

        undo.append(undo_one)
        report.patched.append((label, kernel))
    return report


def unpatch_model(model: nn.Module) -> None:
    """Restore every module :func:`patch_model` patched in ``model`` (and the modeling
    files' ``apply_rotary_pos_emb`` once no patched attention module is left)."""
    for action in reversed(_UNDO.pop(model, [])):
        action()
