"""ClusterDispatcher: tasks run on a Dask distributed cluster.

For users who outgrow one machine: give the address of a running scheduler
(``ClusterDispatcher("tls://scheduler:8786", security=...)``), or let the dispatcher start
a ``LocalCluster`` bound to 127.0.0.1 (no dashboard).  The cluster it starts uses mutual
TLS with a throw-away certificate authority (``distributed.security.Security.temporary()``):
only this process holds a client certificate, so another local user cannot submit code to
it.  ``insecure=True`` starts it without TLS (with a warning).  Needs the ``dask`` extra::

    pip install 'sakura-async[dask]'

The task is encoded as for the other dispatchers (cloudpickle + zstandard, tensors as raw
buffers) into one ``bytes`` object that Dask ships to a worker, where a function of this
module decodes and runs it.  So a function travels exactly as with ``LocalDispatcher``
(by value for ``__main__`` and for modules registered with
``cloudpickle.register_pickle_by_value``), and a payload that cannot be decoded on the
worker fails that task instead of breaking the worker's connection (which is what Dask's own
by-reference pickling of a function the worker cannot import does).  Dask retries a task
elsewhere if its worker dies (up to the scheduler's ``allowed-failures``); a task that
exhausts its retries fails with Dask's ``KilledWorker``.  Securing a remote scheduler (TLS,
authentication) is Dask's configuration (``distributed.security.Security``, passed as
``security=``).  A task over ``task_timeout`` fails with TaskTimeoutError and is cancelled
on the cluster.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from sakura.options import check_bool, check_int, option_error
from sakura_async.dispatch.base import (
    DEFAULT_INTERRUPT_GRACE,
    DEFAULT_TASK_TIMEOUT,
    Dispatcher,
    TaskFuture,
)
from sakura_async.dispatch.options import DispatchOptions
from sakura_async.wire.serialize import Encoder

__all__ = ["ClusterDispatcher"]


def _run_encoded(body: bytes) -> bytes:
    """What a Dask worker runs: decode ``(fn, args, kwargs)``, run it, encode the outcome."""
    from sakura_async.wire.serialize import Decoder
    from sakura_async.wire.tasks import run_task

    return b"".join(bytes(chunk) for chunk in run_task(bytearray(body), Decoder()))


def _import_distributed() -> Any:
    try:
        import distributed
    except ImportError as exc:
        raise ImportError(
            "ClusterDispatcher needs Dask distributed: pip install 'sakura-async[dask]'"
        ) from exc
    return distributed


class ClusterDispatcher(Dispatcher):
    """Run tasks on a Dask distributed cluster.

    Args:
        address: a scheduler address (``"tcp://host:8786"``) or a ``distributed.Client``
            (yours to close); None starts a ``LocalCluster`` on 127.0.0.1.
        n_workers, threads_per_worker, processes: the LocalCluster's shape (ignored with
            an address).
        max_pending: unfinished tasks allowed before ``submit`` blocks.
        security: a ``distributed.security.Security`` for a TLS scheduler, or for the local
            cluster (default for the local cluster: ``Security.temporary()``, mutual TLS).
        insecure: start the local cluster without TLS (any local user can then submit
            code to it); warns.  Not allowed together with ``security``.
        cluster_kwargs: more ``LocalCluster`` options (its ``host`` stays 127.0.0.1).
        start_timeout: seconds to wait for a local cluster's workers to start before
            failing with a TimeoutError.
        task_timeout, interrupt_grace: see :class:`~sakura_async.dispatch.Dispatcher`.
    """

    kind = "cluster"

    def __init__(
        self,
        address: Any = None,
        *,
        n_workers: int = 1,
        threads_per_worker: int = 1,
        processes: bool = True,
        max_pending: int = 4,
        security: Any = None,
        cluster_kwargs: Mapping[str, Any] | None = None,
        start_timeout: float = 120.0,
        insecure: bool = False,
        task_timeout: float | None = DEFAULT_TASK_TIMEOUT,
        interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
    ) -> None:
        options = DispatchOptions.from_kwargs(
            owner="ClusterDispatcher",
            max_pending=max_pending,
            task_timeout=task_timeout,
            interrupt_grace=interrupt_grace,
            start_timeout=start_timeout,
        )
        super().__init__(options=options)
        self.insecure: bool = check_bool("insecure", insecure, owner="ClusterDispatcher")
        if insecure and security is not None:
            raise option_error(
                "insecure",
                insecure,
                "False when security is given (insecure=True means: no security)",
                owner="ClusterDispatcher",
            )
        if address is not None and not isinstance(address, str) and not hasattr(address, "submit"):
            raise TypeError(
                f"address must be a scheduler address such as 'tcp://host:8786', a "
                f"distributed.Client, or None for a local cluster; got {address!r}"
            )
        self.address = address
        self.n_workers: int = check_int(
            "n_workers", n_workers, minimum=1, owner="ClusterDispatcher"
        )
        self.threads_per_worker: int = check_int(
            "threads_per_worker", threads_per_worker, minimum=1, owner="ClusterDispatcher"
        )
        if not isinstance(processes, bool):
            raise TypeError(f"processes must be a bool, got {processes!r}")
        self.processes = processes
        self.start_timeout: float = options.start_timeout
        self.security = security
        self.cluster_kwargs = dict(cluster_kwargs or {})
        if "host" in self.cluster_kwargs and self.cluster_kwargs["host"] != "127.0.0.1":
            raise ValueError("cluster_kwargs['host']: a local cluster always binds to 127.0.0.1")
        self._client: Any = None
        self._cluster: Any = None
        self._owns_client = False
        self._lock = threading.Lock()
        self._running: dict[int, Any] = {}  # task id -> Dask future, for timeouts

    @property
    def client(self) -> Any:
        """The ``distributed.Client`` (connects or starts the cluster on first use)."""
        with self._lock:
            if self._client is None:
                self._open()
            return self._client

    def start(self) -> ClusterDispatcher:
        self.check_open()
        _ = self.client
        return self

    def _open(self) -> None:
        distributed = _import_distributed()
        if self.address is not None and not isinstance(self.address, str):
            self._client = self.address
            return
        if self.address is None:
            options: dict[str, Any] = {
                "host": "127.0.0.1",
                "n_workers": self.n_workers,
                "threads_per_worker": self.threads_per_worker,
                "processes": self.processes,
                # The scheduler serves HTTP (health, metrics) even without a dashboard:
                # keep it on loopback, on a free port.
                "dashboard_address": "127.0.0.1:0",
            }
            if self.insecure:
                warnings.warn(
                    "ClusterDispatcher(insecure=True): the local Dask cluster accepts tasks "
                    "(arbitrary code) from any user of this machine over plain TCP",
                    UserWarning,
                    stacklevel=4,
                )
            elif self.security is None:
                from distributed.security import Security

                self.security = Security.temporary()  # type: ignore[no-untyped-call]
            if self.security is not None:
                options["security"] = self.security
            # Over the loopback network also with processes=False (Dask's in-process
            # transport takes no host), so that TLS applies there too.
            options["protocol"] = "tls://" if self.security is not None else "tcp://"
            options.update(self.cluster_kwargs)
            self._cluster = distributed.LocalCluster(**options)
            self._client = distributed.Client(self._cluster, security=self.security)
            # Fail loudly now if the workers cannot start (a loaded machine, a broken
            # environment) instead of leaving every later task waiting for a worker.
            self._client.wait_for_workers(self.n_workers, timeout=self.start_timeout)
        else:
            self._client = distributed.Client(self.address, security=self.security)
        self._owns_client = True

    def start_task(
        self,
        future: TaskFuture,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        body = b"".join(bytes(chunk) for chunk in Encoder(placer=None).encode((fn, args, kwargs)))
        dask_future = self.client.submit(_run_encoded, body, pure=False)
        self._running[future.task_id] = dask_future
        future.mark_submitted()

        def done(f: Any) -> None:
            self._running.pop(future.task_id, None)
            try:
                outcome = f.result()
            except BaseException as exc:  # KilledWorker, a cancelled future...
                future.settle(error=exc)
                return
            future._finish_outcome(outcome, "a Dask worker")

        # Dask runs callbacks on its event loop; result() of a finished future is immediate
        # there, but a slow one would stall the loop, so hand it to a thread.
        dask_future.add_done_callback(
            lambda f: threading.Thread(target=done, args=(f,), daemon=True).start()
        )

    def handle_timeout(self, future: TaskFuture) -> None:
        dask_future = self._running.pop(future.task_id, None)
        if dask_future is not None:
            dask_future.cancel()

    def close_resources(self, wait: bool) -> None:
        if self._owns_client and self._client is not None:
            self._client.close()
        if self._cluster is not None:
            self._cluster.close()
        self._client = self._cluster = None

    def __repr__(self) -> str:
        where = self.address if isinstance(self.address, str) else "local cluster"
        return f"<ClusterDispatcher {where} {'closed' if self.closed else f'{self.pending}/{self.max_pending} pending'}>"
