"""--web.config.file in the exporter-toolkit format: TLS, client certificates, basic auth. Real openssl certs,
checked with promtool, served by the real exporter."""

from __future__ import annotations

import base64
import http.client
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
