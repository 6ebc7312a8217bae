"""Mutual authentication of a RemoteDispatcher client and a ``sakura-worker --listen``.

Both sides prove that they hold the shared token before either decodes a single pickled
byte (a pickle runs code: the client would run the worker's results, the worker the
client's tasks).  After the TLS handshake, if any::

    client -> worker   HELLO | has-token flag | client nonce (32 random bytes)
    worker -> client   HELLO | has-token flag | worker nonce (32) |
                       HMAC-SHA256(token, "worker" | client nonce | worker nonce)
    client -> worker   HMAC-SHA256(token, "client" | worker nonce | client nonce)
    worker -> client   OK

Each side compares the other's proof in constant time against one it computes over its own
fresh nonce, so a recorded exchange cannot be replayed, and the two directions use
different labels, so one side's proof is never a valid answer for the other.  A client that
has a token refuses a worker that says none is needed (``--insecure-loopback``): such a
worker proves nothing.  The token never crosses the wire.

Every message before ``OK`` has a fixed size (at most 70 bytes): nothing a peer announces is
allocated before it has authenticated, and the whole exchange has one deadline (a peer that
sends a byte at a time is cut off when it passes).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
import time

from sakura_async.errors import AuthenticationError

__all__ = ["client_handshake", "is_loopback", "read_token", "server_handshake"]

_HELLO = b"SKWA2"
_NONCE = 32
_PROOF = 32
_OK = b"OK"
_CLIENT_LABEL = b"sakura-worker-auth-v2 client"
_WORKER_LABEL = b"sakura-worker-auth-v2 worker"


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


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AuthenticationError("the peer did not complete authentication in time")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError as exc:
            raise AuthenticationError("the peer did not complete authentication in time") from exc
        if not chunk:
            raise AuthenticationError("the peer closed the connection during authentication")
        data += chunk
    return bytes(data)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise AuthenticationError("the peer did not complete authentication in time")
    sock.settimeout(remaining)
    sock.sendall(data)


def _proof(token: bytes, label: bytes, mine: bytes, theirs: bytes) -> bytes:
    return hmac.new(token, label + mine + theirs, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, token: bytes | None, *, timeout: float) -> None:
    """The worker's side: prove the token to the client and make the client prove it.
    Raises AuthenticationError (then close the connection) unless both succeed within
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    hello = _recv_exact(sock, len(_HELLO) + 1 + _NONCE, deadline)
    if not hello.startswith(_HELLO):
        raise AuthenticationError("the client is not a sakura RemoteDispatcher (bad greeting)")
    client_nonce = hello[len(_HELLO) + 1 :]
    nonce = secrets.token_bytes(_NONCE)
    if token is None:
        _send(sock, _HELLO + b"N" + nonce + bytes(_PROOF), deadline)
        _recv_exact(sock, _PROOF, deadline)
    else:
        proof = _proof(token, _WORKER_LABEL, client_nonce, nonce)
        _send(sock, _HELLO + b"T" + nonce + proof, deadline)
        answer = _recv_exact(sock, _PROOF, deadline)
        if not hmac.compare_digest(answer, _proof(token, _CLIENT_LABEL, nonce, client_nonce)):
            raise AuthenticationError("a client failed to prove the shared token")
    _send(sock, _OK, deadline)


def client_handshake(sock: socket.socket, token: bytes | None, *, timeout: float) -> None:
    """The client's side: make the worker prove the token, then prove it.  Raises
    AuthenticationError unless both succeed within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    nonce = secrets.token_bytes(_NONCE)
    _send(sock, _HELLO + (b"T" if token is not None else b"N") + nonce, deadline)
    reply = _recv_exact(sock, len(_HELLO) + 1 + _NONCE + _PROOF, deadline)
    if not reply.startswith(_HELLO):
        raise AuthenticationError("the server is not a sakura-worker (unexpected greeting)")
    wants_token = reply[len(_HELLO) : len(_HELLO) + 1] == b"T"
    worker_nonce = reply[len(_HELLO) + 1 : len(_HELLO) + 1 + _NONCE]
    worker_proof = reply[len(_HELLO) + 1 + _NONCE :]
    if token is not None:
        if not wants_token:
            raise AuthenticationError(
                "the server says it needs no token, but this client has one: a worker that "
                "does not prove the token could be anyone; refusing it (start the worker "
                "with --token-file, or connect without a token to an --insecure-loopback one)"
            )
        expected = _proof(token, _WORKER_LABEL, nonce, worker_nonce)
        if not hmac.compare_digest(worker_proof, expected):
            raise AuthenticationError(
                "the server failed to prove the shared token: it is not the sakura-worker "
                "you meant (or its token differs); refusing to send or accept anything"
            )
        _send(sock, _proof(token, _CLIENT_LABEL, worker_nonce, nonce), deadline)
    else:
        _send(sock, secrets.token_bytes(_PROOF), deadline)
    try:
        ok = _recv_exact(sock, len(_OK), deadline)
    except (AuthenticationError, OSError) as exc:
        reason = "no token was given" if wants_token and token is None else "the token is wrong"
        raise AuthenticationError(f"the sakura-worker refused this client ({reason})") from exc
    if ok != _OK:
        raise AuthenticationError("the sakura-worker refused this client")
