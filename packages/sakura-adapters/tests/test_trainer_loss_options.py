"""SakuraTrainer's chunked_loss=, loss_chunk_size= and packing= options on a tiny Llama.

chunked_loss installs sakura-kernels' ``chunked_loss`` service by name (this package does
not import sakura-kernels; its [test] extra installs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import SakuraRuntime
from sakura.options import OptionError
from sakura.plugins import reset_plugin_managers
from sakura_adapters import SakuraTrainer

transformers = pytest.importorskip("transformers")

VOCAB = 256
TOL = 1e-5


def llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def args(tmp_path: Path, **overrides: Any) -> Any:
    options: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def rows(count: int = 8, seq: int = 10) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(count):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        labels = ids.clone()
        labels[: 2 + i % 3] = -100  # prompts of different lengths: num_items_in_batch matters
        out.append({"input_ids": ids, "labels": labels})
    return out


def head_calls(model: Any) -> list[int]:
    calls = [0]
    model.lm_head.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_chunked_loss_trains_like_the_models_own_loss_and_never_runs_the_head(
    tmp_path: Path,
) -> None:
    ref = llama()
    ref_calls = head_calls(ref)
    SakuraTrainer(
        model=ref, args=args(tmp_path / "a"), train_dataset=rows(), runtime=SakuraRuntime()
    ).train()
    model = llama()
    calls = head_calls(model)
    rt = SakuraRuntime()
    trainer = SakuraTrainer(
        model=model,
        args=args(tmp_path / "b"),
        train_dataset=rows(),
        runtime=rt,
        chunked_loss=True,
        loss_chunk_size=7,
    )
    service = rt.get("chunked_loss")
    assert getattr(service, "chunk", None) == 7
    trainer.train()
    assert ref_calls[0] == 4 and calls[0] == 0  # the logits never existed
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert torch.allclose(param, ref_params[name], rtol=0, atol=TOL), name


def test_defaults_keep_the_models_own_loss(tmp_path: Path) -> None:
    rt = SakuraRuntime()
    trainer = SakuraTrainer(model=llama(), args=args(tmp_path), train_dataset=rows(), runtime=rt)
    assert trainer.chunked_loss is False and trainer.loss_chunk_size == 1024
    assert trainer.packing is False and "chunked_loss" not in rt


def test_chunked_loss_without_sakura_kernels_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAKURA_DISABLED_PLUGINS", "sakura-kernels")
    reset_plugin_managers()
    try:
        with pytest.raises(ImportError, match="pip install sakura-kernels"):
            SakuraTrainer(
                model=llama(),
                args=args(tmp_path),
                train_dataset=rows(),
                runtime=SakuraRuntime(),
                chunked_loss=True,
            )
    finally:
        monkeypatch.delenv("SAKURA_DISABLED_PLUGINS")
        reset_plugin_managers()


def documents() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g)} for n in (5, 8, 3, 6, 7, 4)]


def summed_loss_per_document(model: Any, docs: list[dict[str, torch.Tensor]]) -> float:
    """Each document alone through the model: the sum of its token losses."""
    total = 0.0
    with torch.no_grad():
        for doc in docs:
            ids = doc["input_ids"][None]
            out = model(input_ids=ids, labels=ids)
            total += out.loss.item() * (ids.shape[1] - 1)
    return total


@pytest.mark.parametrize("packing", [True, 9])
def test_packing_packs_each_batch_with_restarting_positions(
    tmp_path: Path, packing: bool | int
) -> None:
    model = llama().eval()
    docs = documents()
    trainer = SakuraTrainer(
        model=model,
        args=args(tmp_path, per_device_train_batch_size=3),
        train_dataset=docs,
        runtime=SakuraRuntime(),
        packing=packing,
    )
    width = 8 if packing is True else 9
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 2
    total, scored = 0.0, 0
    for batch in batches:
        assert "attention_mask" not in batch and batch["use_cache"] is False
        assert batch["input_ids"].shape[1] <= width
        starts = (batch["position_ids"] == 0).sum().item()
        assert starts >= 3  # three documents a batch, each from position 0 (plus padding)
        with torch.no_grad():
            out = model(**batch)
        count = int((batch["labels"][:, 1:] != -100).sum())
        total += out.loss.item() * count
        scored += count
    # Attention stays inside each document: the packed loss is the documents' own.
    assert scored == sum(d["input_ids"].numel() - 1 for d in docs)
    assert abs(total - summed_loss_per_document(model, docs)) <= 1e-3  # sums of ~40 tokens


def test_options_are_validated(tmp_path: Path) -> None:
    def make(**options: Any) -> Any:
        return SakuraTrainer(
            model=llama(),
            args=args(tmp_path),
            train_dataset=rows(),
            runtime=SakuraRuntime(),
            **options,
        )

    with pytest.raises(OptionError, match="SakuraTrainer: chunked_loss='yes'"):
        make(chunked_loss="yes")
    with pytest.raises(OptionError, match="SakuraTrainer: loss_chunk_size=0"):
        make(loss_chunk_size=0)
    for bad in (0, -4, 2.5, "rows"):
        with pytest.raises(OptionError, match=f"SakuraTrainer: packing={bad!r}"):
            make(packing=bad)
    with pytest.raises(ValueError, match="packing= builds the data_collator"):
        make(packing=True, data_collator=lambda features: features)
    rt = SakuraRuntime()
    rt.install("chunked_loss")
    with pytest.raises(ValueError, match="already has a 'chunked_loss' service"):
        SakuraTrainer(
            model=llama(), args=args(tmp_path), train_dataset=rows(), runtime=rt, chunked_loss=True
        )
