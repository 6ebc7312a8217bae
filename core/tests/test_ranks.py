"""sakura.testing.launch_ranks: N worker processes with torchrun's environment; a failing
or hanging rank fails the launch promptly with every rank's output."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sakura.testing import RanksFailedError, launch_ranks

WORKER = """
import json, os, sys, time
rank, world, init_file, out_dir, mode = sys.argv[1:6]
env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME",
                                  "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER",
                                  "EXTRA")}
print(f"hello from rank {rank}")  # not flushed by hand: the launcher runs ranks unbuffered
if mode == "fail" and rank == "0":
    open(os.path.join(out_dir, "rank0-said-hello"), "w").close()
if mode == "fail" and rank == "1":
    while not os.path.exists(os.path.join(out_dir, "rank0-said-hello")):
        time.sleep(0.01)  # fail only once rank 0 has printed, so the test does not race
    raise SystemExit("rank 1 gives up")
if mode == "hang" or (mode == "fail" and rank == "0"):
    time.sleep(60)  # waits as a rank in a collective with a dead peer would
with open(os.path.join(out_dir, f"out{rank}.json"), "w") as f:
    json.dump({"argv": [rank, world, init_file], "env": env}, f)
"""


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_ranks_get_torchrun_environment_and_arguments(worker: Path, tmp_path: Path) -> None:
    import json

    out = tmp_path / "out"
    outputs = launch_ranks(worker, 3, out, "ok", env={"EXTRA": "x"})
    assert [o.strip() for o in outputs] == [f"hello from rank {r}" for r in range(3)]
    for rank in range(3):
        got = json.loads((out / f"out{rank}.json").read_text())
        assert got["argv"] == [str(rank), "3", str(out / "init")]
        assert got["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",
            "EXTRA": "x",
        }
        assert (out / f"rank{rank}.log").read_text().strip() == f"hello from rank {rank}"


def test_a_failing_rank_stops_the_others_at_once(worker: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        launch_ranks(worker, 2, tmp_path / "out", "fail", timeout=50)
    assert time.monotonic() - start < 40  # not the 60 s rank 0 would sleep, nor the timeout
    message = str(info.value)
    assert message.startswith("rank 1 exited with 1")
    assert "rank 1 gives up" in message and "hello from rank 0" in message
    assert "--- rank 0 (signal 9) ---" in message
    assert isinstance(info.value, AssertionError)


ENDINGS = """
import atexit, os, sys, threading, time
rank, world, init_file, out_dir, mode = sys.argv[1:6]
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(out_dir, f"where{rank}.txt"), "w") as f:
    f.write(f"{__name__} {sys.path[0] == here} {sys.argv[0] == __file__}")
if mode == "threads":
    def late(name, delay):
        time.sleep(delay)
        open(os.path.join(out_dir, f"{name}{rank}"), "w").close()
    threading.Thread(target=late, args=("thread", 0.3)).start()  # joined, as at a normal exit
    atexit.register(lambda: open(os.path.join(out_dir, f"atexit{rank}"), "w").close())
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("rank gives up with a traceback")
if mode == "native":
    # A daemon thread inside a torch op (the GIL released) when the script returns, as
    # torch's gloo threads can be after destroy_process_group: a normally exiting
    # interpreter aborts when the op ends and the thread takes the GIL back during
    # finalization ("terminate called without an active exception", SIGABRT).
    import torch
    a = torch.randn(1200, 1200)
    def spin():
        while True:
            a @ a
    threading.Thread(target=spin, daemon=True).start()
    time.sleep(0.2)
    open(os.path.join(out_dir, f"done{rank}"), "w").close()
"""


@pytest.fixture
def endings(tmp_path: Path) -> Path:
    path = tmp_path / "endings.py"
    path.write_text(ENDINGS)
    return path


def test_a_rank_runs_as_its_script_and_ends_as_a_normal_exit(endings: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    launch_ranks(endings, 2, out, "threads")
    for rank in range(2):
        # __main__, the script's folder first on sys.path and argv[0]: as `python SCRIPT`
        assert (out / f"where{rank}.txt").read_text() == "__main__ True True"
        assert (out / f"thread{rank}").exists()  # a non-daemon thread was joined
        assert (out / f"atexit{rank}").exists()  # atexit handlers ran


def test_a_rank_with_native_threads_at_exit_ends_cleanly(endings: Path, tmp_path: Path) -> None:
    # Failed before the ranks skipped finalization: the rank aborted with signal 6 after
    # finishing its work (seen in CI on gloo ranks whose process group outlived the script).
    pytest.importorskip("torch")
    out = tmp_path / "out"
    launch_ranks(endings, 2, out, "native", timeout=60)
    assert all((out / f"done{rank}").exists() for rank in range(2))


@pytest.mark.parametrize(
    ("mode", "status", "said"),
    [("exit3", "exited with 3", None), ("raise", "exited with 1", "rank gives up with a")],
)
def test_a_rank_exit_status_is_its_scripts(
    endings: Path, tmp_path: Path, mode: str, status: str, said: str | None
) -> None:
    with pytest.raises(RanksFailedError, match=status) as info:
        launch_ranks(endings, 1, tmp_path / "out", mode)
    if said is not None:
        assert "Traceback" in str(info.value) and said in str(info.value)


def test_a_hanging_rank_times_out(worker: Path, tmp_path: Path) -> None:
    with pytest.raises(RanksFailedError, match=r"rank\(s\) \[0, 1\] did not finish within 1 s"):
        launch_ranks(worker, 2, tmp_path / "out", "hang", timeout=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
        ({"world_size": True}, "world_size must be an integer >= 1, got True"),
        ({"world_size": 2, "timeout": 0}, "timeout must be a positive number of seconds, got 0"),
    ],
)
def test_bad_arguments(worker: Path, tmp_path: Path, kwargs: dict, message: str) -> None:
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=message):
        launch_ranks(worker, world_size, tmp_path, **kwargs)


def test_the_unreleased_old_name_is_gone() -> None:
    # RanksFailed was renamed RanksFailedError before any release: no alias stands in.
    import sakura.testing
    import sakura.testing.ranks

    for module in (sakura.testing, sakura.testing.ranks):
        assert not hasattr(module, "RanksFailed")
