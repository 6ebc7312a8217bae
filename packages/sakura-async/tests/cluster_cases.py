"""ClusterDispatcher on a real Dask LocalCluster bound to 127.0.0.1."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest

pytest.importorskip(
    "distributed",
    reason="ClusterDispatcher needs Dask distributed: pip install 'sakura-async[dask]'",
)

from sakura import OnValidationEnd, SakuraRuntime
from sakura.testing import RecordingService
from sakura_async import AsyncEval
from sakura_async.dispatch import ClusterDispatcher

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterDispatcher]:
    with ClusterDispatcher(n_workers=1, threads_per_worker=1, processes=True) as dispatcher:
        dispatcher.start()
        yield dispatcher


def where() -> int:
    return os.getpid()


def fail() -> None:
    raise ValueError("failed on the cluster")


def test_everything_listens_on_loopback_and_tasks_run_in_a_worker_process(
    cluster: ClusterDispatcher,
) -> None:
    info = cluster.client.scheduler_info()
    assert info["address"].startswith("tcp://127.0.0.1:")
    assert info["workers"] and all(a.startswith("tcp://127.0.0.1:") for a in info["workers"])
    assert cluster.submit(where).result(60) != os.getpid()
    with pytest.raises(ValueError, match="failed on the cluster"):
        cluster.submit(fail).result(60)


def test_a_function_the_worker_cannot_import_fails_its_task_not_the_worker(
    cluster: ClusterDispatcher,
) -> None:
    """A function pickled by reference from a module only this process has: the task fails
    with the import error, and the worker keeps serving tasks."""
    module = types.ModuleType("sakura_only_in_the_test_process")
    exec("def answer():\n    return 42\n", module.__dict__)  # noqa: S102 - a test fixture
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(ModuleNotFoundError, match="sakura_only_in_the_test_process"):
            cluster.submit(module.answer).result(60)
    finally:
        del sys.modules[module.__name__]
    assert cluster.submit(where).result(60) != os.getpid()


def test_async_eval_on_the_cluster_is_exact(world: Any, cluster: ClusterDispatcher) -> None:
    rec = RecordingService(event_types={OnValidationEnd})
    with SakuraRuntime([rec], strict=True) as rt:
        rt.install(
            AsyncEval(
                world.eval_fn,
                world.val_payload(),
                dispatcher=cluster,
                max_pending=2,
                pass_task=True,
            )
        )
        _, reference = world.train(rt, epochs=3)
    assert [(e.epoch, dict(e.metrics)) for e in rec.of(OnValidationEnd)] == list(
        enumerate(reference)
    )


def test_a_second_dispatcher_connects_by_scheduler_address(cluster: ClusterDispatcher) -> None:
    address = cluster.client.scheduler.address
    with ClusterDispatcher(address) as other:
        assert other.submit(where).result(60) == cluster.submit(where).result(60)


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="n_workers must be an int >= 1, got 0"):
        ClusterDispatcher(n_workers=0)
    with pytest.raises(ValueError, match=r"always binds to 127\.0\.0\.1"):
        ClusterDispatcher(cluster_kwargs={"host": "0.0.0.0"})  # noqa: S104 - rejected, never bound
    with pytest.raises(TypeError, match="address must be a scheduler address"):
        ClusterDispatcher(42)
