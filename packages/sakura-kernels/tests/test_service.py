"""The ``kernels`` service: options validated; ``"auto"`` leaves a plain model bit-exact and
patches a quantized one (sakura-quant's ``quantize_model``); fused LoRA on request; under a
raw loop (``SakuraRuntime`` + ``rt.prepare``) and under Lightning, losses and updated
weights against the unpatched model's."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peft
import pytest
import torch

from sakura import SakuraRuntime
from sakura_kernels import Kernels
from sakura_kernels.service import is_quantized
from sakura_quant import quantize_model

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = 2e-5  # relative, fp32: the fused kernels against the model's own code


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def forwards(model: torch.nn.Module) -> int:
    return sum("forward" in m.__dict__ for m in model.modules())


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match=r"kernels='maybe'.*'auto', True, False"):
        Kernels("maybe")
    with pytest.raises(ValueError, match=r"fused_lora=1.*'auto', True, False"):
        Kernels(fused_lora=1)
    with pytest.raises(ValueError, match=r"attention='on'.*'auto', True, False"):
        Kernels(attention="on")
    with pytest.raises(ValueError, match=r"keep_expanded"):
        Kernels(keep_expanded="sometimes")
    with pytest.raises(ValueError, match=r"fp32_outputs='always'.*False, True, 'eval'"):
        Kernels(fp32_outputs="always")
    assert Kernels().fp32_outputs == "eval" and Kernels(fp32_outputs=True).fp32_outputs is True
    with pytest.raises(ValueError, match=r"reuse_heap='yes'"):
        Kernels(reuse_heap="yes")
    with SakuraRuntime() as rt, pytest.raises(Exception, match="kernels='yes'"):
        rt.install("kernels:yes")
    with pytest.raises(ValueError, match="model"):
        Kernels(True).wrap_model("not a model")


def test_auto_leaves_a_plain_model_bit_exact(make_model: Callable[..., torch.nn.Module]) -> None:
    reference = make_model("llama")
    model = copy.deepcopy(reference)
    with SakuraRuntime(strict=True) as rt:
        service = rt.install("kernels")
        assert isinstance(service, Kernels) and service.enabled == "auto"
        prepared, _ = rt.prepare(model)
        assert prepared is model and forwards(model) == 0 and service.reports == []
        loss, grads = step(model, batch())
        ref_loss, ref_grads = step(reference, batch())
        assert loss == ref_loss
        assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_raw_loop_with_kernels_on_matches_the_unpatched_model(
    make_model: Callable[..., torch.nn.Module],
) -> None:
    reference = make_model("mistral")
    model = copy.deepcopy(reference)
    with SakuraRuntime(strict=True) as rt:
        rt.install("kernels:true,fused_lora=false")
        prepared, _ = rt.prepare(model)
        assert forwards(model) == 5 + 2 + 2  # norms, MLPs, attention modules
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for seed in range(2):
            loss, _ = step(prepared, batch(seed))
            ref_loss, _ = step(reference, batch(seed))
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
            opt.step()
            ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p, q, rtol=0, atol=1e-5), name
    assert forwards(model) == 0  # the runtime closed: the service restored the model


def quantized_peft(make_model: Callable[..., torch.nn.Module]) -> Any:
    model = make_model("llama")
    quantize_model(model, "nf4", targets=PROJECTIONS, freeze=True)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS)
    peft_model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft_model


def test_auto_patches_a_quantized_model_and_fuses_its_lora(
    make_model: Callable[..., torch.nn.Module],
) -> None:
    reference = quantized_peft(make_model)
    assert is_quantized(reference) and not is_quantized(make_model("llama"))
    model = copy.deepcopy(reference)
    with SakuraRuntime(strict=True) as rt:
        service = rt.install("kernels:auto,keep_expanded=true")
        rt.prepare(model)
        (report,) = service.reports
        assert report.count("rms_norm") == 5 and report.count("glu") == 2, report
        assert report.count("rotary") == 2 and report.skipped == [], report
        (lora_report,) = service.lora_reports
        assert len(lora_report.fused) == 2 * len(PROJECTIONS), lora_report
        assert model.get_base_model().config._attn_implementation == "sakura"  # fused attention
        loss, grads = step(model, batch())
        ref_loss, ref_grads = step(reference, batch())
        assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)
        assert grads.keys() == ref_grads.keys() and grads
        for name, grad in ref_grads.items():
            error = (grads[name] - grad).abs().max() / grad.abs().max()
            assert error <= 1e-3, name
    assert model.get_base_model().config._attn_implementation == "eager"  # given back


def test_fused_lora_off_keeps_the_peft_layers(make_model: Callable[..., torch.nn.Module]) -> None:
    model = quantized_peft(make_model)
    service = Kernels("auto", fused_lora=False)
    service.wrap_model(model)
    assert service.lora_reports == [] and len(service.reports) == 1
    service.teardown()
    assert forwards(model) == 0


def test_lightning_with_kernels_matches_the_unpatched_model(
    make_model: Callable[..., torch.nn.Module], tmp_path: Path
) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from sakura_adapters import LightningAdapter

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model("qwen2")
            self.losses: list[float] = []

        def training_step(self, ids: torch.Tensor, index: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rows = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(5))

    def fit(services: list[str]) -> Any:
        # run as a context manager: leaving it tears the service down, which restores the
        # modeling files' apply_rotary_pos_emb (a runtime never started was never closed,
        # and left them patched for the tests after this one)
        with SakuraRuntime(strict=True) as rt:
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
            trainer.fit(module, torch.utils.data.DataLoader(list(rows), batch_size=2))
            counted = forwards(module.model)
        assert forwards(module.model) == 0  # unpatched at teardown
        return module, counted

    ref, _ = fit([])
    got, patched = fit(["kernels:true"])
    assert patched == 5 + 2 + 2
    assert len(got.losses) == 2
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert abs(a - b) <= TOL * abs(b)
    ref_params = dict(ref.model.named_parameters())
    for name, param in got.model.named_parameters():
        assert torch.allclose(param, ref_params[name], rtol=0, atol=1e-5), name


REUSE_HEAP = """
import json, torch
from sakura import SakuraRuntime
model = torch.nn.Linear(4, 4)
with SakuraRuntime(strict=True) as rt:
    service = rt.install("kernels:auto,reuse_heap=true")
    rt.prepare(model)
    print(json.dumps({"heap": list(service.heap), "repr": repr(service)}))
"""


@pytest.mark.skipif(
    not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"), reason="needs glibc"
)
def test_reuse_heap_is_asked_for_not_assumed(make_model: Callable[..., torch.nn.Module]) -> None:
    # default: the process's allocator is left alone
    with SakuraRuntime(strict=True) as rt:
        service = rt.install("kernels")
        rt.prepare(make_model("llama"))
        assert service.reuse_heap is False and service.heap is None
    # asked for (in its own interpreter: the setting is process-wide)
    done = subprocess.run(
        [sys.executable, "-c", REUSE_HEAP], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["heap"][0] is True and "keeps freed memory" in got["heap"][1]
    assert "reuse_heap=True" in got["repr"]
