"""HTTP(S) endpoint: /metrics, a landing page and /-/healthy, with the exporter-toolkit web configuration.

Connections are served by one event loop (asyncio) in one thread, as Go's netpoller serves node_exporter's: an
idle, slow or unauthenticated connection costs a socket and a few KiB of buffers, never a thread (issue 41: 64
idle keep-alive connections used to fill a cap of 64 threads and keep every scrape out). The loop reads each
request head within its bounds, answers what is cheap itself (health, errors, 401, 404, 405, 429), and hands
what costs CPU to threads: bcrypt to one thread of its own (PasswordChecks), renders to a few workers.

What a client can make the server hold is bounded:
- each request head (request line and headers) within HEAD_MAX_BYTES, in by HEAD_DEADLINE_S (the first one
  from accept, the TLS handshake included; a kept-alive connection may idle REQUEST_TIMEOUT_S between
  requests), and no request body, ever (one announced is refused and the connection closed);
- at most `max_connections` connections (MAX_CONNECTIONS, lowered to fit the open-files limit). At the bound a
  new connection is not refused: room is made by closing a connection that is waiting (not in a request) of the
  address holding the most, one that never made an authorised request first, the oldest first. So whoever holds
  connections cannot keep a newcomer from another address out, nor an authorised scraper from their own;
- a response is written within REQUEST_TIMEOUT_S, or the connection is closed; and the next request on a
  connection is not parsed, nor its bytes read, until its client has taken all but SEND_QUEUE_MAX of the answers
  sent: a client pipelining requests it never reads the answers of costs one answer and a few KiB of requests;
- connections in a request (its answer being made) are bounded per client and in all (BUSY_*: beyond, 503),
  health checks too; a request whose credentials were verified before (the cache) is never refused so, nor
  waits behind unchecked passwords: whoever fills the server, an authorised scraper is answered;
- any request gets a status: a malformed request line (a target no URL, a stray %, bytes beyond ASCII, a method
  no token, a bad version) 400, and anything failing unexpectedly 500; what a client can make the server log is
  bounded (LogLimit: a line per kind a minute, and a count of those left out);
- /-/healthy and /-/ready need no credentials and take no rate-limit token: they tell nothing but that the
  process answers, and a kubelet's or systemd's check has no password (exporter-toolkit guards every path; a
  DaemonSet's httpGet probe could then never pass with basic auth on).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import fcntl
import functools
import gzip
import html
import io
import ipaddress
import logging
import os
import re
import resource
import socket
import ssl
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from . import __version__, protobuf
from .exposition import OPENMETRICS_ESCAPINGS, TextExposition
from .logs import fields
from .osthread import name_this_thread
from .webconfig import Credential, TokenBucket, WebConfig, WebConfigWatcher, certificate_sans

log = logging.getLogger(__name__)

_Client = tuple[Any, ...]  # (host, port), and flow and scope for IPv6

# A connection's first request head must be in by HEAD_DEADLINE_S after it is accepted, the TLS handshake
# included; a later one on a kept-alive connection may take REQUEST_TIMEOUT_S to begin (idle), then has
# HEAD_DEADLINE_S. A scraper sends its head in one write, so seconds are ample on any network.
HEAD_DEADLINE_S = 5.0
# Request line plus headers. Prometheus sends well under 1 KiB; 32 KiB leaves room for a browser's cookies
# behind a proxy (nginx's default allows 4 x 8 KiB). The stdlib bounds only each line (64 KiB) and the count (100).
HEAD_MAX_BYTES = 32 * 1024
# Connections held at once. One costs a socket, its transport and buffers, a few KiB (measured in
# tests/test_http.py and bench/connections: about 6 KiB idle, 15 KiB pipelining requests it never reads the
# answers of): 4096 of them about 60 MiB at most, against the DaemonSet's 128 MiB.
# Lowered to leave OPEN_FILES_RESERVE of the open-files limit to the probes and the rest.
MAX_CONNECTIONS = 4096
OPEN_FILES_RESERVE = 256
REQUEST_TIMEOUT_S = 30.0
# What a connection may make the server buffer (issue 52: 800 connections pipelining health checks they never
# read took 100 KiB each). Its transport stops reading past twice READ_LIMIT unparsed. The next request on a
# connection is parsed only once its answer is written whole (handed to the kernel) and the kernel holds at
# most SEND_QUEUE_MAX of its answers not yet taken by the client (Linux grows a socket's send buffer to 4 MiB:
# a client that never reads would have had it fill that with answers); its reading is paused meanwhile. So a
# connection holds at most one answer, 2 x READ_LIMIT of requests, and SEND_QUEUE_MAX in the kernel beyond.
READ_LIMIT = 4 * 1024
WRITE_BUFFER_HIGH = 0
SEND_QUEUE_MAX = 16 * 1024
# The kernel's receive buffer of a connection (Linux doubles it for its bookkeeping), set on the listening socket:
# what a client can have queued unread, and so what one read takes (asyncio reads up to 256 KiB at a time, which
# a client pipelining requests filled at once). A request head is at most HEAD_MAX_BYTES: it comes in a few reads.
RECEIVE_BUFFER = 8 * 1024
# Connections in a request at once (its head read, its answer not yet made: waiting for a password check or a
# render), per client and in all; beyond, a request is answered 503 at once. Health checks count as any request;
# an authorised one (its credentials in the verified cache) is never refused for it. Prometheus has one or two in
# a request. A connection whose answer waits for its client to read it is not in a request: room may be made
# by closing it.
BUSY_PER_CLIENT = 64
BUSY_CONNECTIONS = 256
# What a client can make the server log: at most LOG_LINES lines of each kind every LOG_INTERVAL_S; the count of
# those left out is logged when the interval ends.
LOG_LINES = 1
LOG_INTERVAL_S = 60.0
# Threads that render /metrics and the landing page (rendering holds the GIL: more would not render faster).
RENDER_WORKERS = 2
# Password checks (bcrypt) waiting per client (client_key) and in all; beyond, a request needing one is answered
# 429. And the clients remembered as once authorised, whose checks go first.
PENDING_CHECKS_PER_CLIENT = 4
PENDING_CHECKS = 256
TRUSTED_CLIENTS = 64
HEALTH_PATHS = ("/-/healthy", "/-/ready")


def parse_listen_address(address: str) -> tuple[str, int]:
    """`:10130`, `0.0.0.0:10130`, `[::1]:10130` or `localhost:10130` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not host:port (e.g. :10130, 127.0.0.1:10130, [::1]:10130)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


SD_LISTEN_FDS_START = 3


def systemd_sockets() -> list[socket.socket]:
    """The listening sockets systemd passed this process (socket activation, sd_listen_fds(3)): descriptors 3
    onwards, LISTEN_FDS of them, if LISTEN_PID is this process. The variables are then removed, as
    sd_listen_fds(1) does, so that no child takes the sockets for its own."""
    count, pid = os.environ.get("LISTEN_FDS", ""), os.environ.get("LISTEN_PID", "")
    for name in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if not (count.isdigit() and pid.isdigit() and int(pid) == os.getpid()):
        return []
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))
    return sockets


def raise_open_files_limit() -> int:
    """Raise the soft limit of open files to the hard one, as Go's runtime does at start for node_exporter
    (systemd gives services 1024 soft, 524288 hard); the soft limit in force is returned."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_bound() -> int:
    """MAX_CONNECTIONS, or fewer if the open-files limit leaves less than that beside OPEN_FILES_RESERVE."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - OPEN_FILES_RESERVE))


def _encoder(accept: str) -> tuple[Callable[[Collector], bytes], str]:
    """prometheus_client's choice for an Accept header; its own text format where it cannot choose (it raises on
    some malformed versions, e.g. `text/plain;version=1.x`), as Go's expfmt.Negotiate falls back."""
    try:
        return choose_encoder(accept)
    except Exception:  # any header a client sends must get an answer, not a 500
        return generate_latest, CONTENT_TYPE_PLAIN_0_0_4


def exposition_format(accept: str) -> str:
    """The content type a scrape with this Accept header gets."""
    return protobuf.CONTENT_TYPE if protobuf.wanted(accept) else _encoder(accept)[1]


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


class _Connection:
    """What the server knows of one open connection: whose it is, whether it is in a request, and whether it
    ever made an authorised one (what it gave up first when room is made)."""

    __slots__ = ("busy", "checking", "client", "since", "transport", "trusted")

    def __init__(self, client: str, transport: asyncio.WriteTransport) -> None:
        self.client = client  # client_key of its address
        self.transport = transport
        self.busy = False
        self.checking = False  # in a request that waits for its password check (bcrypt)
        self.trusted = False
        self.since = time.monotonic()


# One bcrypt at a time in the whole process, each followed by as long a rest, whichever listener asked for it.
_BCRYPT_SLOT = threading.Lock()


def _check_and_rest(web: WebConfigWatcher, credential: Credential) -> bool:
    with _BCRYPT_SLOT:
        started = time.monotonic()
        try:
            return web.check(credential)
        finally:
            time.sleep(time.monotonic() - started)  # at most half a core


def threads(count: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of `count` threads named `name`, all started now: the server's threads are there from its start
    (a pool starts them at its first tasks otherwise), so the thread count says nothing of its clients."""
    pool = concurrent.futures.ThreadPoolExecutor(count, initializer=name_this_thread, initargs=(name,))
    # Each waits for the others and for this thread, so none is idle when the next is asked for, and all have
    # begun before the pool is handed out: a shutdown(cancel_futures=True) at once must not cancel a wait the
    # started ones count on (they would then wait for ever, and the interpreter for them at exit).
    barrier = threading.Barrier(count + 1)
    for _ in range(count):
        pool.submit(barrier.wait, 10)
    with contextlib.suppress(threading.BrokenBarrierError):  # a machine too busy to start them in 10 s
        barrier.wait(10)
    return pool


def client_key(address: str) -> str:
    """Whose a connection is, for fairness: its IPv4 address (an IPv4-mapped IPv6 one too), or its IPv6 /64, the
    least a host is given, so that one host's many addresses count as one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class LogLimit:
    """What a client can make the server log, bounded: at most LOG_LINES warnings of each kind every
    LOG_INTERVAL_S, and one line later with the count of those left out. Safe from any thread; the count is
    logged by the event loop at the interval's end (or with the next line of its kind, without a loop)."""

    def __init__(self, address: str = "") -> None:
        self.address = address  # the listener's, its log lines' address field
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._windows: dict[str, list[Any]] = {}  # kind -> [start, lines logged, lines left out, flush due]

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            window = self._windows.get(kind)
            if window is None or now - window[0] >= LOG_INTERVAL_S:
                left_out = window[2] if window is not None else 0
                window = self._windows[kind] = [now, 0, 0, False]
                if left_out:
                    self._left_out(kind, left_out)
            if window[1] < LOG_LINES:
                window[1] += 1
                log.warning(message, *args, extra=fields(address=self.address))
                return
            window[2] += 1
            if window[3] or self.loop is None:
                return
            window[3] = True
            due = LOG_INTERVAL_S - (now - window[0])
        with contextlib.suppress(RuntimeError):  # the loop closed: the next line of its kind tells the count
            self.loop.call_soon_threadsafe(self._flush_later, kind, window, due)

    def _flush_later(self, kind: str, window: list[Any], due: float) -> None:
        asyncio.get_running_loop().call_later(max(0.0, due), self._flush, kind, window)

    def _flush(self, kind: str, window: list[Any]) -> None:
        with self._lock:
            if self._windows.get(kind) is not window or not window[2]:
                return
            left_out, window[2] = window[2], 0
            self._left_out(kind, left_out)

    def _left_out(self, kind: str, count: int) -> None:
        log.warning(
            "%d more %r lines left out in the last %g s",
            count,
            kind,
            LOG_INTERVAL_S,
            extra=fields(address=self.address),
        )


class PasswordChecks:
    """bcrypt of credentials not in the cache, on a thread of its own, one at a time in the process and each
    followed by as long a rest: failed passwords, however many, take at most half a core. The checks waiting are
    taken one client after another (round robin), those of clients that were ever authorised first; at most
    PENDING_CHECKS_PER_CLIENT from one client and PENDING_CHECKS in all wait (beyond, 429), and none longer
    than REQUEST_TIMEOUT_S. One client's flood so delays another client's check by one check per client, and
    a known scraper's (a rotated password) by none."""

    def __init__(self, web: WebConfigWatcher, logs: LogLimit | None = None) -> None:
        self.web = web
        self.logs = logs or LogLimit()
        self._queues: collections.OrderedDict[str, collections.deque[tuple[Credential, asyncio.Future[bool]]]] = (
            collections.OrderedDict()
        )
        self._waiting = 0
        self.trusted: collections.OrderedDict[str, None] = collections.OrderedDict()  # clients once authorised
        self._pool = threads(1, "vp auth")
        self._wake: asyncio.Event | None = None

    def authorised(self, client: str) -> None:
        self.trusted[client] = None
        self.trusted.move_to_end(client)
        while len(self.trusted) > TRUSTED_CLIENTS:
            self.trusted.popitem(last=False)

    async def check(self, client: str, credential: Credential) -> bool | None:
        """Whether the credential is good; None if too many checks wait (this client's, or all), or it waited
        REQUEST_TIMEOUT_S."""
        queue = self._queues.setdefault(client, collections.deque())
        if len(queue) >= PENDING_CHECKS_PER_CLIENT or self._waiting >= PENDING_CHECKS:
            if not queue:
                del self._queues[client]
            return None
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        queue.append((credential, future))
        self._waiting += 1
        assert self._wake is not None, "run() is running"
        self._wake.set()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                return await future  # cancelled with the waiter: run() then skips it
        except TimeoutError:
            return None

    def _next(self) -> tuple[Credential, asyncio.Future[bool]]:
        client = next((c for c in self._queues if c in self.trusted), next(iter(self._queues)))
        queue = self._queues.pop(client)
        job = queue.popleft()
        if queue:
            self._queues[client] = queue  # its next check after every other client's
        self._waiting -= 1
        return job

    async def run(self) -> None:
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        while True:
            if not self._queues:
                self._wake.clear()
                await self._wake.wait()
                continue
            credential, future = self._next()
            if future.done():  # its waiter went meanwhile
                continue
            try:
                result = await loop.run_in_executor(self._pool, _check_and_rest, self.web, credential)
            except Exception as err:  # that request fails (500 is not owed: it is refused), the checks go on
                self.logs.warn("password check", "a password check failed: %r", err)
                result = False
            if not future.done():
                future.set_result(result)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Stream:
    """A connection's bytes, plain or through TLS (an SSLObject over memory buffers, so that a failed handshake
    still sends its alert, which asyncio's own TLS drops), read a line at a time into a buffer of its own."""

    READ_SIZE = READ_LIMIT  # what one read takes from the stream reader: the unparsed rest of a pipeline

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buffer = bytearray()
        self.tls: ssl.SSLObject | None = None
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()

    async def handshake(self, context: ssl.SSLContext) -> None:
        self.tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        while True:
            try:
                self.tls.do_handshake()
            except ssl.SSLWantReadError:
                self._send_outgoing()  # the handshake's next flight
                await self._receive()
            except ssl.SSLError:
                self._send_outgoing()  # its alert
                raise
            else:
                self._send_outgoing()
                return

    def peercert(self) -> dict[str, Any] | None:
        return self.tls.getpeercert() if self.tls is not None else None

    def write(self, data: bytes) -> None:
        if self.tls is None:
            self.writer.write(data)
        else:
            self.tls.write(data)
            self._send_outgoing()

    async def wait_for_data(self) -> None:
        """Until some of a request is in (EOFError if the connection closes first)."""
        while not self.buffer:
            await self._fill()

    async def readline(self, limit: int) -> bytes | None:
        """The next line, its newline included; None if none ends within `limit` bytes; EOFError at the end."""
        while True:
            end = self.buffer.find(b"\n", 0, limit)
            if end >= 0:
                line = bytes(self.buffer[: end + 1])
                del self.buffer[: end + 1]
                return line
            if len(self.buffer) >= limit:
                return None
            await self._fill()

    async def _fill(self) -> None:
        if self.tls is None:
            self.buffer += await self._read()
            return
        while True:
            try:
                data = self.tls.read(self.READ_SIZE)
            except ssl.SSLWantReadError:
                self._send_outgoing()  # TLS 1.3 sends session tickets after the handshake
                await self._receive()
                continue
            except ssl.SSLZeroReturnError:  # the client's close_notify
                raise EOFError from None
            except ssl.SSLError:
                self._send_outgoing()  # the alert
                raise
            self._send_outgoing()
            if not data:
                raise EOFError
            self.buffer += data
            return

    async def _receive(self) -> None:
        self._incoming.write(await self._read())

    async def _read(self) -> bytes:
        data = await self.reader.read(self.READ_SIZE)
        if not data:
            raise EOFError
        return data

    def close_notify(self) -> None:
        """TLS: tell the client the connection ends (best effort: its answer is not waited for)."""
        if self.tls is not None:
            with contextlib.suppress(ssl.SSLError, ValueError):
                self.tls.unwrap()
            self._send_outgoing()

    def _send_outgoing(self) -> None:
        if self._outgoing.pending:
            self.writer.write(self._outgoing.read())


def address_text(name: object) -> str:
    """A socket's address as node_exporter logs it: host:port, an IPv6 host in brackets ([::]:9100); a Unix
    socket's path, an abstract one's name after "@"."""
    if isinstance(name, tuple) and len(name) >= 2:
        host, port = name[0], name[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    if isinstance(name, bytes):  # an abstract Unix socket: a NUL, then its name
        return "@" + name[1:].decode("utf-8", "backslashreplace")
    return str(name) or "unnamed"


def listen(address: tuple[str, int]) -> socket.socket:
    """A socket listening on `address` (host, port; host "" for every address, IPv4 and IPv6), or OSError."""
    host = address[0]
    family = socket.AF_INET6 if (not host or ":" in host) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):  # one socket for IPv4 and IPv6, as Go's ":port" does
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host or "::", address[1]))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


class ExporterHTTPServer:
    """One listening socket, served by an event loop in the thread that calls serve_forever()."""

    def __init__(
        self,
        address: tuple[str, int] | socket.socket,
        registry: CollectorRegistry,
        web: WebConfigWatcher,
        landing: Callable[[], str] | None = None,
        telemetry_path: str = "/metrics",
        max_requests: int = 0,
        max_connections: int | None = None,
    ) -> None:
        """Listen on `address` (host, port), or serve `address` if it is a socket listening already (one systemd
        passed: systemd_sockets()), which the server then owns. `max_requests`: scrapes being rendered or waiting
        for a render at once, beyond which one is answered 503 (0: no limit; --web.max-requests).
        `max_connections`: this listener's share of connection_bound() (all of it by default)."""
        self.registry = registry
        self.max_requests = max_requests
        self.scrapes = 0  # in a render, or waiting for one (the event loop's thread alone counts them)
        self.web = web
        self.landing = landing or (lambda: "")
        self.telemetry_path = telemetry_path
        self.ready = threading.Event()
        self.renders = SharedRender(self._render)
        self.text = TextExposition()  # remembers series' text from one scrape to the next, in either format
        self.max_connections = max_connections or connection_bound()
        self.connections: dict[_Connection, None] = {}  # open ones, oldest first
        self.held: collections.Counter[str] = collections.Counter()  # open connections per client
        self.busy: collections.Counter[str] = collections.Counter()  # connections in a request per client
        self.busy_total = 0
        self.logs = LogLimit()  # its address set below
        self.passwords = PasswordChecks(web, self.logs)
        self._bucket: TokenBucket | None = None  # rate_limit: one per listener, as in exporter-toolkit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()  # not serving yet: shutdown() has nothing to wait for
        self._workers = threads(RENDER_WORKERS, "vp http")
        # The web config is looked at (its files stat'ed, re-read when they changed) on a thread of its own: a
        # file on a hung filesystem must not stop the event loop.
        self._config_pool = threads(1, "vp webconfig")
        self._config_look: asyncio.Future[WebConfig] | None = None
        if isinstance(address, socket.socket):
            self.socket = address
            self.server_address: _Client = self.socket.getsockname()
            self.address = self.logs.address = address_text(self.server_address)
            return
        self.socket = listen(address)
        self.server_address = self.socket.getsockname()
        self.address = address_text(self.server_address)  # its log lines' address field, as node_exporter's
        self.logs.address = self.address

    # -- running ---------------------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until shutdown() (called from another thread, before or after this starts)."""
        name_this_thread("vp http")
        self._stopped.clear()
        try:
            if not self._stopping.is_set():
                asyncio.run(self._serve())
        finally:
            self._stopped.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._loop = self.logs.loop = asyncio.get_running_loop()
        if self._stopping.is_set():  # shutdown() came before the loop could be told
            return
        checks = asyncio.create_task(self.passwords.run())
        # On the listening socket, so that each connection has it from its handshake (its window): set on an
        # accepted one it would come too late for what a client sent at once.
        with contextlib.suppress(OSError):
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        server = await asyncio.start_server(
            self._connection, sock=self.socket, limit=READ_LIMIT, backlog=socket.SOMAXCONN
        )
        try:
            await self._stop.wait()
        finally:
            server.close()
            for connection in list(self.connections):
                connection.transport.abort()
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks

    def shutdown(self) -> None:
        """Stop serve_forever() (running in another thread) and wait for it."""
        self._stopping.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop ended already
                loop.call_soon_threadsafe(stop.set)
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
        self.passwords.close()
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._config_pool.shutdown(wait=False, cancel_futures=True)

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
        encoder, content_type = _encoder(accept)
        if encoder is generate_latest:  # the text format: the same bytes, rendered faster
            return self.text.generate(self.registry), content_type
        escaping = _openmetrics_escaping(encoder)
        if escaping is not None:  # OpenMetrics 1.0.0, which Prometheus asks for first: the same, faster
            return self.text.generate_openmetrics(self.registry, escaping), content_type
        return encoder(self.registry), content_type

    def _warn(self, what: str, message: str, *args: object) -> None:
        """A warning at most LOG_LINES times every LOG_INTERVAL_S for each `what` (LogLimit): a flood must not
        flood the log too. Its address field says which listener (each has its own share of the connections)."""
        self.logs.warn(what, message, *args)

    async def _web_config(self) -> WebConfig:
        """The web config as it is now (its files looked at on a thread of its own); the one in force if that
        look takes over a second (the files on a hung filesystem)."""
        if self._config_look is None or self._config_look.done():
            self._config_look = asyncio.get_running_loop().run_in_executor(self._config_pool, self.web.current)
        try:
            async with asyncio.timeout(1.0):
                return await asyncio.shield(self._config_look)
        except TimeoutError:
            self._warn(
                "webconfig", "web config %s: its files do not answer; serving with the one in force", self.web.path
            )
            return self.web.in_force

    # -- connections -----------------------------------------------------------------------------------------

    def _make_room(self) -> bool:
        """At the bound: close a waiting connection (not in a request), one never authorised first, then of the
        client holding the most, the oldest first; failing that, one never authorised whose request waits for a
        password check (its check is left to run, its answer to no one): wrong passwords held waiting cannot keep
        an authorised scraper out at a low bound. False if every connection is in a request otherwise."""
        waiting = (c for c in self.connections if not c.busy)
        victim = min(waiting, key=lambda c: (c.trusted, -self.held[c.client], c.since), default=None)
        if victim is None:
            checking = (c for c in self.connections if c.checking and not c.trusted)
            victim = min(checking, key=lambda c: (-self.held[c.client], c.since), default=None)
        if victim is None:
            return False
        self._warn(
            "room",
            "%d connections open, the most held at once: closing the oldest waiting one of %s (%d open) to make room",
            self.max_connections,
            victim.client,
            self.held[victim.client],
        )
        victim.transport.abort()
        self._forget(victim)
        return True

    def _forget(self, connection: _Connection) -> None:
        if self.connections.pop(connection, 0) is None:
            self.held[connection.client] -= 1
            if not self.held[connection.client]:
                del self.held[connection.client]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        deadline = time.monotonic() + HEAD_DEADLINE_S  # for the first request's head, the handshake included
        client: _Client = writer.get_extra_info("peername") or ("", 0)
        if len(self.connections) >= self.max_connections and not self._make_room():
            self._warn("full", "%d connections open, every one in a request: closing new ones", self.max_connections)
            writer.transport.abort()
            return
        connection = _Connection(client_key(str(client[0])), writer.transport)
        self.connections[connection] = None
        self.held[connection.client] += 1
        # drain() then waits until the answer is all handed to the kernel (WRITE_BUFFER_HIGH 0).
        writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        sock = writer.get_extra_info("socket")
        # A response larger than the socket buffer would wait for delayed ACKs under Nagle's algorithm. Go's
        # servers set this too.
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = _Stream(reader, writer)
        clean = False  # ended as HTTP ends a connection: what is left of a response may still go out
        try:
            config = await self._web_config()
            if config.tls is not None and not await self._handshake(stream, config, deadline, client):
                return
            first = True
            while True:
                head = await self._read_head(stream, deadline if first else None, client)
                first = False
                if head is None:
                    clean = True
                    return
                with self._in_request(connection):
                    response, close = await self._answer_anyhow(head, client, connection)
                stream.write(response)
                await self._taken(writer)
                connection.since = time.monotonic()
                if close:
                    clean = True
                    return
        except (OSError, TimeoutError, ssl.SSLError) as err:
            log.debug("connection from %s ended: %r", client[0], err)
        except Exception as err:
            self._warn("failed", "connection from %s failed: %r", client[0], err)
            log.debug("connection from %s failed", client[0], exc_info=True)
        finally:
            self._forget(connection)
            if clean:
                stream.close_notify()
                writer.close()
                if writer.transport.get_write_buffer_size():  # a client that does not read: not for long
                    asyncio.get_running_loop().call_later(HEAD_DEADLINE_S, writer.transport.abort)
            else:
                writer.transport.abort()

    @staticmethod
    async def _taken(writer: asyncio.StreamWriter) -> None:
        """Until the answer just written is all handed to the kernel, and the kernel holds at most SEND_QUEUE_MAX
        not yet taken by the client (within REQUEST_TIMEOUT_S, else TimeoutError): no further request on the
        connection is parsed meanwhile, and its reading is paused, so a client that sends requests and never reads
        their answers makes the server hold one answer and what little was read before the pause. The connection
        is not in a request meanwhile: room may be made by closing it."""
        transport = writer.transport
        sock = writer.get_extra_info("socket")
        if not transport.get_write_buffer_size() and _unsent(sock) <= SEND_QUEUE_MAX:
            return
        # Paused here only if reading (the stream reader may have paused it itself, and resumes it itself).
        paused = transport.is_reading()  # type: ignore[attr-defined]
        if paused:
            transport.pause_reading()  # type: ignore[attr-defined]
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                await writer.drain()
                # No event tells that a client took its bytes: looked at 10 ms on, then ever less often (1 s).
                wait = 0.01
                while not transport.is_closing() and _unsent(sock) > SEND_QUEUE_MAX:
                    await asyncio.sleep(wait)
                    wait = min(2 * wait, 1.0)
        finally:
            if paused and not transport.is_closing():
                transport.resume_reading()  # type: ignore[attr-defined]

    async def _answer_anyhow(self, head: bytes, client: _Client, connection: _Connection) -> tuple[bytes, bool]:
        """_answer's, or 500 and the connection closed if it failed: whatever a client sends gets a status, and
        one log line a minute at most (the traceback at debug)."""
        try:
            return await self._answer(head, client, connection)
        except Exception as err:
            self._warn("error", "a request from %s failed: %r; answered 500", client[0], err)
            log.debug("a request from %s failed", client[0], exc_info=True)
            return _INTERNAL_ERROR, True

    @contextlib.contextmanager
    def _in_request(self, connection: _Connection) -> Iterator[None]:
        connection.busy = True
        self.busy[connection.client] += 1
        self.busy_total += 1
        try:
            yield
        finally:
            connection.busy = False
            self.busy_total -= 1
            self.busy[connection.client] -= 1
            if not self.busy[connection.client]:
                del self.busy[connection.client]

    async def _handshake(self, stream: _Stream, config: WebConfig, deadline: float, client: _Client) -> bool:
        assert config.tls is not None
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                await stream.handshake(config.tls)
        except (ssl.SSLError, OSError, TimeoutError, EOFError) as err:
            log.debug("TLS handshake with %s failed: %r", client[0], err)
            return False
        if config.allowed_sans is not None:
            certificate = stream.peercert()
            if not certificate or not any(name in config.allowed_sans for name in certificate_sans(certificate)):
                # Go's exporter-toolkit fails the handshake here; the connection is closed unanswered alike.
                log.debug("client %s refused: no SAN in client_allowed_sans", client[0])
                return False
        return True

    async def _read_head(self, stream: _Stream, deadline: float | None, client: _Client) -> bytes | None:
        """The next request head, from request line to blank line; _TOO_LARGE when over HEAD_MAX_BYTES. None when
        the connection is to close unanswered: the client closed it, was idle past REQUEST_TIMEOUT_S (kept
        alive: `deadline` None), or missed the head's deadline."""
        head = bytearray()
        try:
            if deadline is None:  # kept alive: the next request may take the idle timeout to begin
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    await stream.wait_for_data()
                deadline = time.monotonic() + HEAD_DEADLINE_S
            async with asyncio.timeout_at(_loop_time(deadline)):
                while True:
                    line = await stream.readline(HEAD_MAX_BYTES + 1 - len(head))
                    if line is None:
                        return _TOO_LARGE
                    head += line
                    if len(head) > HEAD_MAX_BYTES:
                        return _TOO_LARGE
                    if line in (b"\r\n", b"\n"):  # the end (or a blank request line)
                        return bytes(head)
        except EOFError:
            return None  # closed by the client, between requests or mid-head
        except TimeoutError:
            log.debug("%s: no complete request head in time; connection closed", client[0])
            return None

    async def _answer(self, head: bytes, client: _Client, connection: _Connection) -> tuple[bytes, bool]:
        """The response to one request head, and whether the connection closes after it."""
        # Each request sees the web config as it is when it arrives, but for a health check or a malformed request:
        # they are answered with the one in force, without a look at its files on another thread (a pipeline of
        # them would otherwise keep its connection in a request, waiting for looks, from first to last).
        config = self.web.in_force
        handler = _Handler(self, client, head, config)
        if handler.parsed and not handler.exempt():
            config = await self._web_config()
            handler = _Handler(self, client, head, config)
        if not handler.parsed:
            return handler.response.getvalue(), handler.close_connection
        # Credentials checked before (the verified cache: a digest and a look-up, no bcrypt) first: an authorised
        # scraper is never refused as busy, whoever fills the server, nor queued behind unchecked passwords.
        verdict: bool | Credential = False
        if handler.guarded():
            verdict = self.web.verdict(config, handler.headers.get("Authorization"))
        proven = verdict is True and bool(config.users)
        if not proven and (self.busy[connection.client] > BUSY_PER_CLIENT or self.busy_total > BUSY_CONNECTIONS):
            self._warn("busy", "too many requests in progress (from %s): answering 503", connection.client)
            handler.unavailable()
            return handler.response.getvalue(), handler.close_connection
        handler.limited = not handler.exempt() and not self.allow(config)
        if not handler.limited and handler.guarded():
            if not isinstance(verdict, bool):
                connection.checking = True
                try:
                    checked = await self.passwords.check(connection.client, verdict)
                finally:
                    connection.checking = False
                handler.limited = checked is None
                verdict = bool(checked)
            handler.authorized = verdict
            if verdict and config.users:
                connection.trusted = True
                self.passwords.authorised(connection.client)
        if handler.costly():
            scrape = handler.route == self.telemetry_path
            if scrape and 0 < self.max_requests <= self.scrapes:
                handler.over_limit(self.max_requests)
                return handler.response.getvalue(), handler.close_connection
            self.scrapes += scrape
            try:
                await asyncio.get_running_loop().run_in_executor(self._workers, handler.respond)
            finally:
                self.scrapes -= scrape
        else:
            handler.respond()
        return handler.response.getvalue(), handler.close_connection


_INTERNAL_ERROR = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 39\r\n"
    b"Connection: close\r\n\r\nthe request failed; see volprobe's log\n"
)


class _TooLarge(bytes):
    """_read_head's answer for a request head over HEAD_MAX_BYTES (its bytes are not kept)."""


_TOO_LARGE = _TooLarge()


def _unsent(sock: Any) -> int:
    """Bytes a connected socket's kernel holds not yet acknowledged by the client (Linux's SIOCOUTQ); 0 where
    that cannot be asked."""
    try:
        answer = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, AttributeError, ValueError):
        return 0
    return int.from_bytes(answer, sys.byteorder, signed=True)


def _loop_time(deadline: float) -> float:
    """A time.monotonic() deadline in the running loop's clock (the same clock, by default)."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - time.monotonic())


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


_METHOD = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,32}")  # a token (RFC 9110), of a sane length
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")  # a % not followed by two hex digits


def _request_target_problem(method: str, target: str) -> str | None:
    """What is malformed in a request line the stdlib parsed (it checks the version, not these), or None."""
    if not _METHOD.fullmatch(method):
        return "the method is not a token"
    if not target.isascii() or not target.isprintable():
        return "the request target is not printable ASCII"
    if _PERCENT.search(target):
        return "the request target has a % not followed by two hex digits"
    try:
        urlsplit(target)
    except ValueError:  # "http://[x]/": not an IPv6 address in its brackets
        return "the request target is not a URL"
    return None


class _Handler(BaseHTTPRequestHandler):
    """One request: parsed from its head by the stdlib's parser, answered into `wfile` (bytes the loop then
    writes). Not a socketserver handler: no socket, no thread of its own."""

    server: ExporterHTTPServer  # type: ignore[assignment]
    server_version = f"volprobe/{__version__}"
    protocol_version = "HTTP/1.1"
    # A request line that does not parse still gets a status line (the stdlib's default, HTTP/0.9, sends the
    # error page bare).
    default_request_version = "HTTP/1.0"

    def __init__(self, server: ExporterHTTPServer, client_address: _Client, head: bytes, config: WebConfig) -> None:
        # Not BaseRequestHandler.__init__, which would serve a socket.
        self.server = server
        self.client_address = client_address
        self.rfile = io.BytesIO(head)
        self.wfile = self.response = io.BytesIO()
        self._config = config
        self.close_connection = True
        self.limited = False  # over the rate limit, or too many password checks waiting: 429
        self.authorized = False
        self.parsed = self._parse(head)

    def _parse(self, head: bytes) -> bool:
        """The stdlib's handle_one_request up to the method call: False when answered already (or to close)."""
        self.command = self.requestline = self.request_version = self._route = ""
        if isinstance(head, _TooLarge):
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, explain=f"over {HEAD_MAX_BYTES} bytes")
            return False
        self.raw_requestline = self.rfile.readline(HEAD_MAX_BYTES + 1)
        if not self.parse_request():
            return False
        problem = _request_target_problem(self.command, self.path)
        if problem is not None:
            self.send_error(HTTPStatus.BAD_REQUEST, explain=problem)
            return False
        self._route = urlsplit(self.path).path
        if not hasattr(self, "do_" + self.command):
            self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command!r})")
            return False
        return True

    @property
    def route(self) -> str:
        """The request target's path (its query left out), as _parse found it."""
        return self._route

    def exempt(self) -> bool:
        """Health checks: no rate limit, no credentials."""
        return self.command in ("GET", "HEAD") and self.route in HEALTH_PATHS

    def guarded(self) -> bool:
        """Answered only with credentials (when basic_auth_users has any)."""
        return self.command in ("GET", "HEAD") and self.route not in HEALTH_PATHS

    def costly(self) -> bool:
        """Answered by a render worker: a render, or the landing page (which reads the targets)."""
        return (
            self.guarded() and self.authorized and not self.limited and self.route in (self.server.telemetry_path, "/")
        )

    def respond(self) -> None:
        getattr(self, "do_" + self.command)()

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

    def end_headers(self) -> None:
        # The security headers of http_server_config go on every response, the stdlib's error pages too.
        for name, value in self._config.headers.items():
            self.send_header(name, value)
        super().end_headers()

    def unavailable(self) -> None:
        """Too many requests in progress (from this client, or in all)."""
        self.close_connection = True
        self._send(503, b"Too many requests in progress, try again later.\n", "text/plain; charset=utf-8")

    def over_limit(self, limit: int) -> None:
        """--web.max-requests reached: promhttp's answer."""
        body = f"Limit of concurrent requests reached ({limit}), try again later.\n".encode()
        self._send(503, body, "text/plain; charset=utf-8")

    def _too_many(self) -> None:
        self._send(429, b"Too Many Requests\n", "text/plain; charset=utf-8")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _method_not_allowed(self) -> None:
        """Scrapes are GET (or HEAD): anything else gets 405 and what is allowed, not the stdlib's 501."""
        self.close_connection = True
        if self.limited:
            self._too_many()
            return
        self._send(405, b"Method Not Allowed\n", "text/plain; charset=utf-8", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _method_not_allowed

    def do_GET(self) -> None:
        path = self.route
        if path in HEALTH_PATHS:
            ready = path == "/-/healthy" or self.server.ready.is_set()
            self._send(200 if ready else 503, b"OK\n" if ready else b"Starting\n", "text/plain; charset=utf-8")
            return
        if self.limited:
            self._too_many()
            return
        if not self.authorized:
            self._send(
                401,
                b"Unauthorized\n",
                "text/plain; charset=utf-8",
                {"WWW-Authenticate": 'Basic realm="volprobe"'},
            )
            return
        if path == self.server.telemetry_path:
            try:
                body, content_type = self.server.renders.get(self.headers.get("Accept", ""))
            except Exception as err:
                self.server._warn("scrape failed", "scrape failed: %r", err)
                log.debug("scrape failed", exc_info=True)
                self._send(500, b"scrape failed; see the exporter's log\n", "text/plain; charset=utf-8")
                return
            extra = {}
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                body = gzip.compress(body, compresslevel=1)
                extra["Content-Encoding"] = "gzip"
            self._send(200, body, content_type, extra)
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
