"""Start N ranks of a worker script as separate processes, like torchrun: a file
rendezvous, gloo on the loopback interface only, one thread each.  A rank that dies or
hangs fails the test with its output instead of blocking it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def launch(
    script: Path,
    world_size: int,
    out_dir: Path,
    *args: str,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    init_name: str = "init",
) -> None:
    base = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **(env or {})}
    init_file = out_dir / init_name
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(rank),
                str(world_size),
                str(init_file),
                str(out_dir),
                *args,
            ],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    failures = []
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            output = proc.communicate()[0]
            failures.append(f"rank {rank} timed out after {timeout}s:\n{output}")
            continue
        if proc.returncode != 0:
            failures.append(f"rank {rank} exited with {proc.returncode}:\n{output}")
    assert not failures, "\n".join(failures)
