"""Multi-task DistilBERT on GLUE: one encoder, one classification head per task.

Tasks: SST-2, CoLA (single sentences), MRPC, QNLI, RTE, MNLI (sentence pairs).  Each batch
comes from one task (its head runs); the order of the tasks' batches is shuffled each
epoch.  Synthetic data for all six tasks by default; ``--data DIR`` reads every task whose
folder (``SST-2/``, ``CoLA/``, ``MRPC/``, ``QNLI/``, ``RTE/``, ``MNLI/``) is in ``DIR``,
``train.tsv`` and ``dev.tsv`` (MNLI: ``dev_matched.tsv``), tokenized with sakura-bench's
word-level tokenizer.  Metrics: accuracy per task (``val_acc_<task>``), their mean
(``val_acc``) and the loss over every evaluation example (``val_loss``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from sakura_bench.errors import BenchError
from sakura_bench.workload import Split, Workload, classification_sums
from sakura_bench.workloads.distilbert import DISTILBERT_GPU, DISTILBERT_SCALES

__all__ = ["DistilBertGLUE", "MultiTaskBatches"]

TASK_ORDER = ("sst2", "cola", "mrpc", "qnli", "rte", "mnli")
_PAIRS = {"mrpc", "qnli", "rte", "mnli"}


class MultiTaskBatches:
    """Single-task dict batches over a table with a ``task`` column; the batch carries the
    task as a Python int (``batch["task"]``), so choosing the head needs no host read."""

    def __init__(
        self,
        split: Split,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.columns = {k: v for k, v in split.items() if k != "task"}
        task = split["task"]
        self.groups = [
            (int(t), (task == t).nonzero().flatten()) for t in torch.unique(task).tolist()
        ]
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def _plan(self, epoch: int) -> list[tuple[int, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        plan: list[tuple[int, torch.Tensor]] = []
        for task, rows in self.groups:
            if self.shuffle:
                rows = rows[torch.randperm(rows.numel(), generator=g)]
            if self.world_size > 1:
                per_rank = rows.numel() // self.world_size
                rows = rows[: per_rank * self.world_size][self.rank :: self.world_size]
            plan += [(task, chunk) for chunk in rows.split(self.batch_size) if chunk.numel()]
        if self.shuffle:
            order = torch.randperm(len(plan), generator=g).tolist()
            plan = [plan[i] for i in order]
        return plan

    def __len__(self) -> int:
        return len(self._plan(0))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        plan = self._plan(self.epoch)
        self.epoch += 1
        for task, rows in plan:
            batch: dict[str, Any] = {k: v[rows] for k, v in self.columns.items()}
            batch["task"] = task
            yield batch


class DistilBertGLUE(Workload):
    """Multi-task DistilBERT over six GLUE tasks (raw and Lightning loops)."""

    description = "multi-task DistilBERT, one head per GLUE task, AdamW"
    default_epochs = 2
    frameworks = ("pytorch-ddp", "lightning")
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "tiny": {**DISTILBERT_SCALES["tiny"], "train": 16, "eval": 8},
        "small": {**DISTILBERT_SCALES["small"], "train": 64, "eval": 32},
        "full": {**DISTILBERT_SCALES["full"], "batch_size": 32, "train": 4096, "eval": 1024},
    }
    gpu_scales: ClassVar[Mapping[str, str]] = DISTILBERT_GPU

    _cache: tuple[list[str], dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None

    def _load(self) -> tuple[list[str], Split, Split]:
        if self._cache is not None:
            return self._cache
        from sakura_bench.data.text import GLUE_TASKS

        c = self.config
        train_parts: list[Split] = []
        eval_parts: list[Split] = []
        if self.data_dir is None:
            from sakura_bench.data.text import synthetic_classification

            tasks = list(TASK_ORDER)
            for i, key in enumerate(tasks):
                common = {
                    "seq_len": c["max_length"],
                    "vocab_size": c["vocab_size"],
                    "num_labels": len(GLUE_TASKS[key].labels),
                    "pair": key in _PAIRS,
                }
                seed = self.seed * 31 + i
                train_parts.append(
                    synthetic_classification(c["train"], seed=seed, split=0, **common)
                )
                eval_parts.append(synthetic_classification(c["eval"], seed=seed, split=1, **common))
        else:
            from sakura_bench.data.text import read_glue_task, task_folder
            from sakura_bench.data.tokenizer import WordTokenizer

            tasks = [k for k in TASK_ORDER if task_folder(self.data_dir, GLUE_TASKS[k]) is not None]
            if not tasks:
                raise BenchError(
                    f"--data {self.data_dir!r} holds no GLUE task folder; expected one or more of "
                    + ", ".join(f"{GLUE_TASKS[k].folder}/train.tsv" for k in TASK_ORDER)
                )
            examples = {k: read_glue_task(self.data_dir, GLUE_TASKS[k]) for k in tasks}
            texts = []
            for train_ex, _ in examples.values():
                texts += train_ex.first[: c["train"]]
                texts += (train_ex.second or [])[: c["train"]]
            tokenizer = WordTokenizer.build(texts, c["vocab_size"])
            for key in tasks:
                for part, ex, n in (
                    (train_parts, examples[key][0], c["train"]),
                    (eval_parts, examples[key][1], c["eval"]),
                ):
                    second = ex.second[:n] if ex.second is not None else None
                    ids, mask = tokenizer.encode_pairs(ex.first[:n], second, c["max_length"])
                    part.append({"input_ids": ids, "attention_mask": mask, "labels": ex.labels[:n]})
        train = _stack(train_parts)
        dev = _stack(eval_parts)
        self._cache = (tasks, train, dev)
        return self._cache

    @property
    def tasks(self) -> list[str]:
        return self._load()[0]

    def train_split(self) -> Split:
        return self._load()[1]

    def eval_split(self) -> Split:
        return self._load()[2]

    def train_batches(
        self, split: Split, *, rank: int = 0, world_size: int = 1
    ) -> MultiTaskBatches:
        return MultiTaskBatches(
            split, self.batch_size, shuffle=True, seed=self.seed, rank=rank, world_size=world_size
        )

    def eval_batches(self, split: Split, *, rank: int = 0, world_size: int = 1) -> MultiTaskBatches:
        return MultiTaskBatches(
            split, self.eval_batch_size, shuffle=False, rank=rank, world_size=world_size
        )

    def make_model(self) -> nn.Module:
        from sakura_bench.data.text import GLUE_TASKS
        from sakura_bench.models.transformer import MultiTaskDistilBert, distilbert_config

        labels = [len(GLUE_TASKS[k].labels) for k in self.tasks]
        torch.manual_seed(self.seed)
        return MultiTaskDistilBert(distilbert_config(self.config, num_labels=2), labels)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=float(self.config["lr"]), weight_decay=0.01)

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        logits = model(batch["input_ids"], batch["attention_mask"], batch["task"])
        return nn.functional.cross_entropy(logits, batch["labels"])

    def eval_batch(self, model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        task = batch["task"]
        sums = classification_sums(
            model(batch["input_ids"], batch["attention_mask"], task), batch["labels"]
        )
        return {f"{self.tasks[task]}/{k}": v for k, v in sums.items()}

    def eval_metrics(self, totals: Mapping[str, torch.Tensor]) -> dict[str, float]:
        values = {k: float(v) for k, v in totals.items()}
        metrics: dict[str, float] = {}
        loss = count = 0.0
        for key in self.tasks:
            n = values.get(f"{key}/count", 0.0)
            if n:
                metrics[f"val_acc_{key}"] = values[f"{key}/correct"] / n
                loss += values[f"{key}/loss_sum"]
                count += n
        accs = [v for k, v in metrics.items() if k.startswith("val_acc_")]
        metrics["val_acc"] = sum(accs) / max(len(accs), 1)
        metrics["val_loss"] = loss / max(count, 1.0)
        return metrics


def _stack(parts: list[Split]) -> Split:
    """Concatenate per-task tables, adding the ``task`` column."""
    out: Split = {
        key: torch.cat([p[key] for p in parts]) for key in ("input_ids", "attention_mask", "labels")
    }
    out["task"] = torch.cat(
        [torch.full((p["labels"].shape[0],), i, dtype=torch.long) for i, p in enumerate(parts)]
    )
    return out
