"""Authentication of a RemoteDispatcher client to a ``sakura-worker --listen``.

After the TLS handshake (the client pins the worker's certificate, which authenticates the
worker), the worker sends a random 32-byte challenge; the client answers with
``HMAC-SHA256(token, context || challenge)``; the worker compares in constant time and
answers ``OK`` or closes the connection.  The token never crosses the wire.  A worker
accepts tasks (arbitrary code) only from an authenticated client.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket

from sakura_async.errors import AuthenticationError

__all__ = ["client_handshake", "is_loopback", "read_token", "server_handshake"]

_HELLO = b"SKWA1"
_CONTEXT = b"sakura-worker-auth-v1"
_OK = b"OK"
_NO_TOKEN = b"--"


def read_token(path: str) -> bytes:
    """The shared secret stored in ``path`` (surrounding whitespace removed)."""
    with open(path, "rb") as f:
        token = f.read().strip()
    if len(token) < 16:
        raise ValueError(
            f"the token in {path} is too short: use at least 16 random bytes/characters"
        )
    return token


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    if host in ("", "0.0.0.0", "::"):  # noqa: S104 - the point is to detect them
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses
    )


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AuthenticationError("the peer closed the connection during authentication")
        data += chunk
    return bytes(data)


def _answer(token: bytes, challenge: bytes) -> bytes:
    return hmac.new(token, _CONTEXT + challenge, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, token: bytes | None) -> None:
    """Challenge the client; raise AuthenticationError unless it proves the token."""
    challenge = secrets.token_bytes(32) if token is not None else b"\0" * 32
    sock.sendall(_HELLO + (b"T" if token is not None else b"N") + challenge)
    answer = _recv_exact(sock, 32)
    if token is not None and not hmac.compare_digest(answer, _answer(token, challenge)):
        raise AuthenticationError("a client failed to prove the shared token")
    sock.sendall(_OK)


def client_handshake(sock: socket.socket, token: bytes | None) -> None:
    """Answer the worker's challenge; raise AuthenticationError if it is refused."""
    hello = _recv_exact(sock, len(_HELLO) + 1 + 32)
    if not hello.startswith(_HELLO):
        raise AuthenticationError("the server is not a sakura-worker (unexpected greeting)")
    wants_token = hello[len(_HELLO) : len(_HELLO) + 1] == b"T"
    challenge = hello[len(_HELLO) + 1 :]
    if wants_token and token is None:
        sock.sendall(os.urandom(32))
    else:
        sock.sendall(_answer(token, challenge) if token is not None else b"\0" * 32)
    try:
        reply = _recv_exact(sock, 2)
    except (AuthenticationError, OSError) as exc:
        reason = "no token was given" if wants_token and token is None else "the token is wrong"
        raise AuthenticationError(f"the sakura-worker refused this client ({reason})") from exc
    if reply != _OK:
        raise AuthenticationError("the sakura-worker refused this client")
