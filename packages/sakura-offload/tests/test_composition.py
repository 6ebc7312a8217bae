"""Composition: a quantized (NF4) frozen base streamed per block by ``WeightPaging``, saved
activations planned per block (``memory_plan``: keep / page / recompute) or checkpointed
(``activation_checkpoint``) and ``OffloadAdamW`` stepping the LoRA weights, all installed
as services, give the same LoRA weights as the same choices applied by hand in a plain
loop: under a real ``lightning.Trainer``, a real ``transformers.Trainer``, a raw loop
(``DDPAdapter``) and ZeRO1 on 2 gloo ranks (a raw DDP loop, and Lightning's
``strategy="ddp"``).  Every comparison is ``torch.equal``: no framework changes the
arithmetic here (no padding, so the HF Trainer's token-count loss equals the mean).
The model, data and by-hand reference are in ``_composition_rank.py`` (shared with the
rank worker)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from _composition_rank import (
    BATCH,
    LR,
    STEPS,
    StreamWeights,
    batches,
    by_hand,
    lora_llama,
    rows,
    trainable,
)

from sakura import SakuraRuntime

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("sakura_quant")

from sakura_offload import OffloadAdamW
from sakura_offload.planner import MemoryPlanner
from sakura_offload.planner.service import MemoryPlannerService

PLANNER: dict[str, Any] = {
    "min_bytes": 1024,
    "cost_trials": 0,
    "host_bandwidth": 1e12,
    "disk": False,
}
"""Estimated costs, not timed (the plan is the same on a loaded machine).  A host round
trip at 1 TB/s makes paging cheaper than recomputing any block; at 1 B/s recomputing is
cheaper.  Every choice is bit-identical, so the plan cannot change the parameters."""


@dataclass(frozen=True)
class Variant:
    """One set of choices, as services (spec strings) and by hand (the same options)."""

    quant: dict[str, Any] = field(default_factory=dict)
    """quantize_model's options (and the quant spec's)."""
    paging: dict[str, Any] = field(default_factory=dict)
    """WeightPaging's options (``disk_offload=True``: a folder under tmp_path)."""
    planner: dict[str, Any] = field(default_factory=dict)
    """MemoryPlanner's options over PLANNER (and the memory_plan spec's)."""
    optimizer: dict[str, Any] = field(default_factory=dict)
    """OffloadAdamW's options (and the offload_adamw spec's)."""
    choices: frozenset[str] = frozenset({"keep", "page_host"})
    """The plan's choices, as a set."""
    buffers_per_layer: int = 7 * 2
    """Paged buffers per layer: codes and scales of 7 quantized projections (+ double-quant
    statistics or LoftQ factors)."""


VARIANTS = {
    "nf4-page-host": Variant(),
    "int8-recompute": Variant(
        quant={"quantize": "int8"},
        planner={"host_bandwidth": 1.0},
        choices=frozenset({"keep", "recompute"}),
    ),
    "nf4-double-quant-disk": Variant(
        quant={"double_quant": True},
        paging={"disk_offload": True, "host_budget": 0},
        planner={"disk": True, "host_budget": 0, "disk_bandwidth": 1e12},
        choices=frozenset({"keep", "page_disk"}),
        buffers_per_layer=7 * 4,
    ),
    "loftq-eager-adamw": Variant(
        quant={"error_rank": 4}, optimizer={"eager": True}, buffers_per_layer=7 * 4
    ),
    "bf16-moments": Variant(optimizer={"moment_dtype": "bf16"}),
    "int8-moments": Variant(optimizer={"moment_dtype": "int8"}),
}


def _spec(name: str, options: dict[str, Any]) -> str:
    """``name:key=value,...`` (``name:value,...`` for a ``quantize`` option: the format)."""
    given = dict(options)
    values = [str(given.pop("quantize"))] if "quantize" in given else []
    values += [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in given.items()]
    return f"{name}:{','.join(values)}" if values else name


def budget(variant: Variant = Variant()) -> int:
    """Halfway between the least reachable peak and keeping everything, measured on the
    quantized, streamed model: a plan that mixes keep with page / recompute."""
    model = lora_llama()
    by_hand(model, quant=variant.quant)
    batch = batches()[0]
    plan = MemoryPlanner(10**12, **PLANNER).plan(model, lambda: model(**batch).loss)
    assert plan.least_peak < plan.keep_peak
    return (plan.keep_peak + plan.least_peak) // 2


def planner_options(limit: int, variant: Variant) -> dict[str, Any]:
    return {"budget": limit, **PLANNER, **variant.planner, "track": True}


def paging_options(variant: Variant, folder: Path) -> dict[str, Any]:
    options = dict(variant.paging)
    if options.get("disk_offload"):
        options["disk_offload"] = str(folder)
    return options


def reference(
    limit: int, variant: Variant = Variant(), *, folder: Path | None = None, **hyper: Any
) -> Any:
    """The plain loop: the choices by hand, STEPS AdamW steps on the batches in order."""
    model = lora_llama()
    options = planner_options(limit, variant)
    paging, plan, optimizer = by_hand(
        model,
        quant=variant.quant,
        paging=paging_options(variant, folder or Path(tempfile.gettempdir())),
        planner=MemoryPlanner(options.pop("budget"), **options),
        optimizer=variant.optimizer,
        **hyper,
    )
    for step, batch in enumerate(batches()):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
        if step == 1:  # two measured steps, as the service's measure_steps=2
            plan.decide()
    assert plan.applied is not None
    assert set(plan.applied.choices.values()) == variant.choices
    paging.check_released()
    paging.remove()
    return model


def services(
    rt: SakuraRuntime, limit: int, variant: Variant = Variant(), *, folder: Path | None = None
) -> tuple[StreamWeights, MemoryPlannerService, Any]:
    """The same choices as services, by spec string (WeightPaging: a service of the test's,
    see StreamWeights)."""
    rt.install(_spec("quant", {"quantize": "nf4", **variant.quant}))
    streamed = rt.install(
        StreamWeights(**paging_options(variant, folder or Path(tempfile.gettempdir())))
    )
    planned = rt.install(
        _spec(
            "memory_plan", {**planner_options(limit, variant), "measure_steps": 2, "report": False}
        )
    )
    offload = rt.install(_spec("offload_adamw", variant.optimizer))
    return streamed, planned, offload


def _folders(tmp_path: Path) -> tuple[Path, Path]:
    """Where the by-hand run's and the services' disk tiers go."""
    hand, served = tmp_path / "hand", tmp_path / "services"
    hand.mkdir()
    served.mkdir()
    return hand, served


def check(
    trained: Any,
    expected: Any,
    streamed: StreamWeights,
    planned: MemoryPlannerService,
    limit: int,
    swapped: list[Any],
    used: Any,
    variant: Variant = Variant(),
) -> None:
    """The services did their part (the quantized base streamed, the variant's plan within
    the budget, the loop's optimizer swapped) and the LoRA weights equal the by-hand run's."""
    paging = streamed.paging
    assert paging is not None and paging.stats.paged_buffers == variant.buffers_per_layer * 3
    assert paging.stats.materialised == STEPS * 2 * 3  # forward + backward of 3 layers
    assert paging.stats.written == 0 and paging.stats.still_referenced == 0
    assert paging.stats.disk_blocks == (3 if variant.paging.get("disk_offload") else 0)
    plan = planned.plan
    assert plan is not None and plan.budget == limit
    assert set(plan.choices.values()) == variant.choices
    assert 0 < planned.planner.measured_peak <= limit
    assert len(swapped) == 1 and isinstance(swapped[0], OffloadAdamW)
    while used is not swapped[0]:  # the loop stepped it (through its wrappers)
        used = used.optimizer
    got, want = trainable(trained), trainable(expected)
    assert [n for n, _ in got] == [n for n, _ in want] and len(got) == 4 * 2 * 3
    start = dict(trainable(lora_llama()))
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert not torch.equal(b, start[name]), name  # it trained
        assert torch.equal(a, b), name
    # Every tensor, frozen ones too (codes, scales, norms), once the streaming is removed.
    full, reference_state = trained.state_dict(), expected.state_dict()
    assert list(full) == list(reference_state)
    assert all(torch.equal(full[k], reference_state[k]) for k in full)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_raw_loop_composes_bit_identically(name: str, tmp_path: Path) -> None:
    from sakura_adapters.ddp import DDPAdapter

    variant, folders = VARIANTS[name], _folders(tmp_path)
    limit = budget(variant)
    expected = reference(limit, variant, folder=folders[0])
    with SakuraRuntime(strict=True) as rt:
        streamed, planned, offload = services(rt, limit, variant, folder=folders[1])
        model = lora_llama()
        adapter = DDPAdapter(rt)
        model, optimizer = rt.prepare(
            model, torch.optim.AdamW([p for _, p in trainable(model)], lr=LR)
        )
        adapter.on_train_begin(model, optimizer, accumulation_steps=1)
        for step, batch in enumerate(batches()):
            adapter.on_train_step_begin(model, batch, step)
            optimizer.zero_grad()
            adapter.backward(model(**batch).loss)
            adapter.step(optimizer)
        adapter.on_train_end(model)
        swapped = list(offload.optimizers)  # (the service forgets them at teardown)
    check(model, expected, streamed, planned, limit, swapped, optimizer, variant)
    assert swapped[0].eager is bool(variant.optimizer.get("eager"))
    assert not any(folders[1].iterdir())  # the disk tier's folders are gone


def _lightning_fit(rt: SakuraRuntime, tmp_path: Path, **trainer_options: Any) -> Any:
    """A real lightning.Trainer with LightningAdapter(rt) over the rows in order; returns
    (the trained LightningModule, the trainer)."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from sakura_adapters.lightning import LightningAdapter

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = lora_llama()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for _, p in trainable(self.model)], lr=LR)

    module = Module()
    trainer = pl.Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
        callbacks=[LightningAdapter(rt)],
        **trainer_options,
    )
    data = rows() + rows(seed=5)  # enough for accumulation too
    trainer.fit(module, DataLoader(data, batch_size=BATCH, shuffle=False))
    return module, trainer


@pytest.mark.parametrize("name", list(VARIANTS))
def test_lightning_trainer_composes_bit_identically(name: str, tmp_path: Path) -> None:
    variant, folders = VARIANTS[name], _folders(tmp_path)
    limit = budget(variant)
    expected = reference(limit, variant, folder=folders[0])
    with SakuraRuntime(strict=True) as rt:
        streamed, planned, offload = services(rt, limit, variant, folder=folders[1])
        module, trainer = _lightning_fit(rt, tmp_path, max_steps=STEPS)
        swapped = list(offload.optimizers)
    check(module.model, expected, streamed, planned, limit, swapped, trainer.optimizers[0], variant)
    assert not any(folders[1].iterdir())


def test_lightning_gradient_accumulation_with_eager_updates(tmp_path: Path) -> None:
    """accumulate_grad_batches=2 (Lightning divides each loss by 2) with eager host
    updates (offload_adamw:eager=true reads the accumulation from the loop) and recomputed
    activations: the same as two halved backward passes per OffloadAdamW step by hand."""
    variant = VARIANTS["int8-recompute"]
    limit = budget(variant)
    model = lora_llama()
    options = planner_options(limit, variant)
    paging, plan, optimizer = by_hand(
        model,
        quant=variant.quant,
        planner=MemoryPlanner(options.pop("budget"), **options),
        optimizer={"eager": True, "accumulation_steps": 2},
    )
    for i, batch in enumerate(batches() + batches(seed=5)):
        (model(**batch).loss / 2).backward()
        if i % 2:
            optimizer.step()
            optimizer.zero_grad()
        if i == 1:
            plan.decide()
    paging.check_released()
    served = Variant(quant=variant.quant, planner=variant.planner, optimizer={"eager": True})
    with SakuraRuntime(strict=True) as rt:
        streamed, planned, offload = services(rt, limit, served)
        module, _ = _lightning_fit(rt, tmp_path, max_steps=STEPS, accumulate_grad_batches=2)
        swapped = list(offload.optimizers)
        assert swapped[0].eager and swapped[0].accumulation_steps == 2
    assert set(planned.plan.choices.values()) == {"keep", "recompute"}
    assert streamed.paging.stats.materialised == 2 * STEPS * 2 * 3  # two batches per step
    for (name, a), (_, b) in zip(trainable(module.model), trainable(model), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["nf4-page-host", "int8-recompute"])
def test_lightning_bf16_autocast_composes_bit_identically(name: str, tmp_path: Path) -> None:
    """sakura-precision's mixed_precision:bf16-mixed (autocast around the forward, the
    recomputation replaying it) on top: the same as torch.autocast by hand."""
    pytest.importorskip("sakura_precision")
    variant = VARIANTS[name]
    limit = budget(variant)
    model = lora_llama()
    options = planner_options(limit, variant)
    paging, plan, optimizer = by_hand(
        model, quant=variant.quant, planner=MemoryPlanner(options.pop("budget"), **options)
    )
    for step, batch in enumerate(batches()):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        if step == 1:
            plan.decide()
    paging.check_released()
    with SakuraRuntime(strict=True) as rt:
        rt.install("mixed_precision:bf16-mixed")
        streamed, planned, offload = services(rt, limit, variant)
        module, trainer = _lightning_fit(rt, tmp_path, max_steps=STEPS)
        swapped = list(offload.optimizers)
    check(module.model, model, streamed, planned, limit, swapped, trainer.optimizers[0], variant)


class _InOrder(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The rows in order: the Trainer shuffles a map-style dataset, never an iterable one."""

    def __iter__(self) -> Any:
        return iter(rows())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hf_trainer_composes_bit_identically(name: str, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from sakura_adapters.hf import SakuraTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: the by-hand loop does not clip
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    variant, folders = VARIANTS[name], _folders(tmp_path)
    limit = budget(variant)
    expected = reference(limit, variant, folder=folders[0], weight_decay=args.weight_decay)
    with SakuraRuntime(strict=True) as rt:
        streamed, planned, offload = services(rt, limit, variant, folder=folders[1])
        model = lora_llama()
        trainer = SakuraTrainer(model=model, args=args, train_dataset=_InOrder(), runtime=rt)
        trainer.train()
        swapped = list(offload.optimizers)
    # The Trainer passes num_items_in_batch to the model; without padding the loss is
    # the same float32 value as the model's own mean, so the weights are bit-identical.
    check(model, expected, streamed, planned, limit, swapped, trainer.optimizer, variant)
    assert not any(folders[1].iterdir())


@pytest.mark.parametrize("activations", ["checkpoint", "plan"])
def test_zero1_on_two_ranks_composes_bit_identically(activations: str, tmp_path: Path) -> None:
    """ZeRO1 shards the OffloadAdamW that the services made; the activations recomputed
    by sakura-precision's ``activation_checkpoint`` on every layer, or planned by
    ``memory_plan`` (recompute chosen: host paging priced at 1 B/s)."""
    pytest.importorskip("sakura_zero")
    pytest.importorskip("sakura_precision")
    from sakura.testing import launch_ranks

    mode = activations
    if activations == "plan":
        recompute = Variant(planner={"host_bandwidth": 1.0})  # on the NF4 base
        options = {**planner_options(budget(), recompute), "measure_steps": 2, "report": False}
        mode = _spec("memory_plan", options).partition(":")[2]
    worker = Path(__file__).with_name("_composition_rank.py")
    launch_ranks(worker, 2, tmp_path, mode, timeout=240)
    ranks = [json.loads((tmp_path / f"{activations}-rank{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        assert result["type"] == "OffloadAdamW"  # the swapped optimizer, sharded in place
        assert result["diffs"] == [0.0] * STEPS  # every step equal to the unsharded by-hand one
        assert result["paged_buffers"] == result["by_hand_paged_buffers"] == 7 * 2 * 3
        assert result["materialised"] == STEPS * 2 * 3
        if activations == "checkpoint":
            assert result["recomputed_blocks"] == [3, 3]  # service and by hand: every layer
        else:
            assert result["choices"] == [["keep", "recompute"]] * 2  # service and by hand
    held = [r["held_states"] for r in ranks]
    assert sum(held) == ranks[0]["total_trainable"] and min(held) >= 1  # each keeps its shard


def test_hf_trainer_clipping_refuses_eager_updates_before_training(tmp_path: Path) -> None:
    """The Trainer clips (max_grad_norm, 1.0 by default) in its own loop: the HF adapter
    says so on LoopContext.gradient_clipping, so offload_adamw:eager=true is refused when
    training starts, naming the setting, before an eager update runs on unclipped
    gradients (the weights untouched)."""
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from sakura.options import OptionError
    from sakura_adapters.hf import SakuraTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=LR,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = lora_llama()
    with SakuraRuntime(strict=True) as rt:
        services(rt, budget(), Variant(optimizer={"eager": True}))
        trainer = SakuraTrainer(model=model, args=args, train_dataset=_InOrder(), runtime=rt)
        with pytest.raises(
            OptionError, match=r"eager=True.*TrainingArguments\(max_grad_norm=1\.0\)"
        ):
            trainer.train()
    start = dict(trainable(lora_llama()))
    assert all(torch.equal(p, start[name]) for name, p in trainable(model))


def test_lightning_ddp_zero1_on_two_ranks_composes_bit_identically(tmp_path: Path) -> None:
    """A real lightning.Trainer(strategy="ddp") on 2 gloo ranks (started as torchrun
    would, so Lightning makes no processes of its own), with the services and ZeRO1: the
    same LoRA weights as the choices by hand in a DDP loop over each rank's rows."""
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("sakura_zero")
    pytest.importorskip("sakura_precision")
    from sakura.testing import launch_ranks

    env = {
        "TORCHELASTIC_RUN_ID": "sakura-composition-test",  # processes made externally
        "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        # read by Lightning's environment object only: the worker makes the process
        # group with a file rendezvous, nothing listens on this port
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29401",
    }
    worker = Path(__file__).with_name("_composition_rank.py")
    launch_ranks(worker, 2, tmp_path, "lightning", timeout=240, env=env)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"lightning-rank{rank}.json").read_text())
        assert result["diff"] == 0.0
        assert result["steps"] == STEPS  # 16 rows, 8 a rank, 2 a batch
        assert result["paged_buffers"] == 7 * 2 * 3
