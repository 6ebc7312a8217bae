"""What the training loop around the runtime offers its services.

Framework knowledge lives in the adapters.  A service that needs something only the loop
knows — where the run writes its files, the framework's own checkpoint, where metrics are
reported, the model the framework actually runs — reads it from the :class:`LoopContext`
that the adapter publishes on ``OnTrainBegin.loop``, never from the framework's objects.
A third-party adapter (for a trainer Sakura has never heard of) fills in the same fields
and every first-party service works under it.

Each field is optional: None means "this loop does not offer it", and a service that needs
it says so (naming the option the user can pass instead, such as ``AsyncCheckpoint(dir=...)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LoopContext", "MetricReporter"]

MetricReporter = Callable[[Mapping[str, Any], int, int], None]
"""``report(metrics, epoch, step)``: hand metrics to the loop's own logging."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopContext:
    """Published by an adapter on ``OnTrainBegin.loop``; see the module docstring."""

    framework: str = "raw"
    """Who drives the loop: ``"lightning"``, ``"transformers"``, ``"raw"``, or a third
    party's own name.  For messages and reports only: a service never branches on it."""

    output_dir: str | None = None
    """The run's output directory (Lightning's ``default_root_dir``, the HF Trainer's
    ``args.output_dir``, what a raw loop passes to its adapter); services that write files
    default to a folder named after themselves inside it."""

    checkpoint_state: Callable[[], dict[str, Any]] | None = None
    """Builds the framework's own full checkpoint dict, as the framework itself would save
    it at this moment (Lightning: what ``Trainer.save_checkpoint`` writes).  Called on the
    training thread, at a step boundary."""

    checkpoint_format: str | None = None
    """The name of the layout ``checkpoint_state`` returns (``"lightning"``), so a service
    can say which one a file holds and check a user's ``format=`` option against it."""

    report_metrics: MetricReporter | None = None
    """Hands metrics computed outside the loop (an asynchronous evaluation, say) to the
    framework's own logging: Lightning's loggers and ``callback_metrics``, the HF Trainer's
    ``log_history`` and ``on_log`` callbacks, a raw loop's sink."""

    wrapped_model: Callable[[], Any] | None = None
    """The module the framework actually runs forward on (a ``DistributedDataParallel`` or
    an FSDP-sharded module around the user's model), when it differs from the events'
    ``model``.  Called when needed: frameworks may wrap the model after training begins."""

    gradient_clipping: str | None = None
    """Set when the framework clips gradients itself, outside ``rt.clip_grad_norm_``: the
    setting as its user wrote it (``"Trainer(gradient_clip_val=1.0)"``), for messages.  A
    service that cannot support clipping it does not see (ZeRO-2 shards the gradients, so a
    norm over "all" of them would be wrong) refuses it, naming this text."""
