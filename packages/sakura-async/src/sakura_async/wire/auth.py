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

The proof alone says nothing about the bytes that follow it: a relay that forwarded the
exchange between a real client and a real worker could then inject frames of its own.  So
the handshake also derives the session's frame keys (:class:`SessionKeys`): HKDF-SHA256 of
the token with both nonces as salt, one key per direction.  Over ``tcp://`` every frame
after ``OK`` carries an HMAC under its sender's key over a per-direction sequence number,
its header and its body (:mod:`sakura_async.wire.channel`): a frame that was forged,
replayed, reordered or reflected back fails the check and closes the connection before
anything of it is decoded.  Over ``tls://`` the TLS record layer already authenticates
every byte to the pinned certificate, and the keys are not used.

A token has at least :data:`MIN_TOKEN_BYTES` bytes wherever it is given
(:func:`check_token`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
import time
from dataclasses import dataclass

from sakura.options import OptionError
from sakura_async.errors import AuthenticationError

__all__ = [
    "HELLO_MAGIC",
    "HELLO_SIZE",
    "MIN_TOKEN_BYTES",
    "SessionKeys",
    "check_token",
    "client_handshake",
    "is_loopback",
    "read_token",
    "server_handshake",
]

MIN_TOKEN_BYTES = 16
"""The shortest token accepted, in every entry point (``token``, ``token_file``,
``--token-file``)."""

_HELLO = b"SKWA3"  # v3: frames after the handshake carry a MAC over tcp://
_NONCE = 32
_PROOF = 32
_OK = b"OK"
_CLIENT_LABEL = b"sakura-worker-auth-v2 client"
_WORKER_LABEL = b"sakura-worker-auth-v2 worker"
_KEYS_INFO = b"sakura-worker-frames-v1 "
HELLO_MAGIC = _HELLO
"""How a client's first message starts."""
HELLO_SIZE = len(_HELLO) + 1 + _NONCE
"""The size of a client's first message (what a worker waits for before it spends a
handshake on the connection)."""


@dataclass(frozen=True, repr=False)
class SessionKeys:
    """The frame keys of one authenticated connection, as seen from one end."""

    send: bytes
    recv: bytes


def _session_keys(
    token: bytes, client_nonce: bytes, worker_nonce: bytes, *, client: bool
) -> SessionKeys:
    # HKDF-SHA256 (RFC 5869): extract with both nonces as salt, expand once per direction.
    prk = hmac.new(client_nonce + worker_nonce, token, hashlib.sha256).digest()
    to_worker = hmac.new(prk, _KEYS_INFO + b"client->worker\x01", hashlib.sha256).digest()
    to_client = hmac.new(prk, _KEYS_INFO + b"worker->client\x01", hashlib.sha256).digest()
    if client:
        return SessionKeys(send=to_worker, recv=to_client)
    return SessionKeys(send=to_client, recv=to_worker)


def check_token(
    token: str | bytes | bytearray, *, option: str = "token", owner: str | None = None
) -> bytes:
    """``token`` as bytes if it has at least :data:`MIN_TOKEN_BYTES` bytes; OptionError
    naming ``option`` otherwise (the message gives the length, never the secret)."""
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, (bytes, bytearray)):
        raise TypeError(
            f"{owner + ': ' if owner else ''}{option} must be str or bytes, got "
            f"{type(token).__name__}"
        )
    token = bytes(token)
    if len(token) < MIN_TOKEN_BYTES:
        accepted = f"a secret of at least {MIN_TOKEN_BYTES} bytes (e.g. secrets.token_hex(16))"
        raise OptionError(
            f"{owner + ': ' if owner else ''}{option} is too short ({len(token)} bytes); "
            f"accepted: {accepted}",
            option=option,
            value=f"<{len(token)} bytes>",
            accepted=accepted,
        )
    return token


def read_token(path: str, *, option: str = "token_file", owner: str | None = None) -> bytes:
    """The shared secret stored in ``path`` (surrounding whitespace removed), checked by
    :func:`check_token`."""
    with open(path, "rb") as f:
        token = f.read().strip()
    return check_token(token, option=f"{option}={path!r}", owner=owner)


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


def server_handshake(
    sock: socket.socket, token: bytes | None, *, timeout: float
) -> SessionKeys | None:
    """The worker's side: prove the token to the client and make the client prove it.
    Raises AuthenticationError (then close the connection) unless both succeed within
    ``timeout`` seconds.  Returns the session's frame keys (None without a token)."""
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
    if token is None:
        return None
    return _session_keys(token, client_nonce, nonce, client=False)


def client_handshake(
    sock: socket.socket, token: bytes | None, *, timeout: float
) -> SessionKeys | None:
    """The client's side: make the worker prove the token, then prove it.  Raises
    AuthenticationError unless both succeed within ``timeout`` seconds.  Returns the
    session's frame keys (None without a token)."""
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
    if token is None:
        return None
    return _session_keys(token, nonce, worker_nonce, client=True)
