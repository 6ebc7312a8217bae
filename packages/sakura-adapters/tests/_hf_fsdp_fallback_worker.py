"""One rank of ``test_hf_fsdp_fallback.py``: a stock ``transformers.Trainer`` with the
HFAdapter and ``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})`` on
CPU gloo ranks, started as torchrun would start it.  accelerate runs DDP instead of FSDP
here; the rank writes whether the adapter warned and whether the model ended up sharded."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from sakura import SakuraRuntime
    from sakura_adapters.hf import HFAdapter

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("sakura.adapters.hf").addHandler(Keep(logging.WARNING))
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    model = LlamaForCausalLM(config)
    rows = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(4)]
    args = TrainingArguments(
        str(Path(out_dir) / f"hf{rank}"),
        max_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=2,
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2},
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=rows, callbacks=[HFAdapter(SakuraRuntime([]))]
    )
    trainer.train()
    info = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapped": type(trainer.model_wrapped).__name__,
        "warnings": [r for r in records if "TrainingArguments.fsdp" in r],
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(info))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank, _world, _init, _out = sys.argv[1:5]
    main(int(_rank), int(_world), _init, _out)
