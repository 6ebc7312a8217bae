"""RemoteDispatcher and ``sakura-worker --listen``: TLS with a pinned certificate and a
token, on 127.0.0.1 only."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

cryptography = pytest.importorskip(
    "cryptography", reason="the tests generate a self-signed certificate with cryptography"
)

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from sakura import OnValidationEnd, SakuraRuntime  # noqa: E402
from sakura.testing import RecordingService  # noqa: E402
from sakura_async import AsyncEval  # noqa: E402
from sakura_async.dispatch import RemoteDispatcher  # noqa: E402
from sakura_async.errors import AuthenticationError  # noqa: E402
from sakura_async.worker import main as worker_main  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOKEN = "s3cret-token-for-the-tests-0123456789"


def self_signed(directory: Path, name: str) -> tuple[Path, Path, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path, cert.public_bytes(serialization.Encoding.DER)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key, der = self_signed(directory, "worker")
    _, _, other_der = self_signed(directory, "impostor")
    token_file = directory / "token"
    token_file.write_text(TOKEN)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sakura_async.worker",
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            str(token_file),
            "--cert",
            str(cert),
            "--key",
            str(key),
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert line.startswith("sakura-worker listening on tls://127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        yield {
            "uri": f"tls://127.0.0.1:{port}",
            "der": der,
            "other_der": other_der,
            "proc": proc,
            "cafile": str(cert),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def remote_sum(x: torch.Tensor, scale: float) -> dict[str, Any]:
    return {"pid": os.getpid(), "sum": float(x.sum()) * scale, "back": x[:3].clone()}


def test_runs_tasks_over_tls_with_tensors(server: dict[str, Any]) -> None:
    with RemoteDispatcher(uri=server["uri"], token=TOKEN, cert_der=server["der"]) as d:
        x = torch.arange(1000, dtype=torch.float32)
        result = d.submit(remote_sum, x, 2.0).result(60)
        assert result["pid"] == server["proc"].pid
        assert result["sum"] == float(x.sum()) * 2
        assert torch.equal(result["back"], x[:3])
        assert d.worker_info["pid"] == server["proc"].pid


def test_async_eval_over_the_remote_worker_is_exact(world: Any, server: dict[str, Any]) -> None:
    rec = RecordingService(event_types={OnValidationEnd})
    dispatcher = RemoteDispatcher(
        uri=server["uri"], token=TOKEN, cert_sha256=hashlib.sha256(server["der"]).hexdigest()
    )
    with dispatcher, SakuraRuntime([rec], strict=True) as rt:
        rt.install(
            AsyncEval(world.eval_fn, world.val_payload(), dispatcher=dispatcher, pass_task=True)
        )
        _, reference = world.train(rt, epochs=2)
    assert [dict(e.metrics) for e in rec.of(OnValidationEnd)] == reference


def test_a_client_without_the_token_is_rejected(server: dict[str, Any]) -> None:
    with pytest.raises(AuthenticationError, match="refused this client \\(no token was given\\)"):
        RemoteDispatcher(uri=server["uri"], cert_der=server["der"]).start()


def test_a_client_with_a_wrong_token_is_rejected(server: dict[str, Any]) -> None:
    # The worker proves the token first: a client with another token refuses the worker.
    with pytest.raises(AuthenticationError, match="the server failed to prove the shared token"):
        RemoteDispatcher(uri=server["uri"], token="x" * 32, cert_der=server["der"]).start()


def test_the_client_refuses_a_worker_whose_certificate_is_not_the_pinned_one(
    server: dict[str, Any],
) -> None:
    with pytest.raises(AuthenticationError, match="does not match the pinned one"):
        RemoteDispatcher(uri=server["uri"], token=TOKEN, cert_der=server["other_der"]).start()


def test_a_plain_tcp_client_gets_nothing_from_a_tls_worker(server: dict[str, Any]) -> None:
    with pytest.raises((AuthenticationError, OSError)):
        RemoteDispatcher(
            uri=server["uri"].replace("tls://", "tcp://"), token=TOKEN, connect_timeout=1
        ).start()


def test_the_worker_refuses_to_listen_beyond_loopback_without_tls_and_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    # Rejected before anything binds: no socket is ever opened on 0.0.0.0.
    assert worker_main(["--listen", "0.0.0.0:0"]) == 2
    assert "not a loopback address, without TLS" in capsys.readouterr().err
    assert worker_main(["--listen", "0.0.0.0:0", "--token-file", str(token)]) == 2
    assert "without TLS" in capsys.readouterr().err
    assert worker_main(["--listen", "0.0.0.0:0", "--insecure-loopback"]) == 2
    assert worker_main(["--listen", "127.0.0.1:0"]) == 2
    assert "a token is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"uri": "quic://h:1"}, "uri must be tls://HOST:PORT"),
        ({"uri": "tls://127.0.0.1:1"}, "give exactly one of cert_der"),
        ({"uri": "tcp://10.1.2.3:1"}, "only allowed to a loopback address"),
        ({"uri": "tls://127.0.0.1:1", "cert_sha256": "zz"}, "64 hex digits"),
        ({"uri": "tcp://127.0.0.1:1", "token": "a", "token_file": "b"}, "not both"),
        ({"uri": "tcp://127.0.0.1:1", "liveness_timeout": 0}, "liveness_timeout=0 is not accepted"),
        ({"uri": "tcp://127.0.0.1:1", "max_frame_bytes": 10}, "max_frame_bytes=10 is not accepted"),
        ({"uri": "tcp://127.0.0.1:1", "connect_timeout": -1}, "connect_timeout=-1 is not accepted"),
    ],
)
def test_options_are_validated(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        RemoteDispatcher(**kwargs)
