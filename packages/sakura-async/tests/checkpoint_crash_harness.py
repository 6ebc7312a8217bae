"""Crash-safety harness (run as a script by test_checkpoint_crash.py).

Forks a child that writes checkpoints in a loop through AsyncCheckpoint (a background
writer thread, keep=2 so retention deletes while it writes), SIGKILLs it, and checks that
load_latest returns a complete checkpoint whose content matches its step, and that the next
AsyncCheckpoint on the directory removes every temporary directory the dead writer left.
Repeats ``kills`` times and prints a JSON summary.  Forking (instead of starting an
interpreter per kill) keeps each round to milliseconds.

``mode`` says where the child dies:

* ``random`` — the parent SIGKILLs it at a random moment;
* ``fsync`` — the child SIGKILLs itself inside one of the fsyncs of a temporary directory's
  files or of the directory itself (the n-th, n random over its first three writes);
* ``rename`` — inside the rename of a temporary directory to its final name (before it);
* ``pause`` — no kill: the child (one ``write_checkpoint``) stops inside such an fsync or
  rename until the parent, having started an AsyncCheckpoint on the directory meanwhile
  (which must leave the live writer's temporary directory alone), lets it go on.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import signal
import sys
import time
import traceback
from typing import Any

import torch

torch.set_num_threads(1)  # no OpenMP pool in the parent: forked children stay safe

from sakura import OnTrainStepEnd, SakuraRuntime  # noqa: E402
from sakura_async import AsyncCheckpoint, load_latest  # noqa: E402
from sakura_async.checkpoint import find_checkpoints, write_checkpoint  # noqa: E402

NUMEL = 512 * 1024  # 2 MiB of fp32
IN_TEMPORARY = re.compile(r"/\.step-[^/]*\.tmp(/|$)")
FSYNCS_PER_WRITE = 4  # the marker, the state file, the manifest, the directory


def state_for(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((NUMEL,), float(step)), "step": torch.tensor(step)}


def writer(root: str, first_step: int, ready: int) -> None:
    live = state_for(first_step)
    with SakuraRuntime() as rt:
        ckpt = rt.install(
            AsyncCheckpoint(
                root, every="1 step", keep=2, dispatcher="thread", state_provider=lambda: live
            )
        )
        step = first_step
        while True:
            step += 1
            live["w"].fill_(float(step))
            live["step"].fill_(step)
            rt.emit(OnTrainStepEnd, step=step)
            if ready >= 0 and ckpt.saved:  # one checkpoint of this child is durable
                os.write(ready, b"1")
                os.close(ready)
                ready = -1


def stop_at(point: str, nth: int, stop: Any) -> None:
    """Call ``stop()`` inside the ``nth`` fsync of a temporary directory's contents
    (``point="fsync"``) or before the ``nth`` rename of a temporary directory."""
    calls = 0
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: Any) -> None:
        nonlocal calls
        if point == "fsync" and IN_TEMPORARY.search(os.readlink(f"/proc/self/fd/{int(fd)}")):
            calls += 1
            if calls == nth:
                stop()
        real_fsync(fd)

    def rename(src: Any, dst: Any, **kwargs: Any) -> None:
        nonlocal calls
        if point == "rename" and IN_TEMPORARY.search(os.fspath(src)):
            calls += 1
            if calls == nth:
                stop()
        real_rename(src, dst, **kwargs)

    os.fsync, os.rename = fsync, rename  # type: ignore[assignment]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def temporaries(root: str) -> list[str]:
    return sorted(e for e in os.listdir(root) if e.startswith("."))


def next_start(root: str) -> None:
    """What the next run does: an AsyncCheckpoint set up on the directory."""
    with SakuraRuntime(strict=True) as rt:
        rt.install(AsyncCheckpoint(root, dispatcher="inthread"))


def pause_round(root: str, step: int, point: str, nth: int, summary: dict[str, Any]) -> None:
    """A live writer stopped inside an fsync or rename while the next AsyncCheckpoint
    starts: its temporary directory must survive, and its write must then complete."""
    paused_r, paused_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(paused_r)
            os.close(go_w)

            def pause() -> None:
                os.write(paused_w, b"1")
                os.read(go_r, 1)

            stop_at(point, nth, pause)
            write_checkpoint(root, state_for(step), step=step, epoch=0, keep=2)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(1)
    os.close(paused_w)
    os.close(go_r)
    readable, _, _ = select.select([paused_r], [], [], 60)
    if not readable or os.read(paused_r, 1) != b"1":
        summary["problems"].append(f"the writer never reached {point} #{nth}")
    before = {e: sorted(os.listdir(os.path.join(root, e))) for e in temporaries(root)}
    next_start(root)
    after = {e: sorted(os.listdir(os.path.join(root, e))) for e in temporaries(root)}
    if not before or after != before:
        summary["problems"].append(f"at {point} #{nth}: live temporaries {before} became {after}")
    summary["live_temporaries_kept"] += len(after)
    with contextlib.suppress(BrokenPipeError):  # (a writer that never paused is gone)
        os.write(go_w, b"1")
    os.close(go_w)
    os.close(paused_r)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        summary["problems"].append(f"the writer paused at {point} #{nth} failed ({status})")


def main() -> None:
    root, kills, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "random"
    rng = random.Random(seed)
    write_checkpoint(root, state_for(0), step=0, epoch=0)
    summary: dict[str, Any] = {
        "mode": mode,
        "kills": 0,
        "loaded_steps": [],
        "problems": [],
        "temporaries_seen": 0,
        "survivors": 0,
        "survivor_names": [],
        "live_temporaries_kept": 0,
    }
    for round_ in range(kills):
        latest = load_latest(root)
        start = latest.step if latest is not None else 0
        if mode == "pause":
            point = "rename" if round_ % 5 == 4 else "fsync"
            pause_round(root, start + 1, point, 1 + round_ % 4 if point == "fsync" else 1, summary)
        else:
            kill_round(root, start, mode, rng, summary)
        latest = load_latest(root)
        if latest is None:
            summary["problems"].append("load_latest returned None")
            continue
        step = int(latest.state["step"])
        if step != latest.step or not torch.equal(
            latest.state["w"], torch.full((NUMEL,), float(step))
        ):
            summary["problems"].append(f"checkpoint {latest.path} does not hold step {latest.step}")
        every = find_checkpoints(root)
        verified = find_checkpoints(root, verify=True)
        if len(every) != len(verified):
            summary["problems"].append(
                f"{len(every) - len(verified)} complete-looking checkpoint(s) fail verification"
            )
        summary["loaded_steps"].append(latest.step)
    print(json.dumps(summary))


def kill_round(root: str, start: int, mode: str, rng: random.Random, summary: Any) -> None:
    r, w = os.pipe()
    nth = rng.randint(1, 3 * FSYNCS_PER_WRITE if mode == "fsync" else 3)
    pid = os.fork()
    if pid == 0:  # the child writes until killed
        try:
            os.close(r)
            if mode != "random":
                stop_at(mode, nth, die)
            writer(root, start, w if mode == "random" else -1)
        finally:
            os._exit(1)
    os.close(w)
    if mode == "random":  # kill at a random moment once the child is writing steadily
        readable, _, _ = select.select([r], [], [], 60)
        if not readable:
            summary["problems"].append("a writer never completed a checkpoint")
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(pid, signal.SIGKILL)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not os.WIFSIGNALED(status) or os.WTERMSIG(status) != signal.SIGKILL:
        summary["problems"].append(f"the writer was not killed ({status})")
    summary["kills"] += 1
    left = temporaries(root)
    summary["temporaries_seen"] += len(left)
    if mode != "random" and not left:
        summary["problems"].append(f"a kill at {mode} #{nth} left no temporary directory")
    next_start(root)
    survived = set(summary["survivor_names"]) | set(temporaries(root))
    summary["survivor_names"] = sorted(survived)
    summary["survivors"] = len(survived)  # distinct ones a next start did not remove


if __name__ == "__main__":
    main()
