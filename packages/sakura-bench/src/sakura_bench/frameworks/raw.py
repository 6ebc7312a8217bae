"""``pytorch-ddp``: the loop an expert writes by hand, and the same loop through sakura.

Baseline, per step: forward, ``loss.backward()``, optional ``clip_grad_norm_``,
``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``; the epoch's loss is
summed on the device and read once per epoch; evaluation under ``torch.inference_mode()``.
Launched with several ranks (``--nproc``), the model is wrapped in
``DistributedDataParallel`` and each rank trains on its shard.

Sakura: the same loop with ``DDPAdapter`` events, ``rt.prepare``, ``rt.autocast()`` around
the forward, ``rt.backward`` (``scale_loss``), ``rt.clip_grad_norm_`` (unscales first) and
``rt.optimizer_step`` (a service may own the step).  When a service evaluates on its own
(``async_eval``), the loop does not evaluate: the service gets the epoch's weights at
``OnEpochEnd``.
"""

from __future__ import annotations

from typing import Any

import torch

from sakura_bench.framework import Framework, TrialContext, unwrap
from sakura_bench.workload import move_to

__all__ = ["PyTorchDDP"]


class PyTorchDDP(Framework):
    description = "hand-written torch loop (DistributedDataParallel with several ranks)"

    def run(self, ctx: TrialContext) -> None:
        w = ctx.workload
        model = w.make_model().to(ctx.device)
        if ctx.world_size > 1:
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        optimizer = w.make_optimizer(model)
        ctx.model = model
        train = w.train_batches(ctx.train_split, rank=ctx.rank, world_size=ctx.world_size)
        evals = (
            w.eval_batches(ctx.eval_split, rank=ctx.rank, world_size=ctx.world_size)
            if ctx.loop_evaluates
            else None
        )
        if ctx.runtime is None:
            _baseline(ctx, model, optimizer, train, evals)
        else:
            _sakura(ctx, model, optimizer, train, evals)


def _baseline(ctx: TrialContext, model: Any, optimizer: Any, train: Any, evals: Any) -> None:
    w, device, rec = ctx.workload, ctx.device, ctx.recorder
    clip = w.grad_clip
    params = [p for p in model.parameters() if p.requires_grad]
    rec.train_begin()
    for epoch in range(ctx.epochs):
        rec.epoch_begin(epoch)
        model.train()
        loss_sum = torch.zeros((), device=device)
        steps = 0
        for batch in train:
            batch = move_to(batch, device)
            loss = w.loss(model, batch)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            steps += 1
            rec.step()
        rec.train_phase_end(loss_sum / max(steps, 1))
        rec.eval_begin()
        metrics = w.evaluate(unwrap(model), evals, device)
        rec.eval_end(metrics)
        rec.epoch_end(epoch)
    rec.finish_begin()
    rec.train_end()


def _sakura(ctx: TrialContext, model: Any, optimizer: Any, train: Any, evals: Any) -> None:
    from sakura_adapters.ddp import DDPAdapter

    w, device, rec, rt = ctx.workload, ctx.device, ctx.recorder, ctx.runtime
    if rt is None:
        raise ValueError("the sakura loop needs ctx.runtime")
    clip = w.grad_clip
    adapter = DDPAdapter(rt, rank=ctx.rank, world_size=ctx.world_size, output_dir=ctx.output_dir)
    model, optimizer = rt.prepare(model, optimizer)
    ctx.model = model
    adapter.on_train_begin(model, optimizer, train)
    rec.train_begin()
    for epoch in range(ctx.epochs):
        rec.epoch_begin(epoch)
        adapter.on_epoch_begin(epoch)
        model.train()
        loss_sum = torch.zeros((), device=device)
        steps = 0
        for i, batch in enumerate(train):
            batch = move_to(batch, device)
            adapter.on_train_step_begin(model, batch, i)
            with rt.autocast():
                loss = w.loss(model, batch)
            adapter.backward(loss)
            if clip is not None:
                rt.clip_grad_norm_(optimizer, clip)
            adapter.step(optimizer)
            adapter.on_before_zero_grad(optimizer)
            optimizer.zero_grad(set_to_none=True)
            adapter.on_train_step_end(model, batch, i, loss)
            loss_sum += loss.detach()
            steps += 1
            rec.step()
        train_loss = float(loss_sum / max(steps, 1))
        rec.train_phase_end(train_loss)
        rec.eval_begin()
        metrics: dict[str, float] = {"train_loss": train_loss}
        if ctx.loop_evaluates:
            adapter.on_validation_begin(model)
            with rt.autocast():
                result = w.evaluate(unwrap(model), evals, device)
            adapter.on_validation_end(model, result)
            metrics.update(result)
            adapter.on_epoch_end(epoch, model, optimizer, metrics=metrics)
            rec.eval_end(result)
        else:
            # An evaluating service snapshots the weights here and evaluates off-thread;
            # the time measured is what the training thread spent on it (copy, backpressure).
            adapter.on_epoch_end(epoch, model, optimizer, metrics=metrics)
            rec.eval_end(None)
        rec.epoch_end(epoch)
    rec.finish_begin()
    adapter.on_train_end(model, metrics=None)  # asynchronous evaluations finish here
    rec.train_end()
