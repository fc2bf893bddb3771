"""HTTP(S) endpoint: /metrics, a landing page and /-/healthy, with the exporter-toolkit web configuration.

Connections are accepted plainly and, when TLS is configured, wrapped and handshaken in their own thread,
so a slow or hostile client never holds up the accept loop, and renewed certificates apply to the next
connection.

What an unauthenticated client can make the server hold is bounded (issue 24): at most MAX_CONNECTIONS
connections, each with a thread; each request head (request line and headers) within HEAD_MAX_BYTES, read by
HEAD_DEADLINE_S; and no request body, ever (one announced is refused and the connection closed).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import html
import io
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from . import __version__, protobuf
from .exposition import OPENMETRICS_ESCAPINGS, TextExposition
from .osthread import name_this_thread
from .webconfig import TokenBucket, WebConfig, WebConfigWatcher, certificate_sans

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

# What socketserver hands a server's methods: a TCP server's requests are sockets (a UDP server's are pairs).
_Request = socket.socket | tuple[bytes, socket.socket]
_Client = tuple[Any, ...]  # (host, port), and flow and scope for IPv6

# A connection's first request head must be in by HEAD_DEADLINE_S after it is accepted, the TLS handshake
# included; a later one on a kept-alive connection may take REQUEST_TIMEOUT_S to begin (idle), then has
# HEAD_DEADLINE_S. A scraper sends its head in one write, so seconds are ample on any network.
HEAD_DEADLINE_S = 5.0
# Request line plus headers. Prometheus sends well under 1 KiB; 32 KiB leaves room for a browser's cookies
# behind a proxy (nginx's default allows 4 x 8 KiB). The stdlib bounds only each line (64 KiB) and the count (100).
HEAD_MAX_BYTES = 32 * 1024
# Connections served at once, each with a thread. Prometheus keeps one connection per server (two for an HA
# pair), health checks and a person's curl add a few: 64 is ten times what is needed. What one costs before
# any authentication: its head (up to HEAD_MAX_BYTES), the reader's 8 KiB buffer and a thread (8 MiB of stack
# reserved, only the pages it touches resident): 45-50 KiB measured with a head at the cap, so about 3 MiB for
# all 64 (tests/test_http.py holds 30 to at most 10 MiB), against the DaemonSet's 128 MiB. Beyond the cap a
# connection is closed at once, unanswered and without a thread, and a scrape arriving then is refused too
# (the scrape fails: up == 0). The trade-off: whoever holds 64 connections keeps scrapes out while it holds
# them, but cannot take the memory or threads the probes need; and holding one takes work (a head within
# HEAD_DEADLINE_S, then a request at least every REQUEST_TIMEOUT_S).
MAX_CONNECTIONS = 64
REQUEST_TIMEOUT_S = 30.0


def parse_listen_address(address: str) -> tuple[str, int]:
    """`:10130`, `0.0.0.0:10130`, `[::1]:10130` or `localhost:10130` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not host:port (e.g. :10130, 127.0.0.1:10130, [::1]:10130)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def exposition_format(accept: str) -> str:
    """The content type a scrape with this Accept header gets."""
    return protobuf.CONTENT_TYPE if protobuf.wanted(accept) else choose_encoder(accept)[1]


class SharedRender:
    """Concurrent scrapes share one render: a scrape that arrives while one is being rendered waits for it and
    gets its bytes, instead of rendering the same state again (rendering is CPU-bound and holds the GIL, so N
    renders at once would take N times as long for everyone). A scrape never gets a render that started before
    it arrived plus one: at most one render old."""

    def __init__(self, render: Callable[[str], tuple[bytes, str]]) -> None:
        self._render = render  # Accept header -> (body, content type)
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}

    def get(self, accept: str) -> tuple[bytes, str]:
        key = exposition_format(accept)  # one flight per exposition format
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
        assert flight is not None
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.result
        try:
            flight.result = self._render(accept)
        except Exception as err:
            flight.error = err
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()
        return flight.result


class _Flight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: tuple[bytes, str] = (b"", "")
        self.error: Exception | None = None


class ExporterHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        web: WebConfigWatcher,
        landing: Callable[[], str] | None = None,
        telemetry_path: str = "/metrics",
    ) -> None:
        host = address[0]
        self.address_family = socket.AF_INET6 if (not host or ":" in host) else socket.AF_INET
        self.registry = registry
        self.web = web
        self.landing = landing or (lambda: "")
        self.telemetry_path = telemetry_path
        self.ready = threading.Event()
        self.renders = SharedRender(self._render)
        self.text = TextExposition()  # remembers series' text from one scrape to the next, in either format
        self._stop_reading, self._stop_writing = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._stopped = threading.Event()
        self._stopped.set()  # not serving yet: shutdown() has nothing to wait for
        self._bucket: TokenBucket | None = None  # rate_limit: one per listener, as in exporter-toolkit
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._refusal_logged = -60.0  # monotonic time of the last warning that the cap was reached
        # finish_request() makes each _Handler itself, with its head's deadline: socketserver never calls it.
        super().__init__((host or "::", address[1]), _Handler)  # type: ignore[arg-type]

    def serve_forever(self, poll_interval: float = 0.0) -> None:
        """Accept until shutdown(). socketserver's loop wakes every poll_interval to look for a shutdown
        request: idle, that is the exporter's most frequent wake-up. This one sleeps until a connection or
        shutdown() arrives."""
        self._stopped.clear()
        name_this_thread("vp http")
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(self._stop_reading, selectors.EVENT_READ)
                while not self._stopping:
                    for key, _ in selector.select():
                        if key.fileobj is self and not self._stopping:
                            self._handle_request_noblock()  # type: ignore[attr-defined]  # not in typeshed
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever() (running in another thread) and wait for it."""
        self._stopping = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._stop_writing, b"x")
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        for fd in (self._stop_reading, self._stop_writing):
            with contextlib.suppress(OSError):
                os.close(fd)

    def allow(self, config: WebConfig) -> bool:
        """rate_limit: False when the request is over the limit (answered 429, before authentication)."""
        if config.rate_limit is None:
            return True
        bucket = self._bucket
        if bucket is None or bucket.limit != config.rate_limit:  # a changed limit starts a full bucket
            bucket = self._bucket = TokenBucket(config.rate_limit)
        return bucket.allow()

    def _render(self, accept: str) -> tuple[bytes, str]:
        if protobuf.wanted(accept):  # native histograms: only for a scraper that asks for it first
            return protobuf.generate(self.registry), protobuf.CONTENT_TYPE
        encoder, content_type = choose_encoder(accept)
        if encoder is generate_latest:  # the text format: the same bytes, rendered faster
            return self.text.generate(self.registry), content_type
        escaping = _openmetrics_escaping(encoder)
        if escaping is not None:  # OpenMetrics 1.0.0, which Prometheus asks for first: the same, faster
            return self.text.generate_openmetrics(self.registry, escaping), content_type
        return encoder(self.registry), content_type

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            try:  # one socket for IPv4 and IPv6, as Go's ":port" does
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except OSError:
                pass
        super().server_bind()

    def process_request(self, request: _Request, client_address: _Client) -> None:
        """A thread for the connection if fewer than MAX_CONNECTIONS are open; beyond, it is closed at once."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            now = time.monotonic()
            if now - self._refusal_logged >= 60:  # once a minute at most: a flood must not flood the log too
                self._refusal_logged = now
                log.warning(
                    "%d connections open, the most served at once: new ones are closed unanswered (from %s)",
                    MAX_CONNECTIONS,
                    client_address[0],
                )
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nothing else will give the slot back
            self._slots.release()
            raise

    def process_request_thread(self, request: _Request, client_address: _Client) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: _Request, client_address: _Client) -> None:
        deadline = time.monotonic() + HEAD_DEADLINE_S  # for the first request's head, the handshake included
        assert isinstance(request, socket.socket)  # a TCP server's
        config = self.web.current()
        connection: socket.socket = request
        # The headers and the body go out in two writes; with Nagle's algorithm the body's last segment would
        # wait for the client's delayed ACK of the headers (40 ms on Linux). Go's servers set this too.
        with contextlib.suppress(OSError):
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if config.tls is not None:
            request.settimeout(HEAD_DEADLINE_S)  # ssl bounds the whole handshake by it, not each read
            try:
                connection = config.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as err:
                log.debug("TLS handshake with %s failed: %s", client_address[0], err)
                return
            if config.allowed_sans is not None and not _allowed(connection, config.allowed_sans):
                # Go's exporter-toolkit fails the handshake here; the connection is closed unanswered alike.
                log.debug("client %s refused: no SAN in client_allowed_sans", client_address[0])
                connection.close()
                return
        try:
            connection.settimeout(REQUEST_TIMEOUT_S)
            _Handler(connection, client_address, self, deadline)
        finally:
            if connection is not request:
                connection.close()

    def handle_error(self, request: _Request, client_address: _Client) -> None:
        log.debug("connection from %s ended with an error", client_address[0], exc_info=True)


def _openmetrics_escaping(encoder: Callable[[Collector], bytes]) -> str | None:
    """The escaping of the encoder choose_encoder picked if it is OpenMetrics 1.0.0 in an escaping TextExposition
    writes; else None (another version or escaping, or a prometheus_client that chooses differently)."""
    if not isinstance(encoder, functools.partial) or encoder.func is not openmetrics.generate_latest or encoder.args:
        return None
    options = encoder.keywords
    if options.keys() != {"escaping", "version"} or options["version"] != "1.0.0":
        return None
    escaping: str = options["escaping"]
    return escaping if escaping in OPENMETRICS_ESCAPINGS else None


def _allowed(connection: ssl.SSLSocket, allowed: tuple[str, ...]) -> bool:
    """client_allowed_sans: the verified client certificate names one of them."""
    certificate = connection.getpeercert()
    if not certificate:
        return False
    return any(name in allowed for name in certificate_sans(certificate))


class _HeadTooLarge(Exception):
    """A request head over HEAD_MAX_BYTES."""


class _DeadlineIO(socket.SocketIO):
    """A connection's raw reads. While `deadline` is set (a request head is being read), each recv may wait only
    until then: a socket timeout bounds each recv, not their sum, so a client sending a byte at a time would
    otherwise be waited for without end."""

    def __init__(self, connection: socket.socket) -> None:
        super().__init__(connection, "rb")
        self.connection = connection
        self.deadline: float | None = None

    def readinto(self, buffer: WriteableBuffer) -> int | None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request head was not in by its deadline")
            self.connection.settimeout(left)
        return super().readinto(buffer)


class _Handler(BaseHTTPRequestHandler):
    server: ExporterHTTPServer
    server_version = f"volprobe/{__version__}"
    protocol_version = "HTTP/1.1"
    # A request line that does not parse still gets a status line (the stdlib's default, HTTP/0.9, sends the
    # error page bare).
    default_request_version = "HTTP/1.0"

    def __init__(
        self, request: socket.socket, client_address: _Client, server: ExporterHTTPServer, head_deadline: float
    ) -> None:
        self._head_deadline = head_deadline  # the first request's: set at accept
        self._heads = 0  # request heads begun on this connection
        super().__init__(request, client_address, server)  # serves the connection

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own reader: replaced by one that keeps the head's deadline
        self._reader = _DeadlineIO(self.connection)
        self.rfile = self._buffered = io.BufferedReader(self._reader)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    _config: WebConfig | None = None  # the web config of the request being answered

    def handle_one_request(self) -> None:
        self._config = None  # each request sees the web config as it is when it arrives, as exporter-toolkit's
        try:
            head = self._read_head()
        except _HeadTooLarge:
            self.requestline = self.request_version = self.command = ""  # as the stdlib has them for its 414
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, explain=f"over {HEAD_MAX_BYTES} bytes")
            return
        if head is None:
            self.close_connection = True
            return
        # The stdlib parses the head read here, from memory: the limits above bound what it reads.
        reader, self.rfile = self.rfile, io.BytesIO(head)
        try:
            super().handle_one_request()
        finally:
            self.rfile = reader

    def _read_head(self) -> bytes | None:
        """The next request head, from request line to blank line. None when the connection is to close
        unanswered: the client closed it, was idle past REQUEST_TIMEOUT_S, or missed the head's deadline."""
        try:
            if self._heads:  # kept alive: the next request may take the idle timeout to begin
                if not self._buffered.peek(1):
                    return None
                self._head_deadline = time.monotonic() + HEAD_DEADLINE_S
            self._heads += 1
            self._reader.deadline = self._head_deadline
            head = bytearray()
            while True:
                line = self._buffered.readline(HEAD_MAX_BYTES + 1 - len(head))
                head += line
                if len(head) > HEAD_MAX_BYTES:
                    raise _HeadTooLarge
                if not line.endswith(b"\n"):
                    return None  # closed by the client mid-head
                if line in (b"\r\n", b"\n"):  # the blank line that ends the head (or a blank request line)
                    return bytes(head)
        except TimeoutError:
            log.debug("%s: no complete request head in time; connection closed", self.address_string())
            return None
        finally:
            self._reader.deadline = None
            self.connection.settimeout(REQUEST_TIMEOUT_S)  # for the response, and the idle wait after it

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        # No request here takes a body. One announced is refused and the connection closed, before the rate
        # limit and authentication: left unread, its bytes would be taken for a next request, which a proxy
        # pooling connections would then answer to someone else (request smuggling).
        if self.headers.defects:  # a line that is no header: what it hides (a "Content-Length : 5") is unknown
            self.send_error(HTTPStatus.BAD_REQUEST, explain="a header line is malformed")
            return False
        lengths = [value.strip() for value in self.headers.get_all("Content-Length", [])]
        if not all(length.isascii() and length.isdigit() for length in lengths):
            self.send_error(HTTPStatus.BAD_REQUEST, explain="Content-Length is not a number")
            return False
        if self.headers.get_all("Transfer-Encoding") or any(int(length) for length in lengths):
            self.send_error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, explain="this server takes no request body")
            return False
        return True

    def handle_expect_100(self) -> bool:
        """No "100 Continue": a body is never read, and one announced is refused above with a final status."""
        return True

    def _web(self) -> WebConfig:
        if self._config is None:
            self._config = self.server.web.current()
        return self._config

    def end_headers(self) -> None:
        # The security headers of http_server_config go on every response, the stdlib's error pages too.
        for name, value in self._web().headers.items():
            self.send_header(name, value)
        super().end_headers()

    def _over_limit(self) -> bool:
        if self.server.allow(self._web()):
            return False
        self._send(429, b"Too Many Requests\n", "text/plain; charset=utf-8")
        return True

    def do_HEAD(self) -> None:
        self.do_GET()

    def _method_not_allowed(self) -> None:
        """Scrapes are GET (or HEAD): anything else gets 405 and what is allowed, not the stdlib's 501."""
        self.close_connection = True
        if self._over_limit():
            return
        self._send(405, b"Method Not Allowed\n", "text/plain; charset=utf-8", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _method_not_allowed

    def do_GET(self) -> None:
        if self._over_limit():
            return
        config = self._web()
        if not self.server.web.authorized(config, self.headers.get("Authorization")):
            self._send(
                401,
                b"Unauthorized\n",
                "text/plain; charset=utf-8",
                {"WWW-Authenticate": 'Basic realm="volprobe"'},
            )
            return
        path = urlsplit(self.path).path
        if path == self.server.telemetry_path:
            try:
                body, content_type = self.server.renders.get(self.headers.get("Accept", ""))
            except Exception:
                log.exception("scrape failed")
                self._send(500, b"scrape failed; see the exporter's log\n", "text/plain; charset=utf-8")
                return
            extra = {}
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                body = gzip.compress(body, compresslevel=1)
                extra["Content-Encoding"] = "gzip"
            self._send(200, body, content_type, extra)
        elif path in ("/-/healthy", "/-/ready"):
            ready = path == "/-/healthy" or self.server.ready.is_set()
            self._send(200 if ready else 503, b"OK\n" if ready else b"Starting\n", "text/plain; charset=utf-8")
        elif path == "/" and self.server.telemetry_path != "/":
            self._send(200, self.server.landing().encode(), "text/html; charset=utf-8")
        else:
            self._send(404, b"Not Found\n", "text/plain; charset=utf-8")


def landing_page(rows: list[tuple[str, str, str, str]], telemetry_path: str = "/metrics") -> str:
    """The / page: what this is, where the metrics are, and what is being probed."""
    body = (
        "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        or "<tr><td colspan=4>no targets</td></tr>"
    )
    return (
        "<!DOCTYPE html><html><head><title>volprobe</title></head><body>"
        f"<h1>volprobe {html.escape(__version__)}</h1>"
        "<p>Queue-depth-1 direct I/O probes of block volumes: latency, throttling and warm-up.</p>"
        f'<p><a href="{html.escape(telemetry_path)}">Metrics</a> &middot; <a href="/-/healthy">Health</a></p>'
        "<table border=1 cellpadding=4><tr><th>target</th><th>path</th><th>device</th><th>probes</th></tr>"
        f"{body}</table></body></html>"
    )
