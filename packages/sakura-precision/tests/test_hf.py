"""The three services under a real ``transformers.Trainer``: ``SakuraTrainer`` (the Trainer
subclass) and, where a callback suffices, the stock Trainer with ``HFAdapter``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from precision_helpers import grad_scaler_loop, loss_fn, make_batches, make_model, weights
from torch import nn

from sakura import SakuraRuntime, Service
from sakura_precision import ActivationCheckpoint, Compile, MixedPrecision

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("sakura_adapters")
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
)

from sakura_adapters.hf import HFAdapter, SakuraTrainer, SakuraTrainerRequiredError

STEPS, BATCH, EPOCHS = 3, 8, 2
SCALER = {"init_scale": 2.0**30, "growth_interval": 2}
SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


class StackForTrainer(nn.Module):
    """The shared TinyStack with the Trainer's calling convention."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.model = make_model(dropout=dropout)
        self.logit_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.model(x)
        self.logit_dtypes.append(logits.dtype)
        return {"loss": loss_fn(logits, labels) if labels is not None else None, "logits": logits}


def dataset() -> list[dict[str, torch.Tensor]]:
    return [
        {"x": x[i], "labels": y[i]}
        for x, y in make_batches(STEPS, batch=BATCH)
        for i in range(BATCH)
    ]


def args(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": BATCH,
        "num_train_epochs": EPOCHS,
        "learning_rate": 0.1,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "train_sampling_strategy": "sequential",
        "eval_strategy": "no",
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "seed": 0,
    }
    options.update(overrides)
    return TrainingArguments(**options)


def _assert_equal(model: nn.Module, ref: nn.Module) -> None:
    ours, theirs = weights(model), weights(ref)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


# --- MixedPrecision ------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_fp16_under_sakura_trainer_is_bit_identical_to_the_grad_scaler_loop(
    tmp_path: Path, clip: float
) -> None:
    model = StackForTrainer()
    service = MixedPrecision("fp16", **SCALER)
    rt = SakuraRuntime([service], strict=True)
    SakuraTrainer(
        model=model,
        args=args(tmp_path, max_grad_norm=clip),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=SGD,
        runtime=rt,
    ).train()
    reference = make_model()
    _, scaler = grad_scaler_loop(
        reference,
        make_batches(STEPS, batch=BATCH) * EPOCHS,
        clip=clip or None,
        scaler=torch.amp.GradScaler("cpu", **SCALER),
    )
    _assert_equal(model.model, reference)
    assert service.state_dict()["scaler"] == scaler.state_dict()
    assert service.skipped_steps >= 1 and service.optimizer_steps == EPOCHS * STEPS
    assert set(model.logit_dtypes) == {torch.float16}


def test_fp16_skipped_steps_leave_the_lr_schedule_alone(tmp_path: Path) -> None:
    """As with accelerate's own GradScaler: after an overflow the Trainer does not step its
    LR scheduler (``accelerator.optimizer_step_was_skipped``)."""
    total = EPOCHS * STEPS
    settings = {"init_scale": 2.0**17, "growth_interval": 2}  # skips some steps, not all
    model = StackForTrainer()
    service = MixedPrecision("fp16", **settings)
    rt = SakuraRuntime([service], strict=True)
    seen: list[bool] = []

    class Skips(Service):
        def on_optimizer_step(self, event: Any) -> None:
            seen.append(event.skipped)

    rt.install(Skips())
    trainer = SakuraTrainer(
        model=model,
        args=args(tmp_path, lr_scheduler_type="linear"),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=SGD,
        runtime=rt,
    )
    trainer.train()
    reference = make_model()
    grad_scaler_loop(
        reference,
        make_batches(STEPS, batch=BATCH) * EPOCHS,
        scaler=torch.amp.GradScaler("cpu", **settings),
        schedule=lambda step: max(0.0, (total - step) / total),
    )
    _assert_equal(model.model, reference)
    skipped = service.skipped_steps
    assert 1 <= skipped < total and seen.count(True) == skipped and len(seen) == total
    assert trainer.lr_scheduler.last_epoch == total - skipped


def test_fp16_scaler_state_resumes_from_a_trainer_checkpoint(tmp_path: Path) -> None:
    first = MixedPrecision("fp16", **SCALER)
    SakuraTrainer(
        model=StackForTrainer(),
        args=args(tmp_path, save_strategy="steps", save_steps=STEPS),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=SGD,
        runtime=SakuraRuntime([first], strict=True),
    ).train()
    checkpoint = tmp_path / "out" / f"checkpoint-{STEPS}"
    saved = torch.load(checkpoint / "sakura_state.pt", weights_only=True)["mixed_precision"]
    assert saved["scaler"]["scale"] < SCALER["init_scale"] and saved["optimizer_steps"] == STEPS

    model = StackForTrainer()
    resumed = MixedPrecision("fp16")
    SakuraTrainer(
        model=model,
        args=args(tmp_path, save_strategy="steps", save_steps=STEPS),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=SGD,
        runtime=SakuraRuntime([resumed], strict=True),
    ).train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state_dict() == first.state_dict()  # the same end state as the full run


def test_fp16_needs_the_trainer_subclass(tmp_path: Path) -> None:
    rt = SakuraRuntime([MixedPrecision("fp16")])
    with pytest.raises(SakuraTrainerRequiredError, match=r"'mixed_precision'.*wrap_loss"):
        Trainer(
            model=StackForTrainer(),
            args=args(tmp_path),
            train_dataset=dataset(),
            callbacks=[HFAdapter(rt)],
        )


def test_bf16_under_the_stock_trainer_with_only_the_callback(tmp_path: Path) -> None:
    model = StackForTrainer()
    rt = SakuraRuntime([MixedPrecision("bf16")], strict=True)
    Trainer(
        model=model,
        args=args(tmp_path, num_train_epochs=1),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=SGD,
        callbacks=[HFAdapter(rt)],
    ).train()
    assert model.logit_dtypes == [torch.bfloat16] * STEPS
    assert next(model.parameters()).dtype == torch.float32


def test_true_mode_under_sakura_trainer(tmp_path: Path) -> None:
    model = StackForTrainer()
    SakuraTrainer(
        model=model,
        args=args(tmp_path, num_train_epochs=1),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=SGD,
        runtime=SakuraRuntime([MixedPrecision("bf16-true")], strict=True),
    ).train()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.logit_dtypes == [torch.bfloat16] * STEPS


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
@pytest.mark.parametrize("service", ["bf16", "fp16"])
def test_training_arguments_precision_conflicts(tmp_path: Path, flag: str, service: str) -> None:
    rt = SakuraRuntime([MixedPrecision(service)])
    try:
        hf_args = args(tmp_path, **{flag: True})
    except ValueError as exc:  # transformers refuses fp16 on the CPU by itself
        assert flag == "fp16" and "fp16" in str(exc)
        return
    with pytest.raises(ValueError, match=rf"{flag}=True.*'mixed_precision'.*use one"):
        SakuraTrainer(model=StackForTrainer(), args=hf_args, train_dataset=dataset(), runtime=rt)


# --- ActivationCheckpoint on a real transformers model -------------------------------------------


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def token_dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (16, 12), generator=g)
    labels = torch.randint(0, 2, (16,), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(16)]


def _train_bert(
    tmp_path: Path, services: list[Any], **overrides: Any
) -> BertForSequenceClassification:
    model = tiny_bert()
    SakuraTrainer(
        model=model,
        args=args(tmp_path, per_device_train_batch_size=4, **overrides),
        train_dataset=token_dataset(),
        runtime=SakuraRuntime(services, strict=True),
    ).train()
    return model


def test_activation_checkpoint_on_bert_is_bit_identical(tmp_path: Path) -> None:
    plain = _train_bert(tmp_path, [])  # dropout 0.1 everywhere: the RNG replay is exercised
    service = ActivationCheckpoint()
    checkpointed = _train_bert(tmp_path, [service])
    assert service.checkpointed == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    _assert_equal(checkpointed, plain)


def test_transformers_gradient_checkpointing_conflicts(tmp_path: Path) -> None:
    with pytest.raises(
        RuntimeError, match=r"BertLayer also has the framework's own gradient checkpointing"
    ):
        _train_bert(tmp_path, [ActivationCheckpoint()], gradient_checkpointing=True)


# --- Compile ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("trainer_cls", [SakuraTrainer, Trainer])
def test_compile_in_place_matches_eager(tmp_path: Path, trainer_cls: type) -> None:
    torch._dynamo.reset()

    def train(services: list[Any]) -> StackForTrainer:
        model = StackForTrainer()
        rt = SakuraRuntime(services, strict=True)
        extra = {"runtime": rt} if trainer_cls is SakuraTrainer else {"callbacks": [HFAdapter(rt)]}
        trainer_cls(
            model=model,
            args=args(tmp_path),
            train_dataset=dataset(),
            optimizer_cls_and_kwargs=SGD,
            **extra,
        ).train()
        return model

    eager = train([])
    service = Compile(target="blocks", backend="aot_eager", cache_dir=tmp_path / "cache")
    compiled = train([service])
    assert service.compiled == [f"model.blocks.{i}" for i in range(3)]
    ours, theirs = weights(compiled), weights(eager)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("trainer_cls", [SakuraTrainer, Trainer])
def test_transformers_torch_compile_and_the_compile_service_conflict(
    tmp_path: Path, trainer_cls: type
) -> None:
    rt = SakuraRuntime([Compile()], strict=True)
    kwargs: dict[str, Any] = {"runtime": rt} if trainer_cls is SakuraTrainer else {}
    callbacks = [] if trainer_cls is SakuraTrainer else [HFAdapter(rt)]
    with pytest.raises(
        ValueError, match=r"torch_compile=True\) and the sakura service\(s\) \['compile'\]"
    ):
        trainer_cls(
            model=StackForTrainer(),
            args=args(tmp_path, torch_compile=True),
            train_dataset=dataset(),
            callbacks=callbacks,
            **kwargs,
        )
