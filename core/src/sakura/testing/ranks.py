"""Run N ranks of a worker script as separate processes, the way ``torchrun`` does, for
tests of distributed services on real process groups (gloo on a CPU).

Each rank runs ``python SCRIPT RANK WORLD_SIZE INIT_FILE OUT_DIR *ARGS`` (see below) with
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` set, ``GLOO_SOCKET_IFNAME=lo`` (gloo talks over
the loopback interface only), one OpenMP thread and unbuffered output
(``PYTHONUNBUFFERED=1``: a rank killed because another failed still shows what it printed).
The worker joins the group with a file rendezvous, which needs no free port::

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )

and writes what the test checks into ``OUT_DIR``.  A rank that fails or hangs fails the
launch with every rank's output; the others are stopped at once rather than left waiting
in a collective until the timeout.

The script runs as ``__main__`` through ``sakura.testing._rank_entry``: when it returns, the
rank joins its threads, runs its ``atexit`` handlers and leaves with ``os._exit``, without
the interpreter's finalization, during which torch's gloo threads (alive after
``destroy_process_group()`` while a DDP module or FSDP mesh still refers to the group) could
abort a rank that had finished.  A rank killed by a signal prints every thread's Python stack
(``PYTHONFAULTHANDLER=1``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

__all__ = ["RanksFailedError", "launch_ranks"]


class RanksFailedError(AssertionError):
    """A rank exited with an error or did not finish in time (an AssertionError, so that
    pytest shows it as a test failure with the ranks' output)."""


def launch_ranks(
    script: str | os.PathLike[str],
    world_size: int,
    out_dir: str | os.PathLike[str],
    *args: str,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    init_name: str = "init",
) -> list[str]:
    """Run ``world_size`` ranks of ``script`` and wait for all of them.

    Returns each rank's output (stdout and stderr together, also kept in
    ``OUT_DIR/rank<N>.log``).  Raises :class:`RanksFailedError` as soon as a rank exits with a
    non-zero status (the other ranks are killed), or when ``timeout`` seconds pass.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    init_file = out / init_name
    # Unbuffered output: a rank killed because another failed keeps what it printed.
    base = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # A rank killed by a signal (an abort in native code) prints every thread's Python
        # stack into its log, so that a failure seen once in CI can be diagnosed.
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    logs = [out / f"rank{rank}.log" for rank in range(world_size)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, log in enumerate(logs):
            with log.open("wb") as sink:  # the child keeps its own handle
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "sakura.testing._rank_entry",
                            os.fspath(script),
                            str(rank),
                            str(world_size),
                            str(init_file),
                            str(out),
                            *args,
                        ],
                        env={
                            **base,
                            "RANK": str(rank),
                            "LOCAL_RANK": str(rank),
                            "WORLD_SIZE": str(world_size),
                        },
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                    )
                )
        failure = _wait(procs, timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    outputs = [log.read_text(errors="replace") for log in logs]
    if failure is not None:
        report = "\n".join(
            f"--- rank {rank} ({_status(proc)}) ---\n{output}"
            for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True))
        )
        raise RanksFailedError(f"{failure}\n{report}")
    return outputs


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> str | None:
    """Wait for every process; the reason to stop early, or None when all exited with 0."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return f"rank {failed[0]} exited with {codes[failed[0]]}"
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() >= deadline:
            running = [rank for rank, code in enumerate(codes) if code is None]
            return f"rank(s) {running} did not finish within {timeout:g} s"
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _status(proc: subprocess.Popen[bytes]) -> str:
    code = proc.returncode
    return f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
