"""Padding-free packing: variable-length documents in full rows, attention kept inside each.

Training a causal LM on documents of many lengths wastes most of a padded batch.  Packing
puts several documents in one row instead:

* :func:`best_fit` chooses which documents share a row (best-fit decreasing bin packing);
* :func:`pack_sequences` builds the rows: ``input_ids``, ``labels`` and ``position_ids``,
  the positions restarting at 0 for every document and the label of each document's first
  token set to -100, so no token is predicted from another document;
* :class:`PackedCollator` does the same per batch for ``transformers.Trainer``.

Why position ids are enough: transformers' causal mask (``masking_utils``) recognises packed
documents from ``position_ids`` (a position that does not follow its predecessor starts a
new document) and makes the mask block-diagonal, for the eager and SDPA attentions as for
flash-attention.  It does so only when no ``attention_mask`` is given **and no KV cache is
built** — and a model whose ``config.use_cache`` is true (the default) builds one on every
forward, training included, unless ``use_cache=False`` is passed.  With a cache the
documents silently attend to each other.  ``transformers.Trainer`` (5.x) sets
``model.config.use_cache`` from ``TrainingArguments.use_cache`` (default False);
:class:`PackedCollator` adds ``use_cache=False`` to every batch anyway, and a loop of one's
own (Lightning, plain torch) must pass it too, or set ``model.config.use_cache = False``.
The detection is in transformers 4.54 and later; before, only flash-attention separated
packed documents.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sakura.options import check_choice, check_int, option_error

__all__ = ["IGNORE_INDEX", "MAX_TOKEN_ID", "PackedCollator", "best_fit", "pack_sequences"]

IGNORE_INDEX = -100
"""The label that cross-entropy ignores (transformers' and torch's default)."""

MAX_TOKEN_ID = 2**31 - 1
"""The largest token id accepted (and ``pad_token_id``): ids are int32-sized in every
tokenizer (the largest vocabularies hold a few hundred thousand), so a larger one is a
corrupted input, not a token."""
_ID_TEXT = f"a token id: an int from 0 to {MAX_TOKEN_ID} (not a bool)"
_LABEL_TEXT = f"a label: {IGNORE_INDEX} or a token id, an int from 0 to {MAX_TOKEN_ID}"

OVERFLOW = ("split", "truncate", "error")
PAD_TO = ("max_length", "longest")


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices whose lengths sum to at most ``capacity`` each.

    Best-fit decreasing: items are placed longest first, each in the open bin it fills most
    tightly (the least room left that still fits; ties to the bin opened first), a new bin
    when none fits.  Asymptotically it needs at most 11/9 of the optimal number of bins
    (Johnson, 1974), and any two of its bins hold more than ``capacity`` together (a bin
    is opened only when the item fits in no open bin).  It is a heuristic: on a given list,
    first-fit in the original order occasionally needs one bin fewer.  Each bin lists its
    indices in increasing order; bins are in the order they were opened.
    """
    capacity = check_int("capacity", capacity, minimum=1, owner="best_fit")
    sizes = [_length(value, capacity, i) for i, value in enumerate(lengths)]
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (space left, bin index) of bins not yet full, sorted
    for item in order:
        size = sizes[item]
        at = bisect.bisect_left(room, (size, -1))
        if at == len(room):
            index, left = len(bins), capacity - size
            bins.append([item])
        else:
            space, index = room.pop(at)
            bins[index].append(item)
            left = space - size
        if left > 0:
            bisect.insort(room, (left, index))
    return [sorted(b) for b in bins]


def _length(value: Any, capacity: int, index: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= capacity:
        raise option_error(
            f"lengths[{index}]", value, f"an int from 1 to capacity={capacity}", owner="best_fit"
        )
    return value


def pack_sequences(
    sequences: Sequence[Any],
    max_length: int,
    *,
    pad_token_id: int = 0,
    overflow: str = "split",
    pad_to: str = "max_length",
) -> dict[str, torch.Tensor]:
    """Documents packed into rows of at most ``max_length`` tokens (see :func:`best_fit`).

    Args:
        sequences: documents, each a sequence of token ids (list, tuple, 1-D tensor) or a
            mapping with ``input_ids`` and optionally ``labels`` of the same length (-100
            where a token is not to be learned, e.g. a prompt).  Ids are ints from 0 to
            :data:`MAX_TOKEN_ID` (not bools), labels the same or -100.
        max_length: tokens per row.
        pad_token_id: the input id of padding at the end of rows (a token id, 0 to
            :data:`MAX_TOKEN_ID`).
        overflow: a document longer than ``max_length``: ``"split"`` into pieces of
            ``max_length`` tokens, each packed as a document of its own (the first token of
            each piece is not predicted); ``"truncate"`` to its first ``max_length`` tokens;
            ``"error"``.
        pad_to: ``"max_length"`` (every row ``max_length`` wide: fixed shapes) or
            ``"longest"`` (as wide as the fullest row).

    Returns:
        ``input_ids``, ``labels`` and ``position_ids``, ``int64`` tensors of
        ``(rows, width)``.  Positions count from 0 in every document; the label of every
        document's first token is -100, so the last token of one document never learns to
        predict the next document.  Padding has label -100 and positions 0, 1, ... (a
        segment of its own).  Pass the rows with **no** ``attention_mask`` and with
        ``use_cache=False`` (see the module's docstring).
    """
    owner = "pack_sequences"
    max_length = check_int("max_length", max_length, minimum=1, owner=owner)
    pad_token_id = check_int(
        "pad_token_id", pad_token_id, minimum=0, maximum=MAX_TOKEN_ID, owner=owner
    )
    check_choice("overflow", overflow, OVERFLOW, owner=owner)
    check_choice("pad_to", pad_to, PAD_TO, owner=owner)
    documents: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, sequence in enumerate(sequences):
        ids, labels = _document(sequence, i)
        if ids.numel() > max_length:
            if overflow == "error":
                raise option_error(
                    f"sequences[{i}]",
                    f"<{ids.numel()} tokens>",
                    f"at most max_length={max_length} tokens with overflow='error' "
                    f"('split' and 'truncate' accept longer documents)",
                    owner=owner,
                )
            if overflow == "truncate":
                ids, labels = ids[:max_length], labels[:max_length]
        for start in range(0, ids.numel(), max_length):
            documents.append((ids[start : start + max_length], labels[start : start + max_length]))
    if not documents:
        raise option_error("sequences", sequences, "at least one non-empty document", owner=owner)
    rows = best_fit([d[0].numel() for d in documents], max_length)
    used = [sum(documents[i][0].numel() for i in row) for row in rows]
    width = max_length if pad_to == "max_length" else max(used)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.empty((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            ids, doc_labels = documents[i]
            n = ids.numel()
            input_ids[r, at : at + n] = ids
            labels[r, at + 1 : at + n] = doc_labels[1:]
            position_ids[r, at : at + n] = torch.arange(n)
            at += n
        position_ids[r, at:] = torch.arange(width - at)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def _document(sequence: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of one document as 1-D int64 tensors."""
    labels: Any = None
    ids: Any = sequence
    if isinstance(sequence, Mapping):
        if "input_ids" not in sequence:
            raise option_error(
                f"sequences[{index}]",
                f"<mapping with keys {sorted(sequence)}>",
                "a mapping with 'input_ids' (and optionally 'labels')",
                owner="pack_sequences",
            )
        ids, labels = sequence["input_ids"], sequence.get("labels")
    ids_t = _ids(ids, f"sequences[{index}]", labels=False)
    if labels is None:
        return ids_t, ids_t
    labels_t = _ids(labels, f"sequences[{index}]['labels']", labels=True)
    if labels_t.shape != ids_t.shape:
        raise option_error(
            f"sequences[{index}]['labels']",
            f"<{labels_t.numel()} labels>",
            f"one label per input id ({ids_t.numel()})",
            owner="pack_sequences",
        )
    return ids_t, labels_t


def _ids(value: Any, option: str, *, labels: bool) -> torch.Tensor:
    """``value`` as a 1-D int64 tensor, each element a token id (or -100 for ``labels``)."""
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        tensor = None
    if tensor is not None and tensor.dim() == 1 and tensor.numel() == 0:
        return tensor.to(torch.long)  # an empty document: packed as nothing
    if (
        tensor is None
        or tensor.dim() != 1
        or tensor.is_floating_point()
        or tensor.is_complex()
        or tensor.dtype == torch.bool
    ):
        shown = value if not isinstance(value, torch.Tensor) else f"<tensor {tuple(value.shape)}>"
        raise option_error(option, shown, "a 1-D sequence of int token ids", owner="pack_sequences")
    ids = tensor.to(torch.long)  # a uint64 past int64's range wraps negative: caught below
    bad = (ids < 0) | (ids > MAX_TOKEN_ID)
    if labels:
        bad &= ids != IGNORE_INDEX
    if bool(bad.any()):
        at = int(bad.nonzero()[0])
        raise option_error(
            f"{option}[{at}]",
            int(tensor[at]),
            _LABEL_TEXT if labels else _ID_TEXT,
            owner="pack_sequences",
        )
    return ids


class PackedCollator:
    """A ``data_collator`` for ``transformers.Trainer`` that packs each batch's documents.

    With ``max_length`` the batch's features are packed into rows of at most
    ``max_length`` tokens by :func:`pack_sequences` (best-fit decreasing); with
    ``max_length=None`` they are concatenated into one row, which is what transformers'
    ``DataCollatorWithFlattening`` does (and is used for).  Either way the batch has
    ``input_ids``, ``labels`` and ``position_ids`` (no ``attention_mask``) and, unless
    ``use_cache=None``, ``use_cache`` (default False: without it the model builds a KV
    cache and transformers no longer separates the documents, see the module docstring).

    Features are mappings with ``input_ids`` and optionally ``labels`` (lists or 1-D
    tensors), as a tokenized dataset yields them; other keys (``attention_mask``) are
    ignored.
    """

    def __init__(
        self,
        max_length: int | None = None,
        *,
        pad_token_id: int = 0,
        overflow: str = "split",
        pad_to: str = "longest",
        use_cache: bool | None = False,
    ) -> None:
        owner = "PackedCollator"
        self.max_length = check_int(
            "max_length", max_length, minimum=1, allow_none=True, owner=owner
        )
        self.pad_token_id = check_int(
            "pad_token_id", pad_token_id, minimum=0, maximum=MAX_TOKEN_ID, owner=owner
        )
        self.overflow = check_choice("overflow", overflow, OVERFLOW, owner=owner)
        self.pad_to = check_choice("pad_to", pad_to, PAD_TO, owner=owner)
        self.use_cache = check_choice("use_cache", use_cache, (False, True, None), owner=owner)
        self._flatten: Any = None
        _check_transformers()
        if self.max_length is None:
            from transformers import DataCollatorWithFlattening

            self._flatten = DataCollatorWithFlattening(  # type: ignore[no-untyped-call]
                return_position_ids=True, separator_id=IGNORE_INDEX
            )

    def __repr__(self) -> str:
        return (
            f"PackedCollator(max_length={self.max_length}, overflow={self.overflow!r}, "
            f"pad_to={self.pad_to!r}, use_cache={self.use_cache})"
        )

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any]
        if self._flatten is not None:
            batch = dict(self._flatten(list(features), return_tensors="pt"))
        else:
            batch = dict(
                pack_sequences(
                    features,
                    self.max_length,
                    pad_token_id=self.pad_token_id,
                    overflow=self.overflow,
                    pad_to=self.pad_to,
                )
            )
        if self.use_cache is not None:
            batch["use_cache"] = self.use_cache
        return batch


def _check_transformers() -> None:
    """Warn when this transformers cannot separate packed documents outside flash-attention."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        import warnings

        warnings.warn(
            "PackedCollator: this transformers version detects packed documents from "
            "position_ids only with flash-attention; with eager or SDPA attention the "
            "documents of a row attend to each other (transformers >= 4.54 separates them)",
            RuntimeWarning,
            stacklevel=3,
        )
