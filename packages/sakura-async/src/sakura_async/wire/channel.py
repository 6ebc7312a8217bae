"""Length-prefixed messages over a stream socket, optionally carrying file descriptors.

Header: ``magic (4s) | kind (B) | task id (Q) | body length (Q)``, then the body, then,
on a channel with session keys (``tcp://`` with a token), a 32-byte tag:
HMAC-SHA256 under the sender's direction key of ``sequence number (Q) | header | body``.
Each direction counts its frames from 0 and the counter is never sent, so a frame that a
relay forged, replayed, reordered or reflected back to its sender fails the check: the
receiver raises :class:`FrameAuthenticationError` (the connection is then closed) and
returns nothing of it, so nothing of it is ever unpickled.  A local worker's channel needs
no tag: it is an unnamed Unix socket pair that only the two processes hold.  File descriptors
(shared-memory segments for a local worker) ride on the header's ``sendmsg`` as
``SCM_RIGHTS`` ancillary data, so they only ever cross a Unix socket.  Bodies are received
into a ``bytearray`` so tensors rebuilt from them are writable without a copy.

A body longer than the channel's ``max_body`` is refused from its header, before anything
is allocated, and the body buffer grows as bytes arrive (never from the announced length
alone): a peer cannot make the receiver reserve memory it has not sent.  Channels exist
only after authentication (:mod:`sakura_async.wire.auth` reads fixed-size messages before
that).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

from sakura_async.wire.auth import SessionKeys

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "Channel",
    "ChannelClosed",
    "ChannelClosedError",
    "ChannelTimeoutError",
    "FrameAuthenticationError",
    "FrameTooLargeError",
    "Kind",
]

MAGIC = b"SKW1"
_HEADER = struct.Struct("!4sBQQ")
_SEQ = struct.Struct("!Q")
TAG_BYTES = 32
MAX_FDS = 32
DEFAULT_MAX_FRAME_BYTES = 4 << 30
"""4 GiB: the largest message a channel accepts unless told otherwise (``max_frame_bytes``
of the dispatchers and ``sakura-worker --max-frame-bytes``)."""
_GROW = 1 << 24
_ZEROS = bytes(_GROW)  # calloc'd: costs no memory until read, and reading it is cheap


class Kind:
    READY = 1
    TASK = 2
    RESULT = 3
    SEGMENTS = 4
    RELEASE = 5
    SHUTDOWN = 6
    HEARTBEAT = 7


class ChannelClosedError(ConnectionError):
    """The peer closed the connection (or it broke)."""


ChannelClosed = ChannelClosedError  # the name of sakura-async 0.1 (internal)


class ChannelTimeoutError(ChannelClosedError):
    """Nothing arrived from the peer within the channel's timeout (not even a heartbeat)."""


class FrameTooLargeError(ChannelClosedError):
    """A message header announced a body over the channel's ``max_body``."""


class FrameAuthenticationError(ChannelClosedError):
    """A message failed its session MAC: it was forged, replayed, reordered or reflected
    by something between the two ends.  Nothing of it was decoded."""


class Channel:
    """One end of a worker connection.  ``send`` is thread-safe; one thread receives.

    Args:
        sock: a connected, authenticated stream socket.
        fds: whether messages may carry file descriptors (a Unix socket).
        max_body: the largest body accepted, in bytes.
        timeout: seconds a ``recv`` or ``send`` may wait for the peer before the channel
            counts it as gone (None: no bound; use with heartbeats from the peer).
        keys: the session's frame keys from the handshake: every message is sent with a
            tag and every message received must carry a valid one (None: no tags, for a
            transport that authenticates its bytes itself, TLS or a socket pair).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        fds: bool = False,
        max_body: int = DEFAULT_MAX_FRAME_BYTES,
        timeout: float | None = None,
        keys: SessionKeys | None = None,
    ) -> None:
        self.sock = sock
        self.fds = fds
        self.max_body = max_body
        self._keys = keys
        self._sent = 0
        self._received = 0
        self._send_lock = threading.Lock()
        sock.settimeout(timeout)

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
            mac = None
            if self._keys is not None:
                mac = hmac.new(self._keys.send, _SEQ.pack(self._sent) + header, hashlib.sha256)
                self._sent += 1
            try:
                if fds:
                    socket.send_fds(self.sock, [header], list(fds))
                else:
                    self.sock.sendall(header)
                for chunk in chunks:
                    if memoryview(chunk).nbytes:
                        if mac is not None:
                            mac.update(chunk)
                        self.sock.sendall(chunk)
                if mac is not None:
                    self.sock.sendall(mac.digest())
            except TimeoutError as exc:
                raise ChannelTimeoutError(
                    f"the peer did not take a message within {self.sock.gettimeout()} s"
                ) from exc
            except OSError as exc:
                raise ChannelClosedError(f"connection lost while sending: {exc}") from exc

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
                    raise ChannelClosedError("connection closed by the peer")
            while len(header) < _HEADER.size:
                chunk = self.sock.recv(_HEADER.size - len(header))
                if not chunk:
                    raise ChannelClosedError("connection closed by the peer")
                header += chunk
            magic, kind, task_id, size = _HEADER.unpack(header)
            if magic != MAGIC:
                raise ChannelClosedError("protocol error: bad message header")
            if size > self.max_body:
                raise FrameTooLargeError(
                    f"the peer announced a {size}-byte message; this side accepts at most "
                    f"max_frame_bytes={self.max_body}"
                )
            body = self._recv_body(size)
            if self._keys is not None:
                self._check_tag(self._keys.recv, bytes(header), body)
        except TimeoutError as exc:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise ChannelTimeoutError(
                f"nothing arrived from the peer within {self.sock.gettimeout()} s"
            ) from exc
        except OSError as exc:
            if isinstance(exc, ChannelClosedError):
                raise
            raise ChannelClosedError(f"connection lost: {exc}") from exc
        return kind, task_id, body, fds

    def _check_tag(self, key: bytes, header: bytes, body: bytearray) -> None:
        tag = self._recv_body(TAG_BYTES)
        mac = hmac.new(key, _SEQ.pack(self._received) + header, hashlib.sha256)
        mac.update(body)
        if not hmac.compare_digest(mac.digest(), bytes(tag)):
            raise FrameAuthenticationError(
                f"message #{self._received} from the peer failed authentication (forged, "
                f"replayed or reordered by something between the two ends); the connection "
                f"is closed and nothing of the message was decoded"
            )
        self._received += 1

    def _recv_body(self, size: int) -> bytearray:
        """Receive ``size`` bytes, growing the buffer by at most 16 MiB ahead of the data."""
        body = bytearray()
        got = 0
        while got < size:
            step = min(size - got, _GROW)
            body += memoryview(_ZEROS)[:step]
            view = memoryview(body)
            try:
                end = got + step
                while got < end:
                    n = self.sock.recv_into(view[got:end], end - got)
                    if not n:
                        raise ChannelClosedError("connection closed by the peer mid-message")
                    got += n
            finally:
                view.release()
        return body

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
