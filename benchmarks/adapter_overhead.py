"""What do the Lightning and Hugging Face adapters cost a real training run?

Vanilla runs of a tiny model under ``lightning.Trainer`` and ``transformers.Trainer``
against the same runs with the sakura adapter attached, with no services and with 8 no-op
services (each handling every per-step event: ``on_train_step_begin`` ...
``on_train_step_end``, as ``pass``).

* **Lightning**: an MLP 784-256-10 (batch 64, SGD, data already batched, so the step is
  the model and Lightning's loop and nothing else).  Variants: vanilla;
  ``callbacks=[LightningAdapter(rt)]`` with an empty runtime (the adapter also installs
  its ``SakuraPrecision`` around the Trainer's precision plugin); the same with 8 no-op
  services.
* **Hugging Face**: the same MLP as an ``nn.Module`` returning ``{"loss", "logits"}``
  (``--hf-model bert``: a 2-layer BERT with hidden size 32, sequence length 32, batch 16),
  the Trainer building its own DataLoader from per-sample dicts.  Variants: the stock
  ``transformers.Trainer``; the stock Trainer with ``callbacks=[HFAdapter(rt)]``, empty
  runtime; the same with 8 no-op services; and ``SakuraTrainer`` with an empty runtime
  (the subclass path: optimizer proxy, accelerator hooks, autocast context).  A callback
  on the stock Trainer does not see the backward pass, so there the services receive 5 of
  the 7 per-step events (no ``OnBeforeBackward``/``OnAfterBackward``).

Every run is a fresh Trainer (and a fresh model with the trial's initial weights).  The
time per step comes from a timing callback that every variant carries as its first
callback: it reads the clock when step ``W`` begins and when step ``W + N`` begins, so it
covers ``N`` whole steps including every hook of the adapter, and excludes the Trainer's
construction, setup, the ``W`` warm-up steps and the end of training.

Within a trial each variant runs ``--rounds`` times, interleaved (A B C D, B C D A, ...:
``sakura_bench.measure.interleaved``),
so drift in machine speed hits the variants alike.  A trial's time of a variant is its
fastest run (on a shared machine other processes come in bursts of seconds and only ever
slow a run down); each trial's ratio divides by the vanilla time of the same trial.  The
median ratio over the trials is reported with its IQR and min-max, for wall-clock time
and, as a second opinion, for the process's CPU time.  A second vanilla variant (the A/A
control) measures the noise: a ratio whose IQR does not stand clear of the control's is
noise, not overhead, whichever side of 1.01 its median falls.  Because a 1 % difference
is close to that noise, the adapters' cost is also measured in isolation: the same runs
with a one-parameter model, where the framework's loop is nearly all of the step; the
per-step time of the fastest 20-step stretch in any of the interleaved repeats, less
vanilla's, is the adapter's cost in microseconds per step, also given as a share of the
real vanilla step measured the same way (its fastest 20-step stretch).

Target (from the issue): adapter with no services and with 8 no-op services within 1 % of
vanilla (median ratio).

Run ``python benchmarks/adapter_overhead.py`` (about 4 minutes on 2 cores), ``--quick``
for a smoke run (about 1 minute), ``--json OUT`` to keep the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import (
    make_noop_services,
    overhead_row,
    overhead_row_text,
    pin_threads,
    run_environment,
    verdict,
    write_json,
)

from sakura_bench.measure import interleaved, load_average

N_SERVICES = 8
WINDOW = 20  # steps per stretch in the isolated measurement
TARGET = 1.01  # adapter within 1 % of vanilla

# key, label; "vanilla" is the reference, "control" a second vanilla run (A/A).
LIGHTNING_VARIANTS = (
    ("vanilla", "vanilla lightning.Trainer"),
    ("control", "vanilla again (A/A control)"),
    ("empty", "LightningAdapter, no services"),
    ("8noop", f"LightningAdapter, {N_SERVICES} no-op services"),
)
HF_VARIANTS = (
    ("vanilla", "vanilla transformers.Trainer"),
    ("control", "vanilla again (A/A control)"),
    ("empty", "Trainer + HFAdapter, no services"),
    ("8noop", f"Trainer + HFAdapter, {N_SERVICES} no-op services"),
    ("sakura-trainer", "SakuraTrainer, no services"),
)
TARGET_KEYS = ("empty", "8noop")
FRAMEWORKS = {"lightning": "Lightning", "hf": "Hugging Face"}


def _quiet() -> None:
    """Silence framework chatter.  Lightning sets its loggers' level when imported, so it
    is imported first."""
    warnings.simplefilter("ignore")
    with contextlib.suppress(ImportError):
        import lightning.pytorch  # noqa: F401
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()


def _runtime(key: str) -> Any:
    """A fresh runtime for the variant ``key`` (None for the vanilla ones)."""
    from sakura import SakuraRuntime

    if key in ("vanilla", "control"):
        return None
    if key == "8noop":
        return SakuraRuntime(make_noop_services(N_SERVICES))
    return SakuraRuntime()


class _Stamps:
    """The clock reads of a timing callback: wall clock at the start of every step from
    ``first`` to ``last``, and the process's CPU time at those two."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.wall: list[int] = []
        self.cpu: list[int] = []

    def tick(self, index: int) -> None:
        if self.first <= index <= self.last:
            self.wall.append(time.perf_counter_ns())
            if index in (self.first, self.last):
                self.cpu.append(time.process_time_ns())

    def result(self, what: str) -> tuple[float, float, float]:
        """Seconds per step: (wall, CPU, the fastest ``WINDOW``-step stretch of wall)."""
        steps = self.last - self.first
        if len(self.wall) != steps + 1 or len(self.cpu) != 2:
            raise RuntimeError(f"{what} ended before its last timed step")
        wall = (self.wall[-1] - self.wall[0]) / 1e9 / steps
        cpu = (self.cpu[1] - self.cpu[0]) / 1e9 / steps
        k = min(WINDOW, steps)
        window = min(
            (self.wall[i + k] - self.wall[i]) / 1e9 / k for i in range(0, steps - k + 1, k)
        )
        return wall, cpu, window


def _cycle_dataset(base: Sequence[Any], length: int) -> Any:
    """A map-style dataset of ``length`` items cycling through ``base`` (no copies)."""
    from torch.utils.data import Dataset

    class Cycle(Dataset):
        def __len__(self) -> int:
            return length

        def __getitem__(self, index: int) -> Any:
            return base[index % len(base)]

    return Cycle()


# --- Lightning ------------------------------------------------------------------------------


class LightningBench:
    """Fresh ``lightning.Trainer`` runs; ``run`` returns seconds per timed step."""

    def __init__(self, tmpdir: Path, *, tiny: bool) -> None:
        import lightning as L
        import torch
        from torch import nn

        self.tmpdir = tmpdir
        self.tiny = tiny
        gen = torch.Generator().manual_seed(0)
        if tiny:  # the isolated measurement: one parameter, a scalar per batch
            self.base: list[Any] = [torch.randn(1, generator=gen) for _ in range(32)]
        else:
            self.base = [
                (torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen))
                for _ in range(32)
            ]

        class MLP(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                x, y = batch
                return nn.functional.cross_entropy(self.net(x), y)

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01)

        class Scalar(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(1))

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                return (self.w * batch).sum()

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01)

        class StepTimer(L.Callback):
            """Reads the clocks when each batch from ``first`` to ``last`` begins."""

            def __init__(self, first: int, last: int) -> None:
                self.stamps = _Stamps(first, last)

            def on_train_batch_start(
                self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
            ) -> None:
                self.stamps.tick(batch_idx)

        self.module_cls = Scalar if tiny else MLP
        self.timer_cls = StepTimer

    def run(self, key: str, steps: int, warmup: int, seed: int) -> tuple[float, float, float]:
        import lightning as L
        import torch
        from torch.utils.data import DataLoader

        from sakura_adapters.lightning import LightningAdapter

        total = warmup + steps + 1
        loader = DataLoader(_cycle_dataset(self.base, total), batch_size=None)
        torch.manual_seed(seed)
        module = self.module_cls()
        timer = self.timer_cls(warmup, warmup + steps)
        rt = _runtime(key)
        with rt if rt is not None else contextlib.nullcontext():
            callbacks: list[Any] = [timer]
            if rt is not None:
                callbacks.append(LightningAdapter(rt))
            trainer = L.Trainer(
                max_epochs=1,
                limit_train_batches=total,
                callbacks=callbacks,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                num_sanity_val_steps=0,
                accelerator="cpu",
                devices=1,
                default_root_dir=str(self.tmpdir),
            )
            gc.collect()
            trainer.fit(module, loader)
        return timer.stamps.result(f"lightning run {key!r}")


# --- Hugging Face ---------------------------------------------------------------------------


class HFBench:
    """Fresh ``transformers.Trainer`` runs; ``run`` returns seconds per timed step."""

    def __init__(self, tmpdir: Path, *, model: str, tiny: bool) -> None:
        import torch
        from torch import nn
        from transformers import TrainerCallback

        self.tmpdir = tmpdir
        self.kind = "scalar" if tiny else model
        gen = torch.Generator().manual_seed(0)
        if self.kind == "scalar":
            self.batch = 1
            self.base: list[Any] = [
                {"x": torch.randn(1, generator=gen), "labels": torch.zeros(1)} for _ in range(64)
            ]
        elif self.kind == "mlp":
            self.batch = 64
            self.base = [
                {"x": torch.randn(784, generator=gen), "labels": torch.tensor(i % 10)}
                for i in range(256)
            ]
        else:
            self.batch = 16
            self.base = [
                {
                    "input_ids": torch.randint(0, 100, (32,), generator=gen),
                    "attention_mask": torch.ones(32, dtype=torch.long),
                    "labels": torch.tensor(i % 2),
                }
                for i in range(256)
            ]

        class MLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

            def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
                logits = self.net(x)
                return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

        class Scalar(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(1))

            def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
                out = self.w * x
                return {"loss": out.sum(), "logits": out}

        class StepTimer(TrainerCallback):
            """Reads the clocks when each step from ``first`` to ``last`` begins (counted
            from 0)."""

            def __init__(self, first: int, last: int) -> None:
                self.stamps = _Stamps(first, last)
                self.index = 0

            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.stamps.tick(self.index)
                self.index += 1

        self.classes = {"mlp": MLP, "scalar": Scalar}
        self.timer_cls = StepTimer

    def _model(self, seed: int) -> Any:
        import torch

        torch.manual_seed(seed)
        if self.kind != "bert":
            return self.classes[self.kind]()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        return BertForSequenceClassification(config)

    def run(self, key: str, steps: int, warmup: int, seed: int) -> tuple[float, float, float]:
        from transformers import Trainer, TrainingArguments
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        from sakura_adapters.hf import HFAdapter, SakuraTrainer

        total = warmup + steps + 1
        args = TrainingArguments(
            output_dir=str(self.tmpdir / "hf"),
            max_steps=total,
            per_device_train_batch_size=self.batch,
            learning_rate=0.01,
            lr_scheduler_type="constant",
            train_sampling_strategy="sequential",
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        dataset = _cycle_dataset(self.base, total * self.batch)
        model = self._model(seed)
        timer = self.timer_cls(warmup, warmup + steps)
        rt = _runtime(key)
        with rt if rt is not None else contextlib.nullcontext():
            callbacks: list[Any] = [timer]
            if key == "sakura-trainer":
                trainer: Any = SakuraTrainer(
                    model=model, args=args, train_dataset=dataset, callbacks=callbacks, runtime=rt
                )
            else:
                if rt is not None:
                    callbacks.append(HFAdapter(rt))
                trainer = Trainer(
                    model=model, args=args, train_dataset=dataset, callbacks=callbacks
                )
            # The end-of-training summary printer, alike for every variant.
            trainer.remove_callback(PrinterCallback)
            trainer.remove_callback(ProgressCallback)
            gc.collect()
            trainer.train()
        return timer.stamps.result(f"HF run {key!r}")


# --- measurement ----------------------------------------------------------------------------

CLOCKS = ("wall", "cpu")  # wall clock; CPU time of this process
Run = Callable[[str, int, int, int], tuple[float, float, float]]


def _freeze_heap() -> None:
    """Move every object alive now (torch, Lightning, transformers: some 400k) out of the
    garbage collector's sight, so the ``gc.collect()`` that levels the collector's state
    before each run takes microseconds instead of a third of a second.  Objects the runs
    allocate are collected as usual."""
    gc.collect()
    gc.freeze()


def interleaved_trials(
    run: Run, keys: Sequence[str], args: argparse.Namespace, steps: int, name: str
) -> dict[str, dict[str, list[list[float]]]]:
    """Seconds per step of every run, ``{field: {variant: [[per round] per trial]}}`` for
    the fields wall, cpu and window (the run's fastest ``WINDOW``-step stretch).
    Each trial runs every variant ``args.rounds`` times, interleaved, the order rotating by
    one every round; a run's seed is its trial's number."""
    per_round = max(1, steps // args.rounds)
    rounds = args.rounds
    fields = (*CLOCKS, "window")

    def contender(key: str) -> Callable[[int], tuple[float, float, float]]:
        return lambda i: run(key, per_round, args.warmup, i // rounds)

    done: dict[str, list[tuple[float, float, float]]] = {k: [] for k in keys}

    def progress(i: int, results: dict[str, tuple[float, float, float]]) -> None:
        for k in keys:
            done[k].append(results[k])
        if args.verbose and (i + 1) % rounds == 0:
            line = "  ".join(
                f"{k}=" + "/".join(f"{r[0] * 1e6:.0f}" for r in done[k][-rounds:]) for k in keys
            )
            print(f"  {name} trial {i // rounds + 1}/{args.trials}: {line} us/step", flush=True)

    flat = interleaved({k: contender(k) for k in keys}, args.trials * rounds, on_trial=progress)
    return {
        field: {
            k: [[r[f] for r in flat[k][t * rounds : (t + 1) * rounds]] for t in range(args.trials)]
            for k in keys
        }
        for f, field in enumerate(fields)
    }


def isolated_costs(
    run: Run, keys: Sequence[str], repeats: int, steps: int, warmup: int
) -> dict[str, dict[str, float]]:
    """Seconds per step, ``{clock: {variant: s}}``, over interleaved repeats: for the wall
    clock the fastest ``WINDOW``-step stretch of any run, for CPU time the fastest run."""
    runs = interleaved(
        {key: lambda _, key=key: run(key, steps, warmup, 0) for key in keys}, repeats
    )
    return {
        "wall": {key: min(window for _, _, window in r) for key, r in runs.items()},
        "cpu": {key: min(cpu for _, cpu, _ in r) for key, r in runs.items()},
    }


def framework_benchmark(
    bench: Any,
    iso_bench: Any,
    variants: Sequence[tuple[str, str]],
    args: argparse.Namespace,
    steps: int,
    name: str,
) -> dict[str, Any]:
    keys = [key for key, _ in variants]
    labels = dict(variants)
    for key in keys:  # one short untimed run of every variant: imports, first-call caches
        bench.run(key, 5, 2, 0)
    _freeze_heap()
    runs = interleaved_trials(bench.run, keys, args, steps, name)
    results: dict[str, dict[str, Any]] = {}
    for clock in CLOCKS:
        # A trial's time of a variant: its least disturbed run (other processes only ever
        # slow a run down).
        per_trial = {key: [min(rounds) for rounds in runs[clock][key]] for key in keys}
        results[clock] = {
            key: overhead_row(labels[key], per_trial[key], per_trial["vanilla"]) for key in keys
        }
    out: dict[str, Any] = {
        "trials": args.trials,
        "rounds": args.rounds,
        "steps_per_run": max(1, steps // args.rounds),
        "warmup_steps_per_run": args.warmup,
        "clocks": results,
        "runs_us": {
            field: {key: [[t * 1e6 for t in r] for r in per_key[key]] for key in keys}
            for field, per_key in runs.items()
        },
    }
    # The real vanilla step at its least disturbed: what the isolated cost is compared with.
    real_step = min(t for r in runs["window"]["vanilla"] for t in r) * 1e6
    if iso_bench is not None:
        for key in keys:
            iso_bench.run(key, 5, 2, 0)
        _freeze_heap()
        best = isolated_costs(
            iso_bench.run, keys, args.isolated_repeats, args.isolated_steps, args.warmup
        )
        iso: dict[str, Any] = {}
        for key in keys:
            entry: dict[str, Any] = {"label": labels[key]}
            for clock in CLOCKS:
                added = (best[clock][key] - best[clock]["vanilla"]) * 1e6
                real = (
                    real_step
                    if clock == "wall"
                    else results[clock]["vanilla"]["us_per_step"].median
                )
                entry[clock] = {
                    "min_us_per_step": best[clock][key] * 1e6,
                    "added_us_per_step": added,
                    "pct_of_real_step": 100 * added / real,
                }
            iso[key] = entry
        out["isolated"] = {
            "real_vanilla_step_us": real_step,
            "steps_per_run": args.isolated_steps,
            "repeats": args.isolated_repeats,
            "variants": iso,
        }
    return out


# --- report ---------------------------------------------------------------------------------


def _noise_note(entry: dict[str, Any], control: dict[str, Any]) -> str:
    """Whether a ratio's IQR stands clear of the A/A control's IQR (and of 1.0)."""
    ratio, noise = entry["ratio"], control["ratio"]
    lo = min(noise.q1, 1.0)
    hi = max(noise.q3, 1.0)
    if ratio.q1 <= hi and ratio.q3 >= lo:
        return "within noise"
    return "above noise" if ratio.median > 1.0 else "below, beyond noise"


def print_report(report: dict[str, Any]) -> None:
    env = report["environment"]
    print()
    print("Sakura adapter overhead")
    print(
        f"python {env['python']}, torch {env['torch']}, lightning {env['lightning']}, "
        f"transformers {env['transformers']}, accelerate {env['accelerate']}, sakura "
        f"{env['sakura-core']}, sakura-adapters {env['sakura-adapters']}; torch threads "
        f"{env['torch_threads']}"
    )
    print(env["machine"])
    models = {
        "lightning": "MLP 784-256-10, batch 64 (pre-batched), SGD",
        "hf": report["hf_model_description"],
    }
    present = [(fw, title) for fw, title in FRAMEWORKS.items() if fw in report]
    for section, (fw, title) in enumerate(present, start=1):
        res = report[fw]
        print()
        print(f"{section}. {title}: {models[fw]}, CPU")
        print(
            f"   {res['trials']} trials; per trial {res['rounds']} fresh-Trainer runs of every "
            f"variant, interleaved, each {res['steps_per_run']} timed steps after "
            f"{res['warmup_steps_per_run']} untimed"
        )
        wall, cpu = res["clocks"]["wall"], res["clocks"]["cpu"]
        header = (
            f"   {'variant':<38} {'us/step':>9}  {'ratio (IQR, min-max)':<55}  "
            f"{'CPU ratio':>9}  noise?"
        )
        print(header)
        print("   " + "-" * (len(header) - 3))
        for key, entry in wall.items():
            note = "" if key in ("vanilla", "control") else _noise_note(entry, wall["control"])
            print(
                f"{overhead_row_text(entry, 38):<{len(header) - 19}}"
                f"{cpu[key]['ratio'].median:>9.4f}  {note}".rstrip()
            )
        print(
            "   us/step: median over trials of a trial's fastest run (wall clock).  ratio: that "
            "time / vanilla's\n   in the same trial; median, IQR, min-max over trials.  CPU "
            "ratio: the median ratio of this process's\n   CPU time.  A/A control: vanilla "
            "against itself, how far noise alone moves a ratio."
        )
        iso = res.get("isolated")
        if iso:
            print(
                f"   Isolated: the same runs with a one-parameter model, where the framework's "
                f"loop is nearly all\n   of the step; the fastest {WINDOW}-step stretch in "
                f"{iso['repeats']} interleaved runs of {iso['steps_per_run']} steps each;\n"
                f"   % of the real vanilla step at its fastest {WINDOW}-step stretch, "
                f"{iso['real_vanilla_step_us']:.0f} us."
            )
            header = (
                f"   {'variant':<38} {'us/step':>8} {'added us':>9} {'% of real vanilla step':>23}"
            )
            print(header)
            print("   " + "-" * (len(header) - 3))
            for key, entry in iso["variants"].items():
                c = entry["wall"]
                line = f"   {entry['label']:<38} {c['min_us_per_step']:>8.1f}"
                if key != "vanilla":
                    line += f" {c['added_us_per_step']:>9.1f} {c['pct_of_real_step']:>22.2f}%"
                print(line)

    print()
    print("Targets (the issue's: with the adapter, within 1 % of vanilla)")
    for target in report["targets"]:
        print(f"   [{verdict(target['met'])}] {target['name']}: {target['value']}")
    print(
        "   A median ratio whose IQR overlaps the A/A control's is within this machine's noise, "
        "MET or MISSED;\n   the isolated cost is the adapter's own cost, measured apart from "
        "the noise of the tensor work."
    )
    print()


def evaluate_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    for fw, title in FRAMEWORKS.items():
        if fw not in report:
            continue
        res = report[fw]
        wall = res["clocks"]["wall"]
        control = wall["control"]
        for key in TARGET_KEYS:
            entry = wall[key]
            targets.append(
                {
                    "name": f"{title}: {entry['label']}, median ratio",
                    "met": entry["ratio"].median <= TARGET,
                    "value": f"{entry['ratio'].format(4, iqr=True)}; A/A control "
                    f"{control['ratio'].format(4, iqr=True)}; {_noise_note(entry, control)}",
                }
            )
            iso = res.get("isolated")
            if iso:
                cost = iso["variants"][key]["wall"]
                noise = iso["variants"]["control"]["wall"]["added_us_per_step"]
                real = iso["real_vanilla_step_us"]
                targets.append(
                    {
                        "name": f"{title}: {entry['label']}, isolated cost",
                        "met": cost["pct_of_real_step"] <= 100 * (TARGET - 1),
                        "value": f"{cost['added_us_per_step']:.1f} us/step = "
                        f"{cost['pct_of_real_step']:.2f} % of the {real:.0f} us real vanilla step "
                        f"(A/A control: {noise:+.1f} us, the noise of this figure)",
                    }
                )
    return targets


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-step cost of sakura's Lightning and Hugging Face adapters against "
        "vanilla Trainer runs of a tiny model.",
    )
    parser.add_argument("--trials", type=int, default=7, help="trials (>= 7 for a report)")
    parser.add_argument(
        "--rounds", type=int, default=6, help="interleaved runs per variant per trial"
    )
    parser.add_argument(
        "--lightning-steps",
        type=int,
        default=1200,
        help="timed Lightning steps per variant per trial (split over the rounds)",
    )
    parser.add_argument(
        "--hf-steps",
        type=int,
        default=720,
        help="timed HF steps per variant per trial (split over the rounds)",
    )
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps at each run's start")
    parser.add_argument(
        "--hf-model",
        choices=("mlp", "bert"),
        default="mlp",
        help="HF model: the MLP (default) or a 2-layer BERT with hidden size 32",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch / BLAS threads")
    parser.add_argument(
        "--isolated-repeats", type=int, default=10, help="repeats of the isolated measurement"
    )
    parser.add_argument("--isolated-steps", type=int, default=200, help="steps per isolated run")
    parser.add_argument("--no-isolated", action="store_true", help="skip the isolated measurement")
    parser.add_argument("--only", choices=tuple(FRAMEWORKS), help="benchmark one framework only")
    parser.add_argument("--quick", action="store_true", help="smoke run (~1 minute)")
    parser.add_argument("--json", metavar="OUT", type=Path, help="also write the results as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every trial")
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.rounds, args.lightning_steps, args.hf_steps = 3, 3, 450, 300
        args.isolated_repeats, args.isolated_steps, args.warmup = 3, 200, 10
    for name in (
        "trials",
        "rounds",
        "lightning_steps",
        "hf_steps",
        "threads",
        "isolated_repeats",
        "isolated_steps",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    pin_threads(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    _quiet()
    if args.trials < 7 and not args.quick:
        print(f"note: {args.trials} trials; the report needs >= 7", file=sys.stderr)
    started = time.perf_counter()
    load_start = load_average()
    report: dict[str, Any] = {"quick": args.quick, "hf_model": args.hf_model}
    report["hf_model_description"] = {
        "mlp": "MLP 784-256-10 as an nn.Module, batch 64 (Trainer's DataLoader), SGD",
        "bert": "BertForSequenceClassification (2 layers, hidden 32), seq 32, batch 16, SGD",
    }[args.hf_model]
    frameworks = [args.only] if args.only else list(FRAMEWORKS)
    with tempfile.TemporaryDirectory(prefix="sakura-adapter-overhead-") as tmp:
        tmpdir = Path(tmp)
        if "lightning" in frameworks:
            print("Lightning ...", flush=True)
            report["lightning"] = framework_benchmark(
                LightningBench(tmpdir, tiny=False),
                None if args.no_isolated else LightningBench(tmpdir, tiny=True),
                LIGHTNING_VARIANTS,
                args,
                args.lightning_steps,
                "lightning",
            )
        if "hf" in frameworks:
            print("Hugging Face ...", flush=True)
            report["hf"] = framework_benchmark(
                HFBench(tmpdir, model=args.hf_model, tiny=False),
                None if args.no_isolated else HFBench(tmpdir, model=args.hf_model, tiny=True),
                HF_VARIANTS,
                args,
                args.hf_steps,
                "hf",
            )
    report["environment"] = run_environment(
        ("lightning", "transformers", "accelerate", "sakura-core", "sakura-adapters"), load_start
    )
    report["targets"] = evaluate_targets(report)
    report["wall_s"] = time.perf_counter() - started
    print_report(report)
    print(f"({report['wall_s']:.0f} s)")
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
