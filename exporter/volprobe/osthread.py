"""OS-level thread names: `top -H`, `ps -L`, perf and /proc/PID/task/*/comm then tell volprobe's threads apart."""

from __future__ import annotations

import ctypes
import threading

PR_SET_NAME = 15
PR_SET_TIMERSLACK = 29
_libc = ctypes.CDLL(None, use_errno=True)


def name_this_thread(name: str | None = None) -> None:
    """Give the calling OS thread its Python name (or `name`), cut to the kernel's 15 bytes. Best effort."""
    text = (name or threading.current_thread().name).encode("utf-8", "replace")[:15]
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0)


def set_timer_slack(nanoseconds: int) -> None:
    """How late the kernel may wake the calling OS thread from a timed sleep: wake-ups of several threads due
    within that much of each other then share one timer interrupt, and on a VM one exit from a halted vCPU.
    0 restores the thread's default (50 us). Best effort."""
    _libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(nanoseconds), 0, 0, 0)
