"""Where AsyncCheckpoint writes: ``dir`` is required unless an integration knows the run's
output directory; a directory that cannot be written and a full disk are errors naming the
option and the OS error, and the last good checkpoint stays loadable."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import OnEpochEnd, OnError, OnTrainBegin, SakuraRuntime
from sakura.loop import LoopContext
from sakura.options import OptionError
from sakura.testing import RecordingService
from sakura_async import AsyncCheckpoint, load_latest
from sakura_async.checkpoint import store
from sakura_async.checkpoint.encoding import write_state
from sakura_async.errors import CheckpointWriteError


def _start(directory: Any) -> None:
    SakuraRuntime([AsyncCheckpoint(directory, dispatcher="inthread")]).start()


def test_a_file_given_as_dir_names_the_option_and_the_os_error(tmp_path: Path) -> None:
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    with pytest.raises(
        OptionError, match=r"AsyncCheckpoint: dir='.*not-a-dir' is not accepted"
    ) as e:
        _start(file)
    assert "a writable directory" in str(e.value) and "FileExistsError" in str(e.value)
    assert isinstance(e.value.__cause__, OSError)


def test_a_dir_under_a_file_names_the_option_and_the_os_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OptionError, match=r"dir='.*file/sub'.*NotADirectoryError") as e:
        _start(tmp_path / "file" / "sub")
    assert e.value.__cause__ is not None and e.value.__cause__.errno == errno.ENOTDIR


def test_a_read_only_dir_names_the_option_and_the_os_error() -> None:
    """sysfs is read-only even for root (the tests run as root, so chmod would not do)."""
    target = "/sys/kernel"
    try:
        fd, probe = tempfile.mkstemp(dir=target)
    except OSError:
        pass
    else:  # pragma: no cover - a system where /sys/kernel is writable
        os.close(fd)
        os.unlink(probe)
        pytest.skip(f"{target} is writable here")
    with pytest.raises(OptionError, match=r"dir='/sys/kernel' is not accepted.*(Permission|Errno)"):
        _start(target)


def test_a_full_disk_names_the_option_and_the_os_error_and_keeps_the_last_good_one(
    tmp_path: Path, monkeypatch: Any
) -> None:
    rec = RecordingService(event_types={OnError})
    state = {"w": torch.arange(4.0)}
    rt = SakuraRuntime([rec])
    ckpt = rt.install(
        AsyncCheckpoint(
            tmp_path, every=1, keep=1, dispatcher="thread", state_provider=lambda: state
        )
    )
    rt.start()
    rt.emit(OnEpochEnd, epoch=0, step=1)
    ckpt.drain()
    real = store.write_state

    def full_disk(tree: Any, raw: Any, fmt: str, compress: Any) -> Any:
        raw.write(b"\0" * 100)  # part of the file went out before the disk filled up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store, "write_state", full_disk)
    state["w"] = torch.arange(4.0) + 1
    rt.emit(OnEpochEnd, epoch=1, step=2)
    with pytest.raises(CheckpointWriteError) as e:
        rt.close()
    message = str(e.value)
    assert "1 checkpoint write(s)" in message and "No space left on device" in message
    assert f"AsyncCheckpoint: dir={str(tmp_path)!r}" in message
    assert [ev.source for ev in rec.of(OnError)] == ["async_checkpoint"]
    monkeypatch.setattr(store, "write_state", real)
    latest = load_latest(tmp_path)
    assert latest is not None and latest.step == 1
    assert torch.equal(latest.state["w"], torch.arange(4.0))
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # nothing half-made


def test_without_dir_or_an_output_dir_the_first_save_fails_loudly(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    rec = RecordingService(event_types={OnError})
    model = torch.nn.Linear(2, 2)
    rt = SakuraRuntime([rec])
    ckpt = rt.install(AsyncCheckpoint(every=1, dispatcher="inthread"))
    rt.start()
    rt.emit(OnTrainBegin, model=model)  # a raw loop: no framework knows an output dir
    for epoch in range(3):
        rt.emit(OnEpochEnd, epoch=epoch, step=epoch + 1, model=model)
    with pytest.raises(CheckpointWriteError, match=r"AsyncCheckpoint: dir=None is not accepted"):
        rt.close()
    assert len(rec.of(OnError)) == 1  # reported once, not per epoch
    assert ckpt.saved == [] and os.listdir(tmp_path) == []  # nothing written to the cwd


def test_the_loops_output_dir_gives_the_default_and_an_explicit_dir_wins(tmp_path: Path) -> None:
    """The default dir comes from OnTrainBegin.loop.output_dir, the one door an adapter
    (first-party or not) opens; the service has no other (no attach, no use_output_dir)."""
    state = {"w": torch.ones(2)}
    loop = LoopContext(framework="toy", output_dir=str(tmp_path / "run"))
    ckpt = AsyncCheckpoint(every=1, dispatcher="inthread", state_provider=lambda: state)
    with SakuraRuntime([ckpt], strict=True) as rt:
        rt.emit(OnTrainBegin, loop=loop)
        rt.emit(OnEpochEnd, epoch=0, step=1)
    assert ckpt.dir == str(tmp_path / "run" / "async_checkpoint")
    assert load_latest(tmp_path / "run" / "async_checkpoint") is not None
    explicit = AsyncCheckpoint(
        tmp_path / "mine", dispatcher="inthread", state_provider=lambda: state
    )
    with SakuraRuntime([explicit], strict=True) as rt:
        rt.emit(OnTrainBegin, loop=loop)
        rt.emit(OnEpochEnd, epoch=0, step=1)
    assert explicit.dir == str(tmp_path / "mine")
    assert load_latest(tmp_path / "mine") is not None
    assert not hasattr(explicit, "attach") and not hasattr(explicit, "use_output_dir")


def test_a_trainer_on_the_event_is_not_a_door(tmp_path: Path, monkeypatch: Any) -> None:
    """Only the loop context counts: an object with an output dir in OnTrainBegin.trainer
    (for user code) is not read."""

    class Trainer:
        default_root_dir = str(tmp_path / "root")
        args = type("Args", (), {"output_dir": str(tmp_path / "out")})()

    monkeypatch.chdir(tmp_path)
    ckpt = AsyncCheckpoint(every=1, dispatcher="inthread", state_provider=lambda: {})
    rt = SakuraRuntime([ckpt])
    rt.start()
    rt.emit(OnTrainBegin, trainer=Trainer())
    rt.emit(OnEpochEnd, epoch=0, step=1)
    with pytest.raises(CheckpointWriteError, match=r"OnTrainBegin.loop.output_dir"):
        rt.close()
    assert ckpt.dir is None and sorted(os.listdir(tmp_path)) == []


def test_format_loop_saves_the_loops_own_checkpoint(tmp_path: Path) -> None:
    """format='loop' writes what LoopContext.checkpoint_state builds; without one, and for
    format='lightning' on a loop of another layout, the save fails naming what to do."""
    weights = torch.arange(3.0)
    loop = LoopContext(
        framework="toy",
        checkpoint_state=lambda: {"toy_format": 1, "weights": weights.clone()},
        checkpoint_format="toy",
    )
    ckpt = AsyncCheckpoint(tmp_path / "loop", format="loop", dispatcher="inthread")
    with SakuraRuntime([ckpt], strict=True) as rt:
        rt.emit(OnTrainBegin, loop=loop)
        rt.emit(OnEpochEnd, epoch=0, step=1)
    latest = load_latest(tmp_path / "loop")
    assert latest is not None and latest.format == "loop"
    assert latest.state["toy_format"] == 1 and torch.equal(latest.state["weights"], weights)
    cases = [
        ("lightning", loop, r"format='lightning' needs a Lightning checkpoint, but the 'toy' "
         r"loop's checkpoint is in the 'toy' layout: use format='loop'"),
        ("loop", LoopContext(framework="toy"), r"format='loop' saves the loop's own "
         r"checkpoint, but the 'toy' loop offers none"),
        ("lightning", None, r"no adapter published a loop context .*use LightningAdapter"),
    ]  # fmt: skip
    for fmt, given, message in cases:
        rec = RecordingService(event_types={OnError})
        failing = AsyncCheckpoint(tmp_path / fmt, format=fmt, dispatcher="inthread")
        with SakuraRuntime([rec, failing]) as rt:
            rt.emit(OnTrainBegin, loop=given)
            rt.emit(OnEpochEnd, epoch=0, step=1)
        [error] = rec.of(OnError)
        assert error.source == "async_checkpoint"
        assert re.search(message, str(error.exception)), str(error.exception)
        assert failing.saved == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize(
    ("fmt", "compress"),
    [("torch", None), ("lightning", None), ("torch", 3), ("safetensors", None), ("safetensors", 3)],
)
def test_every_format_raises_the_os_error_of_a_full_device(fmt: str, compress: Any) -> None:
    """/dev/full fails every write with ENOSPC; torch.save would report it as its own
    "unexpected pos" RuntimeError, with the disk's error only in its context."""
    tree = {"w": torch.randn(1 << 19, generator=torch.Generator().manual_seed(0))}  # 2 MiB
    with open("/dev/full", "wb", buffering=0) as device, pytest.raises(OSError) as e:
        write_state(tree, device, fmt, compress)
    assert e.value.errno == errno.ENOSPC


FILE_SIZE_LIMITED = """
import json, resource, signal, sys
import torch
from sakura import OnEpochEnd, SakuraRuntime
from sakura_async import AsyncCheckpoint
from sakura_async.errors import CheckpointWriteError

state = {"w": torch.arange(4.0)}
rt = SakuraRuntime()
rt.install(AsyncCheckpoint(sys.argv[1], every=1, keep=1, dispatcher="thread",
                           state_provider=lambda: state))
rt.start()
rt.emit(OnEpochEnd, epoch=0, step=1)
rt.services[0].drain()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
state["w"] = torch.randn(1 << 19)  # 2 MiB: more than the file may grow
rt.emit(OnEpochEnd, epoch=1, step=2)
try:
    rt.close()
except CheckpointWriteError as exc:
    cause = exc.__cause__
    print(json.dumps({"type": type(cause).__name__, "errno": getattr(cause, "errno", None),
                      "message": str(exc)}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="RLIMIT_FSIZE and SIGXFSZ are POSIX")
def test_a_real_write_limit_in_the_default_format_names_dir_and_the_os_error(
    tmp_path: Path,
) -> None:
    """A real failing write (the kernel refuses to grow the file past RLIMIT_FSIZE: EFBIG,
    the same path as ENOSPC), in a subprocess so the limit binds nothing else."""
    root = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMITED, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failure = json.loads(done.stdout.strip().splitlines()[-1])
    assert failure["type"] == "OSError" and failure["errno"] == errno.EFBIG
    assert (
        f"AsyncCheckpoint: dir={str(root)!r}: writing the checkpoint of step 2"
        in (failure["message"])
    )
    assert "File too large" in failure["message"]
    latest = load_latest(root)
    assert latest is not None and latest.step == 1
    assert torch.equal(latest.state["w"], torch.arange(4.0))
    assert [p for p in os.listdir(root) if p.startswith(".")] == []  # nothing half-made
