"""Bad HTTP (issue 13): wrong methods, unknown paths, huge headers and a thousand idle connections get clear
status codes, and scrapes go on unaffected."""

from __future__ import annotations

import http.client
import socket
import threading

import pytest

from volprobe.server import SharedRender

from .harness import MIB


def request(port: int, method: str, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request(method, path, headers=headers or {})
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


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
        for _ in range(1000):  # connected, never sending a byte
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
