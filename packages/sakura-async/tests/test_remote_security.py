"""The wire before and around authentication, attacked: a fake worker that does not know
the token, oversized frames, a slow handshake, a flood of unauthenticated connections.
Everything binds 127.0.0.1."""

from __future__ import annotations

import contextlib
import pickle
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from sakura_async.dispatch import RemoteDispatcher
from sakura_async.errors import AuthenticationError
from sakura_async.remote_server import RemoteWorkerServer
from sakura_async.wire.auth import client_handshake
from sakura_async.wire.channel import MAGIC, Channel, ChannelClosedError, FrameTooLargeError, Kind
from sakura_async.wire.serialize import pack_frame

TOKEN = b"the-shared-token-of-these-tests-0123456789"


class CreatesAMarkerWhenUnpickled:
    """A payload that would run code in whoever unpickles it: it creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


def evil_frames(marker: Path) -> bytes:
    """READY and a RESULT for task 1, each carrying the marker payload."""
    packed = zstandard.ZstdCompressor().compress(pickle.dumps(CreatesAMarkerWhenUnpickled(marker)))
    body = b"".join(bytes(c) for c in pack_frame(packed, []))
    header = struct.Struct("!4sBQQ")
    return b"".join(
        header.pack(MAGIC, kind, task_id, len(body)) + body
        for kind, task_id in ((Kind.READY, 0), (Kind.RESULT, 1), (Kind.RESULT, 2))
    )


@contextlib.contextmanager
def fake_worker(behave: Callable[[socket.socket], None]) -> Iterator[int]:
    """A server on 127.0.0.1 that runs ``behave`` on each connection; yields its port."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(60)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with contextlib.suppress(OSError), conn:
                behave(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        server.close()
        thread.join(timeout=30)


def read_hello(conn: socket.socket) -> bytes:
    data = b""
    while len(data) < 38:
        chunk = conn.recv(38 - len(data))
        if not chunk:
            break
        data += chunk
    return data


def add(a: int, b: int) -> int:
    return a + b


@pytest.mark.parametrize(
    ("greeting", "match"),
    [
        # Claims a token but cannot prove it: a proof of zeros (any guess).
        (lambda: b"SKWA2T" + bytes(32) + bytes(32), "the server failed to prove the shared token"),
        # Claims that no token is needed.
        (lambda: b"SKWA2N" + bytes(32) + bytes(32), "says it needs no token, but this client"),
        # Skips the handshake and sends frames at once.
        (lambda: b"", "not a sakura-worker|failed to prove"),
    ],
    ids=["wrong-proof", "no-token-claimed", "no-handshake"],
)
def test_a_fake_worker_without_the_token_never_gets_a_payload_unpickled(
    tmp_path: Path, greeting: Callable[[], bytes], match: str
) -> None:
    marker = tmp_path / "unpickled"

    def behave(conn: socket.socket) -> None:
        read_hello(conn)
        conn.sendall(greeting() + evil_frames(marker))
        time.sleep(0.5)

    with fake_worker(behave) as port:
        d = RemoteDispatcher(uri=f"tcp://127.0.0.1:{port}", token=TOKEN, connect_timeout=20)
        with pytest.raises(AuthenticationError, match=match):
            d.submit(add, 1, 2)
        with pytest.raises(AuthenticationError, match=match):
            d.start()
        d.close(wait=False)
    assert not marker.exists()


def test_a_proof_for_one_client_nonce_does_not_work_for_another() -> None:
    """Replay: a fake worker that recorded a genuine worker's reply to one client replays
    it to the next one (whose nonce differs) and is refused."""
    server = RemoteWorkerServer("127.0.0.1", 0, token=TOKEN, handshake_timeout=20)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        recorded: list[bytes] = []
        with socket.create_connection(server.address, timeout=20) as sock:
            sock.sendall(b"SKWA2T" + bytes(32))
            reply = b""
            while len(reply) < 70:
                reply += sock.recv(70 - len(reply))
            recorded.append(reply)

        def replay(conn: socket.socket) -> None:
            read_hello(conn)
            conn.sendall(recorded[0])
            time.sleep(0.5)

        with (
            fake_worker(replay) as port,
            socket.create_connection(("127.0.0.1", port)) as s,
            pytest.raises(AuthenticationError, match="failed to prove the shared token"),
        ):
            client_handshake(s, TOKEN, timeout=20)
    finally:
        server.stop()


# --- frames ----------------------------------------------------------------------------------


def test_an_oversized_header_is_rejected_before_anything_is_allocated() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!4sBQQ", MAGIC, Kind.RESULT, 1, 1 << 40))  # 1 TiB announced
        channel = Channel(b, max_body=64 << 20, timeout=30)
        tracemalloc.start()
        try:
            with pytest.raises(FrameTooLargeError, match="1099511627776-byte message"):
                channel.recv()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 1 << 20


def test_the_body_buffer_grows_with_the_bytes_that_arrive() -> None:
    """A header announcing 1 GiB (accepted) followed by 100 bytes and a hang-up costs at
    most one 16 MiB growth step, not the announced gigabyte."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!4sBQQ", MAGIC, Kind.RESULT, 1, 1 << 30) + b"x" * 100)
        a.shutdown(socket.SHUT_WR)
        channel = Channel(b, max_body=2 << 30, timeout=30)
        tracemalloc.start()
        try:
            with pytest.raises(ChannelClosedError, match="mid-message"):
                channel.recv()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 20 << 20


def test_a_frame_that_fits_round_trips() -> None:
    a, b = socket.socketpair()
    with a, b:
        payload = bytes(range(256)) * 200_000  # 51 MB: several growth steps
        sender = threading.Thread(target=Channel(a).send, args=(Kind.TASK, 9, [payload]))
        sender.start()
        kind, task_id, body, _ = Channel(b, timeout=30).recv()
        sender.join(timeout=60)
    assert (kind, task_id) == (Kind.TASK, 9) and body == payload


@pytest.fixture
def worker(request: pytest.FixtureRequest) -> Iterator[RemoteWorkerServer]:
    server = RemoteWorkerServer(
        "127.0.0.1",
        0,
        token=TOKEN,
        handshake_timeout=getattr(request, "param", 2.0),
        max_handshakes=2,
        max_frame_bytes=1 << 20,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(timeout=30)


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the peer closes ``sock`` within ``within`` seconds (a hang detector)."""
    sock.settimeout(within)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_an_authenticated_client_sending_an_oversized_frame_is_dropped(
    worker: RemoteWorkerServer,
) -> None:
    with socket.create_connection(worker.address, timeout=30) as sock:
        client_handshake(sock, TOKEN, timeout=30)
        sock.sendall(struct.pack("!4sBQQ", MAGIC, Kind.TASK, 1, (1 << 20) + 1))
        assert closed_by_peer(sock, within=60)
    # The worker still serves a well-behaved client.
    with RemoteDispatcher(uri=f"tcp://127.0.0.1:{worker.address[1]}", token=TOKEN) as d:
        assert d.submit(add, 2, 3).result(timeout=120) == 5


def test_a_slow_handshake_is_cut_at_the_deadline(worker: RemoteWorkerServer) -> None:
    """One byte of a valid greeting every 0.25 s: each read is quick, the whole is not."""
    with socket.create_connection(worker.address, timeout=30) as sock:
        cut = False
        for byte in b"SKWA2T" + bytes(32):
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(0.25)  # 38 bytes: about 9.5 s against a 2 s handshake deadline
        assert cut or closed_by_peer(sock, within=60)
        if not cut:
            # The greeting was complete: the worker must not have answered it in time.
            sock.settimeout(0)
            with contextlib.suppress(BlockingIOError, ConnectionResetError):
                assert sock.recv(1) == b""


@pytest.mark.parametrize("worker", [600.0], indirect=True)  # no deadline within the test
def test_more_than_max_handshakes_unauthenticated_connections_are_refused(
    worker: RemoteWorkerServer,
) -> None:
    idle = [socket.create_connection(worker.address, timeout=30) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while worker._handshakes._value > 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.02)  # until the worker has accepted both (they hold both slots)
        with socket.create_connection(worker.address, timeout=30) as third:
            assert closed_by_peer(third, within=60)  # refused on accept
        assert worker.refused == 1
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    with RemoteDispatcher(uri=f"tcp://127.0.0.1:{worker.address[1]}", token=TOKEN) as d:
        assert d.submit(add, 20, 22).result(timeout=120) == 42
