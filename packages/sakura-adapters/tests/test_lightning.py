"""LightningAdapter under a real lightning.Trainer (CPU, tiny model)."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import sakura
from sakura import OnError, OnOptimizerStep, SakuraRuntime, Service
from sakura.options import OptionError
from sakura.resume import ServiceStateError, ServiceStateWarning
from sakura.testing import RecordingService

pl = pytest.importorskip("lightning.pytorch")
from sakura_adapters.emitted import UnemittedEventWarning  # noqa: E402
from sakura_adapters.lightning import LightningAdapter, SakuraPrecision  # noqa: E402

STEPS_PER_EPOCH = 3
BATCH = 4


class TinyModule(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        )
        self.lr = lr
        self.forward_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.forward_dtypes.append(out.dtype)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x).float(), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x).float(), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(STEPS_PER_EPOCH * BATCH, 6, generator=g),
        torch.randn(STEPS_PER_EPOCH * BATCH, 2, generator=g),
    )


def loader() -> DataLoader[Any]:
    return DataLoader(data(), batch_size=BATCH, shuffle=False)


def trainer(rt: SakuraRuntime, tmp_path: Path, **kwargs: Any) -> Any:
    options: dict[str, Any] = dict(
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
    )
    strict_resume = kwargs.pop("strict_resume", False)
    options.update(kwargs)
    callbacks = [LightningAdapter(rt, strict_resume=strict_resume), *options.pop("callbacks", [])]
    return pl.Trainer(callbacks=callbacks, **options)


PER_STEP = [
    "OnTrainStepBegin",
    "OnBeforeZeroGrad",
    "OnBeforeBackward",
    "OnAfterBackward",
    "OnBeforeOptimizerStep",
    "OnOptimizerStep",
    "OnTrainStepEnd",
]
VALIDATION = [
    "OnValidationBegin",
    "OnValidationEpochBegin",
    "OnValidationBatchBegin",
    "OnValidationBatchEnd",
    "OnValidationEpochEnd",
    "OnValidationEnd",
]


def test_fit_emits_the_exact_event_sequence(tmp_path: Path) -> None:
    rec = RecordingService()
    with SakuraRuntime([rec], strict=True) as rt:
        fitting = trainer(rt, tmp_path)
        fitting.fit(TinyModule(), loader(), DataLoader(data(), batch_size=12))
    epoch = [
        "OnEpochBegin",
        *PER_STEP * STEPS_PER_EPOCH,
        *VALIDATION,
        "OnEpochEnd",
        "OnSaveCheckpoint",
    ]
    assert rec.names == [
        "OnSetup",
        "OnFitBegin",
        "OnTrainBegin",
        *epoch * 2,
        "OnTrainEnd",
        "OnFitEnd",
        "OnTeardown",
    ]
    assert [e.step for e in rec.of(OnOptimizerStep)] == [1, 2, 3, 4, 5, 6]
    assert [e.epoch for e in rec.of(sakura.OnEpochEnd)] == [0, 1]
    assert all((e.rank, e.world_size) == (0, 1) for e in rec.events)
    epoch_end = rec.of(sakura.OnEpochEnd)[-1]
    assert set(epoch_end.metrics) >= {"train_loss", "val_loss"}
    assert isinstance(rec.of(sakura.OnTrainBegin)[0].optimizer, torch.optim.SGD)
    assert rec.of(sakura.OnTrainBegin)[0].trainer is fitting
    assert rec.of(sakura.OnTrainBegin)[0].accumulation_steps == 1  # accumulate_grad_batches
    assert not any(e.skipped for e in rec.of(OnOptimizerStep))
    assert rec.of(sakura.OnSaveCheckpoint)[0].checkpoint["sakura"] == {}
    assert float(rec.of(sakura.OnTrainStepEnd)[0].loss) > 0


def test_sanity_check_validate_test_and_predict_events(tmp_path: Path) -> None:
    rec = RecordingService()
    with SakuraRuntime([rec], strict=True) as rt:
        t = trainer(rt, tmp_path, max_epochs=1, num_sanity_val_steps=1, enable_checkpointing=False)
        module = TinyModule()
        t.fit(module, loader(), loader())
        assert rec.names[2:4] == ["OnSanityCheckBegin", "OnValidationBegin"]
        assert "OnSanityCheckEnd" in rec.names
        rec.events.clear()
        t.test(module, loader())
        assert rec.names[:3] == ["OnSetup", "OnTestBegin", "OnTestEpochBegin"]
        assert rec.names.count("OnTestBatchEnd") == STEPS_PER_EPOCH
        assert rec.of(sakura.OnTestEnd)[0].metrics["test_loss"] > 0
        rec.events.clear()
        t.predict(module, loader())
        assert rec.names.count("OnPredictBatchEnd") == STEPS_PER_EPOCH
        assert rec.names[-2:] == ["OnPredictEnd", "OnTeardown"]
        assert rec.of(sakura.OnPredictBatchEnd)[0].outputs.shape == (BATCH, 2)


def reference_weights(steps_epochs: int = 2, clip: float | None = None) -> list[torch.Tensor]:
    module = TinyModule()
    opt = module.configure_optimizers()
    for _ in range(steps_epochs):
        for x, y in loader():
            loss = torch.nn.functional.mse_loss(module(x).float(), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("clip", [None, 0.05])
def test_service_that_owns_the_step_matches_a_hand_written_loop(
    tmp_path: Path, step_owner: Any, clip: float | None
) -> None:
    module = TinyModule()
    with SakuraRuntime([step_owner], strict=True) as rt:
        t = trainer(rt, tmp_path, enable_checkpointing=False, gradient_clip_val=clip)
        t.fit(module, loader())
        assert isinstance(t.strategy.precision_plugin, SakuraPrecision)
    for ours, ref in zip(module.parameters(), reference_weights(clip=clip), strict=True):
        torch.testing.assert_close(ours.detach(), ref, rtol=0, atol=1e-6)
    assert step_owner.steps == 2 * STEPS_PER_EPOCH
    # with clipping, the clip asked for unscaling and the step found it already done
    assert step_owner.unscale_calls == (3 if clip else 2) * 2 * STEPS_PER_EPOCH


def test_resume_restores_service_state(tmp_path: Path, step_counter: Any) -> None:
    with SakuraRuntime([step_counter], strict=True) as rt:
        trainer(rt, tmp_path, max_epochs=1).fit(TinyModule(), loader())
    [ckpt] = list(tmp_path.rglob("*.ckpt"))
    saved = torch.load(ckpt, weights_only=True)
    assert saved["sakura"] == {"step_counter": {"count": STEPS_PER_EPOCH}}
    resumed = type(step_counter)()
    with SakuraRuntime([resumed], strict=True) as rt:
        trainer(rt, tmp_path, max_epochs=2).fit(TinyModule(), loader(), ckpt_path=str(ckpt))
    assert resumed.loaded == STEPS_PER_EPOCH
    assert resumed.count == 2 * STEPS_PER_EPOCH


class LogWatcher(Service):
    """Handles on_log, which only the Hugging Face Trainer has, and on_after_backward."""

    name = "log_watcher"

    def __init__(self) -> None:
        self.after_backward = 0

    def on_log(self, event: Any) -> None:
        pass

    def on_after_backward(self, event: Any) -> None:
        self.after_backward += 1


def test_events_lightning_never_emits_are_a_warning_at_fit(tmp_path: Path) -> None:
    emitted = LightningAdapter.emitted_events()
    assert emitted is not None
    never = {cls.__name__ for cls in sakura.events.EVENT_TYPES} - {c.__name__ for c in emitted}
    assert never == {"OnSubstepEnd", "OnLog", "OnPushBegin"}  # Hugging Face-only moments
    without_plugin = LightningAdapter.emitted_events(precision_plugin=False)
    assert without_plugin is not None
    assert {c.__name__ for c in emitted - without_plugin} == {"OnOptimizerStep"}

    watcher = LogWatcher()
    with pytest.warns(UnemittedEventWarning) as record, SakuraRuntime([watcher]) as rt:
        trainer(rt, tmp_path, max_epochs=1, enable_checkpointing=False).fit(TinyModule(), loader())
    messages = [str(w.message) for w in record if w.category is UnemittedEventWarning]
    assert messages == [
        "sakura service 'log_watcher' handles on_log (OnLog), which LightningAdapter under the "
        "lightning.Trainer never emits, so that handler will never run; the lightning.Trainer "
        "has no such moment: handle an event it emits instead "
        "(LightningAdapter.emitted_events() lists them)"
    ]
    assert watcher.after_backward == STEPS_PER_EPOCH


def test_no_warning_for_services_whose_events_lightning_emits(tmp_path: Path) -> None:
    rec = RecordingService("handles_all", event_types=set(LightningAdapter.emitted_events() or ()))
    with warnings.catch_warnings(), SakuraRuntime([rec, LightningMomentsWatcher()]) as rt:
        warnings.simplefilter("error", UnemittedEventWarning)
        trainer(rt, tmp_path, max_epochs=1).fit(TinyModule(), loader(), loader())
    assert rec.counts()["OnAfterBackward"] == STEPS_PER_EPOCH
    emitted = {c.__name__ for c in LightningAdapter.emitted_events() or ()}
    fit_events = set(rec.names)
    assert fit_events <= emitted


class LightningMomentsWatcher(Service):
    """Handles every Lightning-side event by name (none of them draws a warning)."""

    name = "every_lightning_event"

    def on_after_backward(self, event: Any) -> None: ...
    def on_before_backward(self, event: Any) -> None: ...
    def on_optimizer_step(self, event: Any) -> None: ...
    def on_sanity_check_begin(self, event: Any) -> None: ...
    def on_test_begin(self, event: Any) -> None: ...
    def on_predict_epoch_end(self, event: Any) -> None: ...
    def on_validation_epoch_begin(self, event: Any) -> None: ...
    def on_teardown(self, event: Any) -> None: ...


def _fit_one_epoch(tmp_path: Path, services: list[Any]) -> Path:
    with SakuraRuntime(services, strict=True) as rt:
        trainer(rt, tmp_path / "first", max_epochs=1).fit(TinyModule(), loader())
    [ckpt] = list((tmp_path / "first").rglob("*.ckpt"))
    return ckpt


# Each run writes its own checkpoint folder; Lightning says so when resuming.
_NEW_DIRPATH = "ignore:The dirpath has changed"


@pytest.mark.filterwarnings(_NEW_DIRPATH)
def test_resume_with_an_added_service_starts_it_fresh(
    tmp_path: Path, step_counter: Any, epoch_counter: Any
) -> None:
    ckpt = _fit_one_epoch(tmp_path, [step_counter])
    resumed, added = type(step_counter)(), type(epoch_counter)()
    with (
        pytest.warns(
            ServiceStateWarning, match=r"no state for installed service\(s\) \['epoch_counter'\]"
        ),
        SakuraRuntime([resumed, added], strict=True) as rt,
    ):
        trainer(rt, tmp_path / "second", max_epochs=2).fit(
            TinyModule(), loader(), ckpt_path=str(ckpt)
        )
    assert resumed.loaded == STEPS_PER_EPOCH and resumed.count == 2 * STEPS_PER_EPOCH
    assert added.loaded is None and added.epochs == 1  # fresh: only the epoch after resuming


@pytest.mark.filterwarnings(_NEW_DIRPATH)
def test_resume_without_a_service_keeps_its_state_in_the_next_checkpoint(
    tmp_path: Path, step_counter: Any, epoch_counter: Any
) -> None:
    ckpt = _fit_one_epoch(tmp_path, [step_counter, epoch_counter])
    assert torch.load(ckpt, weights_only=True)["sakura"]["epoch_counter"] == {"epochs": 1}
    resumed = type(step_counter)()
    with (
        pytest.warns(ServiceStateWarning, match=r"state for service\(s\) \['epoch_counter'\]"),
        SakuraRuntime([resumed], strict=True) as rt,
    ):
        trainer(rt, tmp_path / "second", max_epochs=2).fit(
            TinyModule(), loader(), ckpt_path=str(ckpt)
        )
    [latest] = list((tmp_path / "second").rglob("*.ckpt"))
    assert torch.load(latest, weights_only=True)["sakura"] == {
        "step_counter": {"count": 2 * STEPS_PER_EPOCH},
        "epoch_counter": {"epochs": 1},  # not installed in this run, kept as it was
    }


@pytest.mark.parametrize("saved_with_epoch_counter", [False, True])
def test_strict_resume_rejects_a_changed_service_list(
    tmp_path: Path, step_counter: Any, epoch_counter: Any, saved_with_epoch_counter: bool
) -> None:
    first = [step_counter, epoch_counter] if saved_with_epoch_counter else [step_counter]
    ckpt = _fit_one_epoch(tmp_path, first)
    second = (
        [type(step_counter)()]
        if saved_with_epoch_counter
        else [type(step_counter)(), type(epoch_counter)()]
    )
    with (
        pytest.raises(ServiceStateError, match="epoch_counter"),
        SakuraRuntime(second, strict=True) as rt,
    ):
        trainer(rt, tmp_path / "second", max_epochs=2, strict_resume=True).fit(
            TinyModule(), loader(), ckpt_path=str(ckpt)
        )
    assert second[0].loaded is None  # nothing was loaded before the error


def test_strict_resume_is_validated() -> None:
    with pytest.raises(
        OptionError,
        match=r"LightningAdapter: strict_resume='yes' is not accepted; accepted: True or False",
    ):
        LightningAdapter(SakuraRuntime(), strict_resume="yes")  # type: ignore[arg-type]


def test_handler_exception_does_not_stop_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failing = RecordingService("failing", fail_on={"OnTrainStepEnd"})
    watcher = RecordingService("watcher", event_types={OnError})
    module = TinyModule()
    with (
        caplog.at_level(logging.CRITICAL, logger="sakura"),
        SakuraRuntime([failing, watcher]) as rt,
    ):
        t = trainer(rt, tmp_path, enable_checkpointing=False)
        t.fit(module, loader())
    assert t.global_step == 2 * STEPS_PER_EPOCH
    assert len(watcher.events) == 2 * STEPS_PER_EPOCH
    assert {e.source for e in watcher.events} == {"failing"}


def test_exception_in_training_reaches_services_as_on_error(tmp_path: Path) -> None:
    class Exploding(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("model exploded")

    watcher = RecordingService("watcher", event_types={OnError})
    with pytest.raises(RuntimeError, match="model exploded"), SakuraRuntime([watcher]) as rt:
        trainer(rt, tmp_path).fit(Exploding(), loader())
    assert [e.source for e in watcher.events] == ["lightning", "training loop"]


class BF16Autocast(Service):
    @contextmanager
    def _ctx(self) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield

    def autocast(self) -> Any:
        return self._ctx()


def test_autocast_service_takes_effect_with_only_the_callback(tmp_path: Path) -> None:
    module = TinyModule()
    with SakuraRuntime([BF16Autocast()], strict=True) as rt:
        trainer(rt, tmp_path, max_epochs=1, enable_checkpointing=False, limit_train_batches=1).fit(
            module, loader()
        )
    assert module.forward_dtypes == [torch.bfloat16]


def test_precision_conflict_is_an_error_at_setup(tmp_path: Path) -> None:
    with SakuraRuntime([BF16Autocast()]) as rt:
        t = trainer(rt, tmp_path, precision="bf16-mixed")
        with pytest.raises(
            ValueError,
            match=r"Trainer\(precision='bf16-mixed'\) and the sakura service\(s\) \['bf16_autocast'\]",
        ):
            t.fit(TinyModule(), loader())


def test_true_precision_modes_combine_with_non_precision_services(
    tmp_path: Path, step_counter: Any
) -> None:
    module = TinyModule()
    with SakuraRuntime([step_counter], strict=True) as rt:
        trainer(rt, tmp_path, precision="64-true", max_epochs=1, enable_checkpointing=False).fit(
            module, loader()
        )
    assert next(module.parameters()).dtype == torch.float64
    assert step_counter.count == STEPS_PER_EPOCH


class Wrapping(Service):
    def __init__(self, replace: bool = False) -> None:
        self.replace = replace
        self.seen: list[Any] = []

    def wrap_model(self, model: Any) -> Any:
        self.seen.append(model)
        model.wrapped_by_sakura = True
        return torch.nn.Linear(1, 1) if self.replace else model

    def wrap_optimizer(self, optimizer: Any) -> Any:
        optimizer.wrapped_by_sakura = True
        return optimizer


def test_model_and_optimizer_wrapping_through_the_precision_plugin(tmp_path: Path) -> None:
    module = TinyModule()
    with SakuraRuntime([Wrapping()], strict=True) as rt:
        t = trainer(rt, tmp_path, max_epochs=1, enable_checkpointing=False)
        t.fit(module, loader())
    assert module.wrapped_by_sakura and t.optimizers[0].wrapped_by_sakura


def test_wrap_model_must_keep_the_lightning_module(tmp_path: Path) -> None:
    with (
        SakuraRuntime([Wrapping(replace=True)]) as rt,
        pytest.raises(TypeError, match="must modify the LightningModule in place"),
    ):
        trainer(rt, tmp_path).fit(TinyModule(), loader())


def test_bad_runtime_argument() -> None:
    with pytest.raises(TypeError, match=r"rt must be a sakura\.SakuraRuntime, got NoneType"):
        LightningAdapter(None)  # type: ignore[arg-type]


def test_facade_resolves_the_adapter() -> None:
    from sakura.adapters import LightningAdapter as FromFacade  # type: ignore[attr-defined]

    assert FromFacade is LightningAdapter


class Lifecycle(Service):
    """Records when it is set up, wraps the model and is torn down."""

    name = "lifecycle"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def setup(self, rt: Any) -> None:
        self.calls.append("setup")

    def wrap_model(self, model: Any) -> Any:
        self.calls.append("wrap_model")
        return model

    def teardown(self) -> None:
        self.calls.append("teardown")


def test_a_runtime_not_started_is_started_and_closed_by_the_adapter(tmp_path: Path) -> None:
    # Before, the services of a runtime handed over without `with` wrapped the model without
    # being set up and were never torn down (a kernels service left the modeling code patched).
    service = Lifecycle()
    rt = SakuraRuntime([service], strict=True)
    trainer(rt, tmp_path, max_epochs=1, enable_checkpointing=False).fit(TinyModule(), loader())
    assert service.calls == ["setup", "wrap_model", "teardown"]
    assert not rt.running
    # a runtime the user runs stays theirs: started and closed by them only
    service = Lifecycle()
    with SakuraRuntime([service], strict=True) as rt:
        trainer(rt, tmp_path, max_epochs=1, enable_checkpointing=False).fit(TinyModule(), loader())
        assert rt.running and service.calls == ["setup", "wrap_model"]
    assert service.calls == ["setup", "wrap_model", "teardown"]
