"""The model, data and by-hand reference of test_composition.py, and one rank of its ZeRO1
case (run as a script through sakura.testing.launch_ranks).

The model: a config-built 3-layer Llama (hidden 64, vocab 128) with PEFT LoRA on its
attention projections; the "choices": its frozen base quantized to NF4, the base's frozen
tensors (codes, scales, norms) streamed per block by ``WeightPaging``, saved activations
kept / paged / recomputed per block (``MemoryPlanner``, or sakura-precision's
``ActivationCheckpoint`` on every block) and the LoRA weights stepped by ``OffloadAdamW``.

As a rank: two copies of the model on every rank see the same DDP-averaged gradients: one
prepared by ``rt.prepare`` under ``quant:nf4`` + weight paging + ``activation_checkpoint``
+ ``offload_adamw`` + ``ZeRO1`` (each rank updates its shard of the LoRA weights on the
host, then the shards are broadcast), the other with the same choices by hand and an
unsharded ``OffloadAdamW``; the activations checkpointed (argument ``checkpoint``) or
planned (the ``memory_plan`` spec's options).  The rank writes the largest difference
after every step to ``<out>/<checkpoint|plan>-rank<R>.json``.  With the argument
``lightning``, the services and ZeRO1 run under ``lightning.Trainer(strategy="ddp")``
instead (:func:`lightning`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from sakura import Service

STEPS = 4
BATCH = 2
LAYERS = 3
VOCAB = 128
LR = 1e-2


def lora_llama() -> Any:
    """The tiny Llama with LoRA (r=4) on q/k/v/o, its base frozen and not yet quantized;
    the LoRA B matrices start non-zero so every LoRA weight trains from step one."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).requires_grad_(False)
    model = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    model.train()
    return model


def rows(seed: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (STEPS * BATCH, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def batches(seed: int = 3) -> list[dict[str, torch.Tensor]]:
    data = rows(seed)
    return [
        {k: torch.stack([r[k] for r in data[i : i + BATCH]]) for k in ("input_ids", "labels")}
        for i in range(0, len(data), BATCH)
    ]


def trainable(model: Any) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class StreamWeights(Service):
    """``WeightPaging`` has no service of its own: under a framework a user applies it in
    a service's ``wrap_model``, after ``quant`` (priority 5) so the quantized base is what
    streams, and before ``memory_plan`` (60) / ``activation_checkpoint``.  ``options`` are
    ``WeightPaging``'s."""

    name = "stream_weights"
    priority: float = 10

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.paging: Any = None

    def wrap_model(self, model: Any) -> Any:
        from sakura_offload.paging.weights import WeightPaging

        if self.paging is None:
            self.paging = WeightPaging(model, **self.options)
        return model

    def teardown(self) -> None:
        if self.paging is not None:  # (a disk tier's folder goes with it)
            self.paging.remove()


def by_hand(
    model: Any,
    *,
    quant: dict[str, Any] | None = None,
    paging: dict[str, Any] | None = None,
    planner: Any = None,
    checkpoint: bool = False,
    optimizer: dict[str, Any] | None = None,
    weight_decay: float = 0.01,
) -> tuple[Any, Any, Any]:
    """The choices applied by hand, in the services' order: quantize (``quant``:
    ``quantize_model``'s options, default NF4), stream the frozen weights (``paging``:
    ``WeightPaging``'s options), plan (or checkpoint) the activations, and an OffloadAdamW
    (``optimizer``: its options, default fp32 moments, no eager updates) on the trainable
    parameters.  Returns (paging, planner or checkpointer, optimizer)."""
    import sakura_quant
    from sakura_offload import OffloadAdamW
    from sakura_offload.paging.weights import WeightPaging

    quant = {"quantize": "nf4", **(quant or {})}
    sakura_quant.quantize_model(model, **quant)
    streamer = WeightPaging(model, **{"prefetch": 1, **(paging or {})})
    activations: Any = None
    if planner is not None:
        activations = planner.attach(model)
    elif checkpoint:
        from sakura_precision.activation_checkpoint import ActivationCheckpoint

        activations = ActivationCheckpoint()
        activations.wrap_model(model)
    stepper = OffloadAdamW(
        [p for _, p in trainable(model)],
        lr=LR,
        weight_decay=weight_decay,
        **{"eager": False, **(optimizer or {})},
    )
    return streamer, activations, stepper


def lightning(rank: int, out: str) -> None:
    """Under ``lightning.Trainer(strategy="ddp")`` (the process group already made): the
    services and ZeRO1 vs the same choices by hand in a DDP loop over this rank's rows
    (the loader's own DistributedSampler, unshuffled: rows rank, rank + 2, ...)."""
    import lightning.pytorch as pl
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from sakura import SakuraRuntime
    from sakura_adapters.lightning import LightningAdapter
    from sakura_zero import ZeRO1

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = lora_llama()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for _, p in trainable(self.model)], lr=LR)

    data = rows() + rows(seed=5)
    plain_net = lora_llama()
    _, _, plain = by_hand(plain_net, checkpoint=True)
    plain_model = DDP(plain_net, broadcast_buffers=False)
    mine = data[rank::2]
    for i in range(0, len(mine), BATCH):
        batch = {k: torch.stack([r[k] for r in mine[i : i + BATCH]]) for k in mine[0]}
        plain.zero_grad()
        plain_model(**batch).loss.backward()
        plain.step()
    streamed = StreamWeights()
    module = Module()
    with SakuraRuntime(strict=True) as rt:
        rt.install("quant:nf4")
        rt.install(streamed)
        rt.install("activation_checkpoint")
        rt.install("offload_adamw")
        zero = rt.install(ZeRO1())
        trainer = pl.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=out,
            callbacks=[LightningAdapter(rt)],
        )
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
        trainer.fit(module, DataLoader(data, batch_size=BATCH, sampler=sampler))
        steps = zero.shardings[0].steps
    diff = max(
        (a - b).abs().max().item()
        for (_, a), (_, b) in zip(trainable(module.model), trainable(plain_net), strict=True)
    )
    result = {"diff": diff, "steps": steps, "paged_buffers": streamed.paging.stats.paged_buffers}
    Path(out, f"lightning-rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sakura import SakuraRuntime
    from sakura_zero import ZeRO1

    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mode = sys.argv[5]  # "checkpoint", or the memory_plan spec's options
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if mode == "lightning":
        lightning(rank, out)
        dist.destroy_process_group()
        return
    sharded_net = lora_llama()
    plain_net = copy.deepcopy(sharded_net)
    planner: Any = None
    if mode != "checkpoint":
        from sakura.plugins import get_plugin_manager

        planner = get_plugin_manager().create("service", f"memory_plan:{mode}").planner
    paging, _, plain = by_hand(plain_net, planner=planner, checkpoint=mode == "checkpoint")
    streamed = StreamWeights()
    diffs: list[float] = []
    with SakuraRuntime(strict=True) as rt:
        rt.install("quant:nf4")
        rt.install(streamed)
        planned = rt.install(
            "activation_checkpoint" if mode == "checkpoint" else f"memory_plan:{mode}"
        )
        rt.install("offload_adamw")
        rt.install(ZeRO1())
        net, sharded = rt.prepare(
            sharded_net,
            torch.optim.AdamW([p for _, p in trainable(sharded_net)], lr=LR, weight_decay=0.01),
        )
        # DDP after the services changed the model: it sees the quantized, streamed base.
        # Its buffers (the base's codes and scales) are frozen: no broadcast each step.
        sharded_model = DDP(net, broadcast_buffers=False)
        plain_model = DDP(plain_net, broadcast_buffers=False)
        for step, batch in enumerate(batches(seed=10 + rank)):  # each rank its own data
            for model, optimizer in ((sharded_model, sharded), (plain_model, plain)):
                optimizer.zero_grad()
                model(**batch).loss.backward()
            if not rt.optimizer_step(sharded):
                sharded.step()
            plain.step()
            if planner is not None and step == 1:  # as the service's measure_steps=2
                planner.decide()
            diffs.append(
                max(
                    (a - b).abs().max().item()
                    for (_, a), (_, b) in zip(
                        trainable(sharded_net), trainable(plain_net), strict=True
                    )
                )
            )
        held = len(sharded.state)
        from sakura.marks import RECOMPUTED, has_mark

        recomputed = [sum(has_mark(m, RECOMPUTED) for m in n.modules()) for n in (net, plain_net)]
        choices = (
            [sorted(set(x.choices.values())) for x in (planned.plan, planner.applied)]
            if planner is not None
            else None
        )
    result = {
        "type": type(sharded).__name__,
        "diffs": diffs,
        "held_states": held,
        "total_trainable": len(trainable(sharded_net)),
        "paged_buffers": streamed.paging.stats.paged_buffers,
        "by_hand_paged_buffers": paging.stats.paged_buffers,
        "materialised": streamed.paging.stats.materialised,
        "recomputed_blocks": recomputed,
        "choices": choices,
    }
    Path(out, f"{'checkpoint' if planner is None else 'plan'}-rank{rank}.json").write_text(
        json.dumps(result)
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
