"""``sakura-offload-verify`` (``python -m sakura_offload.fit.verify``): trains a tiny model
under memory caps and prints where the memory lived with PASS (exit 0); a cap no plan fits
is FAIL with fit's error naming the smallest device budget (exit 1); bad arguments exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sakura_offload.fit.verify import main

pytest.importorskip("transformers")
pytest.importorskip("peft")


def _config_dir(tmp_path: Path) -> Path:
    from transformers import LlamaConfig

    directory = tmp_path / "tiny"
    LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(directory)
    return directory


def _verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sakura_offload.fit.verify", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_generous_caps_pass_and_show_where_the_memory_lived(tmp_path: Path) -> None:
    model = str(_config_dir(tmp_path))
    done = _verify("--model", model, "--device-budget", "64MiB", "--host-budget", "2GiB",
                   "--steps", "2", "--seq", "16", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "PASS" in lines
    for place, category in [("device", "trainable"), ("device", "frozen"), ("device", "optimizer"),
                            ("host", "frozen"), ("host", "optimizer"), ("disk", "frozen")]:  # fmt: skip
        assert any(re.match(rf"{place}\s+{category}\s", line) for line in lines), (place, category)
    result = json.loads(lines[-1])
    assert result["passed"] is True
    assert 0 < result["device_peak"] <= 64 * 2**20
    assert result["device_peak"] == (
        result["device_state_peak"] + result["weights_live_peak"] + result["activations_peak"]
    )
    assert result["activations_peak"] > 0  # the activation planner's estimate
    assert 0 <= result["host_used"] <= 2 * 2**30
    assert result["host_peak"] - result["host_baseline"] == result["host_used"]
    assert len(result["losses"]) == 2


def test_streamed_weights_show_on_the_host() -> None:
    """The built-in tiny Llama (2.5 MiB of frozen weights) under a 2 MiB device cap: its
    blocks are streamed from host RAM, and the table says so."""
    done = _verify("--device-budget", "2MiB", "--host-budget", "2GiB", "--steps", "1",
                   "--seq", "8", "--batch", "1", "--json")  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr)
    result = json.loads(done.stdout.splitlines()[-1])
    assert "frozen weights streamed from host" in result["plan"]
    assert result["host"]["frozen"] > 2 * 2**20
    assert result["weights_live_peak"] > 0
    assert result["device_peak"] <= 2 * 2**20


def test_impossible_device_cap_names_the_smallest_budget(tmp_path: Path) -> None:
    done = _verify("--model", str(_config_dir(tmp_path)), "--device-budget", "10KiB",
                   "--host-budget", "2GiB")  # fmt: skip
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "FAIL: no plan fits" in done.stderr
    least = int(re.search(r"device_budget >= [^(]*\((\d+) bytes\)", done.stderr).group(1))  # type: ignore[union-attr]
    assert least > 10 * 1024


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device-budget", "lots", "--host-budget", "1GiB"], "--device-budget='lots'"),
        (["--device-budget", "1MiB", "--host-budget", "0"], "--host-budget='0'"),
        (["--device-budget", "1MiB", "--host-budget", "1GiB", "--steps", "0"], "--steps=0"),
        (["--device-budget", "1MiB", "--host-budget", "1GiB", "--device", "tpu"], "--device='tpu'"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], message: str, capsys: Any) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "is not accepted" in err


def test_bad_model_and_missing_arguments_exit_2(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["--model", str(tmp_path / "empty"), "--device-budget", "1MiB",
                 "--host-budget", "1GiB"]) == 2  # fmt: skip
    assert "has no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["--device-budget", "1MiB"])  # --host-budget missing: argparse's error
    assert info.value.code == 2


def test_console_script_is_the_command() -> None:
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="sakura-offload-verify")
    assert script.load() is main
