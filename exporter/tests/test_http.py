"""Bad HTTP (issue 13): wrong methods, unknown paths, huge headers and idle connections get clear status codes,
and scrapes go on unaffected. Hostile HTTP (issue 24): request heads trickled or bloated, bodies smuggling a
second request, connections beyond the cap: bounded in time and memory, before any authentication."""

from __future__ import annotations

import http.client
import re
import select
import socket
import threading
import time
from pathlib import Path

import bcrypt
import pytest

from volprobe.server import HEAD_DEADLINE_S, HEAD_MAX_BYTES, MAX_CONNECTIONS, SharedRender

from .support.connections import exchange, read_until_closed
from .support.harness import MIB, write_config


def request(port: int, method: str, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request(method, path, headers=headers or {})
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def statuses(data: bytes) -> list[int]:
    """The status codes of the responses in `data` (none of the bodies here holds a status line)."""
    return [int(code) for code in re.findall(rb"^HTTP/1\.[01] (\d{3}) ", data, re.MULTILINE)]


def no_targets(directory: Path) -> tuple[str, str]:
    """--config of a file with no targets: for tests of the HTTP side alone, which need no device."""
    return "--config", write_config(directory, "targets: []\n")


@pytest.mark.root
def test_bad_requests_get_clear_status_codes_and_idle_connections_block_no_scrape(make_loop, start_exporter):
    exporter = start_exporter("--target", make_loop(16 * MIB))
    port = exporter.port
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        response = request(port, method, "/metrics")
        assert (response.status, response.getheader("Allow")) == (405, "GET, HEAD"), method
    assert request(port, "GET", "/nonesuch").status == 404
    assert request(port, "GET", "/metrics", {"X-Big": "x" * 100_000}).status == 431
    assert request(port, "GET", "/metrics", {f"X-{i}": "1" for i in range(200)}).status == 431
    # A garbage request line, then a clean scrape.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"\x16\x03\x01garbage\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 400")

    idle = []
    try:
        # Connected, never sending a byte: as many as leave the scrapes a few of the MAX_CONNECTIONS (each
        # scrape's slot comes back once the server sees its connection closed, a moment after the client).
        for _ in range(MAX_CONNECTIONS - 8):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        for _ in range(20):  # each within the client's 10 s timeout, or it raises
            assert request(port, "GET", "/metrics").status == 200
    finally:
        for sock in idle:
            sock.close()
    assert exporter.process.poll() is None
    assert request(port, "GET", "/metrics").status == 200
    assert exporter.stop() == 0


def test_concurrent_scrapes_share_one_render():
    renders = []
    gate = threading.Event()

    def render(accept: str) -> tuple[bytes, str]:
        renders.append(accept)
        gate.wait(5)  # a slow render: every scrape arriving meanwhile waits for it
        return f"body {len(renders)}".encode(), "text/plain"

    shared = SharedRender(render)
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(shared.get("text/plain")[0])) for _ in range(20)]
    for thread in threads:
        thread.start()
    while not renders:
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)  # the others have arrived and wait
    gate.set()
    for thread in threads:
        thread.join(10)
    assert len(renders) == 1 and results == [b"body 1"] * 20
    assert shared.get("text/plain")[0] == b"body 2", "a later scrape renders afresh"


def test_a_failed_render_fails_every_scrape_waiting_for_it():
    def render(accept: str) -> tuple[bytes, str]:
        raise RuntimeError("collector broke")

    with pytest.raises(RuntimeError):
        SharedRender(render).get("")


# -- issue 24: what an unauthenticated client can cost ----------------------------------------------------------


def _trickler(port: int, kind: str, results: dict[str, list], ready: threading.Event, stop: threading.Event) -> None:
    """One hostile client: a request head that never ends. `bulky` sends the issue's 98 header lines of 65 KB
    as fast as they go; `long-line` one header line, 1 KiB every 0.2 s; `line-a-second` a short header line
    every second. Records (kind, seconds from connect to the server closing the connection, what it sent)."""
    pieces = {
        "bulky": [(b"X-Bulk-%d: %s\r\n" % (n, b"x" * 65_000), 0.0) for n in range(98)],
        "long-line": [(b"X-Long: ", 0.0)] + [(b"x" * 1024, 0.2)] * 40,
        "line-a-second": [(b"X-Slow-%d: 1\r\n" % n, 1.0) for n in range(20)],
    }[kind]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: volprobe\r\n")
        ready.set()
        try:
            for piece, wait in pieces:
                if select.select([sock], [], [], wait)[0]:  # readable: an answer, or the connection closed
                    break
                sock.sendall(piece)
            while not stop.is_set() and not select.select([sock], [], [], 0.1)[0]:
                pass  # sent all it had: wait for the server to give up on it (or the test to end)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while this sent: what the server answered before is still there to read
        data, closed = read_until_closed(sock, 1.0)
        if closed:
            results[kind].append((time.monotonic() - start, data))


def test_slow_and_bulky_request_heads_cost_little_and_end_at_the_deadline(make_loop, start_exporter):
    """30 connections whose request heads never end (the issue: 10 x 98 lines of 65 KB took 62 MiB, a line every
    1.5 s was served after 12 s) cost the exporter at most 10 MiB, a scrape meanwhile is answered within 1 s, and
    each of them is answered 431 (over HEAD_MAX_BYTES) or closed by HEAD_DEADLINE_S."""
    exporter = start_exporter("--target", make_loop(16 * MIB))
    port = exporter.port
    request(port, "GET", "/metrics")  # the first render's allocations are not the clients'
    baseline = exporter.rss_bytes()[0]
    kinds = ["bulky", "long-line", "line-a-second"] * 10
    results: dict[str, list] = {kind: [] for kind in kinds}
    stop = threading.Event()
    started = [threading.Event() for _ in kinds]
    clients = [
        threading.Thread(target=_trickler, args=(port, kind, results, ready, stop), daemon=True)
        for kind, ready in zip(kinds, started, strict=True)
    ]
    peak = 0
    try:
        for client in clients:
            client.start()
        for ready in started:
            assert ready.wait(5), "every client connected and began its request"
        time.sleep(1)  # the slow ones some way into their heads, the bulky ones answered
        before = time.monotonic()
        assert request(port, "GET", "/metrics").status == 200
        took = time.monotonic() - before
        end = time.monotonic() + HEAD_DEADLINE_S + 5
        while any(client.is_alive() for client in clients) and time.monotonic() < end:
            peak = max(peak, exporter.rss_bytes()[0])
            time.sleep(0.05)
    finally:
        stop.set()
        for client in clients:
            client.join(5)
    growth = peak - baseline
    print(f"RSS {baseline / MIB:.1f} MiB, peak growth {growth / MIB:.2f} MiB; scrape answered in {took:.3f} s")
    assert took < 1.0
    assert growth <= 10 * MIB, f"RSS grew by {growth / MIB:.1f} MiB"
    for kind in kinds:
        assert len(results[kind]) == kinds.count(kind), f"every {kind} client closed by the server: {results[kind]}"
    assert {tuple(statuses(data)) for _, data in results["bulky"]} == {(431,)}
    for kind in ("long-line", "line-a-second"):
        for seconds, data in results[kind]:
            assert data == b"" and HEAD_DEADLINE_S - 0.5 < seconds < HEAD_DEADLINE_S + 1.5, (kind, seconds, data)
    assert request(port, "GET", "/metrics").status == 200
    assert exporter.stop() == 0


SMUGGLED = b"GET /metrics HTTP/1.1\r\nHost: volprobe\r\n\r\n"


def test_a_request_body_is_refused_and_the_connection_closed_before_authentication(tmp_path, start_exporter):
    """A request announcing a body gets 413 (400 for a Content-Length that is no number) and the connection is
    closed: the bytes behind the head, here a second request, are never taken for a request and answered (the
    old server answered 404, then 200, on one connection). Before authentication: no credentials are sent."""
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode()
    web = write_config(tmp_path, f"basic_auth_users: {{alice: '{hashed}'}}\n", "web.yml")
    # tls=True: ready once the port accepts (its /-/ready, as everything here, wants credentials).
    exporter = start_exporter("--web.config.file", web, *no_targets(tmp_path), tls=True)
    port = exporter.port
    length = b"Content-Length: %d\r\n" % len(SMUGGLED)
    cases = {
        "a length": (b"GET /nonesuch HTTP/1.1\r\nHost: volprobe\r\n" + length + b"\r\n" + SMUGGLED, 413),
        "a length, on a HEAD": (b"HEAD /metrics HTTP/1.1\r\nHost: volprobe\r\n" + length + b"\r\n" + SMUGGLED, 413),
        "chunked": (
            b"GET /metrics HTTP/1.1\r\nHost: volprobe\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
            413,
        ),
        "a length and chunked": (
            b"GET / HTTP/1.1\r\nHost: volprobe\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED),
            413,
        ),
        "a length no number": (b"GET / HTTP/1.1\r\nHost: volprobe\r\nContent-Length: +5\r\n\r\n" + SMUGGLED, 400),
        "a length behind a space": (
            b"GET / HTTP/1.1\r\nHost: volprobe\r\nContent-Length : 40\r\n\r\n" + SMUGGLED,
            400,
        ),
        "a POST": (b"POST /metrics HTTP/1.1\r\nHost: volprobe\r\n" + length + b"\r\n" + SMUGGLED, 413),
        "an unknown method": (b"BREW /metrics HTTP/1.1\r\nHost: volprobe\r\n" + length + b"\r\n" + SMUGGLED, 413),
    }
    seen = {}
    for name, (data, _) in cases.items():
        reply, closed = exchange(port, data, within=5)
        seen[name] = (statuses(reply), closed, b"\r\nConnection: close\r\n" in reply)
    assert seen == {name: ([status], True, True) for name, (_, status) in cases.items()}
    # An empty body is no body: served as before (401 here, with no credentials).
    empty = b"GET /metrics HTTP/1.1\r\nHost: volprobe\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    assert statuses(exchange(port, empty)[0]) == [401]
    assert request(port, "POST", "/metrics").status == 405  # http.client sends Content-Length: 0
    assert exporter.stop() == 0


def test_a_request_head_over_the_cap_is_answered_431_and_closed(tmp_path, start_exporter):
    """Each header line under the stdlib's 64 KiB and the count under its 100, but the head over HEAD_MAX_BYTES
    in all: 431 and the connection closed (the old server read 100 lines of 64 KiB per request). A head just
    under the cap is served."""
    exporter = start_exporter(*no_targets(tmp_path))
    port = exporter.port
    line = 1000
    under = {f"X-Pad-{n:02}": "x" * line for n in range(HEAD_MAX_BYTES // (line + 12) - 1)}
    assert request(port, "GET", "/metrics", under).status == 200
    padding = b"".join(b"X-Pad-%02d: %s\r\n" % (n, b"x" * line) for n in range(HEAD_MAX_BYTES // line + 1))
    reply, closed = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: volprobe\r\n" + padding + b"\r\n")
    assert (statuses(reply), closed) == ([431], True)
    reply, closed = exchange(port, b"GET /metrics?%s HTTP/1.1\r\nHost: volprobe\r\n\r\n" % (b"a" * HEAD_MAX_BYTES))
    assert (statuses(reply), closed) == ([431], True)
    assert request(port, "GET", "/metrics").status == 200
    assert exporter.stop() == 0


def scrape_once_served(port: int, within: float) -> int:
    """The status of the first scrape the server takes within `within` seconds (refused ones are retried)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return request(port, "GET", "/metrics").status
        except (ConnectionError, http.client.RemoteDisconnected):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_connections_over_the_cap_are_closed_at_once_and_scrapes_resume_below_it(tmp_path, start_exporter):
    """MAX_CONNECTIONS held open (the head deadline has not come): the next connection is closed at once,
    unanswered and long before that deadline; one of them gone, a scrape is served again."""
    exporter = start_exporter(*no_targets(tmp_path))
    port = exporter.port
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as over:
            over.sendall(b"GET /metrics HTTP/1.1\r\nHost: volprobe\r\n\r\n")
            reply, closed = read_until_closed(over, within=HEAD_DEADLINE_S - 1)
        assert (reply, closed) == (b"", True)
        assert time.monotonic() - started < 1.0, "closed at once, not at the head deadline"
        held.pop().close()
        assert scrape_once_served(port, within=2.0) == 200, "a scrape gets through with the others still held"
    finally:
        for sock in held:
            sock.close()
    assert scrape_once_served(port, within=2.0) == 200
    assert exporter.process.poll() is None
    assert "connections open, the most served at once" in exporter.log()
    assert exporter.stop() == 0


def test_a_kept_alive_connection_may_idle_past_the_head_deadline(tmp_path, start_exporter):
    """The head deadline runs from a request's first byte: between requests a kept-alive connection has the idle
    timeout, as before (Prometheus reuses its connection from one scrape to the next)."""
    exporter = start_exporter(*no_targets(tmp_path))
    connection = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=10)
    seen = []
    for idle in (HEAD_DEADLINE_S + 1, 0):
        connection.request("GET", "/metrics")  # a connection the server closed fails the second one
        response = connection.getresponse()
        response.read()
        seen.append((response.status, connection.sock.getsockname()))
        time.sleep(idle)
    connection.close()
    assert [status for status, _ in seen] == [200, 200]
    assert seen[0][1] == seen[1][1], "both requests went on the one connection"
    assert exporter.stop() == 0
