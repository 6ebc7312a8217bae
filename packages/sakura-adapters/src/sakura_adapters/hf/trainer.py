""":class:`SakuraTrainer`: a drop-in ``transformers.Trainer`` that routes the step through a
sakura runtime (what the table in :mod:`sakura_adapters.hf` lists)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

from torch import nn
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from sakura.errors import UnknownNameError
from sakura.options import check_bool, check_int, option_error
from sakura.runtime import SakuraRuntime
from sakura_adapters.hf.callback import HFAdapter
from sakura_adapters.hf.checks import check_runtime, check_single_compiler, is_compiled
from sakura_adapters.hf.optimizer import _RuntimeStepOptimizer, is_wrapper, service_optimizer

__all__ = ["SakuraTrainer"]

CHUNKED_LOSS_SERVICE = "chunked_loss"
"""The service ``chunked_loss=True`` installs, by name (it lives in sakura-kernels)."""

_TRAINER_INIT = inspect.signature(Trainer.__init__)


def _adapter_in(
    callbacks: list[Any], runtime: SakuraRuntime | None, strict_resume: bool | None
) -> HFAdapter:
    """The one HFAdapter instance in ``callbacks``, checked against ``runtime``; appended
    to ``callbacks`` when there is none."""
    for cb in callbacks:
        if isinstance(cb, type) and issubclass(cb, HFAdapter):
            raise TypeError(
                "callbacks holds the HFAdapter class; pass an instance, HFAdapter(rt), "
                "or pass runtime=rt to SakuraTrainer"
            )
    adapters = [cb for cb in callbacks if isinstance(cb, HFAdapter)]
    if len(adapters) > 1:
        raise ValueError(f"callbacks holds {len(adapters)} HFAdapter instances; pass one")
    if runtime is None and not adapters:
        raise TypeError(
            "SakuraTrainer needs a sakura runtime: pass runtime=SakuraRuntime(...) or "
            "callbacks=[HFAdapter(rt)]"
        )
    if runtime is None:
        return adapters[0]
    check_runtime(runtime, "SakuraTrainer(runtime=...)")
    if not adapters:
        adapter = HFAdapter(runtime, strict_resume=bool(strict_resume))
        callbacks.append(adapter)
        return adapter
    if adapters[0].rt is not runtime:
        raise ValueError(
            "runtime= and the HFAdapter in callbacks hold different SakuraRuntimes; "
            "pass one runtime"
        )
    return adapters[0]


def _check_packing(value: Any) -> bool | int:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value >= 1:
        return value
    raise option_error(
        "packing",
        value,
        "False, True (rows as long as the batch's longest example) or a row length in "
        "tokens, an int >= 1",
        owner="SakuraTrainer",
    )


def _install_chunked_loss(rt: SakuraRuntime, chunk: int) -> None:
    """Install the ``chunked_loss`` service by name (sakura-adapters does not import
    sakura-kernels, which provides it)."""
    if CHUNKED_LOSS_SERVICE in rt:
        raise ValueError(
            f"SakuraTrainer(chunked_loss=True): the runtime already has a "
            f"{CHUNKED_LOSS_SERVICE!r} service; install it or pass chunked_loss=True, not both"
        )
    try:
        rt.install(f"{CHUNKED_LOSS_SERVICE}:chunk={chunk}")
    except UnknownNameError as exc:
        raise ImportError(
            f"SakuraTrainer(chunked_loss=True) needs the {CHUNKED_LOSS_SERVICE!r} service, "
            f"which sakura-kernels provides: pip install sakura-kernels ({exc})"
        ) from exc


def _packing_collator(packing: bool | int, collator: Any, arguments: dict[str, Any]) -> Any:
    """The collator ``packing=`` stands for (see :mod:`sakura_adapters.packing`)."""
    from sakura_adapters.packing import PackedCollator

    if collator is not None:
        raise ValueError(
            "SakuraTrainer: packing= builds the data_collator (a PackedCollator); pass "
            "packing=False with your own data_collator, or drop data_collator"
        )
    tokenizer = arguments.get("processing_class")
    pad = getattr(tokenizer, "pad_token_id", None)
    pad_token_id = pad if isinstance(pad, int) and not isinstance(pad, bool) else 0
    if packing is True:
        return _LongestRowCollator(pad_token_id)
    return PackedCollator(int(packing), pad_token_id=pad_token_id, pad_to="longest")


class _LongestRowCollator:
    """``packing=True``: each batch's examples packed into rows as long as its longest
    example (best fit decreasing; no document is split), positions restarting per
    document, ``use_cache=False``."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __repr__(self) -> str:
        return f"SakuraTrainer packing=True (pad_token_id={self.pad_token_id})"

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        from sakura_adapters.packing import pack_sequences

        longest = max(
            (len(f["input_ids"] if hasattr(f, "keys") else f) for f in features), default=1
        )
        batch: dict[str, Any] = dict(
            pack_sequences(
                features,
                max(longest, 1),
                pad_token_id=self.pad_token_id,
                overflow="error",
                pad_to="longest",
            )
        )
        batch["use_cache"] = False
        return batch


class SakuraTrainer(Trainer):
    """A drop-in :class:`transformers.Trainer` that routes the step through a sakura runtime.

    Same constructor as ``Trainer`` plus ``runtime=`` (a :class:`~sakura.SakuraRuntime`).
    Without it, the runtime of the :class:`HFAdapter` in ``callbacks`` is used; without an
    ``HFAdapter`` there, one is added.  See :mod:`sakura_adapters.hf` for what goes through
    the runtime.

    Loss scaling: the Trainer's ``training_step`` computes the loss, calls
    ``self.accelerator.backward(loss)`` and returns ``loss.detach()`` for logging.  Instead
    of re-implementing ``training_step`` (context parallelism, SageMaker, LOMO, DeepSpeed
    and gradient-accumulation normalisation all live there), SakuraTrainer gives its own
    accelerator instance a ``backward`` that emits ``OnBeforeBackward``, runs the original
    backward on ``rt.scale_loss(loss)`` and emits ``OnAfterBackward``; the loss the Trainer
    logs and returns stays unscaled.  A subclass that overrides ``training_step`` keeps the
    scaling as long as it calls ``self.accelerator.backward``.  The same instance gets a
    ``clip_grad_norm_`` that calls ``rt.unscale_gradients`` first, so clipping and the
    logged gradient norm see true gradients.  Both are (re)installed when training starts
    and at every step, so a replaced accelerator is covered too.

    Step ownership: :meth:`create_optimizer` wraps the optimizer with ``rt.wrap_optimizer``
    and then in a thin ``torch.optim.Optimizer`` proxy; accelerate wraps that proxy as usual.
    The proxy's ``step()`` calls ``rt.unscale_gradients`` and ``rt.optimizer_step`` with the
    services' optimizer and steps it itself only when no service owned the step.  Services
    always receive the optimizer ``rt.wrap_optimizer`` returned, never accelerate's wrapper.

    ``strict_resume`` (``None``: the HFAdapter's setting, False for the one SakuraTrainer
    adds): see :class:`HFAdapter`; a bool given here applies to the adapter.

    Loss and batch options (those of the reference's ``TrainStreamTrainer``):

    * ``chunked_loss`` (default False): install the ``chunked_loss`` service (from
      sakura-kernels, by name) in the runtime, so a causal LM's loss is computed from its
      hidden states ``loss_chunk_size`` tokens at a time and its logits never exist
      (``outputs.logits`` is None in training); an ImportError naming
      ``pip install sakura-kernels`` when that package is missing.
    * ``loss_chunk_size`` (default 1024): tokens per chunk, an int >= 1.
    * ``packing`` (default False): each batch's examples packed into rows with no padding
      and position ids restarting per example (:mod:`sakura_adapters.packing`): ``True``
      makes rows as long as the batch's longest example, an int is the row length (longer
      examples are split). It builds the ``data_collator`` (so it cannot be combined with
      one); examples are mappings with ``input_ids`` and optionally ``labels``.

    Resume: ``train(resume_from_checkpoint=...)`` tells the adapter the folder (``True``
    resolves to the last checkpoint in ``output_dir`` as the Trainer does); the services'
    state is loaded from it when training starts, after the Trainer restored the model,
    optimizer and scheduler and before ``OnFitBegin``, followed by ``OnLoadCheckpoint``.
    """

    def __init__(
        self,
        *args: Any,
        runtime: SakuraRuntime | None = None,
        strict_resume: bool | None = None,
        chunked_loss: bool = False,
        loss_chunk_size: int = 1024,
        packing: bool | int = False,
        **kwargs: Any,
    ) -> None:
        try:
            bound = _TRAINER_INIT.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(
                f"SakuraTrainer takes transformers.Trainer's arguments: {exc}"
            ) from None
        if strict_resume is not None:
            check_bool("strict_resume", strict_resume, owner="SakuraTrainer")
        self.chunked_loss = check_bool("chunked_loss", chunked_loss, owner="SakuraTrainer")
        self.loss_chunk_size: int = check_int(
            "loss_chunk_size", loss_chunk_size, minimum=1, owner="SakuraTrainer"
        )
        self.packing = _check_packing(packing)
        callbacks = list(bound.arguments.get("callbacks") or [])
        adapter = _adapter_in(callbacks, runtime, strict_resume)
        if strict_resume is not None:
            adapter.strict_resume = strict_resume
        bound.arguments["callbacks"] = callbacks
        if self.chunked_loss:
            _install_chunked_loss(adapter.rt, self.loss_chunk_size)
        if self.packing is not False:
            bound.arguments["data_collator"] = _packing_collator(
                self.packing, bound.arguments.get("data_collator"), bound.arguments
            )
        self.runtime: SakuraRuntime = adapter.rt
        self.sakura_adapter: HFAdapter = adapter
        self._sakura_ready = False
        self._sakura_optimizer: _RuntimeStepOptimizer | None = None
        self._sakura_hooks_token = object()
        adapter._bind(self)
        super().__init__(*bound.args[1:], **bound.kwargs)
        model = self._sakura_wrap_model(self.model)
        if model is not self.model:
            if self.model_wrapped is self.model:
                self.model_wrapped = model
            self.model = model
            self.callback_handler.model = model
        self._sakura_install_hooks()
        self._sakura_ready = True

    # --- model and optimizer ------------------------------------------------------------

    def _sakura_wrap_model(self, model: Any) -> Any:
        rt = self.runtime
        names = rt.implements("wrap_model")
        if names:
            was = bool(getattr(self.args, "torch_compile", False)) and is_compiled(model)
            wrapped = rt.wrap_model(model)
            check_single_compiler(self.args, names, was, wrapped)
            if not isinstance(wrapped, nn.Module):
                raise TypeError(
                    f"wrap_model of the sakura service(s) {list(names)} returned a "
                    f"{type(wrapped).__name__}; the Trainer needs a torch.nn.Module whose "
                    f"forward(**batch) it can call"
                )
            model = wrapped
        self.sakura_adapter._wraps.record_model(model, names)
        return model

    def call_model_init(self, trial: Any = None) -> Any:
        """The Trainer's ``model_init`` result, through ``rt.wrap_model`` when ``train()``
        re-creates the model (the constructor wraps its model itself)."""
        model = super().call_model_init(trial)
        if getattr(self, "_sakura_ready", False):
            model = self._sakura_wrap_model(model)
        return model

    def create_optimizer(self, model: Any = None) -> Any:
        """The Trainer's optimizer, through ``rt.wrap_optimizer``, in the step proxy."""
        optimizer: Any = (
            super().create_optimizer(model) if model is not None else super().create_optimizer()
        )
        if optimizer is None:
            return optimizer
        proxy = self._sakura_optimizer
        probe: Any = optimizer
        while is_wrapper(probe):
            if probe is proxy:
                return optimizer  # already routed through the runtime
            probe = probe.optimizer
        proxy = _RuntimeStepOptimizer(self.runtime.wrap_optimizer(optimizer), self.runtime)
        self._sakura_optimizer = proxy
        self.optimizer = proxy
        return proxy

    # --- forward, backward, clipping ----------------------------------------------------

    def compute_loss_context_manager(self) -> Any:
        """The Trainer's contexts plus ``rt.autocast()`` (training and evaluation)."""
        if not self.runtime.implements("autocast"):  # nothing to add: no ExitStack per step
            return super().compute_loss_context_manager()
        stack = contextlib.ExitStack()
        stack.enter_context(super().compute_loss_context_manager())
        stack.enter_context(self.runtime.autocast())
        return stack

    def _sakura_install_hooks(self) -> None:
        """Give the accelerator a ``backward`` and ``clip_grad_norm_`` that go through the
        runtime (idempotent: one dict lookup when they are in place)."""
        accelerator = getattr(self, "accelerator", None)
        if accelerator is None:
            return
        token = self._sakura_hooks_token
        if accelerator.__dict__.get("_sakura_hooks") is token:
            return
        backward = accelerator.backward
        clip_grad_norm_ = accelerator.clip_grad_norm_
        accelerator.backward = functools.partial(self._sakura_backward, backward)
        accelerator.clip_grad_norm_ = functools.partial(
            self._sakura_clip_grad_norm, clip_grad_norm_
        )
        accelerator.__dict__["_sakura_hooks"] = token

    def _sakura_backward(self, backward: Callable[..., Any], loss: Any, **kwargs: Any) -> Any:
        return self.sakura_adapter._backward(self.state, self.model, backward, loss, kwargs)

    def _sakura_clip_grad_norm(self, clip: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        optimizer = service_optimizer(self.optimizer)
        if optimizer is not None:
            self.runtime.unscale_gradients(optimizer)
        return clip(*args, **kwargs)

    # --- entry points -------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``; restores the services' state when resuming and reports an
        exception to the services (``OnError``) before re-raising it."""
        path: Any = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
        self.sakura_adapter._resume_path = os.fspath(path) if path else None
        try:
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        except BaseException as exc:
            self.sakura_adapter._train_failed(self.state, exc)
            raise
        finally:
            self.sakura_adapter._resume_path = None

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """``Trainer.evaluate``, preceded by ``OnValidationBegin`` (once per dataset)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if not isinstance(dataset, dict):  # a dict re-enters evaluate() once per dataset
            self.sakura_adapter._begin_eval(self.state, self.model, predicting=False)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> Any:
        """``Trainer.predict``, preceded by ``OnPredictBegin``; its batches are reported as
        ``OnPredictBatchEnd``."""
        adapter = self.sakura_adapter
        adapter._begin_eval(self.state, self.model, predicting=True)
        try:
            return super().predict(test_dataset, ignore_keys, metric_key_prefix)
        finally:
            adapter._predicting = False
