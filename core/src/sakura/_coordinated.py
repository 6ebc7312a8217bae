"""The runtime's coordinated calls: what a training loop asks the services to do.

:class:`CoordinatedCalls` is the part of :class:`~sakura.SakuraRuntime` that forwards
``prepare``, ``autocast``, ``scale_loss``/``backward``, ``unscale_gradients``,
``loss_scale``, ``optimizer_step`` and ``state_dict``/``load_state_dict`` to the services
implementing them, in priority order, over the ``(service, bound method)`` tuples the
runtime resolved at install (see :mod:`sakura._routing`).  Unlike an event handler's, an
exception in a coordinated call propagates: skipping it would silently change what is
trained.  :func:`invoke` adds a note naming the service to it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

from sakura.errors import add_note
from sakura.resume import ServiceStateWarning, plan_resume
from sakura.step import STEP_SKIPPED

__all__ = ["CoordinatedCalls", "annotate", "invoke"]

_NULL_CONTEXT: AbstractContextManager[None] = nullcontext()
Impls = tuple[tuple[Any, Callable[..., Any]], ...]


def annotate(exc: BaseException, service: Any, call: str) -> None:
    """Add the note ``raised by sakura service 'name' in call()`` to ``exc``."""
    add_note(exc, f"raised by sakura service {getattr(service, 'name', service)!r} in {call}()")


def invoke(service: Any, call: str, method: Callable[..., Any], *args: Any) -> Any:
    """``method(*args)``; an exception propagates with a note naming ``service``."""
    try:
        return method(*args)
    except BaseException as exc:
        annotate(exc, service, call)
        raise


def _thread(impls: Impls, call: str, value: Any) -> Any:
    """``value`` through every method in turn (the per-step chains: the ``try`` is inlined
    rather than calling :func:`invoke`, which would cost a call per service and step)."""
    for service, method in impls:
        try:
            value = method(value)
        except BaseException as exc:
            annotate(exc, service, call)
            raise
    return value


class CoordinatedCalls:
    """Mixin of :class:`~sakura.SakuraRuntime`: the coordinated calls."""

    _calls: dict[str, Impls]
    last_step_skipped: bool
    orphaned_state: dict[str, Any]

    def prepare(self, model: Any, optimizer: Any = None) -> tuple[Any, Any]:
        """Thread ``model`` through every ``wrap_model`` and then ``optimizer`` through every
        ``wrap_optimizer``, in priority order.  Returns ``(model, optimizer)``."""
        model = self.wrap_model(model)
        if optimizer is not None:
            optimizer = self.wrap_optimizer(optimizer)
        return model, optimizer

    def wrap_model(self, model: Any) -> Any:
        """Thread ``model`` through every service's ``wrap_model`` (what ``prepare`` does
        first); for adapters whose framework sets up the model and optimizers apart."""
        return _thread(self._calls.get("wrap_model", ()), "wrap_model", model)

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Thread ``optimizer`` through every service's ``wrap_optimizer``."""
        return _thread(self._calls.get("wrap_optimizer", ()), "wrap_optimizer", optimizer)

    def autocast(self) -> AbstractContextManager[Any]:
        """A context manager for the forward pass that enters every service's ``autocast()``
        in priority order (a shared no-op context when no service provides one)."""
        impls = self._calls.get("autocast")
        if impls is None:
            return _NULL_CONTEXT
        if len(impls) == 1:
            service, make = impls[0]
            return invoke(service, "autocast", make)  # type: ignore[no-any-return]
        return _stacked_autocast(impls)

    def scale_loss(self, loss: Any) -> Any:
        """Thread ``loss`` through every service's ``wrap_loss`` in priority order."""
        return _thread(self._calls.get("wrap_loss", ()), "wrap_loss", loss)

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """``scale_loss(loss).backward(**kwargs)``.  Emits no events: the loop or adapter
        emits OnBeforeBackward / OnAfterBackward around it."""
        self.scale_loss(loss).backward(**kwargs)

    def unscale_gradients(self, optimizer: Any) -> None:
        """Ask every service to bring ``optimizer``'s gradients back to their true scale.

        Exactly once per step: services skip gradients they already unscaled, and the step
        itself does not unscale them again.  Call it once the step's last backward ran
        (``OnBeforeOptimizerStep`` and later); between gradient-accumulation micro-batches
        the next backward would add scaled gradients to unscaled ones: read
        :meth:`loss_scale` there instead.
        """
        for service, unscale in self._calls.get("unscale_gradients", ()):
            invoke(service, "unscale_gradients", unscale, optimizer)

    def loss_scale(self) -> float | None:
        """The factor the current step's gradients were multiplied by through
        :meth:`scale_loss` (the product over the services that scale), or None when no
        installed service scales the loss.

        For monitors that read gradients in ``OnAfterBackward``: divide by it (a norm
        measured there is ``loss_scale()`` times too large).  Reading it may synchronise
        with the device; call it only where a value is needed.
        """
        total: float | None = None
        for service, read in self._calls.get("loss_scale", ()):
            scale = invoke(service, "loss_scale", read)
            if scale is not None:
                total = float(scale) if total is None else total * float(scale)
        return total

    def clip_grad_norm_(
        self,
        optimizer: Any,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        parameters: Iterable[Any] | None = None,
        error_if_nonfinite: bool = False,
    ) -> Any:
        """Clip gradients by norm after unscaling them (once) through the services.

        ``parameters`` defaults to every parameter of ``optimizer``'s param groups.
        Returns the total norm, as ``torch.nn.utils.clip_grad_norm_`` does.
        """
        # torch is imported here, not at module level: ``import sakura`` must stay
        # pluggy-only (the CLI, config and plugin discovery run without torch), and only a
        # loop that clips, which has torch already, reaches this line.
        import torch

        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        self.unscale_gradients(optimizer)
        if parameters is None:
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(
            parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def optimizer_step(self, optimizer: Any) -> bool:
        """Offer the step to the services in priority order.

        Returns True when one of them owned it (performed or deliberately skipped it): the
        loop must then not call ``optimizer.step()`` itself.  :attr:`last_step_skipped`
        says whether the owner skipped it (returned :data:`~sakura.STEP_SKIPPED`).  Usage::

            if not rt.optimizer_step(optimizer):
                optimizer.step()
            if not rt.last_step_skipped:
                scheduler.step()
        """
        for service, step in self._calls.get("optimizer_step", ()):
            try:
                owned = step(optimizer)
            except BaseException as exc:
                self.last_step_skipped = False
                annotate(exc, service, "optimizer_step")
                raise
            if owned:
                self.last_step_skipped = owned is STEP_SKIPPED
                return True
        self.last_step_skipped = False
        return False

    def state_dict(self) -> dict[str, Any]:
        """The state of every service that has one, keyed by service name, plus the
        entries of :attr:`orphaned_state` no installed service wrote (so state of a
        service that is absent in this run is not lost from the next checkpoint)."""
        state: dict[str, Any] = {}
        for service, get_state in self._calls.get("state_dict", ()):
            state[service.name] = invoke(service, "state_dict", get_state)
        for name, kept in self.orphaned_state.items():
            state.setdefault(name, kept)
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = False) -> None:
        """Give each service its entry of ``state`` (from :meth:`state_dict`).

        The installed services may differ from those of the run that saved ``state``
        (see :mod:`sakura.resume`).  By default an installed stateful service without an
        entry starts fresh, and an entry no installed service can load is kept in
        :attr:`orphaned_state` and written again by the next :meth:`state_dict`; each case
        is reported by a :class:`~sakura.resume.ServiceStateWarning` naming the services.
        With ``strict=True`` either case raises one
        :class:`~sakura.resume.ServiceStateError` (a KeyError) listing both, before any
        service is loaded.
        """
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        loaders = {
            service.name: (service, load)
            for service, load in self._calls.get("load_state_dict", ())
        }
        plan = plan_resume(
            state,
            loaders=loaders,
            stateful=[service.name for service, _ in self._calls.get("state_dict", ())],
        )
        if strict and (plan.missing or plan.orphaned):
            raise plan.error(loaders)
        if plan.missing:
            warnings.warn(plan.missing_message(), ServiceStateWarning, stacklevel=2)
        if plan.orphaned:
            warnings.warn(plan.orphaned_message(), ServiceStateWarning, stacklevel=2)
        self.orphaned_state = dict(plan.orphaned)
        for name, service_state in plan.load.items():
            service, load = loaders[name]
            invoke(service, "load_state_dict", load, service_state)


@contextmanager
def _stacked_autocast(impls: Impls) -> Iterator[None]:
    with ExitStack() as stack:
        for service, make in impls:
            try:
                stack.enter_context(make())
            except BaseException as exc:
                annotate(exc, service, "autocast")
                raise
        yield
