"""The command end to end on tiny settings: run (fresh process per trial), compare, export,
list, and the errors for wrong names, values and pairs."""

from __future__ import annotations

import base64
import json
import re
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sakura_bench.cli import main
from sakura_bench.report import SCHEMA, SCHEMA_VERSION, load_report

Run = Callable[..., subprocess.CompletedProcess[str]]  # the ``bench`` fixture of conftest.py

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after checking the signature)."""
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A baseline run (2 trials) and a sakura run with async_eval:thread (1 trial) of
    mnist-mlp at tiny scale; the command runs here, each trial in a fresh process."""
    out = tmp_path_factory.mktemp("reports")
    common = ["--workload", "mnist-mlp", "--framework", "pytorch-ddp", "--scale", "tiny",
              "--epochs", "2", "--threads", "1", "--output", str(out)]  # fmt: skip
    assert main(["run", *common, "--runner", "baseline", "--trials", "2"]) == 0
    assert (
        main(
            [
                "run",
                *common,
                "--runner",
                "sakura",
                "--service",
                "async_eval:thread",
                "--trials",
                "1",
            ]
        )
        == 0
    )
    return out


def test_run_writes_a_valid_report(reports: Path) -> None:
    base = load_report(reports / "mnist-mlp-baseline-pytorch-ddp.json")
    sak = load_report(reports / "mnist-mlp-sakura-pytorch-ddp.json")
    assert base["schema"] == SCHEMA and base["schema_version"] == SCHEMA_VERSION
    assert (base["runner"], base["framework"], base["services"]) == ("baseline", "pytorch-ddp", [])
    assert sak["services"] == ["async_eval:thread"]
    assert base["settings"]["isolation"] == "process per trial"
    assert len(base["trials"]) == 2 and len(sak["trials"]) == 1
    trial = base["trials"][0]
    # 256 samples, batch 32: 8 steps per epoch, 2 epochs; 5 warm-up steps left out.
    assert trial["steps"] == 16 and trial["warmup_steps_excluded"] == 5
    assert trial["step_time_s"]["n"] == 11
    assert [e["steps"] for e in trial["epochs"]] == [8, 8]
    assert trial["samples_per_epoch"] == 256
    assert trial["wall_s"] > 0 and trial["process_s"] > trial["wall_s"]
    assert trial["memory"]["peak_rss_mib"] > 50
    assert trial["errors"] == []
    assert base["environment"]["torch_threads"] == 1
    assert base["environment"]["versions"]["sakura-bench"] == "0.1.0"
    assert base["workload"]["params"] == 784 * 64 + 64 + 64 * 32 + 32 + 32 * 10 + 10
    # Each epoch's metrics: evaluated by the loop (baseline) or by AsyncEval on a thread
    # (sakura) from a snapshot of the same weights: equal.
    for b_epoch, s_epoch in zip(trial["epochs"], sak["trials"][0]["epochs"], strict=True):
        assert b_epoch["eval"].keys() == {"val_loss", "val_acc"}
        for key, value in b_epoch["eval"].items():
            assert s_epoch["eval"][key] == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert base["summary"]["metrics_agree"] is True  # the two baseline trials agree


def test_compare(reports: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = str(reports / "mnist-mlp-baseline-pytorch-ddp.json")
    b = str(reports / "mnist-mlp-sakura-pytorch-ddp.json")
    assert main(["compare", a, b, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    wall_a = load_report(a)["summary"]["wall_s"]
    wall_b = load_report(b)["summary"]["wall_s"]
    assert result["speedup"] == pytest.approx(wall_a["median"] / wall_b["median"])
    assert result["trials"] == [2, 1]
    assert any("--trials 3" in line for line in result["advice"])
    assert result["metrics_agree"] is True
    assert main(["compare", a, b]) == 0
    text = capsys.readouterr().out
    assert "speed-up of B over A" in text and "val_acc" in text


def test_export_writes_markdown_png_and_self_contained_html(reports: Path, tmp_path: Path) -> None:
    paths = sorted(str(p) for p in reports.glob("*.json"))
    assert main(["export", *paths, "--output", str(tmp_path)]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "mnist-mlp · baseline · pytorch-ddp" in md and "![wall_time.png](wall_time.png)" in md
    for name in ("wall_time.png", "step_time.png", "throughput.png", "epochs.png"):
        width, height = png_size((tmp_path / name).read_bytes())
        assert width == 900 and 100 < height < 400  # 9 in at 100 dpi; height grows with rows
    page = (tmp_path / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"(src|href)=\"(?!data:)", page), "the page must not load anything"
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 4
    assert png_size(base64.b64decode(images[0])) == png_size(
        (tmp_path / "wall_time.png").read_bytes()
    )


def test_quiet_prints_only_the_report_path(bench: Run, tmp_path: Path) -> None:
    """The installed command in a fresh interpreter (the trial in that same process)."""
    result = bench("run", "--workload", "mnist-mlp", "--runner", "baseline", "--framework",
                   "pytorch-ddp", "--scale", "tiny", "--epochs", "1", "--trials", "1",
                   "--output", "out", "--quiet", "--in-process")  # fmt: skip
    assert result.stdout.strip() == str(Path("out") / "mnist-mlp-baseline-pytorch-ddp.json")
    assert result.stderr == ""
    report = load_report(tmp_path / result.stdout.strip())
    assert report["trials"][0]["epochs_run"] == 1
    assert report["settings"]["isolation"] == "in-process"


def test_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    workloads = {w["name"]: w for w in data["workloads"] if w["provided_by"] == "sakura-bench"}
    assert sorted(workloads) == [
        "cifar10-resnet50",
        "distilbert-glue",
        "distilbert-sst2",
        "distilbert-sst2-hf",
        "llama3-1b-finetune",
        "mistral-7b-lora",
        "mnist-mlp",
        "mnist-mlp-multi",
        "smollm2-qlora",
        "tiny-llama-qlora",
    ]
    assert workloads["smollm2-qlora"]["variants"].keys() == {
        "peft-bnb",
        "peft-bnb-bf16",
        "peft-bnb-bf16-model",
        "bf16-model",
    }
    assert workloads["smollm2-qlora"]["frameworks"] == ["hf-trainer", "lightning", "pytorch-ddp"]
    assert workloads["distilbert-sst2-hf"]["frameworks"] == [
        "hf-trainer",
        "lightning",
        "pytorch-ddp",
    ]
    assert workloads["distilbert-sst2"]["frameworks"] == ["lightning", "pytorch-ddp"]
    assert workloads["mistral-7b-lora"]["gpu_scales"] == ["full"]
    assert workloads["mnist-mlp"]["gpu_scales"] == []
    frameworks = {f["name"]: f["provided_by"] for f in data["frameworks"]}
    for name in ("hf-trainer", "lightning", "pytorch-ddp"):
        assert frameworks[name] == "sakura-bench"
    services = {s["name"]: s["provided_by"] for s in data["services"]}
    assert services["telemetry"] == "sakura-core"
    assert data["failures"] == []


def test_list_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for word in (
        "workloads",
        "frameworks",
        "services",
        "mnist-mlp-multi",
        "hf-trainer",
        "telemetry",
    ):
        assert word in out
    # Plugins' descriptions are text, not rich markup: the extra in brackets survives.
    assert "sakura-async[dask]" in out


RUN = ["run", "--scale", "tiny", "--in-process", "--output"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "mnist", "--runner", "baseline", "--framework", "pytorch-ddp"],
         r"unknown workload 'mnist'\. Did you mean 'mnist-mlp'\? Available workloads: cifar10-resnet50, "),
        (["--workload", "mnist-mlp", "--runner", "baseline", "--framework", "pytorch"],
         r"unknown framework 'pytorch'\. .*Available frameworks: hf-trainer, lightning, pytorch-ddp"),
        (["--workload", "distilbert-sst2", "--runner", "baseline", "--framework", "hf-trainer"],
         r"--framework hf-trainer cannot run --workload distilbert-sst2: it needs an HF-shaped workload.*"
         r"Workloads it runs: distilbert-sst2-hf, llama3-1b-finetune, mistral-7b-lora, "
         r"smollm2-qlora, tiny-llama-qlora"),
        (["--workload", "distilbert-glue", "--runner", "baseline", "--framework", "hf-trainer"],
         r"supports --framework pytorch-ddp or lightning only"),
        (["--workload", "mnist-mlp", "--runner", "vanilla", "--framework", "pytorch-ddp"],
         r"--runner 'vanilla' is not accepted; use one of baseline, sakura"),
        (["--workload", "mnist-mlp", "--runner", "baseline", "--framework", "pytorch-ddp",
          "--service", "telemetry"], r"services are used by --runner sakura only"),
        (["--workload", "mnist-mlp", "--runner", "sakura", "--framework", "pytorch-ddp",
          "--service", "telemetr"], r"unknown service 'telemetr'.*Did you mean 'telemetry'"),
        (["--workload", "mnist-mlp", "--runner", "sakura", "--framework", "pytorch-ddp",
          "--service", "async_eval:carrier-pigeon"], r"unknown dispatcher 'carrier-pigeon'"),
        (["--workload", "mnist-mlp", "--runner", "baseline", "--framework", "pytorch-ddp",
          "--trials", "0"], r"--trials must be an integer >= 1, got 0"),
        (["--workload", "mnist-mlp", "--runner", "baseline", "--framework", "pytorch-ddp",
          "--scale", "huge"], r"--scale 'huge' is not a scale of workload 'mnist-mlp'; accepted: auto, tiny, small, full"),
        (["--workload", "mnist-mlp", "--runner", "baseline", "--framework", "pytorch-ddp",
          "--device", "tpu"], r"--device 'tpu' is not accepted; use one of auto, cpu, cuda"),
        (["--workload", "mnist-mlp", "--runner", "baseline", "--framework", "lightning",
          "--nproc", "2"], r"supported by --framework pytorch-ddp only"),
        (["--workload", "mnist-mlp", "--runner", "baseline", "--framework", "pytorch-ddp",
          "--data", "/nonexistent/mnist"], r"--data '/nonexistent/mnist' is not a directory"),
        (["--workload", "mnist-mlp", "--runner", "baseline", "--framework", "pytorch-ddp",
          "--variant", "peft-bnb"],
         r"--variant 'peft-bnb' is not a variant of workload 'mnist-mlp'; accepted: none"),
        (["--workload", "tiny-llama-qlora", "--runner", "baseline", "--framework", "pytorch-ddp",
          "--variant", "bnb"], r"--variant 'bnb' is not a variant .* accepted: peft-bnb"),
    ],
)  # fmt: skip
def test_usage_errors_name_what_is_accepted(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*RUN, str(tmp_path), *args, *([] if "--trials" in args else ["--trials", "1"])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sakura-bench: error: ")
    assert re.search(message, err), err
    assert not list(tmp_path.glob("*.json"))


def test_full_scale_needs_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the full scale is allowed")
    argv = ["run", "--workload", "llama3-1b-finetune", "--runner", "baseline", "--framework",
            "hf-trainer", "--scale", "full", "--output", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "workload 'llama3-1b-finetune' at --scale full needs a CUDA GPU (1.24 B parameters" in err
    )
    assert "on CPU use --scale tiny or small" in err


def test_the_default_scale_suits_the_device() -> None:
    """--scale auto (the default): the full size on a CUDA GPU; on a CPU the small one, so
    that a README command finishes in about a minute, or the largest the CPU can run."""
    import torch

    from sakura_bench.registry import get_registry

    registry = get_registry()
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for name in ("mnist-mlp", "mnist-mlp-multi", "cifar10-resnet50", "llama3-1b-finetune"):
        workload = registry.get("workload", name).load()
        assert workload.default_scale(cuda) == "full", name
        assert workload.default_scale(cpu) == "small", name
        assert "small" not in workload.gpu_scales


def test_services_write_under_the_output_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """async_checkpoint without a dir writes under <output>/<report name>/trial-<i>/, never
    into the current directory (the reference's mnist-mlp-multi command)."""
    from sakura_async import load_latest

    monkeypatch.chdir(tmp_path)
    argv = ["run", "--workload", "mnist-mlp-multi", "--runner", "sakura", "--framework",
            "pytorch-ddp", "--scale", "tiny", "--epochs", "2", "--trials", "2", "--threads", "1",
            "--service", "async_checkpoint:thread", "--output", "out"]  # fmt: skip
    assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    report = load_report(tmp_path / "out" / "mnist-mlp-multi-sakura-pytorch-ddp.json")
    assert [t["errors"] for t in report["trials"]] == [[], []]
    for i in (0, 1):
        trial_dir = tmp_path / "out" / "mnist-mlp-multi-sakura-pytorch-ddp" / f"trial-{i}"
        latest = load_latest(trial_dir / "async_checkpoint")
        assert latest is not None and latest.epoch == 1 and "model" in latest.state


def test_compare_and_export_reject_non_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "bogus.json"
    bogus.write_text(json.dumps({"schema": "something-else"}))
    assert main(["compare", str(bogus), str(bogus)]) == 2
    assert "is not a sakura-bench run report: schema is 'something-else'" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing.json")]) == 2
    assert "no such report file" in capsys.readouterr().err


def test_two_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--nproc 2: two gloo ranks per trial (DistributedDataParallel, each rank on its shard).
    The baseline evaluates sharded and all-reduces the sums; AsyncEval evaluates rank 0's
    snapshot on the whole evaluation set: the same numbers."""
    common = ["--workload", "mnist-mlp", "--framework", "pytorch-ddp", "--scale", "tiny",
              "--epochs", "1", "--trials", "1", "--threads", "1", "--nproc", "2", "--output", "out"]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(["run", *common, "--runner", "baseline"]) == 0
    assert main(["run", *common, "--runner", "sakura", "--service", "async_eval:thread"]) == 0
    base = load_report(tmp_path / "out" / "mnist-mlp-baseline-pytorch-ddp.json")
    sak = load_report(tmp_path / "out" / "mnist-mlp-sakura-pytorch-ddp.json")
    for report in (base, sak):
        trial = report["trials"][0]
        assert (trial["world_size"], trial["steps"], trial["errors"]) == (2, 4, [])  # 128 per rank
        assert report["settings"]["nproc"] == 2
    for key, value in base["summary"]["final_metrics"].items():
        assert sak["summary"]["final_metrics"][key] == pytest.approx(value, rel=1e-6)


def test_pair_interleaves_the_trials_and_compares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sakura_bench import runner

    order: list[tuple[str, int]] = []
    real = runner._run_one

    def recording(run: Any, i: int, on_progress: Any) -> dict[str, Any]:
        order.append((run.options.config.runner, i))
        return real(run, i, on_progress)

    monkeypatch.setattr(runner, "_run_one", recording)
    argv = ["pair", "--scale", "tiny", "--in-process", "--output", str(tmp_path),
            "--workload", "mnist-mlp", "--framework", "pytorch-ddp",
            "--service", "telemetry:path=" + str(tmp_path / "t.jsonl"), "--trials", "3",
            "--epochs", "1"]  # fmt: skip
    assert main(argv) == 0
    # A B, B A, A B: drift and order effects fall on both sides alike
    assert order == [("baseline", 0), ("sakura", 0), ("sakura", 1), ("baseline", 1),
                     ("baseline", 2), ("sakura", 2)]  # fmt: skip
    base = json.loads((tmp_path / "mnist-mlp-baseline-pytorch-ddp.json").read_text())
    sak = json.loads((tmp_path / "mnist-mlp-sakura-pytorch-ddp.json").read_text())
    schedule = "interleaved: baseline | sakura telemetry:path=" + str(tmp_path / "t.jsonl")
    assert base["settings"]["schedule"] == sak["settings"]["schedule"] == schedule
    assert [len(base["trials"]), len(sak["trials"])] == [3, 3]
    assert base["services"] == [] and len(sak["services"]) == 1
    assert base["summary"]["final_metrics"] == sak["summary"]["final_metrics"]
    out = capsys.readouterr().out
    assert "B against A" in out and "speed-up of B over A (wall time)" in out


def test_pair_validates_both_sides_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["pair", "--scale", "tiny", "--in-process", "--output", str(tmp_path),
            "--workload", "mnist-mlp", "--framework", "pytorch-ddp", "--service", "telemetr"]  # fmt: skip
    assert main(argv) == 2
    assert "unknown service 'telemetr'" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_run_reports_say_they_ran_sequentially(reports: Path) -> None:
    for path in reports.glob("*.json"):
        assert json.loads(path.read_text())["settings"]["schedule"] == "sequential"


def test_pair_with_a_baseline_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``pair --baseline-variant peft-bnb``: the rival (stock PEFT + bitsandbytes) against
    sakura's quant:nf4 on the same workload; the variant is in the report's file name,
    its workload description and the comparison's label."""
    argv = ["pair", "--workload", "tiny-llama-qlora", "--framework", "pytorch-ddp",
            "--baseline-variant", "peft-bnb", "--service", "quant:nf4", "--scale", "tiny",
            "--epochs", "1", "--trials", "1", "--in-process", "--output", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "baseline[peft-bnb]" in out
    a = load_report(tmp_path / "tiny-llama-qlora-baseline-peft-bnb-pytorch-ddp.json")
    b = load_report(tmp_path / "tiny-llama-qlora-sakura-pytorch-ddp.json")
    assert a["workload"]["variant"] == "peft-bnb" and b["workload"]["variant"] is None
    assert a["settings"]["schedule"] == "interleaved: baseline[peft-bnb] | sakura quant:nf4"
    assert a["summary"]["final_metrics"]["val_ppl"] > 1
