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
import threading
import time
import urllib.request
from pathlib import Path

import bcrypt
import pytest

from volprobe import webconfig
from volprobe.config import ConfigError
from volprobe.server import HEAD_DEADLINE_S

from .support import toolkit
from .support.connections import read_until_closed
from .support.harness import sample_value, volprobe_command
from .support.hostile_yaml import laughs
from .support.pki import make_pki, openssl

PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


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
    # Over bcrypt's 72 bytes: refused as any wrong password (bcrypt 5 raises on them), for a known user as for
    # an unknown one.
    assert https(port, pki, ("alice", "x" * 100)) == https(port, pki, ("mallory", "x" * 100)) == 401
    # Plain HTTP to the TLS listener: the handshake fails on it, and the connection is closed unanswered at
    # once (a server that hung would leave it open past the bound).
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        plain.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply, closed = read_until_closed(plain, within=2)
    assert closed and not reply.startswith(b"HTTP/"), reply
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
    # Without one the server refuses the handshake with TLS 1.3's certificate_required alert, not a timeout.
    # The client reads it before sending: a request sent meanwhile may meet the reset that follows the alert.
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with (
        socket.create_connection(("127.0.0.1", exporter.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"),
    ):
        tls.recv(1)
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


def test_a_handshake_trickled_a_byte_at_a_time_ends_at_the_head_deadline(pki, tmp_path, start_exporter):
    """The TLS handshake counts in the first request's deadline (the old server gave it 10 s of its own)."""
    config = web_config(
        pki, tmp_path, "tls_server_config: {{cert_file: {pki}/server.crt, key_file: {pki}/server.key}}\n"
    )
    exporter = start_exporter("--web.config.file", config, "--config", empty_config(tmp_path), tls=True)
    with socket.create_connection(("127.0.0.1", exporter.port), timeout=10) as raw:
        started = time.monotonic()
        raw.sendall(b"\x16\x03\x01\x02\x00")  # a handshake record of 512 bytes to come: one every 0.5 s
        closed = False
        while not closed and time.monotonic() - started < HEAD_DEADLINE_S + 2:
            try:
                raw.sendall(b"\x01")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            else:
                closed = read_until_closed(raw, within=0.5)[1]
        seconds = time.monotonic() - started
    assert closed and HEAD_DEADLINE_S - 0.5 < seconds < HEAD_DEADLINE_S + 1.5, seconds
    assert https(exporter.port, pki) == 200
    assert exporter.stop() == 0


def test_a_web_config_that_does_not_reload_shows_in_its_reload_metric(tmp_path, start_exporter):
    """volprobe_web_config_last_reload_successful: 0 while the file (replaced, as a renewal replaces files) does
    not load and the previous configuration serves on, 1 again once it does; the success time moves only then.
    Each scrape checks the files first, so the scrape after the change reports it."""
    path = tmp_path / "web.yml"
    good = "http_server_config:\n  headers: {X-Content-Type-Options: nosniff}\n"

    def replace(text: str) -> None:
        (tmp_path / "web.yml.new").write_text(text)
        os.replace(tmp_path / "web.yml.new", path)

    replace(good)
    exporter = start_exporter("--web.config.file", str(path), "--config", empty_config(tmp_path))
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_web_config_last_reload_successful") == 1
    loaded = sample_value(samples, "volprobe_web_config_last_reload_success_timestamp_seconds")
    assert loaded is not None and abs(loaded - time.time()) < 60
    replace("basic_auth_users: {bob: plaintext}\n")  # not a bcrypt hash: refused
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_web_config_last_reload_successful") == 0
    with urllib.request.urlopen(exporter.url + "/metrics", timeout=10) as response:
        assert response.headers["X-Content-Type-Options"] == "nosniff", "the previous configuration serves"
    assert sample_value(samples, "volprobe_web_config_last_reload_success_timestamp_seconds") == loaded
    assert "not reloaded" in exporter.log() and "basic_auth_users.bob" in exporter.log()
    replace(good)
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_web_config_last_reload_successful") == 1
    assert sample_value(samples, "volprobe_web_config_last_reload_success_timestamp_seconds") > loaded
    assert exporter.stop() == 0


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
    assert "not reloaded" in exporter.log() and "cannot load the certificate" in exporter.log()
    # Completed: the matching key arrives.
    shutil.copy(pki / "server.key", live / "server.key")
    assert served_serial(exporter.port, pki) == serial_of(pki / "server.crt")
    assert exporter.stop() == 0


# -- the same behaviour as exporter-toolkit, each checked against it (tests/toolkit.py) ------------------------


def _status(port: int, pki: Path, certificate: str | None = None, path: str = "/metrics") -> int | str:
    """The HTTP status a real client gets, or "refused" when the TLS connection is closed or failed."""
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if certificate:
        context.load_cert_chain(pki / f"{certificate}.crt", pki / f"{certificate}.key")
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    except (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected):
        return "refused"
    finally:
        connection.close()


def _both(exporter_toolkit: Path, config: Path, tmp_path: Path, start_exporter) -> tuple[dict, toolkit.Server]:
    """The ports of volprobe and of exporter-toolkit, serving behind the same web config."""
    exporter = start_exporter("--web.config.file", str(config), "--config", empty_config(tmp_path), tls=True)
    server = toolkit.Server(exporter_toolkit, config, tmp_path / "exporter-toolkit.log")
    return {"volprobe": exporter.port, "exporter-toolkit": server.port}, server


def test_client_allowed_sans(pki, tmp_path, start_exporter, exporter_toolkit):
    """Only a client certificate naming an allowed SAN is served, by volprobe as by exporter-toolkit."""
    config = tmp_path / "web.yml"
    config.write_text(
        f"tls_server_config:\n  cert_file: {pki}/server.crt\n  key_file: {pki}/server.key\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki}/ca.crt\n"
        "  client_allowed_sans: [scraper.example]\n"
    )
    ports, server = _both(exporter_toolkit, config, tmp_path, start_exporter)
    try:
        for name, port in ports.items():
            assert _status(port, pki, "client-allowed") == 200, name
            assert _status(port, pki, "client-other") == "refused", name  # a SAN, not an allowed one
            assert _status(port, pki, "client") == "refused", name  # no SAN at all
            assert _status(port, pki) == "refused", name  # no certificate
    finally:
        server.stop()


def test_rate_limit_answers_429_beyond_the_burst(pki, tmp_path, start_exporter, exporter_toolkit):
    """A bucket of `burst` requests refilled one per interval, before authentication: volprobe and
    exporter-toolkit give the same statuses to the same sequence."""
    config = tmp_path / "web.yml"
    config.write_text(
        f"tls_server_config: {{cert_file: {pki}/server.crt, key_file: {pki}/server.key}}\n"
        "rate_limit: {interval: 3s, burst: 3}\n"
        "basic_auth_users: {alice: '$2y$10$qRTBuFoULoYNA7AQ/F3ck.trZBPyjV64.oA4ZsSBCIWvXuvQlQTuu'}\n"
    )
    ports, server = _both(exporter_toolkit, config, tmp_path, start_exporter)
    try:
        statuses = {name: [_status(port, pki) for _ in range(5)] for name, port in ports.items()}
        time.sleep(3.2)  # one token back
        for name, port in ports.items():
            statuses[name] += [_status(port, pki), _status(port, pki)]
    finally:
        server.stop()
    assert statuses["volprobe"] == statuses["exporter-toolkit"] == [401, 401, 401, 429, 429, 401, 429]
    # volprobe re-reads rate_limit with the rest of the file (exporter-toolkit only at start): a new limit
    # applies to the next request, with a full bucket.
    config.write_text(config.read_text().replace("burst: 3", "burst: 20"))
    assert [_status(ports["volprobe"], pki) for _ in range(5)] == [401] * 5
    config.write_text(config.read_text().replace("rate_limit: {interval: 3s, burst: 20}\n", ""))
    assert [_status(ports["volprobe"], pki) for _ in range(25)] == [401] * 25


def test_security_headers_on_every_response(pki, tmp_path, start_exporter):
    """The configured headers go out on every answer: metrics, 401, 404, 405, 429 and a malformed request."""
    headers = {
        "Strict-Transport-Security": "max-age=31536000",
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "deny",
        "X-XSS-Protection": "1",
        "Content-Security-Policy": "default-src 'none'",
    }
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    config = tmp_path / "web.yml"
    config.write_text(
        f"tls_server_config: {{cert_file: {pki}/server.crt, key_file: {pki}/server.key}}\n"
        "http_server_config:\n  headers:\n"
        + "".join(f"    {name}: {value if name != 'X-XSS-Protection' else 1}\n" for name, value in headers.items())
        + "rate_limit: {interval: 1m, burst: 5}\n"
        + f"basic_auth_users: {{alice: '{hashed}'}}\n"
    )
    exporter = start_exporter("--web.config.file", str(config), "--config", empty_config(tmp_path), tls=True)
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    auth = {"Authorization": "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()}
    seen = []
    for method, path, extra in (
        ("GET", "/metrics", auth),
        ("GET", "/metrics", {}),
        ("GET", "/nonesuch", auth),
        ("POST", "/metrics", auth),
        ("GET", "/", auth),
        (
            "GET",
            "/metrics",
            auth,
        ),  # the 6th request handled: over the burst of 5 (a malformed one is answered before the limit, as in Go)
    ):
        connection = http.client.HTTPSConnection("127.0.0.1", exporter.port, context=context, timeout=10)
        connection.request(method, path, headers=extra)
        response = connection.getresponse()
        response.read()
        seen.append((response.status, {name: response.getheader(name) for name in headers}))
        connection.close()
        if path == "/":  # a request line that does not parse: the stdlib's own 400 page
            with (
                socket.create_connection(("127.0.0.1", exporter.port), timeout=10) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                tls.sendall(b"NOT A REQUEST\r\n\r\n")
                reply = tls.recv(65536).decode()
            status_line, _, rest = reply.partition("\r\n")
            lines = dict(line.split(": ", 1) for line in rest.split("\r\n\r\n")[0].split("\r\n") if ": " in line)
            seen.append((int(status_line.split()[1]), {name: lines.get(name) for name in headers}))
    assert [status for status, _ in seen] == [200, 401, 404, 405, 200, 400, 429]
    for status, sent in seen:
        assert sent == headers, f"response {status}"
    assert exporter.stop() == 0


def test_curve_and_cipher_settings_are_enforced(pki, tmp_path, start_exporter, exporter_toolkit):
    """A curve and a TLS 1.2 suite that are configured are the only ones a client can use, in volprobe as in
    exporter-toolkit (accepted settings are honoured, not ignored)."""
    config = tmp_path / "web.yml"
    config.write_text(
        f"tls_server_config: {{cert_file: {pki}/server.crt, key_file: {pki}/server.key, max_version: TLS12,\n"
        "  curve_preferences: [CurveP384], cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]}\n"
    )

    def handshake(port: int, curve: str, cipher: str) -> str:
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        context.set_ecdh_curve(curve)
        context.set_ciphers(cipher)
        try:
            with (
                socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                return tls.cipher()[0]
        except (ssl.SSLError, ConnectionError):
            return "refused"

    ports, server = _both(exporter_toolkit, config, tmp_path, start_exporter)
    try:
        for name, port in ports.items():
            assert handshake(port, "secp384r1", "ECDHE-RSA-AES128-GCM-SHA256") == "ECDHE-RSA-AES128-GCM-SHA256", name
            assert handshake(port, "prime256v1", "ECDHE-RSA-AES128-GCM-SHA256") == "refused", name
            if webconfig.curve_settable("X25519"):  # clients offer it first; some builds' ssl cannot set it
                assert handshake(port, "X25519", "ECDHE-RSA-AES128-GCM-SHA256") == "refused", name
            assert handshake(port, "secp384r1", "ECDHE-RSA-AES256-GCM-SHA384") == "refused", name
    finally:
        server.stop()


def test_x25519_works_or_is_refused_naming_the_key(pki, tmp_path):
    """On every interpreter: a web config asking for X25519 gives a server that negotiates it, or is refused
    at load naming curve_preferences (some builds' ssl cannot set the curve), never a traceback."""
    config = tmp_path / "web.yml"
    config.write_text(
        f"tls_server_config: {{cert_file: {pki}/server.crt, key_file: {pki}/server.key, max_version: TLS12,\n"
        "  curve_preferences: [X25519]}\n"
    )
    if not webconfig.curve_settable("X25519"):
        with pytest.raises(ConfigError) as refused:
            webconfig.load(str(config))
        assert [p.split(": ")[1] for p in refused.value.problems] == ["tls_server_config.curve_preferences"]
        return
    server_context = webconfig.load(str(config)).tls
    assert server_context is not None
    for curve, expected in (("X25519", True), ("secp384r1", False)):
        client = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        client.maximum_version = ssl.TLSVersion.TLSv1_2
        client.set_ecdh_curve(curve)
        left, right = socket.socketpair()
        with left, right:
            server_side = server_context.wrap_socket(left, server_side=True, do_handshake_on_connect=False)
            client_side = client.wrap_socket(right, server_hostname="127.0.0.1", do_handshake_on_connect=False)
            outcome: dict[str, object] = {}

            def serve(side: ssl.SSLSocket = server_side, outcome: dict[str, object] = outcome) -> None:
                try:
                    side.do_handshake()
                    outcome["server"] = True
                except (ssl.SSLError, OSError):
                    outcome["server"] = False
                    side.close()

            thread = threading.Thread(target=serve)
            thread.start()
            try:
                client_side.do_handshake()
                shook = True
            except (ssl.SSLError, OSError):
                shook = False
            thread.join(10)
            assert shook is expected and outcome["server"] is expected, curve


# (name, bytes, what the refusal says): a Latin-1 byte was refused before issue 41 too.
HOSTILE_WEB_CONFIGS = [
    ("2000-deep nesting", b"http_server_config: " + b"[" * 2000 + b"]" * 2000 + b"\n", "nested more than 32 deep"),
    ("over 1 MiB", b"http_server_config: {}\n" + (b"#" * 1023 + b"\n") * 1100, "more than a configuration may be"),
    ("billion laughs", laughs() + b"http_server_config: {headers: {X-Laugh: *l5}}\n", "more than 100000 added"),
]


@pytest.mark.parametrize("content,why", [pytest.param(c, w, id=n) for n, c, w in HOSTILE_WEB_CONFIGS])
def test_a_hostile_web_config_is_refused_at_start_and_does_not_reload(tmp_path, start_exporter, content, why):
    """Refused at start (exit 2, one line naming the file); while running, the scrapes go on with the previous
    configuration and report the failed reload."""
    path = tmp_path / "web.yml"
    path.write_bytes(content)
    result = subprocess.run(
        volprobe_command("--web.config.file", str(path), "--config", empty_config(tmp_path)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{path}: " in result.stderr and why in result.stderr
    path.write_text("http_server_config:\n  headers: {X-Content-Type-Options: nosniff}\n")
    exporter = start_exporter("--web.config.file", str(path), "--config", empty_config(tmp_path))
    (tmp_path / "web.yml.new").write_bytes(content)
    os.replace(tmp_path / "web.yml.new", path)
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_web_config_last_reload_successful") == 0
    assert why in exporter.log() and "Traceback" not in exporter.log()
    assert exporter.stop() == 0
