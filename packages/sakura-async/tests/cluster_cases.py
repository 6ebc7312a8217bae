"""ClusterDispatcher on a real Dask LocalCluster bound to 127.0.0.1."""

from __future__ import annotations

import os
import socket
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


def test_everything_listens_on_loopback_over_tls_and_tasks_run_in_a_worker_process(
    cluster: ClusterDispatcher,
) -> None:
    info = cluster.client.scheduler_info()
    assert info["address"].startswith("tls://127.0.0.1:")
    assert info["workers"] and all(a.startswith("tls://127.0.0.1:") for a in info["workers"])
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
    with ClusterDispatcher(address, security=cluster.security) as other:
        assert other.submit(where).result(60) == cluster.submit(where).result(60)


def test_a_client_without_the_cluster_certificate_cannot_connect(
    cluster: ClusterDispatcher,
) -> None:
    """What another local user could try: the scheduler's port, without our certificate."""
    import ssl

    import distributed
    from distributed.security import Security

    address = cluster.client.scheduler.address
    # Plain TCP to the TLS port, and TLS with a certificate of another temporary CA.
    for attempt, security in (
        (address.replace("tls://", "tcp://"), None),
        (address, Security.temporary()),
    ):
        with pytest.raises((OSError, TimeoutError)):
            distributed.Client(attempt, timeout=5, security=security)  # 5 s: a hang bound
    # TLS without any client certificate: the scheduler closes the connection.
    host, port = address.removeprefix("tls://").rsplit(":", 1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        try:
            with context.wrap_socket(raw) as tls:
                tls.sendall(b"\0" * 64)
                data = tls.recv(1)
        except (ssl.SSLError, OSError):
            data = b""
    assert data == b""


def test_insecure_is_an_explicit_opt_out_with_a_warning() -> None:
    with ClusterDispatcher(n_workers=1, processes=False, insecure=True) as d:
        with pytest.warns(UserWarning, match="any user of this machine"):
            d.start()
        assert d.client.scheduler.address.startswith("tcp://127.0.0.1:")
        assert d.submit(where).result(60) == os.getpid()  # processes=False: in this process


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="n_workers=0 is not accepted; accepted: an int >= 1"):
        ClusterDispatcher(n_workers=0)
    with pytest.raises(ValueError, match=r"always binds to 127\.0\.0\.1"):
        ClusterDispatcher(cluster_kwargs={"host": "0.0.0.0"})  # noqa: S104 - rejected, never bound
    with pytest.raises(TypeError, match="address must be a scheduler address"):
        ClusterDispatcher(42)
    with pytest.raises(ValueError, match="insecure='yes' is not accepted"):
        ClusterDispatcher(insecure="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="insecure=True is not accepted"):
        ClusterDispatcher(insecure=True, security=object())
