"""OS-level thread names: `top -H`, `ps -L`, perf and /proc/PID/task/*/comm then tell volprobe's threads apart."""

from __future__ import annotations

import ctypes
import threading

PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def name_this_thread(name: str | None = None) -> None:
    """Give the calling OS thread its Python name (or `name`), cut to the kernel's 15 bytes. Best effort."""
    text = (name or threading.current_thread().name).encode("utf-8", "replace")[:15]
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0)
