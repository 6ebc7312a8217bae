"""``sakura-worker --listen HOST:PORT``: serve RemoteDispatcher clients.

Security rules, checked before anything binds:

* Beyond loopback, the worker needs both TLS (``--cert``/``--key``) and a shared token
  (``--token-file``); it refuses to start otherwise.
* On loopback, a token is still required unless ``--insecure-loopback`` is given.

Each client connection gets a thread: TLS handshake, token challenge
(:mod:`sakura_async.wire.auth`), then tasks run one after another and their results go
back.  Tensors travel as raw out-of-band buffers after the compressed pickle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import sys
import threading
from typing import Any

from sakura_async.errors import AuthenticationError
from sakura_async.wire.auth import is_loopback, read_token, server_handshake
from sakura_async.wire.channel import Channel, ChannelClosed, Kind
from sakura_async.wire.serialize import Decoder
from sakura_async.wire.tasks import run_task

__all__ = ["RemoteWorkerServer", "parse_address", "serve_from_args"]

logger = logging.getLogger("sakura.async.worker")

HANDSHAKE_TIMEOUT = 15.0


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:4433), got {text!r}")
    return host.strip("[]"), int(port)


class RemoteWorkerServer:
    """A listening worker.  ``serve_forever`` accepts clients until :meth:`stop`."""

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
    ) -> None:
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

    def serve_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            threading.Thread(
                target=self._serve_client,
                args=(conn, peer),
                name=f"sakura-client-{peer}",
                daemon=True,
            ).start()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self.sock.close()

    def _serve_client(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            if self.context is not None:
                conn = self.context.wrap_socket(conn, server_side=True)
            server_handshake(conn, self.token)
            conn.settimeout(None)
        except (OSError, AuthenticationError, ssl.SSLError) as exc:
            logger.warning("sakura-worker: rejected client %s: %s", peer, exc)
            with contextlib.suppress(OSError):
                conn.close()
            return
        import torch

        channel = Channel(conn)
        info = {"pid": os.getpid(), "python": sys.version.split()[0], "torch": torch.__version__}
        decoder = Decoder()
        try:
            channel.send(Kind.READY, 0, [json.dumps(info).encode()])
            while True:
                kind, task_id, body, _ = channel.recv()
                if kind == Kind.TASK:
                    channel.send(Kind.RESULT, task_id, run_task(body, decoder))
                elif kind == Kind.SHUTDOWN:
                    break
        except ChannelClosed:
            pass
        finally:
            channel.close()


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
