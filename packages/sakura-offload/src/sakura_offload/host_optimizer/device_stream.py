"""Host updates of CUDA parameters without stalling the GPU: side-stream copies, a worker
thread (:class:`HostPipeline`), poll-then-sleep waits; :class:`CudaTransfer` is the CUDA
side, :class:`DeviceTransfer` its protocol (tests give a stand-in).

The steps and their ordering: ``docs/offload.md``, "Host AdamW: design".
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from sakura_offload.host_optimizer.event_wait import Event

__all__ = ["CudaTransfer", "DeviceTransfer", "HostPipeline"]


class DeviceTransfer(Protocol):
    """The device side of the pipeline."""

    def handles(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s host update goes through the pipeline."""
        ...

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` in page-locked memory (copies go asynchronously only from there)."""
        ...

    def to_host(self, grad: torch.Tensor, buffer: torch.Tensor) -> Event:
        """Queue the copy of ``grad`` (any float dtype) into the flat fp32 host ``buffer``
        after the work queued so far; the event completes when it is there."""
        ...

    def to_device(self, master: torch.Tensor, p: torch.Tensor) -> None:
        """Queue the copy of the fp32 host ``master`` into ``p`` (rounded to its dtype)."""
        ...

    def order_compute(self) -> None:
        """Make the work queued from now on wait for every copy queued so far."""
        ...


class CudaTransfer:
    """:class:`DeviceTransfer` on CUDA streams: one side stream per device."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def handles(self, p: torch.Tensor) -> bool:
        return p.device.type == "cuda"

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory()

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def to_host(self, grad: torch.Tensor, buffer: torch.Tensor) -> Event:
        side = self._side(grad.device)
        side.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(side):
            # reshape copies a non-contiguous gradient and .float() converts one of another
            # dtype: either way on the device, in the side stream, into memory of that stream
            source = grad.detach().reshape(-1).float()
            buffer.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        grad.record_stream(side)  # not reused by the compute stream before the copy ran
        return done

    def to_device(self, master: torch.Tensor, p: torch.Tensor) -> None:
        side = self._side(p.device)
        with torch.cuda.stream(side):
            p.detach().copy_(master.view(p.shape), non_blocking=True)

    def order_compute(self) -> None:
        for device, side in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(side)


class HostPipeline:
    """Runs jobs on one worker thread, in order; :meth:`drain` waits for all of them.

    A job that raises stops the pipeline: the jobs after it are dropped and :meth:`drain`
    re-raises that error.  :meth:`drain` is bounded by ``timeout_s`` and notices a worker
    that died."""

    def __init__(self, *, timeout_s: float = 600.0, name: str = "sakura-offload-host") -> None:
        self.timeout_s = timeout_s
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("sakura-offload: the host update thread is not running")
        with self._lock:
            self._pending += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self._error is None:
                    job()
            except BaseException as error:
                self._error = error
            finally:
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def drain(self) -> None:
        """Wait until every submitted job ran; re-raise the first error of one."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while self._pending:
                if not self._thread.is_alive():
                    raise RuntimeError(
                        "sakura-offload: the host update thread died with updates pending"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"sakura-offload: {self._pending} host update(s) did not finish "
                        f"within {self.timeout_s:g} s"
                    )
                self._lock.wait(min(left, 0.5))
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("sakura-offload: a host update failed") from error

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker after the jobs already submitted, waiting at most ``timeout_s``
        (it is a daemon thread: a worker stuck on a hung device does not hold the process
        at exit)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=timeout_s)
