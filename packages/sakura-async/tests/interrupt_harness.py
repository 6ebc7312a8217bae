"""Run by test_interrupt.py.  Two moments when checkpoint writes are in flight:

1. Ctrl+C (SIGINT to the whole process group, as a terminal sends it) inside
   ``with SakuraRuntime()``: the runtime drains, the write on the worker process completes.
2. The program simply ends without closing its runtime, with one write in flight on a
   thread and one on the worker process: both complete before the interpreter exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from sakura import OnEpochEnd, SakuraRuntime
from sakura_async import AsyncCheckpoint
from sakura_async.dispatch import LocalDispatcher


def main() -> None:
    # A process started in the background by a non-interactive shell inherits SIGINT as
    # ignored, and Python then installs no KeyboardInterrupt handler: set it explicitly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root = sys.argv[1]
    state = {"w": torch.full((4_000_000,), 3.0), "step": torch.tensor(1)}
    worker = LocalDispatcher()  # shared by both scenarios: one worker start-up
    try:
        with SakuraRuntime() as rt:
            ckpt = rt.install(
                AsyncCheckpoint(f"{root}/ctrl-c", dispatcher=worker, state_provider=lambda: state)
            )
            rt.emit(OnEpochEnd, epoch=0, step=1)
            print("pending at the interrupt:", len(ckpt._pending), flush=True)
            os.killpg(os.getpgid(0), signal.SIGINT)  # what a terminal does on Ctrl+C
            time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted, drained:", len(ckpt.saved), flush=True)

    rt = SakuraRuntime()
    rt.install(
        AsyncCheckpoint(f"{root}/exit-thread", dispatcher="thread", state_provider=lambda: state)
    )
    rt.install(
        AsyncCheckpoint(
            f"{root}/exit-process", dispatcher=worker, state_provider=lambda: state, name="second"
        )
    )
    rt.start()
    rt.emit(OnEpochEnd, epoch=0, step=1)
    print("leaving without closing the runtime", flush=True)


if __name__ == "__main__":
    main()
