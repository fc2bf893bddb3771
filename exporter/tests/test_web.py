"""--web.config.file in the exporter-toolkit format: TLS, client certificates, basic auth. Real openssl certs,
checked with promtool, served by the real exporter."""

from __future__ import annotations

import base64
import http.client
import os
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import bcrypt
import pytest

from .harness import volprobe_command

PASSWORD = "correct horse battery staple"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA."""
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=volprobe test CA",
        cwd=d,
    )
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            *ext,
            cwd=d,
        )
    return d


def web_config(pki: Path, tmp_path: Path, text: str) -> str:
    path = tmp_path / "web.yml"
    path.write_text(text.format(pki=pki))
    result = subprocess.run(["promtool", "check", "web-config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return str(path)


def https(port: int, pki: Path, auth: tuple[str, str] | None = None, client_cert: bool = False) -> int:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if client_cert:
        context.load_cert_chain(pki / "client.crt", pki / "client.key")
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    headers = {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    connection.request("GET", "/metrics", headers=headers)
    status = connection.getresponse().status
    connection.close()
    return status


def test_tls_and_basic_auth(pki, tmp_path, start_exporter):
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=6)).decode()
    config = web_config(
        pki,
        tmp_path,
        f"""
tls_server_config:
  cert_file: {{pki}}/server.crt
  key_file: {{pki}}/server.key
basic_auth_users:
  alice: {hashed}
""",
    )
    exporter = start_exporter("--web.config.file", config, "--config", empty_config(tmp_path), tls=True)
    port = exporter.port
    assert https(port, pki) == 401
    assert https(port, pki, ("alice", "wrong")) == 401
    assert https(port, pki, ("mallory", PASSWORD)) == 401
    assert https(port, pki, ("alice", PASSWORD)) == 200
    assert https(port, pki, ("alice", PASSWORD)) == 200  # the second time from the cache
    # Plain HTTP to the TLS listener fails.
    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
        plain.request("GET", "/metrics")
        plain.getresponse()
    assert exporter.stop() == 0
    log = exporter.log()
    assert PASSWORD not in log and hashed not in log and "wrong" not in log


def test_mutual_tls_requires_a_client_certificate(pki, tmp_path, start_exporter):
    config = web_config(
        pki,
        tmp_path,
        """
tls_server_config:
  cert_file: {pki}/server.crt
  key_file: {pki}/server.key
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {pki}/ca.crt
""",
    )
    exporter = start_exporter("--web.config.file", config, "--config", empty_config(tmp_path), tls=True)
    assert https(exporter.port, pki, client_cert=True) == 200
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        https(exporter.port, pki, client_cert=False)
    assert exporter.stop() == 0


def test_a_bad_web_config_exits_2_naming_the_key(tmp_path):
    path = tmp_path / "web.yml"
    path.write_text(
        "tls_server_config:\n  cert_file: /nonexistent.crt\n  key_file: /nonexistent.key\n"
        "basic_auth_users:\n  bob: plaintext\n"
    )
    result = subprocess.run(
        volprobe_command("--web.config.file", str(path), "--web.listen-address", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "tls_server_config.cert_file" in result.stderr and "basic_auth_users.bob" in result.stderr
    assert "plaintext" not in result.stderr


def empty_config(directory: Path) -> str:
    path = directory / "volprobe.yml"
    path.write_text("targets: []\n")
    return str(path)


def served_serial(port: int, pki: Path) -> str:
    """The serial number of the certificate the server presents to a new connection (verified by the CA)."""
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return tls.getpeercert()["serialNumber"]


def serial_of(certificate: Path) -> str:
    out = subprocess.run(["openssl", "x509", "-noout", "-serial", "-in", str(certificate)], capture_output=True)
    return out.stdout.decode().strip().split("=", 1)[1]


def test_renewed_certificates_apply_to_the_next_connection(pki, tmp_path, start_exporter):
    """exporter-toolkit reads the certificate at each handshake; volprobe reloads when a file changes. A broken
    renewal (a key that does not match) keeps the last good pair serving, and says why."""
    renewed = tmp_path / "renewed"
    renewed.mkdir()
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
            "/CN=server renewed", cwd=renewed)  # fmt: skip
    openssl("x509", "-req", "-in", "server.csr", "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
            "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", str(pki / "server.ext"),
            cwd=renewed)  # fmt: skip
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(pki / "server.crt", live / "server.crt")
    shutil.copy(pki / "server.key", live / "server.key")
    config = web_config(
        pki, tmp_path, f"tls_server_config: {{{{cert_file: {live}/server.crt, key_file: {live}/server.key}}}}\n"
    )
    exporter = start_exporter("--web.config.file", config, "--config", empty_config(tmp_path), tls=True)
    assert served_serial(exporter.port, pki) == serial_of(pki / "server.crt")
    # Renewal as certbot or cert-manager do it: new files renamed into place (the key first).
    for name in ("server.key", "server.crt"):
        shutil.copy(renewed / name, live / f".{name}.new")
        os.replace(live / f".{name}.new", live / name)
    assert served_serial(exporter.port, pki) == serial_of(renewed / "server.crt"), "the next connection"
    assert https(exporter.port, pki) == 200
    # A broken renewal: the old certificate with a key that is not its own.
    shutil.copy(pki / "server.crt", live / "server.crt")
    shutil.copy(pki / "client.key", live / "server.key")
    assert served_serial(exporter.port, pki) == serial_of(renewed / "server.crt"), "the last good pair serves"
    assert "not reloaded" in exporter.log() and "cannot load certificates" in exporter.log()
    # Completed: the matching key arrives.
    shutil.copy(pki / "server.key", live / "server.key")
    assert served_serial(exporter.port, pki) == serial_of(pki / "server.crt")
    assert exporter.stop() == 0
