"""No thread dies silently: an exception in a long-lived thread is logged with its traceback, counted in
volprobe_thread_restarts_total, and its work restarts after a back-off; a stop never waits a back-off out."""

from __future__ import annotations

import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest

from volprobe import probe, supervise, timer
from volprobe.capabilities import Capabilities
from volprobe.config import ProbeConfig, ThrottleConfig
from volprobe.discovery import Host
from volprobe.runtime.probes import ProbeSet
from volprobe.runtime.provider import ProviderStats
from volprobe.runtime.throttle import ThrottleWatch
from volprobe.runtime.warmups import WarmupManager, _Entry
from volprobe.state import StateStore
from volprobe.stats import ProbeStats

from .support.harness import MIB, descriptors_on, wait_until


def failures_logged(caplog, name: str, kind: type[BaseException]) -> list[logging.LogRecord]:
    """The supervisor's records of `name` failing, each with the exception's traceback."""
    return [
        r
        for r in caplog.records
        if r.name == supervise.__name__
        and r.getMessage().startswith(f"{name} failed")
        and r.exc_info
        and isinstance(r.exc_info[1], kind)
    ]


# -- a probe worker on a real loop device whose cursor fails --------------------------------------------------


class FailingCursor:
    """A probe cursor (probe.Cursor) whose state write fails once, as a reservation past what the state can hold
    would: reserve() raises OverflowError when asked for position `fail_at`."""

    key = 0x5EED
    start = 0

    def __init__(self, fail_at: int) -> None:
        self.gaps: list[tuple[int, int]] = []
        self.fail_at = fail_at
        self.worker: probe.ProbeWorker | None = None
        self.failed_at_completed: int | None = None  # the worker's completed count when it failed
        self.released: list[int] = []

    def reserve(self, needed: int) -> bool:
        if needed == self.fail_at and self.failed_at_completed is None:
            assert self.worker is not None
            self.failed_at_completed = self.worker.completed
            raise OverflowError("Python int too large to convert to C long")
        return True

    def release(self, used: int) -> None:
        self.released.append(used)


@pytest.fixture(params=["c", "python"])
def loop_kind(request, monkeypatch) -> str:
    if request.param == "c" and timer._timedio is None:
        pytest.skip(f"the C timer is not in use (${timer.TEST_TIMER_ENV})")
    if request.param == "python":
        monkeypatch.setattr(timer, "_timedio", None)
    return request.param


def failing_worker(path: str, op: str, interval: float, fail_at: int) -> tuple[probe.ProbeWorker, FailingCursor]:
    flags = (os.O_RDWR if op == "write" else os.O_RDONLY) | os.O_DIRECT
    fd = os.open(path, flags) if op == "write" else None
    spec = ProbeConfig(op, 4096, interval=interval, revisit=0.0, jitter=0.0)
    cursor = FailingCursor(fail_at)
    io = probe.IOTarget(path, flags, 0, 16 * MIB)
    w = probe.ProbeWorker(spec, io, ProbeStats(60.0), name="t", fd=fd, seed=7, cursor=cursor)
    cursor.worker = w
    return w, cursor


@pytest.mark.root
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_probe_worker_whose_cursor_raises_is_logged_counted_and_probes_on(make_loop, loop_kind, op, caplog):
    """The C loop picks 512 offsets a batch at this interval: the failure comes as the second batch is picked
    (the Python loop: at its 513th probe), after about a second of probes."""
    caplog.set_level(logging.INFO)
    path = make_loop(16 * MIB)
    w, cursor = failing_worker(path, op, 0.002, fail_at=513)
    before = supervise.restarts()["probe"]
    w.start()
    try:
        wait_until(lambda: cursor.failed_at_completed is not None, what="the failing reservation")
        failed = wait_until(lambda: failures_logged(caplog, "probe t " + op, OverflowError), what="the traceback")
        assert cursor.failed_at_completed > 0, "it probed before it failed"
        assert supervise.restarts()["probe"] == before + 1
        record = failures_logged(caplog, "probe t " + op, OverflowError)[0]
        assert "in reserve" in logging.Formatter().formatException(record.exc_info), "with its traceback"
        resumed = wait_until(lambda: w.completed > cursor.failed_at_completed, what="probing after the back-off")
        assert resumed - failed >= supervise.FIRST_BACKOFF_S * 0.9, "it restarted after the back-off, not at once"
        wait_until(lambda: w.completed > cursor.failed_at_completed + 20, what="probing on")
        assert descriptors_on(path) <= 1, "a restart reopens the descriptor, never a second one"
    finally:
        w.stop()
        assert w.join(2.0)
    w.close()
    w.drain()
    assert supervise.restarts()["probe"] == before + 1 and w.error_counts() == {}
    assert len(cursor.released) == 1, "the picker is closed once, at the real end, not at the restart"
    assert descriptors_on(path) == 0, "the descriptor is closed at the end"


@pytest.mark.root
def test_stopping_a_probe_worker_during_its_back_off_returns_at_once(make_loop, loop_kind, monkeypatch, caplog):
    monkeypatch.setattr(supervise, "FIRST_BACKOFF_S", 30.0)
    w, cursor = failing_worker(make_loop(16 * MIB), "read", 0.01, fail_at=1)  # the very first pick fails
    w.start()
    try:
        wait_until(lambda: failures_logged(caplog, "probe t read", OverflowError), what="the failure")
    finally:
        started = time.monotonic()
        w.stop()
        assert w.join(2.0)
    assert time.monotonic() - started < 0.5, "a stop does not wait out a 30 s back-off"
    assert w.completed == 0 and len(cursor.released) == 1


# -- the runtime's threads ---------------------------------------------------------------------------------------


class RaisesOnce:
    """A source that raises `error` on its first call, then returns `value`; counts its calls."""

    def __init__(self, error: Exception, value: object) -> None:
        self.error, self.value, self.calls = error, value, 0

    def __call__(self, *_args: object) -> object:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return self.value


def test_a_provider_poll_that_raises_is_logged_counted_and_polled_again(monkeypatch, caplog):
    monkeypatch.setattr(supervise, "FIRST_BACKOFF_S", 0.2)
    disks = RaisesOnce(RuntimeError("sysfs went away"), set())
    provider = ProviderStats(Host(), disks, interval=0.05, capabilities=Capabilities())
    before = supervise.restarts()["provider"]
    provider.start()
    try:
        failed = wait_until(
            lambda: failures_logged(caplog, "provider statistics poll", RuntimeError), what="the traceback"
        )
        assert supervise.restarts()["provider"] == before + 1
        again = wait_until(lambda: disks.calls >= 3, what="polls after the restart")
        assert again - failed >= 0.2 * 0.9, "polled again after the back-off"
    finally:
        provider.stop()
        assert provider._thread is not None
        provider._thread.join(2.0)
    assert not provider._thread.is_alive()
    assert supervise.restarts()["provider"] == before + 1


def test_the_throttle_detectors_sampler_that_raises_is_logged_counted_and_samples_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(supervise, "FIRST_BACKOFF_S", 0.2)
    host = Host()
    watch = ThrottleWatch(ProbeSet(host), host, lambda: StateStore(None))
    devices = RaisesOnce(OSError(5, "Input/output error"), set())
    watch.devices = devices  # the detector asks the watch which disks to sample
    before = supervise.restarts()["throttle"]
    watch.apply(ThrottleConfig(enabled=True, sample_interval=0.05))
    try:
        wait_until(lambda: failures_logged(caplog, "throttle sampling", OSError), what="the traceback")
        assert supervise.restarts()["throttle"] == before + 1
        wait_until(lambda: devices.calls >= 3, what="samples after the restart")
    finally:
        started = time.monotonic()
        watch.stop()
    assert time.monotonic() - started < 1.0
    assert supervise.restarts()["throttle"] == before + 1


def test_stopping_a_provider_during_its_back_off_returns_at_once(monkeypatch, caplog):
    monkeypatch.setattr(supervise, "FIRST_BACKOFF_S", 30.0)
    provider = ProviderStats(
        Host(), RaisesOnce(RuntimeError("once"), set()), interval=0.05, capabilities=Capabilities()
    )
    provider.start()
    wait_until(lambda: failures_logged(caplog, "provider statistics poll", RuntimeError), what="the failure")
    started = time.monotonic()
    provider.stop()
    assert provider._thread is not None
    provider._thread.join(2.0)
    assert not provider._thread.is_alive() and time.monotonic() - started < 0.5


def test_an_error_after_a_warm_up_ran_restarts_the_follow_up_not_the_warm_up(monkeypatch, caplog):
    """A warm-up's own errors end it `failed` (WarmupJob.run); an error that escapes the manager's thread
    afterwards (starting the next queued warm-up, say) is supervised, and the finished job is not run again."""
    monkeypatch.setattr(supervise, "FIRST_BACKOFF_S", 0.05)
    identity = SimpleNamespace(device="vol-1", mode="read")
    job = SimpleNamespace(_stop=threading.Event(), identity=identity, state_path=None, runs=0)

    def run() -> SimpleNamespace:
        job.runs += 1
        return SimpleNamespace(state="done")

    job.run = run
    manager = WarmupManager(StateStore(None), Capabilities())
    start_queued = RaisesOnce(RuntimeError("can't start new thread"), None)
    manager._start_queued = start_queued
    entry = _Entry(SimpleNamespace(name="disk", path="/dev/disk"), job, discovered=True)
    before = supervise.restarts()["warmup"]
    manager._run(entry)
    assert entry.thread is not None
    entry.thread.join(5.0)
    assert not entry.thread.is_alive()
    assert failures_logged(caplog, "warm-up of disk", RuntimeError)
    assert supervise.restarts()["warmup"] == before + 1
    assert job.runs == 1 and entry.finished and start_queued.calls == 2


def test_every_thread_is_exported_from_the_start(monkeypatch):
    from volprobe import metrics
    from volprobe.collectors import VolprobeCollector
    from volprobe.config import Config
    from volprobe.discovery import Host
    from volprobe.runtime import Exporter

    collector = VolprobeCollector(Exporter(Config(), Host()), enabled=[])  # built, not started
    family = next(f for f in collector.collect() if f.name == metrics.THREAD_RESTARTS.name)
    exported = {s.labels["thread"]: s.value for s in family.samples if s.name == metrics.THREAD_RESTARTS.total}
    assert set(exported) == set(supervise.THREADS)
    assert exported == {name: float(count) for name, count in supervise.restarts().items()}
