"""The chunked_loss service: equal loss and gradients to the model's own under a raw loop,
the Hugging Face Trainer (SakuraTrainer) and Lightning; the head (the logits) never runs."""

from __future__ import annotations

import copy
import inspect
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import SakuraRuntime
from sakura.options import OptionError
from sakura_kernels.losses.service import ChunkedLoss

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ, BATCH = 256, 10, 4
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


def batch(seed: int = 0, rows: int = BATCH) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt
    labels[0, -2:] = -100
    return {"input_ids": ids, "labels": labels}


def count_head_calls(model: Any) -> list[int]:
    calls = [0]
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == ref.keys() and got
    for name in ref:
        assert torch.allclose(got[name], ref[name], rtol=0, atol=tol), name


@pytest.mark.parametrize("use_peft", [False, True])
def test_raw_loop_loss_and_gradients_equal_the_models_own(use_peft: bool) -> None:
    reference = llama()
    if use_peft:
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        reference = peft.get_peft_model(reference, config)
    model = copy.deepcopy(reference)
    data = batch()
    ref_out = reference(**data)
    ref_out.loss.backward()
    with SakuraRuntime(strict=True) as rt:
        service = rt.install("chunked_loss:chunk=7")
        assert isinstance(service, ChunkedLoss) and service.chunk == 7
        prepared, _ = rt.prepare(model)
        assert prepared is model
        calls = count_head_calls(model)
        out = model(**data)
        assert out.logits is None and calls[0] == 0  # the head never ran: no logits
        assert abs(out.loss.item() - ref_out.loss.item()) <= TOL
        out.loss.backward()
        assert_same(grads(model), grads(reference), TOL)
        # Without labels the model's own forward runs and returns logits.
        assert model(input_ids=data["input_ids"]).logits.shape == (BATCH, SEQ, VOCAB)
        # num_items_in_batch: the summed loss over that count, as the model's own.
        own = reference(**data, num_items_in_batch=17).loss
        assert abs(model(**data, num_items_in_batch=17).loss.item() - own.item()) <= TOL
    # Uninstalled (the runtime closed): the original forward is back.
    assert model(**data).logits is not None


def test_a_deepcopy_of_a_wrapped_model_computes_its_own_loss() -> None:
    model = llama()
    ChunkedLoss(5).wrap_model(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)  # the copy's own weights differ
    data = batch()
    got = twin(**data)
    assert got.logits is None
    own = type(twin).forward(twin, **data).loss  # the class's forward on the copy
    assert abs(got.loss.item() - own.item()) <= TOL
    assert abs(model(**data).loss.item() - own.item()) > 1e-3
    # The HF Trainer reads the forward's signature (dataset columns, loss kwargs).
    assert list(inspect.signature(model.forward).parameters)[:2] == ["input_ids", "attention_mask"]
    restored = pickle.loads(pickle.dumps(model))
    assert restored(**data).logits is None
    assert abs(restored(**data).loss.item() - model(**data).loss.item()) <= TOL


def test_eval_mode_keeps_the_models_own_forward_unless_in_eval() -> None:
    model = llama().eval()
    data = batch()
    service = ChunkedLoss(4)
    service.wrap_model(model)
    assert model(**data).logits is not None
    service.unwrap(model)
    both = ChunkedLoss(4, in_eval=True)
    both.wrap_model(model)
    out = model(**data)
    assert out.logits is None
    assert abs(out.loss.item() - llama().eval()(**data).loss.item()) <= TOL


def run_trainer(tmp_path: Path, runtime: SakuraRuntime) -> tuple[Any, list[float], int]:
    from sakura_adapters import SakuraTrainer

    model = llama()
    calls = count_head_calls(model)
    rows = [{k: v[i] for k, v in batch(seed=3, rows=8).items()} for i in range(8)]
    args = transformers.TrainingArguments(
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
    trainer = SakuraTrainer(model=model, args=args, train_dataset=rows, runtime=runtime)
    # The Trainer passes num_items_in_batch only to a forward that takes **kwargs: the
    # chunked forward keeps the model's signature.
    assert trainer.model_accepts_loss_kwargs
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return model, losses, calls[0]


def test_sakura_trainer_with_gradient_accumulation_equals_the_models_own(tmp_path: Path) -> None:
    # The labels of the micro-batches hold different numbers of scored tokens, so the
    # Trainer's num_items_in_batch normalisation matters.
    ref_model, ref_losses, ref_calls = run_trainer(tmp_path / "ref", SakuraRuntime())
    rt = SakuraRuntime()
    rt.install(ChunkedLoss(chunk=6))
    model, losses, calls = run_trainer(tmp_path / "chunked", rt)
    assert ref_calls == 4 and calls == 0  # 2 steps x 2 micro-batches; the head never ran
    assert len(losses) == len(ref_losses) == 2
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-4  # the Trainer logs rounded values
    ref_params = dict(ref_model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.allclose(param, ref_params[name], rtol=0, atol=TOL), name


def test_lightning_module_calling_the_model_equals_the_models_own(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from sakura_adapters import LightningAdapter

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()
            self.head_calls = count_head_calls(self.model)
            self.losses: list[float] = []

        def training_step(self, data: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            out = self.model(input_ids=data["input_ids"], labels=data["labels"])
            self.losses.append(out.loss.item())
            return out.loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    rows = [{k: v[i] for k, v in batch(seed=4, rows=4).items()} for i in range(4)]

    def fit(services: list[Any]) -> Any:
        rt = SakuraRuntime()
        for service in services:
            rt.install(service)
        module = Module()
        trainer = pl.Trainer(
            max_steps=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=str(tmp_path),
            accelerator="cpu",
            devices=1,
            callbacks=[LightningAdapter(rt)],
        )
        loader = torch.utils.data.DataLoader(rows, batch_size=2)
        trainer.fit(module, loader)
        return module

    ref = fit([])
    got = fit([ChunkedLoss(chunk=5)])
    assert ref.head_calls[0] == 2 and got.head_calls[0] == 0
    assert len(got.losses) == 2
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert abs(a - b) <= TOL
    ref_params = dict(ref.model.named_parameters())
    for name, param in got.model.named_parameters():
        assert torch.allclose(param, ref_params[name], rtol=0, atol=TOL), name


def test_options_and_models_are_validated() -> None:
    with pytest.raises(OptionError, match="ChunkedLoss: chunk=0"):
        ChunkedLoss(chunk=0)
    with pytest.raises(OptionError, match="ChunkedLoss: chunk='big'"):
        ChunkedLoss(chunk="big")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="in_eval=1"):
        ChunkedLoss(in_eval=1)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="ChunkedLoss: model='Linear'"):
        ChunkedLoss().wrap_model(torch.nn.Linear(2, 2))
    with SakuraRuntime() as rt, pytest.raises(Exception, match="chunk=-3"):
        rt.install("chunked_loss:chunk=-3")
