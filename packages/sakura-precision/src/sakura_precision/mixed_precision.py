"""``MixedPrecision``: autocast policies, fp16 dynamic loss scaling, "-true" modes and fp8.

``MixedPrecision(dtype)`` builds the service for one canonical mode (see
:mod:`sakura_precision.modes`), and only implements the hooks that mode needs, because the
adapters decide from the implemented hooks what a framework must let a service do:

==========================  ===================================================================
mode                        class and hooks
==========================  ===================================================================
``"bf16-mixed"``            :class:`AutocastPrecision`: ``autocast``; ``wrap_model`` and
                            ``on_event`` (loop-start events) only learn the device type
``"16-mixed"``              :class:`LossScaledPrecision`: the above plus ``wrap_loss``,
                            ``unscale_gradients``, ``loss_scale``, ``optimizer_step``,
                            ``state_dict``, ``load_state_dict`` (a ``torch.amp.GradScaler``)
``"bf16-true"``,            :class:`TruePrecision`: ``wrap_model`` casts the weights in place
``"16-true"``,              and casts floating inputs; ``autocast`` makes the dtype the
``"32-true"``, ``"64-true"``  default for tensors created in forward (as Lightning does)
``"fp8"``                   :class:`FP8Precision`: ``wrap_model`` turns Linear layers into
                            :class:`~sakura_precision.float8_linear.Float8Linear` in place; ``autocast``
                            is bf16 autocast for everything else
==========================  ===================================================================

So bf16 runs under the stock Hugging Face Trainer with only ``HFAdapter`` (autocast is
applied by the callback), while fp16, which owns the optimizer step, needs
``SakuraTrainer``; under Lightning every mode works through ``LightningAdapter``.

Under FSDP2 (``fully_shard``) the services read the model's ``MixedPrecisionPolicy``: see
:mod:`sakura_precision.fsdp` (no autocast on top of a policy that already casts, an error
for one that conflicts, autocast kept where no policy casts).

Long file: the four mode classes share the base's options, device and FSDP2 bookkeeping;
the parts that stand alone are in :mod:`.modes`, :mod:`.fsdp` and :mod:`.float8_linear`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from sakura import STEP_SKIPPED, Service, StepSkipped
from sakura.events import OnFitBegin, OnPredictBegin, OnTestBegin, OnTrainBegin, OnValidationBegin
from sakura.options import check_bool, check_choice, check_int, check_number, option_error
from sakura.proxies import unwrap_optimizer
from sakura_precision.float8_linear import check_fp8_hardware, convert_to_float8
from sakura_precision.fsdp import check_castable, fsdp_casting, fsdp_modules, fsdp_mp_policy
from sakura_precision.modes import Mode, resolve_mode

__all__ = [
    "AutocastPrecision",
    "FP8Precision",
    "LossScaledPrecision",
    "MixedPrecision",
    "TruePrecision",
]

_DEVICES = ("cpu", "cuda")
_SCALER_DEFAULTS = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
}
_FP8_DEFAULTS: dict[str, Any] = {"emulate": False, "fp8_filter": None}
_NO_AUTOCAST = contextlib.nullcontext()


def _model_device_type(model: Any) -> str | None:
    if not isinstance(model, nn.Module):
        return None
    for parameter in model.parameters():
        return parameter.device.type
    for buffer in model.buffers():
        return buffer.device.type
    return None


def base_optimizer(optimizer: Any) -> Any:
    """``optimizer`` without the proxies frameworks hand out around it (Lightning's
    ``LightningOptimizer``, accelerate's ``AcceleratedOptimizer``, SakuraTrainer's step
    proxy: whatever an integration registered with :mod:`sakura.proxies`).  They share its
    ``param_groups``, so for loss scaling they are the same optimizer: the scaler must see
    one object per step, or a clip through the proxy and the step through the real
    optimizer would unscale twice."""
    return unwrap_optimizer(optimizer)


def _is_ddp(model: Any) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


class MixedPrecision(Service):
    """Mixed or reduced precision for training: ``MixedPrecision(dtype="bf16")``.

    Args:
        dtype: ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"auto"``, or one of Lightning's
            precision strings (``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
            ``"16-true"``, ``"32-true"``, ``"64-true"``, ``16``, ``32``, ``64``); see
            :mod:`sakura_precision.modes`.
        device: the device type autocast applies to, ``"cpu"`` or ``"cuda"``.  Default:
            learned from the model (at ``wrap_model`` and at train begin), else CUDA when
            available, else CPU.
        init_scale, growth_factor, backoff_factor, growth_interval: the dynamic loss
            scaler's settings (fp16 only; torch's defaults: 2**16, 2.0, 0.5, 2000).
        emulate: fp8 only: run the fp8 numerics emulated in fp32 where the hardware has no
            fp8 matmul (slow; for tests).
        fp8_filter: fp8 only: ``(name, linear) -> bool`` choosing which Linear layers
            run in fp8 (all whose in/out features are multiples of 16 by default).

    ``MixedPrecision(...)`` returns an instance of the subclass for the mode:
    :class:`AutocastPrecision`, :class:`LossScaledPrecision`, :class:`TruePrecision` or
    :class:`FP8Precision`.
    """

    name = "mixed_precision"
    priority = 10
    _KIND: str = ""

    mode: Mode
    dtype: torch.dtype
    requested: Any

    def __new__(cls, dtype: Any = "bf16", **options: Any) -> MixedPrecision:
        if cls is MixedPrecision:
            mode = resolve_mode(dtype)
            if mode.loss_scaled:
                cls = LossScaledPrecision
            elif mode.kind == "mixed":
                cls = AutocastPrecision
            elif mode.kind == "true":
                cls = TruePrecision
            else:
                cls = FP8Precision
        return super().__new__(cls)

    def __init__(
        self,
        dtype: Any = "bf16",
        *,
        device: str | None = None,
        init_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        emulate: bool | None = None,
        fp8_filter: Callable[[str, nn.Module], bool] | None = None,
    ) -> None:
        mode = resolve_mode(dtype)
        expected = self._KIND
        if expected and _kind_of(mode) != expected:
            raise ValueError(
                f"{type(self).__name__} implements {expected!r} modes, not dtype={dtype!r} "
                f"({mode.name}); build it with MixedPrecision(dtype={dtype!r})"
            )
        self.requested = dtype
        self.mode = mode
        self.dtype = mode.dtype
        if device is not None:
            check_choice("device", device, _DEVICES, owner="MixedPrecision")
        self.device = device
        self._device_type: str | None = device
        scaler_options = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        fp8_options = {"emulate": emulate, "fp8_filter": fp8_filter}
        for group, applies, options in (
            ("the fp16 loss scaler", mode.loss_scaled, scaler_options),
            ("fp8", mode.kind == "fp8", fp8_options),
        ):
            given = [k for k, v in options.items() if v is not None]
            if given and not applies:
                raise ValueError(
                    f"MixedPrecision: option(s) {given} configure {group} and do not apply to "
                    f"dtype={dtype!r} ({mode.name})"
                )
        self._configure(scaler_options, fp8_options)

    def _configure(self, scaler_options: dict[str, Any], fp8_options: dict[str, Any]) -> None:
        """Subclasses validate and store their own options here."""

    def __repr__(self) -> str:
        return f"MixedPrecision({self.mode.name!r})"

    def fsdp_mp_policy(self, *, cast_forward_inputs: bool = True) -> Any:
        """The ``MixedPrecisionPolicy`` of this mode for ``fully_shard(mp_policy=...)``
        (:func:`sakura_precision.fsdp.fsdp_mp_policy`); with it the service stops
        autocasting the parameters the policy casts."""
        return fsdp_mp_policy(self.mode, cast_forward_inputs=cast_forward_inputs)

    fsdp_reason: str | None = None
    """What the service does about FSDP2 on the model it last saw (None: no FSDP2 module)."""
    _fsdp_casts = False  # FSDP2's policies compute every parameter in the dtype

    def _learn_fsdp(self, model: Any) -> None:
        """Read the FSDP2 policies of ``model`` (raises on one that conflicts)."""
        if not isinstance(model, nn.Module):
            return  # (an event without a model)
        found = fsdp_casting(model, self.mode, owner=repr(self))
        self._fsdp_casts = found is not None and found.covers_all
        self.fsdp_reason = None if found is None else found.reason

    # --- device bookkeeping ------------------------------------------------------------

    def _learn_device(self, model: Any) -> None:
        if self.device is not None:
            return
        found = _model_device_type(model)
        if found in _DEVICES:
            self._device_type = found

    @property
    def device_type(self) -> str:
        """The device type autocast applies to (see the ``device`` argument)."""
        if self._device_type is None:
            self._device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return self._device_type


# Spec-string errors and help show the constructor's arguments, not __new__'s.
_INIT_SIGNATURE = inspect.signature(MixedPrecision.__init__)
MixedPrecision.__signature__ = _INIT_SIGNATURE.replace(  # type: ignore[attr-defined]
    parameters=list(_INIT_SIGNATURE.parameters.values())[1:]
)


def _kind_of(mode: Mode) -> str:
    return "loss_scaled" if mode.loss_scaled else mode.kind


class AutocastPrecision(MixedPrecision):
    """``"bf16-mixed"`` (and the autocast part of fp16 and fp8): ``torch.autocast`` on the
    model's device type with the mode's dtype; weights stay fp32."""

    name = "mixed_precision"
    _KIND = "mixed"
    _checked_device: str | None = None
    # Where a loop starts using the model: Lightning moves it to its device after
    # wrap_model, so the device type is learned again here.
    event_types = frozenset(
        {OnFitBegin, OnTrainBegin, OnValidationBegin, OnTestBegin, OnPredictBegin}
    )

    def wrap_model(self, model: Any) -> Any:
        """Learns the model's device type and FSDP2 policies; the model is returned
        unchanged."""
        self._learn_device(model)
        self._learn_fsdp(model)
        return model

    def on_event(self, event: Any) -> None:
        model = getattr(event, "model", None)
        self._learn_device(model)
        self._learn_fsdp(model)

    def autocast(self) -> AbstractContextManager[Any]:
        if self._fsdp_casts:
            return _NO_AUTOCAST  # FSDP2's mp_policy already computes in self.dtype
        device_type = self.device_type
        if device_type != self._checked_device:
            self._check_device(device_type)
        return torch.autocast(device_type, dtype=self.dtype)

    def _check_device(self, device_type: str) -> None:
        if (
            device_type == "cuda"
            and self.dtype == torch.bfloat16
            and not torch.cuda.is_bf16_supported()
        ):
            raise RuntimeError(
                f"MixedPrecision({self.requested!r}): this GPU does not support bfloat16 "
                f"(Ampere or newer is needed); use MixedPrecision('fp16') instead"
            )
        self._checked_device = device_type


class LossScaledPrecision(AutocastPrecision):
    """``"16-mixed"``: fp16 autocast plus a dynamic ``torch.amp.GradScaler``.

    Per step: ``wrap_loss`` multiplies the loss by the scale; ``unscale_gradients`` divides
    the gradients back and checks them for inf/NaN, at most once per optimizer and step
    (so clipping through ``rt.clip_grad_norm_`` and the step itself never unscale twice);
    ``optimizer_step`` lets the scaler step the optimizer, or skip the step when a gradient
    was not finite, and always owns the step (returns True, or :data:`~sakura.STEP_SKIPPED`
    for a skipped step); ``loss_scale`` answers the scale the step's gradients carry.  The scale is updated (backed
    off after a skipped step, grown after ``growth_interval`` clean ones) once every
    optimizer of the step has stepped: at the next ``wrap_loss``, or when the scale or the
    state is read.  These are the operations of the hand-written ``GradScaler`` loop, in its
    order, so results are bit-identical to it.

    The scaler's state (scale, growth tracker, settings) and the count of skipped steps
    are in ``state_dict`` and come back on resume.
    """

    name = "mixed_precision"
    _KIND = "loss_scaled"

    def _configure(self, scaler_options: dict[str, Any], fp8_options: dict[str, Any]) -> None:
        settings = dict(_SCALER_DEFAULTS)
        settings.update({k: v for k, v in scaler_options.items() if v is not None})
        owner = "MixedPrecision"
        check_number(
            "init_scale", settings["init_scale"], minimum=0, min_inclusive=False, owner=owner
        )
        check_number(
            "growth_factor", settings["growth_factor"], minimum=1, min_inclusive=False, owner=owner
        )
        check_number(
            "backoff_factor",
            settings["backoff_factor"],
            minimum=0,
            maximum=1,
            min_inclusive=False,
            max_inclusive=False,
            owner=owner,
        )
        check_int("growth_interval", settings["growth_interval"], minimum=1, owner=owner)
        self._settings = settings
        self._scaler: torch.amp.GradScaler | None = None
        self._scaler_device: str | None = None
        self._pending_state: Mapping[str, Any] | None = None
        self._scaled = False  # a scaled backward happened since the last update
        self._unscaled: set[int] = set()
        self._stepped: set[int] = set()
        self._skipped: torch.Tensor | None = None  # count of skipped steps, on the scale's device
        self._last_skipped: torch.Tensor | None = None
        self._loaded_skipped = 0
        self.optimizer_steps = 0
        """Optimizer steps this service owned (performed or skipped)."""

    # --- the scaler ----------------------------------------------------------------------

    def _make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """A GradScaler for ``device_type``, carrying over the previous one's state (or a
        loaded checkpoint's)."""
        previous = self._scaler
        state = previous.state_dict() if previous is not None else self._pending_state
        settings = self._settings
        scaler = torch.amp.GradScaler(
            device_type,
            init_scale=float(settings["init_scale"]),
            growth_factor=float(settings["growth_factor"]),
            backoff_factor=float(settings["backoff_factor"]),
            growth_interval=int(settings["growth_interval"]),
        )
        if state:
            scaler.load_state_dict(dict(state))
        self._scaler, self._scaler_device, self._pending_state = scaler, device_type, None
        return scaler

    def _flush(self) -> None:
        """Finish the last step: update the scale once every optimizer has stepped."""
        if (self._stepped or self._unscaled) and self._scaler is not None:
            self._scaler.update()
        self._scaled = False
        self._unscaled.clear()
        self._stepped.clear()

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The ``torch.amp.GradScaler`` (None before the first scaled loss)."""
        return self._scaler

    @property
    def scale(self) -> float:
        """The current loss scale (updated for the last step first; reads the device)."""
        if self._stepped:
            self._flush()
        if self._scaler is not None:
            return float(self._scaler.get_scale())
        if self._pending_state is not None:
            return float(self._pending_state["scale"])
        return float(self._settings["init_scale"])

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because a gradient was inf/NaN (reads the device)."""
        extra = int(self._skipped.item()) if self._skipped is not None else 0
        return self._loaded_skipped + extra

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent optimizer step was skipped (reads the device)."""
        return bool(self._last_skipped.item()) if self._last_skipped is not None else False

    # --- coordinated calls ---------------------------------------------------------------

    def wrap_loss(self, loss: Any) -> Any:
        if self._stepped or self._unscaled:
            self._flush()
        device_type = loss.device.type
        scaler = self._scaler
        if scaler is None or device_type != self._scaler_device:
            scaler = self._make_scaler(device_type)
        self._scaled = True
        return scaler.scale(loss)

    def loss_scale(self) -> float | None:
        """The scale this step's losses were multiplied by (``rt.loss_scale()``), so that a
        monitor can read after-backward gradients at their true size: divide by it.

        Unlike :attr:`scale` this never finishes the last step early: between an optimizer
        step and the next ``wrap_loss`` it still answers the scale that step's gradients
        carried.  ``None`` before the first scaled loss when no scaler exists yet and no
        state was loaded: nothing has been scaled.  Reads the scale from the device.
        """
        if self._scaler is None:
            return None
        return float(self._scaler.get_scale())

    def unscale_gradients(self, optimizer: Any) -> None:
        optimizer = base_optimizer(optimizer)
        key = id(optimizer)
        scaler = self._scaler
        if scaler is None or not self._scaled or key in self._unscaled or key in self._stepped:
            return
        scaler.unscale_(optimizer)
        self._unscaled.add(key)

    def optimizer_step(self, optimizer: Any) -> bool | StepSkipped:
        scaler = self._scaler
        if scaler is None or not self._scaled:
            return False  # no scaled backward since the last step: the loop steps as usual
        optimizer = base_optimizer(optimizer)
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError(
                "MixedPrecision('fp16'): this optimizer already stepped since the last scaled "
                "backward; each optimizer step needs a backward through rt.scale_loss / "
                "rt.backward first"
            )
        scaler.step(optimizer)
        # GradScaler keeps the per-device inf/NaN flags of this optimizer until update();
        # summing them records whether the step was skipped.  scaler.step() has just read
        # the same flags on the host to decide, so reading them again adds no stall.
        found = sum(scaler._found_inf_per_device(optimizer).values())
        skipped = torch.as_tensor(found).gt(0).to(torch.int64)
        self._last_skipped = skipped
        self._skipped = skipped if self._skipped is None else self._skipped + skipped
        self._stepped.add(key)
        self.optimizer_steps += 1
        return STEP_SKIPPED if bool(skipped) else True

    # --- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self._stepped:
            self._flush()
        if self._scaler is not None:
            scaler_state = self._scaler.state_dict()
        elif self._pending_state is not None:
            scaler_state = dict(self._pending_state)
        else:
            scaler_state = {
                "scale": float(self._settings["init_scale"]),
                "growth_factor": float(self._settings["growth_factor"]),
                "backoff_factor": float(self._settings["backoff_factor"]),
                "growth_interval": int(self._settings["growth_interval"]),
                "_growth_tracker": 0,
            }
        return {
            "scaler": scaler_state,
            "skipped_steps": self.skipped_steps,
            "optimizer_steps": self.optimizer_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or not isinstance(state.get("scaler"), Mapping):
            raise ValueError(
                f"MixedPrecision('fp16'): expected a state with a 'scaler' mapping (from "
                f"state_dict()), got {state!r}"
            )
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval"} - set(
            state["scaler"]
        )
        if missing:
            raise ValueError(f"MixedPrecision('fp16'): the scaler state lacks {sorted(missing)}")
        if self._scaled:
            self._flush()
        if self._scaler is not None:
            self._scaler.load_state_dict(dict(state["scaler"]))
        else:
            self._pending_state = dict(state["scaler"])
        self._loaded_skipped = int(state.get("skipped_steps", 0))
        self._skipped = None
        self._last_skipped = None
        self.optimizer_steps = int(state.get("optimizer_steps", 0))


class _DefaultDtype(AbstractContextManager[None]):
    """Makes ``dtype`` the default floating dtype inside (Lightning's ``-true`` forward)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._previous: torch.dtype | None = None

    def __enter__(self) -> None:
        self._previous = torch.get_default_dtype()
        torch.set_default_dtype(self._dtype)

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            torch.set_default_dtype(self._previous)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in ``value`` (nested tuples, named tuples, lists, dicts) to
    ``dtype``; containers keep their type where it can be rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple):
        items = [_cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        cast = {k: _cast_floating(v, dtype) for k, v in value.items()}
        try:
            return type(value)(cast)
        except TypeError:  # a mapping type that cannot be built from a dict
            return cast
    return value


_MARK = "_sakura_true_precision"


class TruePrecision(MixedPrecision):
    """``"bf16-true"``, ``"16-true"``, ``"32-true"``, ``"64-true"``: everything in one dtype.

    ``wrap_model`` casts the model's parameters and buffers in place and adds a forward
    pre-hook that casts floating-point inputs to the dtype (integer inputs such as token
    ids are left alone), whatever the module.  A loop that hands batches to methods other
    than ``forward`` (Lightning's ``training_step``) casts them itself: its adapter sees
    that the weights now have one floating dtype and casts the batch to it, as
    ``LightningAdapter`` does at Lightning's ``convert_input``.  ``autocast`` makes the dtype the default dtype during the forward,
    so tensors created there match.  No loss scaling: as in Lightning, ``"16-true"`` trains
    without it.  Call ``rt.prepare`` before wrapping the model in DDP.
    """

    name = "mixed_precision"
    _KIND = "true"

    def wrap_model(self, model: Any) -> Any:
        if _is_ddp(model):
            raise ValueError(
                f"MixedPrecision({self.requested!r}) casts the model's weights, which "
                f"DistributedDataParallel has already bucketed; call rt.prepare(model) (or "
                f"rt.wrap_model) before wrapping the model in DDP"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"MixedPrecision({self.requested!r}) needs a torch.nn.Module, got "
                f"{type(model).__name__}"
            )
        self._learn_fsdp(model)  # a conflicting FSDP2 policy is refused before any cast
        check_castable(model, self.dtype, owner=repr(self))
        model.to(self.dtype)  # (FSDP2's own _apply re-registers the sharded parameters)
        if getattr(model, _MARK, None) is not None:
            return model
        dtype = self.dtype
        model.register_forward_pre_hook(_InputCaster(dtype), with_kwargs=True)
        object.__setattr__(model, _MARK, dtype)
        return model

    def autocast(self) -> AbstractContextManager[Any]:
        return _DefaultDtype(self.dtype)


class _InputCaster:
    """Forward pre-hook: floating-point args and kwargs to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return _cast_floating(args, self.dtype), _cast_floating(kwargs, self.dtype)


class FP8Precision(AutocastPrecision):
    """``"fp8"``: Linear matmuls in float8 (see :mod:`sakura_precision.float8_linear`), everything else
    under bf16 autocast.  Needs an NVIDIA GPU of compute capability >= 8.9; elsewhere
    ``wrap_model`` or the first forward raises, unless ``emulate=True``."""

    name = "mixed_precision"
    _KIND = "fp8"

    def _configure(self, scaler_options: dict[str, Any], fp8_options: dict[str, Any]) -> None:
        options = dict(_FP8_DEFAULTS)
        options.update({k: v for k, v in fp8_options.items() if v is not None})
        self.emulate = check_bool("emulate", options["emulate"], owner="MixedPrecision")
        fp8_filter = options["fp8_filter"]
        if fp8_filter is not None and not callable(fp8_filter):
            raise option_error(
                "fp8_filter",
                fp8_filter,
                "a callable (name, linear) -> bool, or None",
                owner="MixedPrecision",
            )
        self.fp8_filter = fp8_filter
        self.converted: list[str] = []
        """Names of the Linear layers that run in fp8."""

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"MixedPrecision('fp8') needs a torch.nn.Module, got {type(model)}")
        if fsdp_modules(model):
            raise NotImplementedError(
                "MixedPrecision('fp8') on a model sharded by FSDP2 (fully_shard) is not "
                "supported: Float8Linear is untested over DTensor weights; use "
                "MixedPrecision('bf16-mixed') with fully_shard(mp_policy="
                "sakura_precision.fsdp_mp_policy('bf16-mixed'))"
            )
        self._learn_device(model)
        if not self.emulate:
            # The model may still be on the CPU here (Lightning moves it later): check the
            # GPU it will run on; every forward checks the device it actually runs on.
            if torch.cuda.is_available():
                check_fp8_hardware(torch.device("cuda", torch.cuda.current_device()))
            else:
                check_fp8_hardware(torch.device("cpu"))  # raises, naming the requirement
        converted = convert_to_float8(model, emulate=self.emulate, module_filter=self.fp8_filter)
        if not converted and not self.converted:
            raise ValueError(
                f"MixedPrecision('fp8'): {type(model).__name__} has no nn.Linear whose in and "
                f"out features are multiples of 16"
                + (" and that fp8_filter accepts" if self.fp8_filter is not None else "")
                + "; fp8 would change nothing"
            )
        self.converted.extend(converted)
        return model

    def _check_device(self, device_type: str) -> None:
        self._checked_device = device_type
