"""Text data: GLUE/SST-2 TSV files, plain-text corpora for language models, and synthetic
token data with the same shapes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sakura_bench.data.files import find_file, read_bytes
from sakura_bench.data.tokenizer import CLS, PAD, SEP, SPECIALS, WordTokenizer
from sakura_bench.errors import BenchError

__all__ = [
    "GLUE_TASKS",
    "GlueTask",
    "TextExamples",
    "read_glue_task",
    "read_lm_corpus",
    "read_tsv",
    "synthetic_classification",
    "synthetic_lm",
]


@dataclass(frozen=True)
class GlueTask:
    """Where a GLUE task's TSV files are and which columns hold what."""

    key: str
    folder: str
    first: str | int
    """Column of the (first) sentence: a header name, or an index for header-less files."""
    second: str | int | None
    label: str | int
    labels: tuple[str, ...]
    header: bool = True
    dev: str = "dev.tsv"


GLUE_TASKS: dict[str, GlueTask] = {
    "sst2": GlueTask("sst2", "SST-2", "sentence", None, "label", ("0", "1")),
    "cola": GlueTask("cola", "CoLA", 3, None, 1, ("0", "1"), header=False),
    "mrpc": GlueTask("mrpc", "MRPC", "#1 String", "#2 String", "Quality", ("0", "1")),
    "qnli": GlueTask(
        "qnli", "QNLI", "question", "sentence", "label", ("entailment", "not_entailment")
    ),
    "rte": GlueTask(
        "rte", "RTE", "sentence1", "sentence2", "label", ("entailment", "not_entailment")
    ),
    "mnli": GlueTask(
        "mnli",
        "MNLI",
        "sentence1",
        "sentence2",
        "gold_label",
        ("contradiction", "entailment", "neutral"),
        dev="dev_matched.tsv",
    ),
}


@dataclass
class TextExamples:
    first: list[str]
    second: list[str] | None
    labels: torch.Tensor


def read_tsv(path: Path) -> list[list[str]]:
    """Rows of a tab-separated file (no quoting, as GLUE writes them); blank lines skipped."""
    text = read_bytes(path).decode("utf-8")
    return [line.split("\t") for line in text.splitlines() if line.strip()]


def _column(header: list[str] | None, spec: str | int, path: Path) -> int:
    if isinstance(spec, int):
        return spec
    if header is None or spec not in header:
        raise BenchError(f"{path}: no column {spec!r} in the header {header}")
    return header.index(spec)


def read_task_file(path: Path, task: GlueTask) -> TextExamples:
    """One TSV file of ``task`` as sentences and label ids."""
    rows = read_tsv(path)
    header = rows.pop(0) if task.header and rows else None
    if not rows:
        raise BenchError(f"{path} holds no examples")
    a = _column(header, task.first, path)
    b = _column(header, task.second, path) if task.second is not None else None
    y = _column(header, task.label, path)
    width = max(a, b or 0, y) + 1
    first: list[str] = []
    second: list[str] | None = [] if b is not None else None
    labels: list[int] = []
    for number, row in enumerate(rows, start=2 if header else 1):
        if len(row) < width:
            raise BenchError(f"{path}:{number}: {len(row)} columns, expected at least {width}")
        label = row[y].strip()
        if label not in task.labels:
            raise BenchError(
                f"{path}:{number}: label {label!r} is not one of {', '.join(task.labels)}"
            )
        first.append(row[a])
        if second is not None and b is not None:
            second.append(row[b])
        labels.append(task.labels.index(label))
    return TextExamples(first, second, torch.tensor(labels, dtype=torch.long))


def task_folder(data_dir: str | Path, task: GlueTask) -> Path | None:
    """The folder holding ``task``'s ``train.tsv``: ``data_dir/<Folder>/`` (a GLUE
    download) or ``data_dir`` itself; None when neither has one."""
    root = Path(data_dir)
    if not root.is_dir():
        raise BenchError(f"--data {str(data_dir)!r} is not a directory")
    for folder in (root / task.folder, root):
        if (folder / "train.tsv").is_file() or (folder / "train.tsv.gz").is_file():
            return folder
    return None


def read_glue_task(data_dir: str | Path, task: GlueTask) -> tuple[TextExamples, TextExamples]:
    """``(train, dev)`` of ``task`` from ``data_dir/<Folder>/`` or ``data_dir``."""
    folder = task_folder(data_dir, task)
    if folder is None:
        raise BenchError(
            f"--data {str(data_dir)!r}: no {task.folder}/train.tsv (nor train.tsv) for GLUE "
            f"task {task.key}"
        )
    train = find_file(folder, ["train.tsv"])
    dev = find_file(folder, [task.dev])
    return read_task_file(train, task), read_task_file(dev, task)


def read_lm_corpus(data_dir: str | Path) -> tuple[str, str]:
    """``(train_text, eval_text)`` from ``train.txt`` and ``valid.txt`` (or
    ``validation.txt``/``test.txt``) in ``data_dir``."""
    train = find_file(data_dir, ["train.txt"])
    valid = find_file(data_dir, ["valid.txt", "validation.txt", "test.txt"])
    return read_bytes(train).decode("utf-8"), read_bytes(valid).decode("utf-8")


def pack_lm(
    tokenizer: WordTokenizer, text: str, seq_len: int, limit: int
) -> dict[str, torch.Tensor]:
    """``text`` as up to ``limit`` blocks of ``seq_len`` consecutive token ids."""
    ids = torch.tensor(tokenizer.encode_words(text), dtype=torch.long)
    blocks = min(limit, ids.numel() // seq_len)
    if blocks == 0:
        raise BenchError(
            f"the text holds {ids.numel()} tokens, fewer than one sequence of {seq_len}"
        )
    input_ids = ids[: blocks * seq_len].view(blocks, seq_len).clone()
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": input_ids.clone(),
    }


def synthetic_classification(
    n: int,
    *,
    seq_len: int,
    vocab_size: int,
    num_labels: int,
    seed: int,
    split: int,
    pair: bool = False,
) -> dict[str, torch.Tensor]:
    """``n`` learnable token sequences of random length (a quarter to all of ``seq_len``):
    each label has its own marker tokens, which replace about 15 % of a sequence's words."""
    first = len(SPECIALS)
    if vocab_size < first + 4 * num_labels:
        raise ValueError(f"vocab_size={vocab_size} is too small for {num_labels} labels")
    g = torch.Generator().manual_seed(seed * 7919 + 101 * (split + 1))
    labels = torch.randint(0, num_labels, (n,), generator=g)
    lengths = torch.randint(max(4, seq_len // 4), seq_len + 1, (n,), generator=g)
    ids = torch.randint(first, vocab_size, (n, seq_len), generator=g)
    markers_per_label = max(1, min(16, (vocab_size - first) // (4 * num_labels)))
    marker = (
        first
        + labels[:, None] * markers_per_label
        + torch.randint(0, markers_per_label, (n, seq_len), generator=g)
    )
    ids = torch.where(torch.rand((n, seq_len), generator=g) < 0.15, marker, ids)
    positions = torch.arange(seq_len)[None, :]
    ids[:, 0] = CLS
    ids[torch.arange(n), lengths - 1] = SEP
    if pair:
        middle = (lengths // 2).clamp(min=2)
        ids[torch.arange(n), middle - 1] = SEP
    ids = torch.where(positions < lengths[:, None], ids, torch.full_like(ids, PAD))
    mask = (positions < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def synthetic_lm(
    n: int, *, seq_len: int, vocab_size: int, seed: int, split: int
) -> dict[str, torch.Tensor]:
    """``n`` sequences from a fixed random Markov chain (three times in four the next token
    is the current one's fixed successor), so a language model has something to learn."""
    first = len(SPECIALS)
    span = vocab_size - first
    successor = torch.randperm(span, generator=torch.Generator().manual_seed(seed)) + first
    g = torch.Generator().manual_seed(seed * 7919 + 101 * (split + 1))
    ids = torch.empty((n, seq_len), dtype=torch.long)
    ids[:, 0] = torch.randint(first, vocab_size, (n,), generator=g)
    jump = torch.rand((n, seq_len), generator=g) >= 0.75
    random_ids = torch.randint(first, vocab_size, (n, seq_len), generator=g)
    for t in range(1, seq_len):
        follow = successor[ids[:, t - 1] - first]
        ids[:, t] = torch.where(jump[:, t], random_ids[:, t], follow)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
