"""RemoteDispatcher: tasks run on a ``sakura-worker --listen`` on another host.

The connection is TLS (the standard :mod:`ssl` module) with the worker's certificate
pinned by the client (``cert_der``, ``cert_sha256`` or ``cafile``), then both sides prove
the shared token by HMAC challenge-response (:mod:`sakura_async.wire.auth`) before either
decodes anything: a server that cannot prove the token never gets a result unpickled here.
Over ``tcp://`` (loopback only) every frame after that carries a MAC under a key derived
from the token and both sides' nonces, with a per-direction sequence number: a relay that
forwarded the handshake cannot inject, replay or reorder a frame afterwards.
The worker sends a heartbeat every second; a worker silent for ``liveness_timeout``
seconds is dropped and its tasks fail with
:class:`~sakura_async.errors.WorkerUnresponsiveError`.  ``tcp://`` without TLS is
accepted only for a loopback address.  Tensors travel as raw buffers after the compressed
pickle, sent from a background thread so the training thread never waits on the network
(a snapshot buffer is not reused before its task has finished).

Start the worker with a token file and a certificate::

    sakura-worker --listen 0.0.0.0:4433 --token-file token --cert cert.pem --key key.pem

and connect::

    RemoteDispatcher(uri="tls://eval-host:4433", token_file="token", cert_der=cert_bytes)

The reference README's spelling ``RemoteDispatcher(uri="quic://eval-host:4433",
cert_der=cert_bytes)`` means the same here: ``quic://`` selects this TLS transport with
``cert_der`` (the worker's DER certificate) pinned.  What differs from the reference's
Rust/QUIC transport: it runs over TCP (TLS 1.2+ from Python's :mod:`ssl`), not QUIC over
UDP, so the worker's port must be open for TCP; and a token is required as well as the
certificate (the worker refuses clients without one beyond loopback).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from sakura_async.dispatch.base import (
    DEFAULT_INTERRUPT_GRACE,
    DEFAULT_TASK_TIMEOUT,
    Dispatcher,
    TaskFuture,
)
from sakura_async.dispatch.options import DispatchOptions
from sakura_async.errors import AuthenticationError, WorkerCrashedError, WorkerUnresponsiveError
from sakura_async.wire.auth import check_token, client_handshake, is_loopback, read_token
from sakura_async.wire.channel import (
    DEFAULT_MAX_FRAME_BYTES,
    Channel,
    ChannelClosedError,
    ChannelTimeoutError,
    FrameAuthenticationError,
    Kind,
)
from sakura_async.wire.serialize import Encoder

__all__ = ["RemoteDispatcher"]

logger = logging.getLogger("sakura.async")

_SCHEMES = ("tls", "tcp", "sakura+tls", "sakura+tcp", "quic")
_TLS_SCHEMES = ("tls", "sakura+tls", "quic")  # quic://: the reference's spelling, TLS over TCP here


class _Connection:
    def __init__(self, channel: Channel, where: str) -> None:
        self.channel = channel
        self.where = where
        self.inflight: dict[int, TaskFuture] = {}
        self.outbox: queue.Queue[Any] = queue.Queue()
        self.dead = False
        self.info: dict[str, Any] = {}
        self.ready = threading.Event()
        self.threads: list[threading.Thread] = []


class RemoteDispatcher(Dispatcher):
    """Run tasks on a remote ``sakura-worker --listen``.

    Args:
        uri: ``tls://HOST:PORT`` (or ``tcp://HOST:PORT`` for a loopback worker).
            ``quic://HOST:PORT``, the reference README's spelling, is accepted as
            ``tls://``: the same certificate pinning and token, over TLS on TCP (not QUIC
            on UDP; see the module docstring).
        token / token_file: the shared secret the worker was started with (at least 16
            bytes).
        cert_der: the worker's certificate (DER bytes) to pin; or ``cert_file``, a file
            holding it (PEM or DER); or ``cert_sha256``, the hex SHA-256 of the DER; or
            ``cafile``, a CA bundle to verify it against (with hostname checking).  Exactly
            one of them is required for ``tls://``.
        max_pending: unfinished tasks allowed before ``submit`` blocks.
        connect_timeout: seconds for connecting and authenticating (the whole handshake).
        liveness_timeout: seconds without any message (the worker sends a heartbeat every
            second) after which the worker counts as gone.
        max_frame_bytes: the largest result message accepted from the worker (4 GiB).
        task_timeout, interrupt_grace: see :class:`~sakura_async.dispatch.Dispatcher`.
    """

    kind = "remote"

    def __init__(
        self,
        uri: str,
        *,
        token: str | bytes | None = None,
        token_file: str | None = None,
        cert_der: bytes | None = None,
        cert_sha256: str | None = None,
        cert_file: str | None = None,
        cafile: str | None = None,
        max_pending: int = 2,
        connect_timeout: float = 15.0,
        liveness_timeout: float = 60.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        task_timeout: float | None = DEFAULT_TASK_TIMEOUT,
        interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
    ) -> None:
        owner = "RemoteDispatcher"
        options = DispatchOptions.from_kwargs(
            owner=owner,
            max_pending=max_pending,
            task_timeout=task_timeout,
            interrupt_grace=interrupt_grace,
            connect_timeout=connect_timeout,
            liveness_timeout=liveness_timeout,
            max_frame_bytes=max_frame_bytes,
        )
        super().__init__(options=options)
        self.liveness_timeout: float = options.liveness_timeout
        self.max_frame_bytes: int = options.max_frame_bytes
        if not isinstance(uri, str):
            raise TypeError(f"uri must be a string such as 'tls://host:4433', got {uri!r}")
        parts = urlsplit(uri)
        if parts.scheme not in _SCHEMES or not parts.hostname or parts.port is None:
            raise ValueError(
                f"{owner}: uri={uri!r} is not accepted; accepted: tls://HOST:PORT, "
                f"quic://HOST:PORT (the same TLS transport), or tcp://HOST:PORT on loopback"
            )
        self.uri = uri
        self.host: str = parts.hostname
        self.port: int = parts.port
        self.tls = parts.scheme in _TLS_SCHEMES
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        if token_file is not None:
            token = read_token(token_file, owner=owner)
        self._token: bytes | None = (
            None if token is None else check_token(token, option="token", owner=owner)
        )
        pins = [p for p in (cert_der, cert_sha256, cert_file, cafile) if p is not None]
        if self.tls and len(pins) != 1:
            raise ValueError(
                f"a {parts.scheme}:// worker must be authenticated: give exactly one of cert_der (the "
                "worker's certificate, DER bytes), cert_file (a PEM or DER file of it), "
                "cert_sha256 (its hex SHA-256) or cafile"
            )
        if cert_file is not None:
            with open(cert_file, "rb") as f:
                data = f.read()
            cert_der = (
                ssl.PEM_cert_to_DER_cert(data.decode("ascii"))
                if data.lstrip().startswith(b"-----BEGIN")
                else data
            )
        if not self.tls and not is_loopback(self.host):
            raise ValueError(
                f"tcp:// (no TLS) is only allowed to a loopback address, not {self.host!r}; "
                f"use tls:// with the worker's certificate"
            )
        if cert_der is not None and not isinstance(cert_der, bytes):
            raise TypeError("cert_der must be the certificate's DER bytes")
        self._pin: str | None = None
        if cert_der is not None:
            self._pin = hashlib.sha256(cert_der).hexdigest()
        elif cert_sha256 is not None:
            pin = cert_sha256.replace(":", "").lower()
            if len(pin) != 64 or any(c not in "0123456789abcdef" for c in pin):
                raise ValueError(f"cert_sha256 must be 64 hex digits, got {cert_sha256!r}")
            self._pin = pin
        self._cafile = cafile
        self.connect_timeout: float = options.connect_timeout
        self._conn: _Connection | None = None
        self._conn_lock = threading.RLock()
        self._encoder = Encoder(placer=None)

    # --- connection -----------------------------------------------------------------------

    def start(self) -> RemoteDispatcher:
        """Connect and authenticate now (raises AuthenticationError if refused)."""
        self.check_open()
        self._connection()
        return self

    @property
    def worker_info(self) -> dict[str, Any]:
        conn = self._connection()
        conn.ready.wait(self.connect_timeout)
        return dict(conn.info)

    def _connection(self) -> _Connection:
        with self._conn_lock:
            conn = self._conn
            if conn is None or conn.dead:
                conn = self._connect()
                self._conn = conn
            return conn

    def _connect(self) -> _Connection:
        where = f"sakura-worker at {self.uri}"
        raw = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        sock: socket.socket = raw
        try:
            if self.tls:
                if self._cafile is not None:
                    context = ssl.create_default_context(cafile=self._cafile)
                else:  # the pin below authenticates the worker
                    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                try:
                    sock = context.wrap_socket(raw, server_hostname=self.host)
                except ssl.SSLError as exc:
                    raise AuthenticationError(f"TLS handshake with {where} failed: {exc}") from exc
                if self._pin is not None:
                    der = sock.getpeercert(binary_form=True) or b""
                    if hashlib.sha256(der).hexdigest() != self._pin:
                        raise AuthenticationError(
                            f"{where} presented a certificate that does not match the pinned one "
                            f"(sha256 {hashlib.sha256(der).hexdigest()}); refusing to send it anything"
                        )
            keys = client_handshake(sock, self._token, timeout=self.connect_timeout)
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
        channel = Channel(
            sock,
            max_body=self.max_frame_bytes,
            timeout=self.liveness_timeout,
            keys=None if self.tls else keys,  # TLS authenticates every byte itself
        )
        conn = _Connection(channel, where)
        reader = threading.Thread(
            target=self._read_loop, args=(conn,), name="sakura-remote-reader", daemon=True
        )
        sender = threading.Thread(
            target=self._send_loop, args=(conn,), name="sakura-remote-sender", daemon=True
        )
        conn.threads = [reader, sender]
        reader.start()
        sender.start()
        return conn

    def _send_loop(self, conn: _Connection) -> None:
        while True:
            item = conn.outbox.get()
            if item is None:
                return
            task_id, chunks = item
            try:
                conn.channel.send(Kind.TASK, task_id, chunks)
            except ChannelClosedError as exc:
                self._lost(conn, exc)
                return

    def _read_loop(self, conn: _Connection) -> None:
        reason: BaseException | None = None
        try:
            while True:
                kind, task_id, body, _ = conn.channel.recv()
                if kind == Kind.HEARTBEAT:
                    continue
                if kind == Kind.READY:
                    conn.info = json.loads(body)
                    conn.ready.set()
                elif kind == Kind.RESULT:
                    with self._conn_lock:
                        future = conn.inflight.pop(task_id, None)
                    if future is None:
                        continue
                    future._finish_outcome(body, conn.where)
        except FrameAuthenticationError as exc:
            logger.error("sakura RemoteDispatcher: dropped %s: %s", conn.where, exc)
            reason = exc
        except ChannelClosedError as exc:
            reason = exc
        except BaseException as exc:
            logger.error("sakura RemoteDispatcher: lost %s: %r", conn.where, exc)
            reason = exc
        self._lost(conn, reason)

    def _lost(self, conn: _Connection, reason: BaseException | None = None) -> None:
        with self._conn_lock:
            if conn.dead:
                return
            conn.dead = True
            orphans = list(conn.inflight.items())
            conn.inflight.clear()
        conn.ready.set()
        conn.outbox.put(None)
        conn.channel.close()
        for task_id, future in orphans:
            if isinstance(reason, ChannelTimeoutError):
                error: WorkerCrashedError = WorkerUnresponsiveError(
                    f"{conn.where} sent nothing (not even a heartbeat) for "
                    f"liveness_timeout={self.liveness_timeout:g} s while task #{task_id} "
                    f"({future.name}) was pending; the next task reconnects"
                )
            else:
                detail = f" ({reason})" if reason is not None and str(reason) else ""
                error = WorkerCrashedError(
                    f"the connection to {conn.where} was lost{detail} while task #{task_id} "
                    f"({future.name}) was pending; the next task reconnects"
                )
            future.settle(error=error)

    def handle_timeout(self, future: TaskFuture) -> None:
        """The worker runs tasks in order: one that timed out blocks the ones behind it, so
        drop the connection (they fail with WorkerCrashedError; the next task reconnects)."""
        with self._conn_lock:
            conn = self._conn
            if conn is None or conn.dead:
                return
        self._lost(conn, ChannelClosedError(f"task #{future.task_id} timed out"))

    # --- tasks ----------------------------------------------------------------------------

    def start_task(
        self,
        future: TaskFuture,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        chunks = self._encoder.encode((fn, args, kwargs))
        with self._conn_lock:
            conn = self._connection()
            conn.inflight[future.task_id] = future
        conn.outbox.put((future.task_id, chunks))
        future.mark_submitted()

    def close_resources(self, wait: bool) -> None:
        with self._conn_lock:
            conn, self._conn = self._conn, None
        if conn is None or conn.dead:
            return
        conn.outbox.put(None)
        if wait:
            for thread in conn.threads[1:]:
                thread.join(timeout=self.liveness_timeout)
            with contextlib.suppress(ChannelClosedError):
                conn.channel.send(Kind.SHUTDOWN, 0)
        conn.channel.close()
        conn.threads[0].join(timeout=10 if wait else 1)

    def __repr__(self) -> str:
        return f"<RemoteDispatcher {self.uri} {'closed' if self.closed else f'{self.pending}/{self.max_pending} pending'}>"
