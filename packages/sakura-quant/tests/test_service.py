"""The ``quant`` service: spec strings, a raw loop with SakuraRuntime, the HF Trainer and
Lightning, each with stock PEFT LoRA on the quantized base."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from sakura import SakuraRuntime
from sakura.errors import SpecError
from sakura.options import OptionError
from sakura.plugins import get_plugin_manager
from sakura_quant import Quantization, QuantizedLinear

peft = pytest.importorskip("peft")


def test_spec_strings_build_the_service() -> None:
    manager = get_plugin_manager()
    service = manager.create("service", "quant:nf4")
    assert isinstance(service, Quantization)
    assert (service.format, service.block_size, service.double_quant) == ("nf4", 64, False)
    service = manager.create("service", "quant:int8,block_size=128,double_quant=true")
    assert (service.format, service.block_size, service.double_quant) == ("int8", 128, True)
    assert manager.create("service", "quant:fp8").block_size == 32
    service = manager.create("service", "quant:nf4,matmul_dtype=bf16")
    assert service.matmul_dtype == torch.bfloat16 and "matmul_dtype='bfloat16'" in repr(service)
    with pytest.raises(SpecError, match=r"Quantization: matmul_dtype='int4'"):
        manager.create("service", "quant:nf4,matmul_dtype=int4")
    with pytest.raises(SpecError, match=r"Quantization: format='fp4'.*accepted: 'int8'"):
        manager.create("service", "quant:fp4")
    with pytest.raises(SpecError, match=r"Quantization: block_size=3"):
        manager.create("service", "quant:nf4,block_size=3")
    with pytest.raises(OptionError, match=r"Quantization: double_quant=True .*'int8' and 'nf4'"):
        Quantization("nvfp4", double_quant=True)


def test_facade_exports_the_service() -> None:
    from sakura.services import Quantization as FromFacade  # type: ignore[attr-defined]

    assert FromFacade is Quantization


def _lm_batch(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 32, (4, 12), generator=gen)


def test_raw_loop_prepares_a_quantized_lora_model(make_tiny_lm: Callable[[], nn.Module]) -> None:
    model = peft.get_peft_model(
        make_tiny_lm(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    with SakuraRuntime(strict=True) as rt:
        service = rt.install(Quantization("nf4", double_quant=True))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, optimizer = rt.prepare(model, optimizer)
        assert service.stats["tensors"] == 4
        quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        assert len(quantized) == 4 and all(q.weight_scales.dtype == torch.uint8 for q in quantized)
        before = [q.weight.clone() for q in quantized]
        gen = torch.Generator().manual_seed(2)
        ids = _lm_batch(gen)
        losses = []
        for _ in range(12):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
            optimizer.zero_grad()
            rt.backward(loss)
            if not rt.optimizer_step(optimizer):
                optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] * 0.9
        assert all(torch.equal(q.weight, b) for q, b in zip(quantized, before, strict=True))
        # Preparing the same model again changes nothing.
        assert rt.wrap_model(model) is model


def test_unfrozen_base_is_an_error_naming_freeze(make_tiny_lm: Callable[[], nn.Module]) -> None:
    with SakuraRuntime(strict=True) as rt:
        rt.install(Quantization("int8"))
        with pytest.raises(OptionError, match=r"quantize_model: freeze=False is not accepted"):
            rt.prepare(make_tiny_lm())
        model = make_tiny_lm()
        rt.uninstall("quant")
        rt.install(Quantization("int8", freeze=True))
        rt.prepare(model)
        assert isinstance(model.layers[0].q_proj, QuantizedLinear)


# --- Hugging Face Trainer ---------------------------------------------------------------


transformers = pytest.importorskip("transformers")


def _tiny_llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(3)
        base = torch.randint(0, 64, (n, 16), generator=gen)
        self.ids = base

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_hf_trainer_with_hfadapter_trains_lora_on_a_quantized_base(tmp_path: Path) -> None:
    from sakura_adapters.hf import HFAdapter

    model = peft.get_peft_model(
        _tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    rt = SakuraRuntime(strict=True)
    service = rt.install(Quantization("nf4"))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_train_epochs=3,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Tokens(8), callbacks=[HFAdapter(rt)]
    )
    # Built: the base is quantized in place (q, k, v, o and the MLP of 2 layers; not lm_head).
    assert service.stats["tensors"] == 14
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(quantized) == 14 and not any("lm_head" in n for n in quantized)
    before = {n: m.weight.clone() for n, m in quantized.items()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6
    assert losses[-1] < losses[0]
    assert all(torch.equal(quantized[n].weight, before[n]) for n in quantized)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


# --- Lightning ---------------------------------------------------------------------------


pl = pytest.importorskip("lightning.pytorch")


class _LoraModule(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = peft.get_peft_model(net, peft.LoraConfig(r=4, target_modules=["q_proj"]))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.net(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def test_lightning_with_lightningadapter_trains_lora_on_a_quantized_base(
    tmp_path: Path, make_tiny_lm: Callable[[], nn.Module]
) -> None:
    from sakura_adapters.lightning import LightningAdapter

    module = _LoraModule(make_tiny_lm())
    rt = SakuraRuntime(strict=True)
    service = rt.install(Quantization("int8"))
    gen = torch.Generator().manual_seed(4)
    data = torch.utils.data.TensorDataset(torch.randint(0, 32, (16, 12), generator=gen))
    trainer = pl.Trainer(
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
        callbacks=[LightningAdapter(rt)],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert service.stats["tensors"] == 4
    assert isinstance(module.net.base_model.model.layers[0].q_proj.base_layer, QuantizedLinear)
    assert isinstance(module.net.base_model.model.layers[0].v_proj, QuantizedLinear)
    assert len(module.losses) == 12
    assert sum(module.losses[-4:]) < sum(module.losses[:4])
