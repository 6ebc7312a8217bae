"""The DPO reference pass: the model being trained, with its adapters off, once.

DPO needs the log-probabilities of every chosen and rejected sequence under the reference
(the model before training).  With LoRA the reference is the base model, which the policy
already holds: :func:`reference_logprobs` runs the policy itself with its PEFT adapters
disabled (``model.disable_adapter()``), under ``torch.no_grad`` and in eval mode, over the
whole preference data once before training, and keeps two fp32 numbers per example.  So
the base is never copied (a quantized or paged base is used as it is) and the training
steps run the policy only.

The result, :class:`ReferenceLogprobs`, is keyed by example: by the ``id`` of each example
when the batches carry one (any hashable: ints, strings), else by the example's position in
the order the data was given (0, 1, ...; the dataset index when it is not shuffled).  A
training loop passes the same keys to :meth:`ReferenceLogprobs.lookup` to get the reference
tensors of its batch.

Batch format (as TRL's paired collators produce, with sakura's names):
``chosen_input_ids`` / ``rejected_input_ids`` ``(batch, seq)``; optional ``chosen_labels``
/ ``rejected_labels`` (``-100`` over the prompt and padding; default: the input ids with
``-100`` where the attention mask is 0), ``chosen_attention_mask`` /
``rejected_attention_mask`` and ``id``.  A single example (1-D tensors or lists) is a batch
of one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sakura.options import check_bool, check_int, option_error
from sakura_kernels.losses.chunked import _causal_lm_parts
from sakura_kernels.losses.preference import IGNORE_INDEX, sequence_logprobs

__all__ = [
    "ReferenceLogprobs",
    "adapters_disabled",
    "model_sequence_logprobs",
    "preference_logprobs",
    "reference_logprobs",
]

_OWNER = "reference_logprobs"
SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class ReferenceLogprobs:
    """Reference log-probabilities per example: ``chosen[i]`` and ``rejected[i]`` belong to
    ``keys[i]`` (fp32, on the CPU)."""

    keys: tuple[Hashable, ...]
    chosen: torch.Tensor
    rejected: torch.Tensor

    def __len__(self) -> int:
        return len(self.keys)

    def index(self) -> dict[Hashable, int]:
        """Key -> row."""
        return {key: row for row, key in enumerate(self.keys)}

    def lookup(
        self, keys: Iterable[Hashable] | torch.Tensor, device: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen, rejected)`` of these examples, in their order, on ``device``."""
        wanted = keys.tolist() if isinstance(keys, torch.Tensor) else list(keys)
        rows_of = self.__dict__.get("_rows")
        if rows_of is None:
            rows_of = self.index()
            object.__setattr__(self, "_rows", rows_of)
        try:
            rows = torch.tensor([rows_of[key] for key in wanted], dtype=torch.long)
        except KeyError as exc:
            raise KeyError(
                f"reference_logprobs has no example keyed {exc.args[0]!r}; the keys are the "
                f"batches' 'id' values, or positions 0..{len(self.keys) - 1} when they had none"
            ) from None
        return self.chosen[rows].to(device), self.rejected[rows].to(device)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model with its adapters off: a PEFT model's ``disable_adapter()``; a
    transformers model with adapters loaded through its PEFT integration
    (``disable_adapters()`` / ``enable_adapters()``); a model without adapters as it is."""
    disable = getattr(model, "disable_adapter", None)
    if callable(disable) and type(model).__module__.startswith("peft"):
        with disable():
            yield
        return
    if getattr(model, "_hf_peft_config_loaded", False):
        model.disable_adapters()  # type: ignore[operator]
        try:
            yield
        finally:
            model.enable_adapters()  # type: ignore[operator]
        return
    yield


def model_sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 1024,
    average: bool = False,
    **model_kwargs: Any,
) -> torch.Tensor:
    """:func:`~sakura_kernels.sequence_logprobs` of a transformers ``*ForCausalLM`` (or a
    PEFT model wrapping one): its decoder runs, its ``lm_head`` is applied in chunks."""
    decoder, head = _causal_lm_parts(model)
    model_kwargs.setdefault("use_cache", False)
    outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    hidden = outputs[0] if isinstance(outputs, tuple) else outputs.last_hidden_state
    return sequence_logprobs(hidden, head, labels, chunk_size=chunk_size, average=average)


def _side(batch: Mapping[str, Any], side: str, device: Any) -> dict[str, torch.Tensor]:
    ids = batch.get(f"{side}_input_ids")
    if ids is None:
        raise option_error(
            "batches_or_dataset",
            f"a batch without {side}_input_ids (keys: {sorted(batch)})",
            "batches or examples with chosen_input_ids and rejected_input_ids",
            owner=_OWNER,
        )
    ids = torch.as_tensor(ids)
    single = ids.dim() == 1
    part: dict[str, torch.Tensor] = {}
    for name in ("input_ids", "labels", "attention_mask"):
        value = batch.get(f"{side}_{name}")
        if value is not None:
            value = torch.as_tensor(value)
            part[name] = (value.unsqueeze(0) if single else value).to(device)
    if "labels" not in part:
        labels = part["input_ids"].clone()
        mask = part.get("attention_mask")
        if mask is not None:
            labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
        part["labels"] = labels
    return part


def preference_logprobs(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    chunk_size: int = 1024,
    average: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` sequence log-probabilities of a preference batch under the
    model as it is (the policy in a DPO step; see the module docstring for the keys)."""
    device = next(model.parameters()).device
    chosen, rejected = (_side(batch, side, device) for side in SIDES)
    if chosen.keys() == rejected.keys() and all(
        chosen[k].shape == rejected[k].shape for k in chosen
    ):
        # One forward over both halves (as TRL does): [chosen; rejected].
        both = {k: torch.cat([chosen[k], rejected[k]]) for k in chosen}
        logps = model_sequence_logprobs(
            model,
            both["input_ids"],
            both["labels"],
            attention_mask=both.get("attention_mask"),
            chunk_size=chunk_size,
            average=average,
        )
        return logps[: chosen["input_ids"].shape[0]], logps[chosen["input_ids"].shape[0] :]
    out = [
        model_sequence_logprobs(
            model,
            part["input_ids"],
            part["labels"],
            attention_mask=part.get("attention_mask"),
            chunk_size=chunk_size,
            average=average,
        )
        for part in (chosen, rejected)
    ]
    return out[0], out[1]


def _keys(batch: Mapping[str, Any], count: int, start: int, key: str) -> list[Hashable]:
    ids = batch.get(key)
    if ids is None:
        return list(range(start, start + count))
    if isinstance(ids, torch.Tensor):
        values: list[Any] = ids.reshape(-1).tolist()
    elif isinstance(ids, (str, bytes, int)) or not isinstance(ids, Sequence):
        values = [ids]
    else:
        values = list(ids)
    if len(values) != count:
        raise option_error(
            key, f"{len(values)} ids for a batch of {count}", "one id per example", owner=_OWNER
        )
    return values


def reference_logprobs(
    model: nn.Module,
    batches_or_dataset: Iterable[Mapping[str, Any]],
    *,
    chunk_size: int = 1024,
    average: bool = False,
    key: str = "id",
    disable_adapters: bool = True,
) -> ReferenceLogprobs:
    """The reference log-probabilities of every pair: ``model`` with its adapters disabled.

    Args:
        model: the policy, a transformers ``*ForCausalLM`` or a PEFT model wrapping one
            (quantized, paged, as it is). Its adapters are disabled for this pass and its
            training mode restored after it; no copy of it is made.
        batches_or_dataset: preference batches (a DataLoader) or examples (a dataset); see
            the module docstring for their keys.
        chunk_size: tokens per chunk of the head (the logits never exist).
        average: per-token averages instead of sums (as the policy's, for IPO-style losses).
        key: the batch entry holding each example's id (default ``"id"``); without it,
            examples are numbered in order.
        disable_adapters: True (default): the reference is the base, the adapters off.
            False: the model as it is now, adapters included: the reference when DPO
            continues from a trained adapter (an SFT adapter), which TRL gets by copying
            the adapter as ``"ref"``; here the copy is two numbers per example.

    Returns:
        a :class:`ReferenceLogprobs`; ``lookup(ids)`` gives a batch's reference tensors.
    """
    chunk_size = check_int("chunk_size", chunk_size, minimum=1, owner=_OWNER)
    average = check_bool("average", average, owner=_OWNER)
    disable_adapters = check_bool("disable_adapters", disable_adapters, owner=_OWNER)
    if not isinstance(key, str):
        raise option_error(
            "key", key, "the name of the batch entry holding example ids", owner=_OWNER
        )
    if not isinstance(model, nn.Module):
        raise option_error("model", type(model).__name__, "a torch.nn.Module", owner=_OWNER)
    if isinstance(batches_or_dataset, Mapping) or not isinstance(batches_or_dataset, Iterable):
        raise option_error(
            "batches_or_dataset",
            type(batches_or_dataset).__name__,
            "an iterable of preference batches or examples (a DataLoader, a dataset, a list)",
            owner=_OWNER,
        )
    keys: list[Hashable] = []
    chosen: list[torch.Tensor] = []
    rejected: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    try:
        adapters = adapters_disabled(model) if disable_adapters else contextlib.nullcontext()
        with torch.no_grad(), adapters:
            for batch in batches_or_dataset:
                c, r = preference_logprobs(model, batch, chunk_size=chunk_size, average=average)
                keys.extend(_keys(batch, c.shape[0], len(keys), key))
                chosen.append(c.float().cpu())
                rejected.append(r.float().cpu())
    finally:
        model.train(was_training)
    if len(set(keys)) != len(keys):
        raise option_error(key, "repeated ids", "one id per example, each once", owner=_OWNER)
    empty = torch.zeros(0)
    return ReferenceLogprobs(
        tuple(keys),
        torch.cat(chosen) if chosen else empty,
        torch.cat(rejected) if rejected else empty,
    )
