"""No thread dies silently: the one mechanism every long-lived thread runs its work under.

An unexpected exception in a probe worker, a warm-up, the throttle detector, the provider poller or discovery
would otherwise end its thread while the exporter serves on: the probe's counters just stop. run() logs it with
its traceback, counts it (volprobe_thread_restarts_total{thread}) and runs the work again after a back-off:
FIRST_BACKOFF_S, doubling up to MAX_BACKOFF_S, and back to FIRST_BACKOFF_S once a run lasted HEALTHY_S. A stop
request ends the back-off at once: a stop never waits one out.

The supervision wraps a thread's whole loop, never a single probe: nothing on a probe's timed path pays for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

THREADS = ("probe", "warmup", "throttle", "provider", "discovery", "mount")  # the metric's label values, fixed
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
HEALTHY_S = 60.0  # a run that lasted this long before failing starts the back-off afresh
POLL_S = 0.05  # how often a back-off looks at a stop flag (an Event wakes it at once)

Stop = threading.Event | Callable[[], bool]

_lock = threading.Lock()
_restarts = dict.fromkeys(THREADS, 0)  # every value present from the start, so rate() sees the first failure


def restarts() -> dict[str, int]:
    """Failures per kind of thread, each followed by a restart unless the thread was stopping."""
    with _lock:
        return dict(_restarts)


def run(thread: str, work: Callable[[], None], stop: Stop, name: str = "") -> None:
    """Run work() until it returns; after each exception, log it, count it and run it again after a back-off.

    `thread` is one of THREADS, `name` what the log calls it (the kind by default). `stop` is the thread's stop
    request: an Event, or a flag to look at (a probe worker's). work() must end on its own once stop is
    requested; its state carries over to the next run, which must take it up where the failed one left it."""
    assert thread in THREADS, thread
    name = name or thread
    delay = FIRST_BACKOFF_S
    while True:
        started = time.monotonic()
        try:
            work()
            return
        except Exception:
            if time.monotonic() - started >= HEALTHY_S:
                delay = FIRST_BACKOFF_S  # a failure after a healthy while is a new streak, not the old one
            with _lock:
                _restarts[thread] += 1
            if _stopping(stop):
                log.exception("%s failed while stopping", name)
                return
            log.exception("%s failed; restarting in %g s", name, delay)
        if _wait(stop, delay):
            return
        delay = min(delay * 2, MAX_BACKOFF_S)


def _stopping(stop: Stop) -> bool:
    return stop.is_set() if isinstance(stop, threading.Event) else stop()


def _wait(stop: Stop, seconds: float) -> bool:
    """Sleep up to `seconds`; True as soon as a stop is requested."""
    if isinstance(stop, threading.Event):
        return stop.wait(seconds)
    deadline = time.monotonic() + seconds
    while not stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, POLL_S))
    return True
