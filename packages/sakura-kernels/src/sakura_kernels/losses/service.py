"""``ChunkedLoss``: the ``chunked_loss`` service, a causal LM's loss without its logits.

``wrap_model`` finds every Hugging Face ``*ForCausalLM`` in the model it is given (the model
itself, the one inside a PEFT wrapper, the one a LightningModule holds) and gives it a
``forward`` that, when ``labels`` are passed, runs the decoder and computes the loss from
the last hidden states ``chunk`` tokens at a time
(:func:`~sakura_kernels.chunked_causal_lm_loss`): the ``tokens x vocab`` logits are never
built and the output's ``.logits`` is None.  ``num_items_in_batch`` (what
``transformers.Trainer`` passes under gradient accumulation), ``shift_labels`` and ``-100``
mean what they mean to the model's own loss.  Without labels the model's own forward runs.

The change is in place (the same module objects come back), so it works where the loop
calls the model: the HF Trainer (``SakuraTrainer`` or ``HFAdapter``), Lightning (the
LightningModule calls its model) and a raw loop after ``rt.prepare``.  It applies in
training mode; in eval mode the model's own forward runs (evaluation metrics read the
logits), unless ``in_eval=True``.  Uninstalling the service (its ``teardown``) or
:meth:`ChunkedLoss.unwrap` restores the original ``forward``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import weakref
from typing import Any

from torch import nn

from sakura.options import check_bool, check_int, option_error
from sakura.service import Service
from sakura_kernels.losses.chunked import _causal_lm_parts, chunked_causal_lm_loss

__all__ = ["ChunkedLoss", "find_causal_lms"]

_OWNER = "ChunkedLoss"
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")
_HEAD_ONLY_KWARGS = ("labels", "logits_to_keep")


def _is_causal_lm(module: nn.Module) -> bool:
    # Through the MRO: FSDP2's fully_shard swaps the class for a subclass of its own
    # (FSDPLlamaForCausalLM, defined in torch) that still is the transformers class.
    if not any(
        cls.__name__.endswith("ForCausalLM") and cls.__module__.startswith("transformers")
        for cls in type(module).__mro__
    ):
        return False
    return isinstance(getattr(module, "base_model", None), nn.Module) and callable(
        getattr(module, "get_output_embeddings", None)
    )


def find_causal_lms(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers ``*ForCausalLM`` modules inside ``model`` (itself
    included; a PEFT wrapper's inner model is found as a submodule)."""
    found: list[nn.Module] = []
    for module in model.modules():
        if _is_causal_lm(module) and not any(
            module is not outer and any(m is module for m in outer.modules()) for outer in found
        ):
            found.append(module)
    return found


class ChunkedLoss(Service):
    """The ``chunked_loss`` service (spec ``chunked_loss``, ``chunked_loss:chunk=1024``,
    ``chunked_loss:chunk=512,in_eval=true``).

    Args:
        chunk: tokens per chunk of the head's matmul (the logits of this many tokens exist
            at a time); an int >= 1.
        in_eval: also compute the loss in chunks in eval mode (``.logits`` is then None
            there too); default False, so evaluation metrics keep their logits.
    """

    name = "chunked_loss"
    priority = 20  # after quantization (5), before compilation and checkpointing wrappers

    def __init__(self, chunk: int = 1024, *, in_eval: bool = False) -> None:
        self.chunk: int = check_int("chunk", chunk, minimum=1, owner=_OWNER)
        self.in_eval: bool = check_bool("in_eval", in_eval, owner=_OWNER)
        self._patched: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"ChunkedLoss(chunk={self.chunk}, in_eval={self.in_eval})"

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise option_error("model", type(model).__name__, "a torch.nn.Module", owner=_OWNER)
        targets = find_causal_lms(model)
        if not targets:
            raise option_error(
                "model",
                type(model).__name__,
                "a module holding a transformers *ForCausalLM (the model, a PEFT model "
                "wrapping one, or a LightningModule whose submodule it is)",
                owner=_OWNER,
            )
        for target in targets:
            _causal_lm_parts(target)  # refuses an adapted head or logit transforms, now
            target.__dict__[_OPTIONS] = (self.chunk, self.in_eval)
            target.forward = _ChunkedForward(target)
            self._patched.add(target)
        return model

    def unwrap(self, model: nn.Module) -> None:
        """Give every ``*ForCausalLM`` in ``model`` its own ``forward`` back."""
        for target in find_causal_lms(model):
            _restore(target)
            self._patched.discard(target)

    def teardown(self) -> None:
        for target in list(self._patched):
            _restore(target)
        self._patched = weakref.WeakSet()


_OPTIONS = "_sakura_chunked_loss"


def _restore(target: nn.Module) -> None:
    if target.__dict__.pop(_OPTIONS, None) is not None:
        target.__dict__.pop("forward", None)


class _ChunkedForward:
    """The patched ``forward`` of a ``*ForCausalLM`` (an instance attribute): with labels
    (in training mode, or with ``in_eval``) the chunked loss from the hidden states; else
    the class's own forward.

    It carries the class forward's signature (the HF Trainer reads it to keep a dataset's
    columns and to pass ``num_items_in_batch``), and a deepcopy of the model (an EMA, a
    reference copy) gets one bound to the copy, not to the original."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __deepcopy__(self, memo: dict[int, Any]) -> _ChunkedForward:
        return _ChunkedForward(copy.deepcopy(self.module, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ChunkedForward, (self.module,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _chunked_forward(self.module, *args, **kwargs)


def _chunked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = type(self).forward.__get__(self)
    options = self.__dict__.get(_OPTIONS)
    if options is None:
        return original(*args, **kwargs)
    chunk, in_eval = options
    if not (self.training or in_eval):
        return original(*args, **kwargs)
    signature = inspect.signature(original)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(parameter.name, {}))
    if arguments.get("labels") is None and arguments.get("shift_labels") is None:
        return original(*args, **kwargs)
    return _loss_forward(self, arguments, chunk)


def _loss_forward(model: nn.Module, arguments: dict[str, Any], chunk: int) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    decoder, head = _causal_lm_parts(model)
    labels = arguments.pop("labels", None)
    loss_kwargs = {k: arguments.pop(k) for k in _LOSS_KWARGS if k in arguments}
    if loss_kwargs.get("shift_labels") is not None:
        labels = None  # as transformers' loss: aligned targets win over labels
    for name in _HEAD_ONLY_KWARGS:
        arguments.pop(name, None)
    return_dict = arguments.pop("return_dict", None)
    outputs = decoder(**arguments)
    hidden = outputs[0] if isinstance(outputs, tuple) else outputs.last_hidden_state
    loss = chunked_causal_lm_loss(
        hidden,
        head.weight,
        labels,
        chunk_size=chunk,
        bias=head.bias,
        num_items_in_batch=loss_kwargs.get("num_items_in_batch"),
        shift_labels=loss_kwargs.get("shift_labels"),
        ignore_index=loss_kwargs.get("ignore_index", -100),
    )
    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    carried = {}
    if not isinstance(outputs, tuple):
        carried = {k: v for k, v in outputs.items() if k in fields and k != "last_hidden_state"}
    result = CausalLMOutputWithPast(loss=loss, logits=None, **carried)
    if return_dict is False:
        return result.to_tuple()
    return result
