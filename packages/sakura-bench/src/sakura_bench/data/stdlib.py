"""Real text that every machine has: the Python standard library's own sources.

The modules of the running interpreter's stdlib directory (``sysconfig``'s ``stdlib``
path, its top-level ``*.py`` files in name order) are split into a training and a held-out
set by a hash of the module name (CRC-32, one module in ``EVAL_EVERY`` is held out), so
held-out perplexity is measured on modules the model never trained on.  Each module is
cut into documents at its top-level definitions (PEP 8's two blank lines), which gives
documents of many lengths -- what padding-free packing is for.  The same Python version
gives the same text; the report records the version.
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

__all__ = ["EVAL_EVERY", "documents", "packed_split", "stdlib_modules"]

EVAL_EVERY = 5
"""One module in this many (by CRC-32 of its name) is held out for evaluation."""

Tokenize = Callable[[str], Sequence[int]]


def stdlib_modules(held_out: bool, root: Path | None = None) -> list[Path]:
    """The top-level stdlib modules of one side of the split, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    paths = sorted(p for p in root.glob("*.py") if p.is_file())
    if not paths:
        raise FileNotFoundError(f"no Python modules in the standard library directory {root}")
    return [p for p in paths if (zlib.crc32(p.stem.encode()) % EVAL_EVERY == 0) == held_out]


def documents(paths: Sequence[Path]) -> Iterator[str]:
    """The non-empty top-level blocks of each module (split at two blank lines)."""
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        for block in text.split("\n\n\n"):
            block = block.strip("\n")
            if block.strip():
                yield block + "\n"


def packed_split(
    tokenize: Tokenize,
    *,
    held_out: bool,
    rows: int,
    max_length: int,
    pad_token_id: int,
    root: Path | None = None,
) -> dict[str, torch.Tensor]:
    """``rows`` packed rows of ``max_length`` tokens from one side of the split.

    Documents are tokenized in order until they hold a little more than ``rows`` full
    rows, then packed best-fit decreasing by :func:`sakura_adapters.packing.pack_sequences`
    (longer documents split into pieces of ``max_length``); the ``rows`` fullest rows are
    kept.  Documents that contain ``pad_token_id`` are left out, so ``input_ids !=
    pad_token_id`` counts the real tokens.  Returns ``input_ids``, ``labels`` (-100 at
    each document's first token and at padding) and ``position_ids`` (restarting at every
    document), each ``(rows, max_length)``."""
    from sakura_adapters.packing import pack_sequences

    wanted = rows * max_length
    docs: list[list[int]] = []
    tokens = 0
    source = documents(stdlib_modules(held_out, root))
    packed: dict[str, torch.Tensor] | None = None
    target = int(wanted * 1.05) + max_length
    while True:
        for text in source:
            ids = list(tokenize(text))
            if not ids or pad_token_id in ids:
                continue
            docs.append(ids)
            tokens += len(ids)
            if tokens >= target:
                break
        else:
            if packed is not None or not docs:
                raise ValueError(
                    f"the standard library has too little text for {rows} rows of "
                    f"{max_length} tokens"
                )
        packed = pack_sequences(docs, max_length, pad_token_id=pad_token_id)
        if packed["input_ids"].shape[0] >= rows:
            break
        target += wanted // 4 + max_length
    fill = (packed["input_ids"] != pad_token_id).sum(dim=1)
    keep = torch.argsort(fill, descending=True, stable=True)[:rows].sort().values
    return {key: value[keep].contiguous() for key, value in packed.items()}
