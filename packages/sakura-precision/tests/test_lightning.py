"""The three services under a real ``lightning.Trainer`` (CPU, through ``LightningAdapter``)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from precision_helpers import grad_scaler_loop, loss_fn, make_batches, make_model, weights
from torch.utils.data import DataLoader, TensorDataset

from sakura import SakuraRuntime
from sakura_precision import ActivationCheckpoint, Compile, MixedPrecision

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("sakura_adapters")
from sakura_adapters.lightning import LightningAdapter, SakuraPrecision  # noqa: E402

STEPS, EPOCHS = 3, 2
SCALER = {"init_scale": 2.0**30, "growth_interval": 2}  # overflows first: skips and back-off


class Module(pl.LightningModule):
    """A LightningModule around the shared TinyStack; records what its forward saw."""

    def __init__(self, dropout: float = 0.0, manual_clip: float | None = None) -> None:
        super().__init__()
        self.model = make_model(dropout=dropout)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []
        self.manual_clip = manual_clip
        self.automatic_optimization = manual_clip is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        self.seen.append((x.dtype, out.dtype))
        return out

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = loss_fn(self(x), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        self.manual_backward(loss)
        self.clip_gradients(
            optimizer, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm"
        )
        optimizer.step()
        optimizer.zero_grad()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader() -> DataLoader[Any]:
    xs, ys = zip(*make_batches(STEPS), strict=True)
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8, shuffle=False)


def fit(rt: SakuraRuntime, module: Any, tmp_path: Path, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "max_epochs": EPOCHS,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(tmp_path),
        "accelerator": "cpu",
        "devices": 1,
    }
    ckpt_path = kwargs.pop("ckpt_path", None)
    options.update(kwargs)
    trainer = pl.Trainer(callbacks=[LightningAdapter(rt), *options.pop("callbacks", [])], **options)
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer


def reference(clip: float | None, epochs: int = EPOCHS) -> tuple[torch.nn.Module, Any]:
    model = make_model()
    _, scaler = grad_scaler_loop(
        model,
        make_batches(STEPS) * epochs,
        clip=clip,
        scaler=torch.amp.GradScaler("cpu", **SCALER),
    )
    return model, scaler


def _assert_equal(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    ours, theirs = weights(model), weights(ref)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


# --- MixedPrecision ------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp16_is_bit_identical_to_the_grad_scaler_loop(tmp_path: Path, clip: float | None) -> None:
    module = Module()
    service = MixedPrecision("fp16", **SCALER)
    with SakuraRuntime([service], strict=True) as rt:
        trainer = fit(rt, module, tmp_path, gradient_clip_val=clip)
        assert isinstance(trainer.strategy.precision_plugin, SakuraPrecision)
    ref, scaler = reference(clip)
    _assert_equal(module.model, ref)
    assert service.state_dict()["scaler"] == scaler.state_dict()
    assert service.skipped_steps >= 1 and service.optimizer_steps == EPOCHS * STEPS
    assert {out for _, out in module.seen} == {torch.float16}


def test_manual_optimization_clip_gradients_unscales_once(tmp_path: Path, monkeypatch: Any) -> None:
    """The double-unscale bug: ``self.clip_gradients`` unscales, then ``optimizer.step()``
    must not unscale again (GradScaler would raise; a hand-rolled scaler would silently
    divide twice)."""
    calls: list[int] = []
    original = torch.amp.GradScaler.unscale_

    def counting(self: Any, optimizer: Any) -> None:
        calls.append(1)
        original(self, optimizer)

    ref, scaler = reference(clip=0.5)
    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", counting)
    module = Module(manual_clip=0.5)
    service = MixedPrecision("fp16", **SCALER)
    with SakuraRuntime([service], strict=True) as rt:
        fit(rt, module, tmp_path)
    assert len(calls) == EPOCHS * STEPS
    _assert_equal(module.model, ref)
    assert service.state_dict()["scaler"] == scaler.state_dict()


def test_fp16_scaler_state_resumes_from_a_lightning_checkpoint(tmp_path: Path) -> None:
    first = MixedPrecision("fp16", **SCALER)
    with SakuraRuntime([first], strict=True) as rt:
        fit(rt, Module(), tmp_path, max_epochs=1, enable_checkpointing=True)
    [ckpt] = list(tmp_path.rglob("*.ckpt"))
    saved = torch.load(ckpt, weights_only=True)["sakura"]["mixed_precision"]
    assert saved["scaler"]["scale"] == first.scale < SCALER["init_scale"]

    module = Module()
    resumed = MixedPrecision("fp16")  # default settings: the checkpoint's come back
    with SakuraRuntime([resumed], strict=True) as rt:
        fit(rt, module, tmp_path, max_epochs=EPOCHS, ckpt_path=str(ckpt))
    ref, scaler = reference(clip=None)
    _assert_equal(module.model, ref)
    assert resumed.state_dict()["scaler"] == scaler.state_dict()


def test_bf16_autocast_and_true_mode(tmp_path: Path) -> None:
    module = Module()
    with SakuraRuntime([MixedPrecision("bf16")], strict=True) as rt:
        fit(rt, module, tmp_path, max_epochs=1)
    assert module.seen == [(torch.float32, torch.bfloat16)] * STEPS
    assert next(module.parameters()).dtype == torch.float32

    module = Module()
    with SakuraRuntime([MixedPrecision("bf16-true")], strict=True) as rt:
        fit(rt, module, tmp_path, max_epochs=1)
    assert module.seen == [(torch.bfloat16, torch.bfloat16)] * STEPS  # the batch was cast
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    clone = pickle.loads(pickle.dumps(module))  # the step wrappers survive pickling
    x, y = make_batches(1)[0]
    assert clone.training_step((x, y), 0).dtype == torch.float32  # loss_fn upcasts
    assert clone.seen[-1] == (torch.bfloat16, torch.bfloat16)


class DirectModule(Module):
    """A training_step that never calls forward: it runs the inner model on the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[torch.dtype] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.batches.append(x.dtype)
        return loss_fn(self.model(x), y)


def test_true_mode_casts_the_batch_a_step_receives_without_forward(tmp_path: Path) -> None:
    """The service only adds a forward pre-hook (it knows no framework); Lightning hands
    the batch to training_step, so LightningAdapter's precision plugin casts it at
    Lightning's convert_input, because a service cast the weights."""
    module = DirectModule()
    with SakuraRuntime([MixedPrecision("bf16-true")], strict=True) as rt:
        fit(rt, module, tmp_path, max_epochs=1)
    assert module.batches == [torch.bfloat16] * STEPS
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}

    module = DirectModule()  # no service changed the weights: the batch is left alone
    with SakuraRuntime([MixedPrecision("bf16")], strict=True) as rt:
        fit(rt, module, tmp_path, max_epochs=1)
    assert module.batches == [torch.float32] * STEPS


@pytest.mark.parametrize(
    ("trainer_precision", "service"),
    [("16-mixed", "fp16"), ("bf16-true", "bf16"), ("bf16-mixed", "bf16-true")],
)
def test_trainer_precision_and_the_service_conflict(
    tmp_path: Path, trainer_precision: str, service: str
) -> None:
    with (
        SakuraRuntime([MixedPrecision(service)]) as rt,
        pytest.raises(
            ValueError,
            # (on the CPU Lightning itself turns '16-mixed' into 'bf16-mixed')
            match=r"Trainer\(precision='[\w-]+'\) and the sakura service\(s\) \['mixed_precision'\]",
        ),
    ):
        fit(rt, Module(), tmp_path, precision=trainer_precision)


# --- ActivationCheckpoint and Compile --------------------------------------------------------


def _seeded_fit(services: list[Any], tmp_path: Path, dropout: float = 0.1) -> Module:
    module = Module(dropout=dropout)
    with SakuraRuntime(services, strict=True) as rt:
        pl.seed_everything(0, verbose=False)
        fit(rt, module, tmp_path)
    return module


def test_activation_checkpoint_is_bit_identical(tmp_path: Path) -> None:
    plain = _seeded_fit([], tmp_path)
    service = ActivationCheckpoint()
    checkpointed = _seeded_fit([service], tmp_path)
    assert service.checkpointed == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    _assert_equal(checkpointed.model, plain.model)  # dropout masks replayed exactly


@pytest.mark.parametrize("target", ["model", "blocks"])
def test_compile_in_place_matches_eager(tmp_path: Path, target: str) -> None:
    torch._dynamo.reset()
    eager = _seeded_fit([], tmp_path, dropout=0.0)
    service = Compile(target=target, backend="aot_eager", cache_dir=tmp_path / "cache")
    compiled = _seeded_fit([service], tmp_path, dropout=0.0)
    assert service.compiled == (
        [""] if target == "model" else [f"model.blocks.{i}" for i in range(3)]
    )
    ours, theirs = weights(compiled.model), weights(eager.model)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_module_lightning_compiled_conflicts_with_compile(tmp_path: Path) -> None:
    compiled = torch.compile(Module(), backend="eager")
    with (
        SakuraRuntime([Compile(backend="aot_eager", cache_dir=tmp_path)]) as rt,
        pytest.raises(ValueError, match=r"Lightning compiled it.*use one"),
    ):
        fit(rt, compiled, tmp_path)
