"""The workload interface: what a benchmark trains, on what data, and how it is evaluated.

A workload is a class registered through the ``sakura_register_workloads`` hook.  Built
for one run as ``Workload(scale=..., data_dir=..., seed=...)``, it provides

* the data: :meth:`train_split` and :meth:`eval_split` return column tensors in host
  memory (synthetic with the real shapes by default, read from ``data_dir`` otherwise);
* the model and optimizer: :meth:`make_model`, :meth:`make_optimizer`;
* the step: :meth:`loss` (the mean training loss of a dict batch);
* the evaluation: :meth:`eval_batch` returns per-batch *sums* (tensors, kept on the device
  so that evaluating costs no host read per batch) and :meth:`eval_metrics` turns the
  totals into metrics (``val_loss``, ``val_acc``...), once per evaluation.

HF-shaped workloads (``hf_shaped = True``) build a model whose ``forward(**batch)``
returns an output with ``.loss`` and have dict batches with a ``labels`` key; only those
run under the ``hf-trainer`` framework.

Everything must be deterministic for a given ``seed``: the trainer, every trial and the
evaluation worker of an asynchronous eval service rebuild the same model and data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from sakura_bench.batches import Batches, check_columns
from sakura_bench.errors import BenchError, ScaleError

__all__ = ["SCALES", "Split", "Workload", "classification_sums", "move_to"]

SCALES = ("tiny", "small", "full")

Split = dict[str, torch.Tensor]
"""A split of a dataset: column name -> tensor, equal first dimension."""


def move_to(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """``batch`` with every tensor (in dicts, lists and tuples) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: move_to(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device, non_blocking) for v in batch)
    return batch


def classification_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summed cross-entropy, correct predictions and count of a batch (device tensors)."""
    logits = logits.float()
    return {
        "loss_sum": nn.functional.cross_entropy(logits, labels, reduction="sum"),
        "correct": (logits.argmax(dim=-1) == labels).sum(),
        "count": torch.tensor(labels.shape[0], device=labels.device),
    }


class Workload:
    """Base class of benchmark workloads.  Subclasses set ``configs`` (one dict per scale,
    with at least ``batch_size``) and implement the data, model, loss and eval methods."""

    description: ClassVar[str] = ""
    hf_shaped: ClassVar[bool] = False
    """True when ``make_model()`` returns a model whose ``forward(**batch)`` returns an
    output with ``.loss`` and batches are dicts with a ``labels`` key (``hf-trainer``)."""
    frameworks: ClassVar[tuple[str, ...] | None] = None
    """The frameworks this workload supports; None: every framework that accepts it."""
    default_epochs: ClassVar[int] = 1
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    """Scale name -> settings (``batch_size``, ``eval_batch_size``, sizes, model sizes)."""
    gpu_scales: ClassVar[Mapping[str, str]] = {}
    """Scale name -> why it needs a CUDA GPU (shown when none is available)."""
    grad_clip: ClassVar[float | None] = None
    """Clip gradients to this global norm every step (None: no clipping)."""
    variants: ClassVar[Mapping[str, str]] = {}
    """Variant name -> description: other ways this workload can build its model for a
    rival to run against (``--variant``; e.g. the QLoRA workloads' ``peft-bnb``, a
    bitsandbytes base).  Same data, steps and seed; ``variant`` says which one is built."""

    def __init__(
        self,
        scale: str = "full",
        *,
        data_dir: str | None = None,
        seed: int = 0,
        name: str | None = None,
        variant: str | None = None,
    ) -> None:
        if variant is not None and variant not in self.variants:
            accepted = ", ".join(self.variants) if self.variants else "none (it has no variants)"
            raise BenchError(
                f"--variant {variant!r} is not a variant of workload "
                f"{name or type(self).__name__!r}; accepted: {accepted}"
            )
        if scale not in self.configs:
            raise BenchError(
                f"--scale {scale!r} is not a scale of workload {name or type(self).__name__!r}; "
                f"accepted: {', '.join(self.configs)}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise BenchError(f"--seed must be an int >= 0, got {seed!r}")
        self.name = name or type(self).__name__
        self.scale = scale
        self.data_dir = data_dir
        self.seed = seed
        self.variant = variant
        self.config: dict[str, Any] = dict(self.configs[scale])
        self.device = torch.device("cpu")
        """Where the model will train (set by the harness before :meth:`make_model`, so a
        very large model can be initialised there directly)."""
        if "batch_size" not in self.config:
            raise TypeError(f"{type(self).__name__}.configs[{scale!r}] has no 'batch_size'")

    # --- settings ----------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return int(self.config["batch_size"])

    @property
    def eval_batch_size(self) -> int:
        return int(self.config.get("eval_batch_size", self.batch_size))

    @classmethod
    def default_scale(cls, device: torch.device) -> str:
        """The scale ``--scale auto`` (the default) picks: the largest on a CUDA device;
        elsewhere ``small`` (a README command then finishes in about a minute on a laptop
        CPU), or the largest scale that does not need a GPU when there is no ``small``."""
        names = list(cls.configs)
        if device.type == "cuda":
            return "full" if "full" in names else names[-1]
        cpu = [s for s in names if s not in cls.gpu_scales]
        if "small" in cpu:
            return "small"
        return cpu[-1] if cpu else names[0]

    def check_device(self, device: torch.device) -> None:
        """ScaleError when this scale needs a CUDA GPU and ``device`` is not one."""
        reason = self.gpu_scales.get(self.scale)
        if reason and device.type != "cuda":
            smaller = [s for s in self.configs if s not in self.gpu_scales]
            raise ScaleError(
                f"workload {self.name!r} at --scale {self.scale} needs a CUDA GPU ({reason}), "
                f"and the device is {device.type!r}"
                + (f"; on CPU use --scale {' or '.join(smaller)}" if smaller else "")
            )

    # --- to implement ------------------------------------------------------------------

    def train_split(self) -> Split:
        """The training data (host tensors)."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_split()")

    def eval_split(self) -> Split:
        """The evaluation data (host tensors)."""
        raise NotImplementedError(f"{type(self).__name__} must implement eval_split()")

    def make_model(self) -> nn.Module:
        """A freshly initialised model (deterministic for ``self.seed``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_model()")

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer (default AdamW, lr 1e-3, over trainable parameters)."""
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=float(self.config.get("lr", 1e-3)))

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        """The mean training loss of ``batch``."""
        if self.hf_shaped:
            return model(**batch).loss  # type: ignore[no-any-return]
        raise NotImplementedError(f"{type(self).__name__} must implement loss()")

    def eval_batch(self, model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Per-batch sums (device tensors) that :meth:`eval_metrics` turns into metrics."""
        raise NotImplementedError(f"{type(self).__name__} must implement eval_batch()")

    def eval_metrics(self, totals: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Metrics from summed :meth:`eval_batch` results (default: ``val_loss`` and
        ``val_acc`` from ``loss_sum``, ``correct`` and ``count``)."""
        values = {k: float(v) for k, v in totals.items()}
        count = max(values.get("count", 0.0), 1.0)
        metrics = {"val_loss": values["loss_sum"] / count}
        if "correct" in values:
            metrics["val_acc"] = values["correct"] / count
        return self.complete_metrics(metrics)

    def complete_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Add metrics derived from others (the LM workloads add ``val_ppl``)."""
        return metrics

    def hf_metrics(self, predictions: Any, labels: Any) -> dict[str, float] | None:
        """Metrics ``transformers.Trainer`` computes from its gathered predictions (argmax
        ids) and labels, named without the ``eval_`` prefix; None: the loss only."""
        return None

    # --- provided ----------------------------------------------------------------------

    def train_batches(
        self, split: Split, *, rank: int = 0, world_size: int = 1
    ) -> Iterable[dict[str, Any]]:
        """Shuffled training batches, a new permutation each epoch."""
        return Batches(
            split,
            self.batch_size,
            shuffle=True,
            seed=self.seed,
            rank=rank,
            world_size=world_size,
        )

    def eval_batches(
        self, split: Split, *, rank: int = 0, world_size: int = 1
    ) -> Iterable[dict[str, Any]]:
        """Evaluation batches in order."""
        return Batches(split, self.eval_batch_size, shuffle=False, rank=rank, world_size=world_size)

    def samples(self, split: Split) -> int:
        """Samples in ``split`` (one epoch)."""
        return check_columns(split, "split")

    def tokens(self, split: Split) -> int | None:
        """Tokens in ``split`` (non-padding), or None for non-text workloads."""
        mask = split.get("attention_mask")
        return int(mask.sum()) if mask is not None else None

    @torch.inference_mode()
    def evaluate(
        self,
        model: nn.Module,
        batches: Iterable[Mapping[str, Any]],
        device: torch.device,
        *,
        distributed: bool | None = None,
    ) -> dict[str, float]:
        """Evaluate ``model`` on ``batches``: sums on the device, one host read at the end.
        With ``distributed`` (default: when ``torch.distributed`` is initialised) the sums
        are all-reduced, each rank having evaluated its shard."""
        was_training = model.training
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        for batch in batches:
            sums = self.eval_batch(model, move_to(batch, device))
            for key, value in sums.items():
                value = value.detach().to(torch.float64)
                totals[key] = totals[key] + value if key in totals else value
        if distributed is None:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            for key in sorted(totals):
                torch.distributed.all_reduce(totals[key])
        model.train(was_training)
        return self.eval_metrics(totals)

    def eval_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The weights an evaluation needs (default: the whole ``state_dict``).  A LoRA
        workload returns the adapter weights only: the frozen base is rebuilt from the
        seed by the evaluator."""
        return model.state_dict()

    def load_eval_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """Load what :meth:`eval_state` returned into a model built by :meth:`make_model`."""
        model.load_state_dict(state)
        return model

    def describe(self) -> dict[str, Any]:
        """Settings for the report (JSON-serialisable)."""
        return {
            "name": self.name,
            "scale": self.scale,
            "data": self.data_dir or "synthetic",
            "seed": self.seed,
            "variant": self.variant,
            "config": {k: v for k, v in self.config.items() if _jsonable(v)},
        }


def _jsonable(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (str, int, bool)) or value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    return False
