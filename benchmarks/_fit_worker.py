"""One measurement of ``benchmarks/fit.py``, run in a fresh process of its own so that its
peak anonymous RSS is its own: load the model, apply one variant (``fit``, a hand-made
combination of the parts, or plain training), train, and return the step times and the
memory peaks.

The model's weights come from a checkpoint written once by the parent and read with
``torch.load(mmap=True)`` into a model built on the meta device: the fp32 frozen weights
start as file-backed pages (not anonymous memory), as a checkpoint on disk does, so the
host peak measures what each variant itself keeps in RAM and not the loading.  On a CPU the
device is simulated: every tensor of the model counts as device memory unless streamed
(``WeightPaging``'s stores are host or disk), exactly as ``sakura-offload-verify`` counts it.

Measured (``sakura_offload.fit.verify``'s definitions, its ``rss_anon`` reused):

- ``host_used``: the peak of ``RssAnon`` sampled after loading, after applying the variant
  and after every forward, backward and optimizer step, less its value before loading
  (taken after :func:`warm_runtime`: the libraries' one-time allocations are not the
  model's, as ``verify`` leaves out their imports; ``runtime_warmup`` says what they took);
- ``device_peak``: the largest device state after an optimizer step (trainable parameters,
  gradients, resident frozen tensors, the optimizer's device state; for ``fit`` from
  ``memory_report`` as ``verify`` takes it) plus the most streamed weight bytes live at
  once plus the activation planner's estimated peak;
- ``host_state_peak``: the host-RAM state the parts account for (streamed blocks kept in
  RAM, OffloadAdamW's moments and masters), the most after any step;
- ``step_s``: wall seconds of each timed step (forward, backward, optimizer step).
"""

from __future__ import annotations

import contextlib
import gc
import time
from pathlib import Path
from typing import Any

PRELOAD = ["torch", "transformers", "peft", "sakura_offload", "sakura_quant", "_fit_worker"]
"""Modules the forkserver imports once, so that each fresh measuring process starts fast."""


def load_model(spec: dict[str, Any]) -> Any:
    """The PEFT LoRA Llama of ``spec``: built on the meta device, weights mmapped from the
    checkpoint (``weights_only``), LoRA adapters initialised from ``spec["seed"]``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**spec["config"])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = torch.load(spec["checkpoint"], mmap=True, weights_only=True)
    model.load_state_dict(state, assign=True, strict=True)
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its buffers are not saved
    model.requires_grad_(False)
    torch.manual_seed(spec["seed"])
    model = get_peft_model(model, LoraConfig(r=spec["lora_rank"], lora_alpha=16))
    model.train()
    return model


def quantize_targets(model: Any) -> tuple[str, ...]:
    """The frozen ``nn.Linear`` layers of the base (not the LM head, not LoRA's)."""
    from torch import nn

    return tuple(
        name
        for name, m in model.named_modules()
        if type(m) is nn.Linear
        and name
        and not name.endswith("lm_head")
        and not m.weight.requires_grad
    )


def _device_state(model: Any, optimizer: Any, paging: Any) -> int:
    """Device bytes now, as ``memory_report`` counts them for a wrapped model."""
    from sakura_offload import OffloadAdamW
    from sakura_offload.fit.report import model_device_bytes

    device = model_device_bytes(model)
    if optimizer is not None and not isinstance(optimizer, OffloadAdamW):
        device["optimizer"] = sum(
            v.numel() * v.element_size()
            for s in optimizer.state.values()
            for v in s.values()
            if hasattr(v, "numel")
        )
    if paging is not None:
        device["frozen"] -= paging.stats.paged_bytes - paging.stats.live_bytes
    return int(sum(device[k] for k in ("trainable", "gradients", "frozen", "optimizer")))


def _host_state(optimizer: Any, paging: Any) -> int:
    """Host-RAM state the parts hold (``memory_report``'s ``host``): streamed blocks kept in
    RAM and OffloadAdamW's moments and masters."""
    from sakura_offload import OffloadAdamW

    held = 0
    if paging is not None:
        held += paging.stats.paged_bytes - paging.stats.disk_bytes
    if isinstance(optimizer, OffloadAdamW):
        stats = optimizer.stats()
        held += int(stats["moment_bytes"]) + int(stats["master_bytes"])
    return int(held)


def apply_by_hand(model: Any, optimizer: Any, spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The hand-made combination ``spec["hand"]``: quantize the base, stream its blocks,
    move the optimizer to the host, plan or recompute the activations; in ``fit``'s order."""
    from sakura_offload import MemoryPlanner, OffloadAdamW, WeightPaging
    from sakura_offload.fit.heap import HeapTrim, trim_heap

    hand = spec["hand"]
    if hand["format"] != "fp32":
        from sakura_quant import quantize_model

        quantize_model(model, hand["format"], targets=quantize_targets(model))
    paging = None
    if hand["weights"] != "resident":
        disk = hand["weights"] == "disk"
        paging = WeightPaging(
            model,
            indices=None,
            prefetch=1,
            disk_offload=spec["directory"] if disk else None,
            host_budget=hand["host_weight_bytes"] if disk else None,
        )
    if hand["optimizer"] != "adamw":
        optimizer = OffloadAdamW.from_optimizer(optimizer, moment_dtype=hand["optimizer"])
    # The heap discipline fit applies with such a plan (sakura_offload.fit.heap): without it
    # the heap's freed pages stay resident and no such plan holds its RSS budget on a CPU.
    moved = (
        hand["weights"] != "resident" or hand["optimizer"] != "adamw" or hand["format"] != "fp32"
    )
    if moved:
        trim_heap()
        spec["_heap_trim"] = HeapTrim(optimizer)
    planner = None
    if hand["activations"] == "planner":
        planner = MemoryPlanner(
            hand["activation_budget"],
            host_budget=hand["activation_host_budget"],
            disk=True,
            directory=spec["directory"],
        )
        # It decides after its measuring forward only when someone listens (as fit does).
        planner.on_planned = _planned_trim if moved else _planned
        planner.attach(model)
    return optimizer, paging, planner


def _planned(plan: Any) -> None:
    """The hand-made planner's listener: it decides at the first training forward."""


def _planned_trim(plan: Any) -> None:
    """As :func:`_planned`, then the measuring forward's pages back (as fit does)."""
    from sakura_offload.fit.heap import trim_heap

    trim_heap()


def _hand_name(plan: Any) -> str:
    """The hand-made variant (``benchmarks/fit.py``'s names) that makes ``plan``'s choices."""
    fmt = "fp32" if plan.option is None else plan.option.name
    opt = "adamw-device" if plan.optimizer == "device" else f"host-{plan.moment_dtype}"
    return f"{fmt}/{plan.weights}/{opt}/planner"


def _recompute_all(model: Any, ids: Any) -> Any:
    """Every block recomputed in backward (the planner's forced ``recompute``)."""
    from sakura_offload import MemoryPlanner

    # Recomputation is forced: no bandwidth to probe (the probe's buffers are not the plan's).
    planner = MemoryPlanner(10**15, cost_trials=0, host_bandwidth=1e9, disk_bandwidth=1e9)
    planner.plan(model, lambda: model(input_ids=ids, labels=ids).loss, trials=1)
    planner.decide("recompute")
    return planner


def warm_runtime(spec: dict[str, Any]) -> None:
    """One training step of a one-layer PEFT LoRA Llama of its own (the measured model's
    widths), with AdamW and OffloadAdamW steps, then freed and the heap trimmed: the
    libraries' one-time allocations (peft's back-ends, BLAS workspaces, thread pools,
    kernel caches, the autograd engine) happen before the baseline, as their imports do.
    Its own model and batch are gone before the baseline; nothing of the measured model
    is."""
    import ctypes

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from sakura_offload import OffloadAdamW

    # One layer of the measured model's widths: the BLAS library's workspaces for its
    # matrix shapes (MKL keeps ~30 MiB of them) are the library's, allocated once.
    config = LlamaConfig(**{**spec["config"], "num_hidden_layers": 1})
    tiny = LlamaForCausalLM(config)
    # peft's first get_peft_model loads its optional back-ends (bitsandbytes' CPU kernels
    # among them): about 55 MiB of anonymous memory, once per process, not the model's.
    tiny = get_peft_model(tiny.requires_grad_(False), LoraConfig(r=2, target_modules=["q_proj"]))
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]))
    tiny(input_ids=ids, labels=ids).loss.backward()
    trainable = [p for p in tiny.parameters() if p.requires_grad]
    torch.optim.AdamW(trainable).step()
    host = OffloadAdamW(trainable)
    host.step()
    host.synchronize()
    del tiny, host, ids, trainable
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant, measured in this process (see the module docstring)."""
    import torch

    import sakura_offload
    from sakura.options import OptionError
    from sakura_offload.fit.verify import rss_anon
    from sakura_offload.planner import MemoryBudgetError

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    Path(spec["directory"]).mkdir(parents=True, exist_ok=True)
    before_warm = rss_anon()
    warm_runtime(spec)
    baseline = rss_anon()
    peak = baseline
    model = load_model(spec)
    peak = max(peak, rss_anon())
    optimizer: Any = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    vocab = spec["config"]["vocab_size"]
    generator = torch.Generator().manual_seed(spec["seed"] + 1)
    batches = [
        torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=generator)
        for _ in range(spec["warmup"] + spec["steps"])
    ]
    paging = planner = None
    plan = ""
    replans: list[str] = []
    same_by_hand = None
    kind = spec["kind"]
    try:
        if kind == "fit":
            # The disk tier: this process's own folder (fit removes its files with the paging).
            disk = str(Path(spec["directory"]) / "fit-disk") if spec.get("fit_disk") else None
            model, optimizer = sakura_offload.wrap(
                model, optimizer, **spec["fit"], disk_offload=disk, report=False
            )
            state = model.sakura_fit
            paging, planner, plan = state.paging, state.planner, state.plan.summary()
            same_by_hand = _hand_name(state.plan)
        elif kind == "hand":
            optimizer, paging, planner = apply_by_hand(model, optimizer, spec)
            if spec["hand"]["activations"] == "recompute":
                planner = _recompute_all(model, batches[0])
        peak = max(peak, rss_anon())
        times: list[float] = []
        losses: list[float] = []
        state_peak = host_state = 0
        for i, ids in enumerate(batches):
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            peak = max(peak, rss_anon())
            loss.backward()
            peak = max(peak, rss_anon())
            optimizer.step()
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - start)
            peak = max(peak, rss_anon())
            if kind == "fit":
                from sakura_offload.fit.verify import _device_state as report_state

                state_peak = max(state_peak, report_state(sakura_offload.memory_report(model)))
            else:
                state_peak = max(state_peak, _device_state(model, optimizer, paging))
            if kind == "fit":  # a re-plan after the first step replaces the parts
                state = model.sakura_fit
                paging, planner, plan = state.paging, state.planner, state.plan.summary()
                same_by_hand = _hand_name(state.plan)
                replans = [r.describe() for r in state.replans]
            host_state = max(host_state, _host_state(optimizer, paging))
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    except (MemoryBudgetError, OptionError, RuntimeError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    live = 0 if paging is None else int(paging.stats.max_live_bytes)
    applied = getattr(planner, "applied", None)
    activations = 0 if applied is None else int(applied.estimated_peak)
    return {
        "error": None,
        "plan": plan,
        "same_by_hand": same_by_hand,
        "replans": replans,
        "step_s": times,
        "losses": losses,
        "host_used": peak - baseline,
        "runtime_warmup": baseline - before_warm,
        "host_state_peak": host_state,
        "device_peak": state_peak + live + activations,
        "device_state_peak": state_peak,
        "weights_live_peak": live,
        "activations_peak": activations,
    }
