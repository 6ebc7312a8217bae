"""``sakura-worker --listen HOST:PORT``: serve RemoteDispatcher clients.

Security rules, checked before anything binds:

* Beyond loopback, the worker needs both TLS (``--cert``/``--key``) and a shared token
  (``--token-file``); it refuses to start otherwise.
* On loopback, a token is still required unless ``--insecure-loopback`` is given.

Each client connection gets a thread: TLS handshake and mutual token proof
(:mod:`sakura_async.wire.auth`) within one deadline (``--handshake-timeout``), then tasks
run one after another and their results go back.  At most ``--max-handshakes`` connections
may be unauthenticated at once: more are closed on accept, so a flood of idle connections
cannot exhaust threads or memory.  After authentication a reader thread takes the client's
messages (bodies of at most ``--max-frame-bytes``) while a heartbeat tells the client the
worker is alive, also while a long task runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import signal
import socket
import ssl
import sys
import threading
from typing import Any

from sakura_async.errors import AuthenticationError
from sakura_async.wire.auth import is_loopback, read_token, server_handshake
from sakura_async.wire.channel import DEFAULT_MAX_FRAME_BYTES, Channel, ChannelClosedError, Kind
from sakura_async.wire.serialize import Decoder
from sakura_async.wire.tasks import run_task

__all__ = ["RemoteWorkerServer", "parse_address", "serve_from_args"]

logger = logging.getLogger("sakura.async.worker")

HANDSHAKE_TIMEOUT = 15.0
MAX_HANDSHAKES = 16
HEARTBEAT_S = 1.0
_QUEUE = 64


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:4433), got {text!r}")
    return host.strip("[]"), int(port)


class RemoteWorkerServer:
    """A listening worker.  ``serve_forever`` accepts clients until :meth:`stop`.

    Args:
        handshake_timeout: seconds for the whole TLS handshake and token proof.
        max_handshakes: connections allowed to be unauthenticated at once.
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
        self.max_frame_bytes: int = check_int(
            "max_frame_bytes", max_frame_bytes, minimum=1024, owner=owner
        )
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
        self.token = token
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
        self._handshakes = threading.BoundedSemaphore(self.max_handshakes)
        self.refused = 0
        """Connections closed on accept because ``max_handshakes`` were in progress."""

    def serve_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            if not self._handshakes.acquire(blocking=False):
                self.refused += 1
                logger.warning(
                    "sakura-worker: refused %s: %d connections are already authenticating",
                    peer,
                    self.max_handshakes,
                )
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            threading.Thread(
                target=self._serve_client,
                args=(conn, peer),
                name=f"sakura-client-{peer}",
                daemon=True,
            ).start()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept()
        with contextlib.suppress(OSError):
            self.sock.close()

    def _authenticate(self, conn: socket.socket, peer: Any) -> socket.socket | None:
        """TLS + token proof under one deadline; the authenticated socket, or None."""
        # Cut the connection when the deadline passes, wherever the handshake is (the TLS
        # handshake reads several records, each with its own socket timeout).
        guard = threading.Timer(self.handshake_timeout, _cut, args=(conn,))
        guard.daemon = True
        guard.start()
        try:
            conn.settimeout(self.handshake_timeout)
            if self.context is not None:
                conn = self.context.wrap_socket(conn, server_side=True)
            server_handshake(conn, self.token, timeout=self.handshake_timeout)
        except (OSError, AuthenticationError, ssl.SSLError, ValueError) as exc:
            logger.warning("sakura-worker: rejected client %s: %s", peer, exc)
            with contextlib.suppress(OSError):
                conn.close()
            return None
        finally:
            guard.cancel()
            self._handshakes.release()
        return conn

    def _serve_client(self, conn: socket.socket, peer: Any) -> None:
        authenticated = self._authenticate(conn, peer)
        if authenticated is None:
            return
        import torch

        channel = Channel(authenticated, max_body=self.max_frame_bytes, timeout=None)
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
        token = read_token(args.token_file) if args.token_file else None
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
