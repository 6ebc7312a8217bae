"""Crash-safety harness (run as a script by test_checkpoint_crash.py).

Forks a child that writes checkpoints in a loop through AsyncCheckpoint (a background
writer thread, keep=2 so retention deletes while it writes), SIGKILLs it at a random
moment, and checks that load_latest returns a complete checkpoint whose content matches
its step.  Repeats ``kills`` times and prints a JSON summary.  Forking (instead of starting
an interpreter per kill) keeps each round to milliseconds.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import sys
import time

import torch

torch.set_num_threads(1)  # no OpenMP pool in the parent: forked children stay safe

from sakura import OnTrainStepEnd, SakuraRuntime  # noqa: E402
from sakura_async import AsyncCheckpoint, load_latest  # noqa: E402
from sakura_async.checkpoint import find_checkpoints, write_checkpoint  # noqa: E402

NUMEL = 512 * 1024  # 2 MiB of fp32


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


def main() -> None:
    root, kills, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    write_checkpoint(root, state_for(0), step=0, epoch=0)
    summary = {"kills": 0, "loaded_steps": [], "problems": [], "temporaries_seen": 0}
    for _ in range(kills):
        latest = load_latest(root)
        start = latest.step if latest is not None else 0
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child writes until killed
            try:
                os.close(r)
                writer(root, start, w)
            finally:
                os._exit(1)
        os.close(w)
        # Kill at a random moment once the child is writing steadily.
        readable, _, _ = select.select([r], [], [], 60)
        os.close(r)
        if not readable:
            summary["problems"].append("a writer never completed a checkpoint")
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        summary["kills"] += 1
        summary["temporaries_seen"] += sum(e.startswith(".") for e in os.listdir(root))
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


if __name__ == "__main__":
    main()
