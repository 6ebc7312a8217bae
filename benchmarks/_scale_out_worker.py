"""One rank of ``benchmarks/scale_out.py`` (run by ``sakura.testing.launch_ranks``).

``python _scale_out_worker.py RANK WORLD INIT OUT MODE CONFIG_JSON``

* ``MODE=memory``: build one variant in this fresh process, run a few steps, write its
  peak RSS and the bytes this rank holds (quantized base, other parameters, optimizer
  state, from the local shards) to ``OUT/rank<N>.json``.
* ``MODE=timing``: build every variant named in the config, run interleaved trials
  (``sakura_bench.measure.interleaved``; both ranks run the same rotation) and write the
  per-trial mean step times.  ``unsharded`` runs on rank 0 alone with the global batch.

A variant that cannot be built or stepped (the bitsandbytes recipe on a CPU) is written as
``{"error": "..."}`` with the reason, never skipped in silence.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

NOTES: dict[str, str] = {}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        local = _local(value)
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _config(cfg: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        vocab_size=cfg["vocab"],
        max_position_embeddings=max(128, cfg["seq"]),
    )


def _lora(cfg: dict[str, Any]) -> Any:
    import peft

    return peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)


def _sakura_model(cfg: dict[str, Any], shard: bool, make_shardable: bool) -> Any:
    import peft
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from sakura_quant import quantize_model
    from sakura_quant.fsdp import _HOOK_ATTR, shardable

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(cfg)).requires_grad_(False)
    quantize_model(model, "nf4", double_quant=True)
    model = peft.get_peft_model(model, _lora(cfg))
    if make_shardable:
        shardable(model)
    else:
        # the peers' naive setup: sakura refuses to let fully_shard leave the quantized
        # base whole on every rank (a one-shot forward check); switched off to measure it
        handle = getattr(model.get_base_model(), _HOOK_ATTR, None)
        if handle is not None:
            handle.remove()
    if shard:
        for layer in model.get_base_model().model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def _bnb_model(cfg: dict[str, Any], out: Path, rank: int) -> Any:
    """The accelerate + bitsandbytes FSDP-QLoRA recipe: 4-bit NF4 + double quant stored
    as bf16 (``bnb_4bit_quant_storage``) so that FSDP can flatten it with the bf16 weights,
    loaded through ``from_pretrained``, LoRA on every projection, then FSDP2.

    accelerate only turns FSDP on for accelerator devices, so first ask accelerate itself
    what it does here; then try the same wrapping with ``fully_shard`` directly."""
    import peft
    from accelerate import Accelerator  # type: ignore[import-untyped]
    from accelerate.utils import (  # type: ignore[import-untyped]
        DistributedType,
        FullyShardedDataParallelPlugin,
    )
    from torch.distributed.fsdp import fully_shard
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    # the group exists already (file rendezvous); accelerate's CPU path still wants these
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    kind = accelerator.state.distributed_type
    NOTES["accelerate"] = (
        f"Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)) "
        f"gives distributed_type={kind.value}"
        + (
            ": accelerate never wraps with FSDP here (accelerate/state.py sets "
            "DistributedType.FSDP only for MULTI_GPU/XPU/NPU/HPU/MLU/MUSA/SDAA/NEURON, "
            "never for MULTI_CPU), so this variant calls fully_shard itself"
            if kind != DistributedType.FSDP
            else ""
        )
    )
    path = out / "bnb-base"
    if rank == 0:  # one checkpoint for both ranks, as a real run loads one
        torch.manual_seed(0)
        LlamaForCausalLM(_config(cfg)).save_pretrained(path, is_main_process=True)
    dist.barrier()
    quant = BitsAndBytesConfig(  # type: ignore[no-untyped-call]
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    model = LlamaForCausalLM.from_pretrained(
        path, quantization_config=quant, torch_dtype=torch.bfloat16, device_map="cpu"
    )
    model = peft.get_peft_model(model, _lora(cfg))
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _bnb_quantized_bytes(model: Any) -> tuple[int, int]:
    """The local shard of each ``Linear4bit`` weight (packed codes stored as bf16) plus its
    ``QuantState`` (absmax, the double-quant statistics, the code table): bitsandbytes
    keeps that state as plain tensors on the Python object, outside every parameter, so
    FSDP never shards it and every rank holds all of it."""
    from bitsandbytes.nn.modules import Linear4bit

    weights = states = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit):
            continue
        weights += _nbytes(module.weight)
        state = getattr(module.weight, "quant_state", None) or getattr(module, "quant_state", None)
        if state is not None:
            states += _nbytes(_state_tensors(state))
    return weights, states


def _state_tensors(state: Any) -> list[torch.Tensor]:
    tensors = [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
    nested = getattr(state, "state2", None)
    return tensors + (_state_tensors(nested) if nested is not None else [])


class Variant:
    """One model + optimizer + its share of the data."""

    def __init__(self, name: str, cfg: dict[str, Any], rank: int, world: int, out: Path):
        self.name = name
        self.active = name != "unsharded" or rank == 0
        self.model: Any = None
        self.error: str | None = None
        if not self.active:
            return
        try:
            if name == "unsharded":
                self.model = _sakura_model(cfg, shard=False, make_shardable=False)
            elif name == "fsdp2-shardable":
                self.model = _sakura_model(cfg, shard=True, make_shardable=True)
            elif name == "fsdp2-naive":
                self.model = _sakura_model(cfg, shard=True, make_shardable=False)
            elif name == "bnb-fsdp2":
                self.model = _bnb_model(cfg, out, rank)
            else:
                raise ValueError(f"unknown variant {name!r}")
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(trainable, lr=1e-4)
            # one global batch per step; a rank of a sharded variant takes its slice, so
            # the mean of the ranks' losses is the unsharded loss on the same data
            g = torch.Generator().manual_seed(100)
            full = [
                torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
                for _ in range(4)
            ]
            self.batches = full if name == "unsharded" else [b.chunk(world)[rank] for b in full]
            self.first_loss = self.step(0)[
                1
            ]  # a failing first step is a reason too (bnb's Params4bit under FSDP)
        except Exception as exc:  # the reason is the result for this variant
            self.error = f"{type(exc).__name__}: {exc}".strip()
            self.model = None
            if os.environ.get("SCALE_OUT_TRACEBACK"):
                traceback.print_exc()

    def step(self, i: int) -> tuple[float, float]:
        ids = self.batches[i % len(self.batches)]
        t0 = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if not torch.isfinite(loss.detach().float()):
            raise FloatingPointError(f"{self.name}: loss {loss.item()} is not finite")
        return dt, float(loss.detach().float())

    def holdings(self) -> dict[str, int]:
        from sakura_quant.fsdp import ShardableQuantizedLinear, local_quantized_nbytes

        params = sum(_nbytes(p) for p in self.model.parameters())
        if self.name == "bnb-fsdp2":
            weights, states = _bnb_quantized_bytes(self.model)
            quant = weights + states
            params -= weights  # the packed codes are parameters, their state is not
        else:
            quant = local_quantized_nbytes(self.model)
        shardable_storage = any(
            isinstance(m, ShardableQuantizedLinear) for m in self.model.modules()
        )
        # with shardable() the whole quantized base is made of parameters
        other = params - quant if shardable_storage else params
        state = sum(_nbytes(s) for s in self.optimizer.state.values())
        return {"quantized_bytes": quant, "param_bytes": other, "optimizer_bytes": state}


def memory(rank: int, world: int, out: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    before = _rss_mb()
    v = Variant(cfg["variant"], cfg, rank, world, out)
    if v.error is not None:
        return {"error": v.error, "notes": NOTES}
    if not v.active:
        return {"idle": True}
    for i in range(cfg["memory_steps"]):
        v.step(i + 1)
    v_loss = v.first_loss
    return {
        "rss_after_import_mb": before,
        "peak_rss_mb": _rss_mb(),
        "notes": NOTES,
        "first_loss": v_loss,
        **v.holdings(),
    }


def timing(rank: int, world: int, out: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    from sakura_bench.measure import interleaved

    variants = [Variant(name, cfg, rank, world, out) for name in cfg["variants"]]
    # both ranks must run the same variants: a variant that failed on either is dropped on both
    flags = torch.tensor([v.error is not None for v in variants], dtype=torch.int32)
    dist.all_reduce(flags)
    runnable = [v for v, bad in zip(variants, flags.tolist(), strict=True) if not bad]

    def trial_of(v: Variant) -> Any:
        def run(trial: int) -> float | None:
            dist.barrier()
            if not v.active:
                return None
            times = [v.step(trial * cfg["steps"] + s)[0] for s in range(cfg["steps"])]
            return statistics.fmean(times)

        return run

    runs = interleaved({v.name: trial_of(v) for v in runnable}, cfg["trials"], warmup=cfg["warmup"])
    return {
        "step_s": runs,
        "errors": {v.name: v.error for v in variants if v.error is not None},
    }


def main() -> None:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    mode, cfg = sys.argv[5], json.loads(sys.argv[6])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        result = (
            memory(rank, world, out, cfg) if mode == "memory" else timing(rank, world, out, cfg)
        )
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
