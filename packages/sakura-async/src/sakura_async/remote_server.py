"""``sakura-worker --listen HOST:PORT``: serve RemoteDispatcher clients.

Security rules, checked before anything binds:

* Beyond loopback, the worker needs both TLS (``--cert``/``--key``) and a shared token
  (``--token-file``); it refuses to start otherwise.
* On loopback, a token is still required unless ``--insecure-loopback`` is given.

Before authentication a connection costs the worker one file descriptor and nothing
else: the accept loop watches every unauthenticated connection in one selector until the
client's whole first message has arrived (the 38-byte greeting over ``tcp://``, the first
TLS record over ``tls://``), and only then hands it to one of at most ``--max-handshakes``
handshake threads (the TLS handshake and mutual token proof, :mod:`sakura_async.wire.auth`).
A legitimate client sends its first message at once; a slow client that trickles bytes
never reaches a handshake thread.  Everything before authentication has one deadline from
accept (``--handshake-timeout``).  At most ``--max-unauthenticated`` connections are
unauthenticated at once, at most ``--max-unauthenticated-per-peer`` of them from one
address: a new connection over either cap closes the oldest one that has not sent its
first message (from that address first), so a flood of idle or reconnecting connections
costs its own slots, never the clients that authenticate.  Closed connections are
reported in one warning line per ``report_interval`` seconds with their counts (a flood
does not flood the log).  After authentication a session thread takes the client's
messages (bodies of at most ``--max-frame-bytes``, each with a MAC over ``tcp://``) while
a heartbeat tells the client the worker is alive, also while a long task runs.

Long file: the pre-authentication state machine (accept, admit, evict, progress, the
deadline tick) and the caps it enforces are one security argument, reviewed in one place;
the wire format and the handshake itself live in :mod:`sakura_async.wire`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import json
import logging
import math
import os
import queue
import selectors
import signal
import socket
import ssl
import sys
import threading
import time
from typing import Any

from sakura_async.errors import AuthenticationError
from sakura_async.wire.auth import (
    HELLO_MAGIC,
    HELLO_SIZE,
    SessionKeys,
    check_token,
    is_loopback,
    read_token,
    server_handshake,
)
from sakura_async.wire.channel import DEFAULT_MAX_FRAME_BYTES, Channel, ChannelClosedError, Kind
from sakura_async.wire.serialize import Decoder
from sakura_async.wire.tasks import run_task

__all__ = ["RemoteWorkerServer", "parse_address", "serve_from_args"]

logger = logging.getLogger("sakura.async.worker")

HANDSHAKE_TIMEOUT = 15.0
MAX_HANDSHAKES = 16
MAX_UNAUTHENTICATED = 128
MAX_UNAUTHENTICATED_PER_PEER = 32
REPORT_INTERVAL = 10.0
HEARTBEAT_S = 1.0
_QUEUE = 64
_TLS_HANDSHAKE_RECORD = 0x16
_TLS_HEADER = 5
_MAX_TLS_RECORD = 16384 + 2048  # RFC 8446 5.2: the largest record a peer may send
_PARK_S = 0.05  # a connection readable with an incomplete first message waits this long
_ACCEPT_BATCH = 16


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:4433), got {text!r}")
    return host.strip("[]"), int(port)


def _peer_text(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


class _Pending:
    """An unauthenticated connection waiting for its first message (or for a thread)."""

    __slots__ = ("deadline", "need", "parked_until", "peer", "ready", "registered", "sock")

    def __init__(self, sock: socket.socket, peer: Any, deadline: float, need: int) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.need = need
        """Bytes of the first message known to be needed so far."""
        self.ready = False
        """The first message is complete: it waits for a handshake thread."""
        self.registered = False
        self.parked_until = 0.0

    @property
    def host(self) -> str:
        return str(self.peer[0]) if isinstance(self.peer, tuple) else str(self.peer)


class _Reporter:
    """Counts the unauthenticated connections closed, by reason, and logs at most one
    warning line per ``interval`` seconds (with the counts since the previous line)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.totals: collections.Counter[str] = collections.Counter()
        self._unreported: collections.Counter[str] = collections.Counter()
        self._latest = ""
        self._last = -math.inf
        self._lock = threading.Lock()

    def note(self, reason: str, peer: Any, detail: str = "") -> None:
        with self._lock:
            self.totals[reason] += 1
            self._unreported[reason] += 1
            self._latest = f"{_peer_text(peer)}: {detail or reason}"
            now = time.monotonic()
            if now - self._last < self.interval:
                return
            self._last = now
            line = self._line()
        logger.warning(line)

    def flush(self) -> None:
        with self._lock:
            line = self._line() if self._unreported else None
        if line is not None:
            logger.warning(line)

    def _line(self) -> str:
        counts = ", ".join(f"{n} {reason}" for reason, n in self._unreported.most_common())
        total = sum(self._unreported.values())
        self._unreported.clear()
        return (
            f"sakura-worker: closed {total} unauthenticated connection(s) ({counts}); the "
            f"latest, {self._latest} (at most one such line per {self.interval:g} s)"
        )


class RemoteWorkerServer:
    """A listening worker.  ``serve_forever`` accepts clients until :meth:`stop`.

    Args:
        handshake_timeout: seconds from accept for the client's first message, the TLS
            handshake and the token proof together.
        max_handshakes: handshakes (TLS + token proof) run at once, each on a thread; only
            a connection whose first message has fully arrived gets one.
        max_unauthenticated: connections allowed to be unauthenticated at once (waiting for
            their first message or for a handshake thread); a new one over the cap closes
            the oldest that has not sent its first message.
        max_unauthenticated_per_peer: the same cap for the connections from one address.
        report_interval: seconds between two warning lines about closed unauthenticated
            connections (each line counts them by reason).
        max_frame_bytes: the largest message accepted from an authenticated client.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: bytes | None,
        certfile: str | None = None,
        keyfile: str | None = None,
        insecure_loopback: bool = False,
        threads: int | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_handshakes: int = MAX_HANDSHAKES,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
        max_unauthenticated_per_peer: int = MAX_UNAUTHENTICATED_PER_PEER,
        report_interval: float = REPORT_INTERVAL,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        from sakura.options import check_int, check_number

        owner = "sakura-worker"
        self.handshake_timeout: float = check_number(
            "handshake_timeout", handshake_timeout, minimum=0, min_inclusive=False, owner=owner
        )
        self.max_handshakes: int = check_int(
            "max_handshakes", max_handshakes, minimum=1, owner=owner
        )
        self.max_unauthenticated: int = check_int(
            "max_unauthenticated", max_unauthenticated, minimum=1, owner=owner
        )
        self.max_unauthenticated_per_peer: int = check_int(
            "max_unauthenticated_per_peer", max_unauthenticated_per_peer, minimum=1, owner=owner
        )
        self.report_interval: float = check_number(
            "report_interval", report_interval, minimum=0, owner=owner
        )
        # The frame size by the dispatchers' own rule (one declaration for both sides).
        from sakura_async.dispatch.options import DispatchOptions

        self.max_frame_bytes: int = DispatchOptions.from_kwargs(
            owner=owner, max_frame_bytes=max_frame_bytes
        ).max_frame_bytes
        loopback = is_loopback(host)
        tls = certfile is not None
        if (certfile is None) != (keyfile is None):
            raise ValueError("--cert and --key go together")
        if not loopback and not (tls and token is not None):
            raise PermissionError(
                f"refusing to listen on {host!r}, which is not a loopback address, without TLS "
                f"(--cert/--key) and a token (--token-file)"
            )
        if insecure_loopback and not loopback:
            raise PermissionError("--insecure-loopback is only allowed on a loopback address")
        if token is None and not insecure_loopback:
            raise PermissionError(
                "a token is required (--token-file); on a loopback address you may pass "
                "--insecure-loopback to run without one"
            )
        self.token = None if token is None else check_token(token, owner=owner)
        self.context: ssl.SSLContext | None = None
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(certfile, keyfile)  # type: ignore[arg-type]
            self.context = context
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self._stopping = threading.Event()
        self._wake_recv, self._wake_send = socket.socketpair()
        self._lock = threading.Lock()
        self._serving = False
        self._pending: dict[int, _Pending] = {}  # oldest first
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._handshaking = 0
        self._next_tick = math.inf
        self.reporter = _Reporter(self.report_interval)
        self.authenticated = 0
        """Clients that completed the handshake."""

    @property
    def closed_unauthenticated(self) -> dict[str, int]:
        """Connections closed before authenticating, by reason (since the start)."""
        with self.reporter._lock:
            return dict(self.reporter.totals)

    @property
    def unauthenticated(self) -> int:
        """Connections waiting for their first message or for a handshake thread now."""
        with self._lock:
            return len(self._pending)

    # --- the accept loop ------------------------------------------------------------------

    def serve_forever(self) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self._serving = True
        sel = selectors.DefaultSelector()
        try:
            self.sock.setblocking(False)
            sel.register(self.sock, selectors.EVENT_READ)
            sel.register(self._wake_recv, selectors.EVENT_READ)
            while not self._stopping.is_set():
                timeout = max(0.0, min(self._next_tick - time.monotonic(), 1.0))
                events = sel.select(timeout)
                # Connections first, new ones last: a client whose first message is in is
                # marked ready (never evicted first) before newcomers may evict anyone.
                for key, _ in sorted(events, key=lambda e: e[0].fileobj is self.sock):
                    if key.fileobj is self.sock:
                        self._accept(sel)
                    elif key.fileobj is self._wake_recv:
                        with contextlib.suppress(OSError):
                            self._wake_recv.recv(64)
                    else:
                        self._progress(sel, key.data)
                if time.monotonic() >= self._next_tick:
                    self._tick(sel)
        finally:
            sel.close()
            with self._lock:
                self._serving = False
                left = list(self._pending.values())
                self._pending.clear()
                self._per_peer.clear()
                self._queue.clear()
            for p in left:
                with contextlib.suppress(OSError):
                    p.sock.close()
            self._close_listener()
            self.reporter.flush()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_send.send(b"x")
        with self._lock:
            serving = self._serving
        if not serving:
            self._close_listener()

    def _close_listener(self) -> None:
        for sock in (self.sock, self._wake_recv, self._wake_send):
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        first = _TLS_HEADER if self.context is not None else HELLO_SIZE
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._stopping.is_set():
                    return
                self.reporter.note("not accepted", "-", f"accept failed: {exc}")
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._evict(sel, None, "closed to free a file descriptor")
                return
            conn.setblocking(False)
            self._admit(sel, _Pending(conn, peer, time.monotonic() + self.handshake_timeout, first))

    def _admit(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        with self._lock:
            over_peer = self._per_peer[p.host] >= self.max_unauthenticated_per_peer
            over_all = len(self._pending) >= self.max_unauthenticated
        if over_peer:
            self._evict(
                sel,
                p.host,
                f"over max_unauthenticated_per_peer={self.max_unauthenticated_per_peer}",
            )
        elif over_all:
            self._evict(sel, None, f"over max_unauthenticated={self.max_unauthenticated}")
        with self._lock:
            self._pending[id(p)] = p
            self._per_peer[p.host] += 1
        self._watch(sel, p)
        self._next_tick = min(self._next_tick, p.deadline)

    def _evict(self, sel: selectors.BaseSelector, host: str | None, why: str) -> None:
        """Close the oldest unauthenticated connection (from ``host`` if given) that has not
        sent its first message, else the oldest waiting for a thread."""
        with self._lock:
            candidates = [p for p in self._pending.values() if host is None or p.host == host]
            victim = next((p for p in candidates if not p.ready), None)
            if victim is None and candidates:
                victim = candidates[0]
            if victim is not None:
                self._forget(victim)
        if victim is not None:
            self._drop(sel, victim, "evicted", f"evicted, {why}")

    def _forget(self, p: _Pending) -> None:
        """Take ``p`` out of the bookkeeping (under the lock)."""
        if self._pending.pop(id(p), None) is not None:
            self._per_peer[p.host] -= 1
            if self._per_peer[p.host] <= 0:
                del self._per_peer[p.host]
        if p.ready:
            with contextlib.suppress(ValueError):
                self._queue.remove(p)

    def _drop(self, sel: selectors.BaseSelector, p: _Pending, reason: str, detail: str) -> None:
        if p.registered:
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(p.sock)
            p.registered = False
        self.reporter.note(reason, p.peer, detail)  # counted before the client sees it
        with contextlib.suppress(OSError):
            p.sock.close()

    def _watch(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        # The kernel reports the socket readable only once `need` bytes are there (or on
        # end of file): a client trickling bytes costs no wake-ups.
        with contextlib.suppress(OSError):
            p.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, p.need)
        sel.register(p.sock, selectors.EVENT_READ, p)
        p.registered = True

    def _progress(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        """``p`` is readable: hand it to a handshake thread once its first message is
        complete (peeked, not consumed: the handshake reads it)."""
        try:
            data = p.sock.recv(p.need, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._forget_and_drop(sel, p, "connection error", str(exc))
            return
        if not data:
            self._forget_and_drop(sel, p, "closed by the client", "closed before authenticating")
            return
        if not self._plausible(data):
            self._forget_and_drop(sel, p, "not a sakura client", "bad first message")
            return
        if len(data) < p.need:  # a platform that ignores SO_RCVLOWAT: look again later
            sel.unregister(p.sock)
            p.registered = False
            p.parked_until = time.monotonic() + _PARK_S
            self._next_tick = min(self._next_tick, p.parked_until)
            return
        if self.context is not None and p.need == _TLS_HEADER:
            p.need = _TLS_HEADER + int.from_bytes(data[3:5], "big")  # the whole first record
            with contextlib.suppress(OSError):
                p.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, p.need)
            return
        sel.unregister(p.sock)
        p.registered = False
        with contextlib.suppress(OSError):
            p.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        with self._lock:
            if id(p) not in self._pending:  # evicted meanwhile
                return
            p.ready = True
            start = self._handshaking < self.max_handshakes
            if start:
                self._handshaking += 1
                self._forget(p)
            else:
                self._queue.append(p)
        if start:
            threading.Thread(
                target=self._handshakes, args=(p,), name="sakura-handshake", daemon=True
            ).start()

    def _plausible(self, data: bytes) -> bool:
        if self.context is None:
            return HELLO_MAGIC.startswith(data[: len(HELLO_MAGIC)])
        if data[0] != _TLS_HANDSHAKE_RECORD or (len(data) > 1 and data[1] != 3):
            return False
        return len(data) < _TLS_HEADER or 0 < int.from_bytes(data[3:5], "big") <= _MAX_TLS_RECORD

    def _forget_and_drop(
        self, sel: selectors.BaseSelector, p: _Pending, reason: str, detail: str
    ) -> None:
        with self._lock:
            self._forget(p)
        self._drop(sel, p, reason, detail)

    def _tick(self, sel: selectors.BaseSelector) -> None:
        """Close what passed its deadline; look again at parked connections."""
        now = time.monotonic()
        with self._lock:
            pending = list(self._pending.values())
        next_tick = math.inf
        for p in pending:
            if now >= p.deadline:
                with self._lock:
                    if id(p) not in self._pending:
                        continue
                    self._forget(p)
                self._drop(
                    sel, p, "timed out", f"no authentication within {self.handshake_timeout:g} s"
                )
                continue
            next_tick = min(next_tick, p.deadline)
            if not p.ready and not p.registered:
                if now >= p.parked_until:
                    self._watch(sel, p)
                else:
                    next_tick = min(next_tick, p.parked_until)
        self._next_tick = next_tick

    # --- handshakes and sessions ----------------------------------------------------------

    def _handshakes(self, first: _Pending) -> None:
        """Run handshakes on this thread until none is waiting."""
        p: _Pending | None = first
        while p is not None:
            self._handshake(p)
            with self._lock:
                if self._queue and not self._stopping.is_set():
                    p = self._queue.popleft()
                    p.ready = False  # no longer in the queue
                    self._forget(p)
                else:
                    p = None
                    self._handshaking -= 1

    def _handshake(self, p: _Pending) -> None:
        """TLS + token proof within what is left of ``p``'s deadline; then a session."""
        remaining = p.deadline - time.monotonic()
        conn = p.sock
        if remaining <= 0:
            self.reporter.note(
                "timed out", p.peer, f"no authentication within {self.handshake_timeout:g} s"
            )
            with contextlib.suppress(OSError):
                conn.close()
            return
        # Cut the connection when the deadline passes, wherever the handshake is (the TLS
        # handshake reads several records, each with its own socket timeout).
        guard = threading.Timer(remaining, _cut, args=(conn,))
        guard.daemon = True
        guard.start()
        try:
            conn.settimeout(remaining)
            if self.context is not None:
                conn = self.context.wrap_socket(conn, server_side=True)
            keys = server_handshake(conn, self.token, timeout=remaining)
        except (OSError, AuthenticationError, ssl.SSLError, ValueError) as exc:
            if time.monotonic() >= p.deadline:
                reason = "timed out"
            elif isinstance(exc, AuthenticationError):
                reason = "failed authentication"
            else:
                reason = "handshake error"
            self.reporter.note(reason, p.peer, str(exc))
            with contextlib.suppress(OSError):
                conn.close()
            return
        finally:
            guard.cancel()
        with self._lock:
            self.authenticated += 1
        threading.Thread(
            target=self._serve_client,
            # Over TLS the record layer authenticates every byte; over tcp:// each frame
            # carries a MAC under the session's keys.
            args=(conn, None if self.context is not None else keys, p.peer),
            name=f"sakura-client-{_peer_text(p.peer)}",
            daemon=True,
        ).start()

    def _serve_client(self, conn: socket.socket, keys: SessionKeys | None, peer: Any) -> None:
        import torch

        channel = Channel(conn, max_body=self.max_frame_bytes, timeout=None, keys=keys)
        info = {
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "heartbeat_s": HEARTBEAT_S,
        }
        decoder = Decoder()
        tasks: queue.Queue[tuple[int, bytearray] | None] = queue.Queue(_QUEUE)
        done = threading.Event()

        def read() -> None:
            try:
                while True:
                    kind, task_id, body, _ = channel.recv()
                    if kind == Kind.TASK:
                        tasks.put((task_id, body))
                    elif kind == Kind.SHUTDOWN:
                        break
            except ChannelClosedError as exc:
                logger.info("sakura-worker: client %s gone: %s", peer, exc)
            finally:
                tasks.put(None)

        def beat() -> None:
            while not done.wait(HEARTBEAT_S):
                try:
                    channel.send(Kind.HEARTBEAT, 0)
                except ChannelClosedError:
                    return

        try:
            channel.send(Kind.READY, 0, [json.dumps(info).encode()])
            threading.Thread(target=read, name=f"sakura-read-{peer}", daemon=True).start()
            threading.Thread(target=beat, name=f"sakura-beat-{peer}", daemon=True).start()
            while True:
                item = tasks.get()
                if item is None:
                    break
                task_id, body = item
                channel.send(Kind.RESULT, task_id, run_task(body, decoder))
        except ChannelClosedError:
            pass
        finally:
            done.set()
            channel.close()


def _cut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def serve_from_args(args: argparse.Namespace) -> int:
    """The ``--listen`` mode of ``sakura-worker``."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        host, port = parse_address(args.listen)
        token = (
            read_token(args.token_file, option="--token-file", owner="sakura-worker")
            if args.token_file
            else None
        )
        server = RemoteWorkerServer(
            host,
            port,
            token=token,
            certfile=args.cert,
            keyfile=args.key,
            insecure_loopback=args.insecure_loopback,
            threads=args.threads,
            handshake_timeout=args.handshake_timeout,
            max_handshakes=args.max_handshakes,
            max_unauthenticated=args.max_unauthenticated,
            max_unauthenticated_per_peer=args.max_unauthenticated_per_peer,
            max_frame_bytes=args.max_frame_bytes,
        )
    except (ValueError, PermissionError, OSError, ssl.SSLError) as exc:
        print(f"sakura-worker: {exc}", file=sys.stderr)
        return 2
    bound_host, bound_port = server.address
    scheme = "tls" if server.context is not None else "tcp"
    print(f"sakura-worker listening on {scheme}://{bound_host}:{bound_port}", flush=True)

    def stop(signum: int, frame: Any) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve_forever()
    return 0
