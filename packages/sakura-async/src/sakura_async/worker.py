"""``sakura-worker``: the process that runs dispatched tasks.

Two ways to run it:

* Spawned by :class:`~sakura_async.dispatch.LocalDispatcher` (``--fd``, internal): it
  talks to its parent over an inherited Unix socket and maps the shared-memory segments
  the parent sends.  It dies with its parent: ``PR_SET_PDEATHSIG`` on Linux, a thread that
  exits when its stdin (a pipe from the parent) reaches end-of-file, and a check of the
  parent pid.  It runs in a session of its own (a terminal's Ctrl+C reaches only the
  parent) and ignores SIGINT anyway: on Ctrl+C the parent drains it and then stops it.
* ``sakura-worker --listen HOST:PORT`` for :class:`~sakura_async.dispatch.RemoteDispatcher`:
  see :mod:`sakura_async.remote_server`.  It refuses to listen beyond loopback without TLS
  and a token.

A worker runs tasks one at a time, in the order they arrive.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["main", "serve_local"]

PR_SET_PDEATHSIG = 1


def _set_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when the thread that spawned it exits."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    """Exit as soon as the parent is gone: stdin EOF (the parent's pipe end closed) or a
    changed parent pid, whichever is noticed first."""

    def stdin_eof() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os._exit(0)

    def poll_ppid() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(0)
            time.sleep(0.5)

    threading.Thread(target=stdin_eof, name="sakura-parent-stdin", daemon=True).start()
    threading.Thread(target=poll_ppid, name="sakura-parent-pid", daemon=True).start()


def serve_local(
    fd: int,
    parent: int,
    *,
    pdeathsig: bool,
    threads: int | None,
    heartbeat: float | None = None,
    max_frame_bytes: int | None = None,
) -> None:
    """Serve the parent: a reader thread takes its messages in order (so the parent's
    sends never wait for a running task), a heartbeat thread says "alive" every
    ``heartbeat`` seconds (from before torch is imported), the main thread runs tasks."""
    if pdeathsig:
        _set_parent_death_signal()
    if os.getppid() != parent:  # the parent died before we could arm the signal
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(parent)

    import mmap
    import queue

    from sakura_async.wire.channel import DEFAULT_MAX_FRAME_BYTES, Channel, ChannelClosedError, Kind

    channel = Channel(
        socket.socket(fileno=fd), fds=True, max_body=max_frame_bytes or DEFAULT_MAX_FRAME_BYTES
    )
    if heartbeat is not None:

        def beat() -> None:
            while True:
                time.sleep(heartbeat)
                try:
                    channel.send(Kind.HEARTBEAT, 0)
                except ChannelClosedError:
                    os._exit(0)

        threading.Thread(target=beat, name="sakura-heartbeat", daemon=True).start()

    import torch

    from sakura_async.wire.serialize import Decoder
    from sakura_async.wire.tasks import run_task

    if threads is not None:
        torch.set_num_threads(threads)
    segments: dict[int, Any] = {}
    decoder = Decoder(segments)
    inbox: queue.SimpleQueue[tuple[int, int, bytearray, list[int]] | None] = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                inbox.put(channel.recv())
        except ChannelClosedError:
            inbox.put(None)

    info = {"pid": os.getpid(), "python": sys.version.split()[0], "torch": torch.__version__}
    channel.send(Kind.READY, 0, [json.dumps(info).encode()])
    threading.Thread(target=read, name="sakura-reader", daemon=True).start()
    while True:
        message = inbox.get()
        if message is None:
            os._exit(0)  # the parent went away
        kind, task_id, body, fds = message
        if kind == Kind.SEGMENTS:
            described = json.loads(body)
            for (seg_id, size), seg_fd in zip(described, fds, strict=True):
                segments[seg_id] = mmap.mmap(seg_fd, size)
                os.close(seg_fd)
        elif kind == Kind.RELEASE:
            for seg_id in json.loads(body):
                segments.pop(seg_id, None)  # unmapped once no tensor views it
        elif kind == Kind.TASK:
            channel.send(Kind.RESULT, task_id, run_task(body, decoder))
        elif kind == Kind.SHUTDOWN:
            channel.close()
            return


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sakura-worker",
        description="Run tasks dispatched by sakura-async (AsyncEval, AsyncCheckpoint).",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="serve RemoteDispatcher clients on this address (port 0 picks a free port)",
    )
    parser.add_argument("--token-file", help="file holding the shared secret clients must prove")
    parser.add_argument("--cert", help="TLS certificate (PEM) presented to clients")
    parser.add_argument("--key", help="TLS private key (PEM) of --cert")
    parser.add_argument(
        "--insecure-loopback",
        action="store_true",
        help="on a loopback address only: serve without TLS and without a token",
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads in the worker")
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=15.0,
        help="seconds a client has from connecting to the end of the token proof (15)",
    )
    parser.add_argument(
        "--max-handshakes",
        type=int,
        default=16,
        help="handshakes run at once, each for a connection whose first message has "
        "arrived; others wait for one (16)",
    )
    parser.add_argument(
        "--max-unauthenticated",
        type=int,
        default=128,
        help="connections that may be unauthenticated at once; a new one over the cap "
        "closes the oldest that has not sent its first message (128)",
    )
    parser.add_argument(
        "--max-unauthenticated-per-peer",
        type=int,
        default=32,
        help="the same cap for the connections from one address (32)",
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=int,
        default=4 << 30,
        help="the largest message accepted from an authenticated client (4 GiB)",
    )
    parser.add_argument("--heartbeat", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pdeathsig", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.threads is not None and args.threads < 1:
        print("sakura-worker: --threads must be >= 1", file=sys.stderr)
        return 2
    if args.fd is not None:
        if args.parent is None:
            print("sakura-worker: --fd needs --parent", file=sys.stderr)
            return 2
        serve_local(
            args.fd,
            args.parent,
            pdeathsig=args.pdeathsig,
            threads=args.threads,
            heartbeat=args.heartbeat,
            max_frame_bytes=args.max_frame_bytes,
        )
        return 0
    if args.listen is None:
        print(
            "sakura-worker: nothing to do; use --listen HOST:PORT to serve RemoteDispatcher "
            "clients (LocalDispatcher starts its own workers)",
            file=sys.stderr,
        )
        return 2
    from sakura_async.remote_server import serve_from_args

    return serve_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
