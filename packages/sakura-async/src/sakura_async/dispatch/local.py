"""LocalDispatcher: tasks run in an auto-spawned ``sakura-worker`` process.

The worker is a separate interpreter (its own GIL), started on :meth:`start` or the first
``submit``, connected by a Unix socket pair (no network listener).  Payloads are
cloudpickle + zstandard; tensors never go through the pickle: they are placed in
shared-memory segments (:mod:`sakura_async.wire.shm`) whose file descriptors cross the
socket once.  Snapshot buffers from :meth:`LocalDispatcher.empty` *are* shared memory, so a
snapshot reaches the worker without any copy; other tensors are copied once into a
transient segment reused across tasks.

The worker dies with its parent (see :mod:`sakura_async.worker`).  When it crashes, every
task it held fails with :class:`~sakura_async.errors.WorkerCrashedError` (no caller ever
hangs) and the next ``submit`` starts a fresh worker.  The worker sends a heartbeat
(``liveness_timeout / 10`` seconds apart) from a thread of its own, also while a task runs:
a worker silent for ``liveness_timeout`` seconds (stopped with SIGSTOP, wedged) is killed
and its tasks fail with :class:`~sakura_async.errors.WorkerUnresponsiveError`.  A task that
exceeds ``task_timeout`` fails with :class:`~sakura_async.errors.TaskTimeoutError` and its
worker is killed too (the tasks queued behind it fail with WorkerCrashedError).

Tensors a task receives are views of shared memory that is reused once the task has
finished: a task that wants to keep one beyond its own run must copy it (``.clone()``).
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sakura.options import check_int, option_error
from sakura_async.dispatch.base import (
    DEFAULT_INTERRUPT_GRACE,
    DEFAULT_TASK_TIMEOUT,
    Dispatcher,
    TaskFuture,
)
from sakura_async.dispatch.options import DispatchOptions
from sakura_async.errors import WorkerCrashedError, WorkerUnresponsiveError
from sakura_async.wire.channel import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_FDS,
    Channel,
    ChannelClosedError,
    ChannelTimeoutError,
    Kind,
)
from sakura_async.wire.serialize import Encoder
from sakura_async.wire.shm import Segment

__all__ = ["LocalDispatcher"]

logger = logging.getLogger("sakura.async")

_ALIGN = 64
_MIN_TRANSIENT = 8 << 20
_KEEP_TRANSIENT_BYTES = 1 << 30


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL (which also ends a stopped process); ignore one that is already gone."""
    with contextlib.suppress(OSError):
        proc.kill()


def _check_python(python: str, owner: str) -> str:
    """``python`` resolved to an executable that runs as Python 3 (checked once, at
    construction, so a wrong path fails here and not at the first ``submit``)."""
    accepted = "the path of a Python 3 interpreter that exists and runs (default: sys.executable)"
    found = shutil.which(python)
    if found is None:
        raise option_error(
            "python", python, f"{accepted}; no executable file is there", owner=owner
        )
    try:
        run = subprocess.run(
            [found, "-c", "import sys; print(sys.version_info[0])"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise option_error(
            "python", python, f"{accepted}; running it failed: {exc}", owner=owner
        ) from exc
    if run.returncode != 0 or run.stdout.strip() != b"3":
        said = (run.stderr or run.stdout).decode(errors="replace").strip()[-200:]
        raise option_error(
            "python",
            python,
            f"{accepted}; it exited with status {run.returncode}" + (f": {said}" if said else ""),
            owner=owner,
        )
    return found


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped responding"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class _Worker:
    """One spawned worker process and its connection."""

    def __init__(self, proc: subprocess.Popen[bytes], channel: Channel) -> None:
        self.proc = proc
        self.channel = channel
        self.known: set[int] = set()
        self.inflight: dict[int, tuple[TaskFuture, list[Segment]]] = {}
        self.dead = False
        self.closing = False
        self.ready = threading.Event()
        self.info: dict[str, Any] = {}
        self.reader: threading.Thread | None = None
        self.why: str | None = None
        """Why the dispatcher stopped this worker (unresponsive, a task timed out)."""
        self.unresponsive = False

    @property
    def pid(self) -> int:
        return self.proc.pid


class _Placer:
    """Decides where each tensor of one payload lives in shared memory."""

    def __init__(self, dispatcher: LocalDispatcher) -> None:
        self.dispatcher = dispatcher
        self.segments: dict[int, Segment] = {}
        self.transient: list[Segment] = []
        self._current: Segment | None = None

    def __call__(self, t: Any) -> tuple[int, int, int]:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return 0, 0, 0
        if t.is_contiguous():
            seg = self.dispatcher._persistent_segment(t.data_ptr(), nbytes)
            if seg is not None:
                self.segments[seg.id] = seg
                return seg.id, t.data_ptr() - seg.base, nbytes
        seg = self._current
        if seg is None or seg.used + nbytes > seg.size:
            seg = self.dispatcher._acquire_transient(nbytes)
            self.transient.append(seg)
            self.segments[seg.id] = seg
            self._current = seg
        offset = seg.used
        seg.tensor[offset : offset + nbytes].copy_(t.contiguous().reshape(-1).view(_uint8()))
        seg.used = offset + -(-nbytes // _ALIGN) * _ALIGN
        return seg.id, offset, nbytes


def _strided() -> Any:
    import torch

    return torch.strided


def _parameter() -> Any:
    import torch

    return torch.nn.Parameter


def _uint8() -> Any:
    import torch

    return torch.uint8


class LocalDispatcher(Dispatcher):
    """Run tasks in an auto-spawned ``sakura-worker`` process on this machine.

    Args:
        max_pending: unfinished tasks allowed before ``submit`` blocks.
        threads: ``torch.set_num_threads`` in the worker (None keeps torch's default).
        python: the interpreter to run the worker with (default: this one); checked at
            construction (it must exist and run as Python 3).
        env: extra environment variables for the worker.  Its ``PYTHONPATH`` lists this
            process's ``sys.path`` so the worker imports the same modules.
        start_timeout: seconds to wait for the worker's first sign of life in
            :meth:`wait_ready` (submitting never waits for it).
        liveness_timeout: seconds without any message from the worker (it sends a
            heartbeat ten times per period) after which it is killed as unresponsive.
        max_frame_bytes: the largest message accepted from the worker (4 GiB).
        task_timeout, interrupt_grace: see :class:`~sakura_async.dispatch.Dispatcher`.
    """

    kind = "process"

    def __init__(
        self,
        *,
        max_pending: int = 2,
        threads: int | None = None,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 120.0,
        liveness_timeout: float = 60.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        task_timeout: float | None = DEFAULT_TASK_TIMEOUT,
        interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
    ) -> None:
        owner = "LocalDispatcher"
        options = DispatchOptions.from_kwargs(
            owner=owner,
            max_pending=max_pending,
            task_timeout=task_timeout,
            interrupt_grace=interrupt_grace,
            start_timeout=start_timeout,
            liveness_timeout=liveness_timeout,
            max_frame_bytes=max_frame_bytes,
        )
        super().__init__(options=options)
        self.liveness_timeout: float = options.liveness_timeout
        self.max_frame_bytes: int = options.max_frame_bytes
        self.threads = check_int(
            "threads", threads, minimum=1, allow_none=True, owner="LocalDispatcher"
        )
        if python is not None and not isinstance(python, str):
            raise TypeError(
                f"python must be a path to an interpreter (str) or None, got {python!r}"
            )
        self.python = sys.executable if python is None else _check_python(python, owner)
        if env is not None and not (
            isinstance(env, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise TypeError(f"env must be a mapping of str to str or None, got {env!r}")
        self.env = dict(env or {})
        self.start_timeout: float = options.start_timeout
        self._worker: _Worker | None = None
        self._workers_started = 0
        self._spawn_lock = threading.RLock()
        self._segments_lock = threading.Lock()
        self._persistent: dict[int, Segment] = {}
        self._bases: list[tuple[int, int]] = []  # sorted (base address, segment id)
        self._free_transient: list[Segment] = []
        self._released: list[int] = []
        ref = weakref.ref(self)

        def at_exit() -> None:  # finish in-flight work (a checkpoint write) at interpreter exit
            dispatcher = ref()
            if dispatcher is not None and not dispatcher.closed:
                dispatcher.close(wait=True)

        self._atexit = at_exit
        atexit.register(at_exit)

    # --- public ---------------------------------------------------------------------------

    def start(self) -> LocalDispatcher:
        """Spawn the worker now (it imports torch while you keep working)."""
        self.check_open()
        self._ensure_worker()
        return self

    @property
    def worker_pid(self) -> int | None:
        """The current worker's pid (None before the first start or after a crash)."""
        worker = self._worker
        return None if worker is None or worker.dead else worker.pid

    @property
    def workers_started(self) -> int:
        """How many worker processes this dispatcher has spawned (1 + restarts)."""
        return self._workers_started

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Start the worker if needed and wait until it has imported torch; return its
        ``{"pid", "python", "torch"}``."""
        worker = self._ensure_worker()
        if not worker.ready.wait(self.start_timeout if timeout is None else timeout):
            raise WorkerCrashedError(
                f"sakura-worker (pid {worker.pid}) did not become ready within "
                f"{self.start_timeout if timeout is None else timeout} s"
            )
        if worker.dead:
            raise WorkerCrashedError(
                f"sakura-worker (pid {worker.pid}) {_describe_exit(worker.proc.poll())} while starting"
            )
        return dict(worker.info)

    def empty(self, shape: Iterable[int], dtype: Any, *, pin_memory: bool = False) -> Any:
        """A tensor in shared memory: a task on this dispatcher receives it without a copy.

        (``pin_memory`` is not honoured: shared memory is not page-locked.)
        """
        import math

        import torch

        shape = tuple(shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        seg = Segment(nbytes)
        view = seg.tensor[:nbytes].view(dtype).view(shape)
        with self._segments_lock:
            self._persistent[seg.id] = seg
            bisect.insort(self._bases, (seg.base, seg.id))
        weakref.finalize(view, self._drop_persistent, seg.id)
        return view

    def stage(self, tree: Any) -> Any:
        """``tree`` with every CPU tensor copied once into shared memory (see
        :meth:`Dispatcher.stage`): later tasks receive them without a copy."""
        from sakura_async.snapshot import map_tensors

        def place(t: Any) -> Any:
            if t.layout != _strided() or t.is_quantized or t.device.type != "cpu":
                return t
            out = self.empty(t.shape, t.dtype)
            out.copy_(t.detach())
            if isinstance(t, _parameter()):
                return _parameter()(out, requires_grad=t.requires_grad)
            return out

        return map_tensors(tree, place)

    # --- segments -------------------------------------------------------------------------

    def _persistent_segment(self, ptr: int, nbytes: int) -> Segment | None:
        with self._segments_lock:
            i = bisect.bisect_right(self._bases, (ptr, float("inf"))) - 1
            if i < 0:
                return None
            seg = self._persistent.get(self._bases[i][1])
        if seg is None or seg.tensor is None or ptr + nbytes > seg.base + seg.size:
            return None
        return seg

    def _drop_persistent(self, seg_id: int) -> None:
        with self._segments_lock:
            seg = self._persistent.pop(seg_id, None)
            if seg is None:
                return
            self._bases.remove((seg.base, seg.id))
            self._released.append(seg.id)
        seg.close()

    def _acquire_transient(self, nbytes: int) -> Segment:
        with self._segments_lock:
            for i, seg in enumerate(self._free_transient):
                if nbytes <= seg.size <= max(4 * nbytes, _MIN_TRANSIENT):
                    del self._free_transient[i]
                    seg.used = 0
                    return seg
        return Segment(max(nbytes, _MIN_TRANSIENT))

    def _return_transient(self, segments: list[Segment]) -> None:
        with self._segments_lock:
            for seg in segments:
                seg.used = 0
                self._free_transient.append(seg)
            total = sum(s.size for s in self._free_transient)
            while self._free_transient and total > _KEEP_TRANSIENT_BYTES:
                seg = self._free_transient.pop(0)
                total -= seg.size
                self._released.append(seg.id)
                seg.close()

    # --- workers --------------------------------------------------------------------------

    def _ensure_worker(self) -> _Worker:
        with self._spawn_lock:
            worker = self._worker
            if worker is None or worker.dead:
                worker = self._spawn()
                self._worker = worker
            return worker

    def _spawn(self) -> _Worker:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [
            self.python,
            "-m",
            "sakura_async.worker",
            "--fd",
            str(child_sock.fileno()),
            "--parent",
            str(os.getpid()),
        ]
        if threading.current_thread() is threading.main_thread():
            # PR_SET_PDEATHSIG fires when the spawning *thread* ends: only arm it from the
            # main thread, whose end is the process's (the other watchers cover the rest).
            cmd.append("--pdeathsig")
        if self.threads is not None:
            cmd += ["--threads", str(self.threads)]
        heartbeat = min(2.0, self.liveness_timeout / 10)
        cmd += ["--heartbeat", repr(heartbeat), "--max-frame-bytes", str(self.max_frame_bytes)]
        env = dict(os.environ)
        path = [p for p in sys.path if p and os.path.isdir(p)]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(path)
        env.update(self.env)
        try:
            # A session of its own: a terminal's Ctrl+C (SIGINT to the foreground process
            # group) reaches only the training process, which then drains the worker, even
            # while the worker is still starting up.
            proc = subprocess.Popen(
                cmd,
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.PIPE,
                env=env,
                close_fds=True,
                start_new_session=True,
            )
        finally:
            child_sock.close()
        self._workers_started += 1
        channel = Channel(
            parent_sock, fds=True, max_body=self.max_frame_bytes, timeout=self.liveness_timeout
        )
        worker = _Worker(proc, channel)
        worker.reader = threading.Thread(
            target=self._read_loop,
            args=(worker,),
            name=f"sakura-worker-{proc.pid}-reader",
            daemon=True,
        )
        worker.reader.start()
        return worker

    def _read_loop(self, worker: _Worker) -> None:
        where = f"sakura-worker (pid {worker.pid})"
        try:
            while True:
                kind, task_id, body, fds = worker.channel.recv()
                for fd in fds:  # the worker never sends descriptors; never leak any
                    os.close(fd)
                if kind == Kind.HEARTBEAT:
                    continue
                if kind == Kind.READY:
                    worker.info = json.loads(body)
                    worker.ready.set()
                elif kind == Kind.RESULT:
                    with self._spawn_lock:
                        entry = worker.inflight.pop(task_id, None)
                    if entry is None:
                        continue
                    future, transient = entry
                    self._return_transient(transient)  # before waking the caller up
                    future._finish_outcome(body, where)
        except ChannelTimeoutError:
            worker.unresponsive = True
            worker.why = worker.why or (
                f"sent nothing, not even a heartbeat, for liveness_timeout="
                f"{self.liveness_timeout:g} s and was killed as unresponsive"
            )
            _kill(worker.proc)
        except ChannelClosedError:
            pass
        except BaseException as exc:
            logger.error("sakura LocalDispatcher: lost %s: %r", where, exc)
            _kill(worker.proc)
        self._worker_gone(worker)

    def _worker_gone(self, worker: _Worker) -> None:
        with self._spawn_lock:
            worker.dead = True
            orphans = list(worker.inflight.items())
            worker.inflight.clear()
        worker.ready.set()
        try:
            code = worker.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _kill(worker.proc)
            code = worker.proc.wait(timeout=30)
        worker.channel.close()
        if worker.proc.stdin is not None:
            with contextlib.suppress(OSError):
                worker.proc.stdin.close()
        if worker.closing and not orphans:
            return
        how = worker.why or _describe_exit(code)
        if orphans:
            logger.error("sakura LocalDispatcher: sakura-worker (pid %d) %s", worker.pid, how)
        kind = WorkerUnresponsiveError if worker.unresponsive else WorkerCrashedError
        for task_id, (future, transient) in orphans:
            self._return_transient(transient)
            future.settle(
                error=kind(
                    f"sakura-worker (pid {worker.pid}) {how} while task #{task_id} "
                    f"({future.name}) was pending on it; the next task starts a new worker"
                )
            )

    # --- tasks ----------------------------------------------------------------------------

    def start_task(
        self,
        future: TaskFuture,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        placer = _Placer(self)
        try:
            body = Encoder(placer).encode((fn, args, kwargs))
        except BaseException:
            self._return_transient(placer.transient)
            raise
        with self._spawn_lock:
            worker = self._ensure_worker()
            worker.inflight[future.task_id] = (future, placer.transient)
        try:
            self._send_releases(worker)
            new = [s for s in placer.segments.values() if s.id not in worker.known]
            for i in range(0, len(new), MAX_FDS):
                batch = new[i : i + MAX_FDS]
                described = json.dumps([[s.id, s.size] for s in batch]).encode()
                worker.channel.send(Kind.SEGMENTS, 0, [described], fds=[s.fd for s in batch])
                worker.known.update(s.id for s in batch)
            worker.channel.send(Kind.TASK, future.task_id, body)
        except ChannelClosedError:
            pass  # the reader thread sees the worker gone and fails the future
        future.mark_submitted()

    def handle_timeout(self, future: TaskFuture) -> None:
        """The worker is stuck in the task: kill it (the reader fails what it held; the
        next task starts a fresh worker)."""
        with self._spawn_lock:
            worker = self._worker
            if worker is None or worker.dead or future.task_id not in worker.inflight:
                return
            _, transient = worker.inflight.pop(future.task_id)
            self._worker = None  # the next task starts a fresh worker at once
            worker.why = (
                f"was stopped because task #{future.task_id} ({future.name}) exceeded "
                f"task_timeout={self.task_timeout:g} s"
            )
        _kill(worker.proc)
        self._return_transient(transient)

    def _send_releases(self, worker: _Worker) -> None:
        with self._segments_lock:
            released, self._released = self._released, []
        gone = [i for i in released if i in worker.known]
        if gone:
            worker.known.difference_update(gone)
            worker.channel.send(Kind.RELEASE, 0, [json.dumps(gone).encode()])

    def close_resources(self, wait: bool) -> None:
        atexit.unregister(self._atexit)
        with self._spawn_lock:
            worker, self._worker = self._worker, None
        if worker is not None and not worker.dead:
            worker.closing = True
            if wait:
                with contextlib.suppress(ChannelClosedError):
                    worker.channel.send(Kind.SHUTDOWN, 0)
                try:
                    worker.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _kill(worker.proc)
            else:  # the tasks it runs were failed already: do not wait for them
                _kill(worker.proc)
            if worker.reader is not None:
                worker.reader.join(timeout=10)
        with self._segments_lock:
            segments = list(self._persistent.values()) + self._free_transient
            self._free_transient = []
        for seg in segments:
            seg.close()

    def __repr__(self) -> str:
        pid = self.worker_pid
        where = f" worker pid {pid}" if pid else ""
        return f"<LocalDispatcher{where} {'closed' if self.closed else f'{self.pending}/{self.max_pending} pending'}>"
