"""Raw connections to a server under test: what it sends, and whether it hangs up, within a time."""

from __future__ import annotations

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
