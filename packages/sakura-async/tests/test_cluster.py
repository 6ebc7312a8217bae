"""ClusterDispatcher on a real Dask LocalCluster bound to 127.0.0.1.

The cases live in ``cluster_cases.py`` and run in a fresh pytest process with a time
limit: a Dask cluster starts worker processes, event-loop threads and sockets, and in
the one big workspace run it must neither inherit state from earlier tests nor leave a
hang behind.  The child's output is shown when it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "distributed",
    reason="ClusterDispatcher needs Dask distributed: pip install 'sakura-async[dask]'",
)

HERE = Path(__file__).resolve().parent
ROOT_CONFIG = HERE.parents[2] / "pyproject.toml"
TIME_LIMIT_S = 600

# Root cause of the hang once seen in the full workspace run: Dask pickled the tests'
# functions by reference ("packages.sakura-async.tests...."), which a worker can import or
# not depending on its working directory; a worker that cannot fails to deserialize the
# task, drops its scheduler connection and the task is never run.  ClusterDispatcher now
# encodes tasks itself (cloudpickle, by value for registered modules) and a payload that
# cannot be decoded fails its task (cluster_cases.py tests both).


def test_cluster_dispatcher_cases_in_a_fresh_process() -> None:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        str(HERE / "cluster_cases.py"),
    ]
    if ROOT_CONFIG.is_file():
        command[3:3] = ["-c", str(ROOT_CONFIG)]
    try:
        result = subprocess.run(
            command,
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=TIME_LIMIT_S,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"the cluster cases did not finish within {TIME_LIMIT_S}s:\n{exc.stdout}\n{exc.stderr}"
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout
