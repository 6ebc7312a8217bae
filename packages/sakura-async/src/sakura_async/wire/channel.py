"""Length-prefixed messages over a stream socket, optionally carrying file descriptors.

Header: ``magic (4s) | kind (B) | task id (Q) | body length (Q)``.  File descriptors
(shared-memory segments for a local worker) ride on the header's ``sendmsg`` as
``SCM_RIGHTS`` ancillary data, so they only ever cross a Unix socket.  Bodies are received
into a ``bytearray`` so tensors rebuilt from them are writable without a copy.
"""

from __future__ import annotations

import array
import contextlib
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["Channel", "ChannelClosed", "Kind"]

MAGIC = b"SKW1"
_HEADER = struct.Struct("!4sBQQ")
MAX_FDS = 32
MAX_BODY = 1 << 40


class Kind:
    READY = 1
    TASK = 2
    RESULT = 3
    SEGMENTS = 4
    RELEASE = 5
    SHUTDOWN = 6


class ChannelClosed(ConnectionError):
    """The peer closed the connection (or it broke)."""


class Channel:
    """One end of a worker connection.  ``send`` is thread-safe; one thread receives."""

    def __init__(self, sock: socket.socket, *, fds: bool = False) -> None:
        self.sock = sock
        self.fds = fds
        self._send_lock = threading.Lock()

    def send(
        self, kind: int, task_id: int, chunks: Sequence[Any] = (), fds: Sequence[int] = ()
    ) -> None:
        size = sum(memoryview(c).nbytes for c in chunks)
        header = _HEADER.pack(MAGIC, kind, task_id, size)
        if fds and not self.fds:
            raise ValueError("this channel cannot carry file descriptors")
        if len(fds) > MAX_FDS:
            raise ValueError(f"at most {MAX_FDS} file descriptors per message")
        with self._send_lock:
            try:
                if fds:
                    socket.send_fds(self.sock, [header], list(fds))
                else:
                    self.sock.sendall(header)
                for chunk in chunks:
                    if memoryview(chunk).nbytes:
                        self.sock.sendall(chunk)
            except OSError as exc:
                raise ChannelClosed(f"connection lost while sending: {exc}") from exc

    def recv(self) -> tuple[int, int, bytearray, list[int]]:
        """Block for the next message: ``(kind, task_id, body, fds)``."""
        header = bytearray()
        fds: list[int] = []
        try:
            if self.fds:
                data, ancdata, _flags, _addr = self.sock.recvmsg(
                    _HEADER.size, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
                )
                header += data
                for level, type_, cdata in ancdata:
                    if level == socket.SOL_SOCKET and type_ == socket.SCM_RIGHTS:
                        arr = array.array("i")
                        arr.frombytes(cdata[: len(cdata) - (len(cdata) % arr.itemsize)])
                        fds.extend(arr)
                if not data:
                    raise ChannelClosed("connection closed by the peer")
            while len(header) < _HEADER.size:
                chunk = self.sock.recv(_HEADER.size - len(header))
                if not chunk:
                    raise ChannelClosed("connection closed by the peer")
                header += chunk
            magic, kind, task_id, size = _HEADER.unpack(header)
            if magic != MAGIC or size > MAX_BODY:
                raise ChannelClosed("protocol error: bad message header")
            body = bytearray(size)
            view = memoryview(body)
            got = 0
            while got < size:
                n = self.sock.recv_into(view[got:], min(size - got, 1 << 24))
                if not n:
                    raise ChannelClosed("connection closed by the peer mid-message")
                got += n
        except OSError as exc:
            if isinstance(exc, ChannelClosed):
                raise
            raise ChannelClosed(f"connection lost: {exc}") from exc
        return kind, task_id, body, fds

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
