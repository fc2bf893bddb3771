"""Raw connections to a server under test: what it sends, and whether it hangs up, within a time."""

from __future__ import annotations

import select
import socket
import time


def read_until_closed(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """What the server sends on `sock`, and whether it closed the connection (a reset counts) within `within`
    seconds; a server still holding the connection open then gives False, not a timeout error."""
    deadline = time.monotonic() + within
    data = b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except ConnectionResetError:
        return data, True
    except TimeoutError:
        pass
    return data, False


def exchange(port: int, data: bytes, within: float = 5.0) -> tuple[bytes, bool]:
    """Send `data` on a new connection, then read_until_closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        return read_until_closed(sock, within)


def pipelining(port: int, request: bytes, count: int, source: str = "", receive_buffer: int = 1024) -> socket.socket:
    """A connection from loopback address `source` that sends `count` copies of `request` at once (as many as the
    kernel takes without blocking) and never reads an answer, its receive buffer `receive_buffer` bytes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connect: the window
        if source:
            sock.bind((source, 0))
        sock.settimeout(10)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        data = memoryview(request * count)
        try:
            while data:
                data = data[sock.send(data) :]
        except (BlockingIOError, ConnectionError):
            pass  # the rest stays unsent: the server has stopped reading (or closed the connection)
    except BaseException:
        sock.close()
        raise
    return sock


def wait_answered(socks: list[socket.socket], within: float) -> int:
    """Wait until each of `socks` has something to read (an answer, or the server's close), within `within`
    seconds; how many have."""
    poll = select.poll()  # select() takes no descriptor over 1023
    for sock in socks:
        poll.register(sock, select.POLLIN)
    pending = {sock.fileno() for sock in socks}
    deadline = time.monotonic() + within
    while pending and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poll.poll(min(left, 0.5) * 1000):
            pending.discard(fd)
            poll.unregister(fd)
    return len(socks) - len(pending)
