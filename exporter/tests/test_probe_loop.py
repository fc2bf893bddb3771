"""The probe worker on real devices, driving either timer: in C (batches of offsets) and in Python (the
fallback), alike."""

from __future__ import annotations

import os
import random
import struct
import time
from pathlib import Path

import pytest

from volprobe import ops, probe, timer
from volprobe.config import ProbeConfig
from volprobe.stats import ProbeStats

from .support.harness import MIB, descriptors_on

pytestmark = pytest.mark.root


def worker(
    path: str, op: str, interval: float, *, size: int = 16 * MIB, block: int = 4096, hold_open: bool = False
) -> probe.ProbeWorker:
    flags = (os.O_RDWR if op == "write" else os.O_RDONLY) | os.O_DIRECT
    io = probe.IOTarget(path, flags, 0, size)
    fd = os.open(path, flags) if op == "write" else None
    spec = ProbeConfig(op, block, interval=interval, revisit=0.0, jitter=0.0, hold_open=hold_open)
    return probe.ProbeWorker(spec, io, ProbeStats(60.0), name="t", fd=fd, seed=7)


def first_time(condition, timeout: float) -> float:
    """Poll until `condition` holds; the monotonic time it was first seen to (failing after `timeout`)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
    return time.monotonic()


def run_for(w: probe.ProbeWorker, seconds: float) -> None:
    w.start()
    time.sleep(seconds)
    w.stop()
    assert w.join(2.0)
    w.close()
    w.drain()


def engine_slacks() -> dict[int, int]:
    """The timer slack of each of the probe engine's threads (named "vp probes"), by thread id."""
    slacks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "vp probes":
                slacks[int(task.name)] = int(Path(f"/proc/{task.name}/timerslack_ns").read_text())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return slacks


def recorded(w: probe.ProbeWorker) -> int:
    now = time.perf_counter_ns()
    return sum(w.stats.snapshot(touch, now).count for touch in ("first", "repeat"))


def test_paced_reads_are_counted_recorded_and_flagged_zero(make_loop, loop_kind):
    interval = 0.02
    w = worker(make_loop(16 * MIB), "read", interval)
    assert isinstance(w.timer, timer.PythonTimer) == (loop_kind == "python")
    assert w.probe.engine == (loop_kind == "c")
    started = time.monotonic()
    w.start()
    # Slot 0 is at the start, slot k k intervals later: the 50th probe can come no sooner than 49 intervals in,
    # however idle the machine; a loaded one only makes it later (the timeout allows a tenth of the rate).
    fiftieth = first_time(lambda: w.completed >= 50, timeout=50 * interval * 10)
    w.stop()
    assert w.join(2.0)
    slots = (time.monotonic() - started) / interval
    w.close()
    w.drain()
    assert fiftieth - started >= 49 * interval, "faster than the requested rate"
    # Each slot that began is probed or skipped (missed) once, never replayed: however late the probes ran,
    # they and the skipped slots add up to no more than the slots there were.
    assert w.completed >= 50 and w.completed + w.missed <= slots + 1, (w.completed, w.missed, slots)
    assert recorded(w) == w.completed, "every finished probe reaches the statistics"
    assert w.zero_reads == w.completed, "a fresh loop device reads zeros"
    assert w.error_counts() == {}
    # Offsets handed out but never used go back: the picker's position is exactly the probes made.
    unused = sum(1 for _, touch in w.probe.picker._queue if touch == "first")
    assert w.probe.picker.fresh_used - unused == w.completed


def test_writes_carry_a_never_repeating_stamp_in_every_sector(make_loop, loop_kind):
    path = make_loop(4 * MIB)
    w = worker(path, "write", 0.01, size=4 * MIB)
    run_for(w, 0.6)
    assert w.completed >= 20 and w.zero_reads == 0
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, 4 * MIB, 0)
    finally:
        os.close(fd)
    stamps = []
    for block in range(0, len(data), 4096):
        heads = {data[block + s : block + s + 8] for s in range(0, 4096, 512)}
        if heads != {bytes(8)}:
            assert len(heads) == 1, "one stamp for every sector of a write"
            stamps.append(struct.unpack("<Q", heads.pop())[0])
    assert len(stamps) == w.completed, "each write went to a fresh block (revisit 0)"
    assert len(set(stamps)) == len(stamps) and max(stamps) - min(stamps) == len(stamps) - 1


def test_a_run_ends_at_its_slot_and_the_next_one_starts_at_the_next(make_loop, loop_kind):
    """A run of one offset at a time (as `volprobe ping` gives): each is due a whole interval after the last."""
    interval = 0.1
    w = worker(make_loop(16 * MIB), "read", interval)
    w.max_batch = 1
    started = time.monotonic()
    run_for(w, 1.5)
    elapsed = time.monotonic() - started
    assert 0.5 * elapsed / interval <= w.completed <= elapsed / interval + 2, (w.completed, elapsed)


def test_stop_and_slow_down_apply_at_once_during_a_long_wait(make_loop, loop_kind):
    w = worker(make_loop(16 * MIB), "read", 30.0)
    w.start()
    time.sleep(0.3)
    assert w.completed <= 1  # the first slot (with jitter 0: at start), then a 30 s wait
    w.set_slowdown(0.001)  # 30 ms: the waiting timer takes the new interval now, not in 30 s
    first_time(lambda: w.completed >= 8, timeout=10.0)  # at 30 s a probe, eight would take minutes
    w.set_slowdown(1000.0)
    time.sleep(0.1)
    before = w.completed
    started = time.monotonic()
    w.stop()
    assert w.join(2.0)
    assert time.monotonic() - started < 0.5, "a stop wakes the timer's wait (for the next slot, in 8 hours)"
    assert w.completed - before <= 1


@pytest.mark.parametrize(("interval", "slack_ns"), [(0.2, 2_000_000), (30.0, probe.MAX_TIMER_SLACK_NS)])
def test_a_worker_lets_the_kernel_wake_it_a_hundredth_of_its_interval_late(make_loop, loop_kind, interval, slack_ns):
    """The timer slack of the thread that sleeps until the probe's slots, as the kernel holds it
    (/proc/TID/timerslack_ns): 1% of the interval, at most 10 ms, so that probes due close together share a
    wake-up; the default 50 us before. The C timer's sleeper is the engine's leader, the Python one's the worker."""
    w = worker(make_loop(16 * MIB), "read", interval)
    w.start()
    try:
        first_time(lambda: w.completed >= 1, timeout=10.0)  # the first batch is under way: the slack is set
        if loop_kind != "c":  # the worker's own thread sleeps
            assert int(Path(f"/proc/{w._thread.native_id}/timerslack_ns").read_text()) == slack_ns
        else:  # the leader sets it before it sleeps again (the watcher sleeps on its timer, without slack)
            first_time(lambda: slack_ns in engine_slacks().values(), timeout=5.0)
    finally:
        w.stop()
        assert w.join(2.0)
        w.close()


def test_failures_are_counted_backed_off_and_recovered_from(tmp_path, loop_kind):
    target = tmp_path / "file"
    target.write_bytes(os.urandom(MIB))
    io = probe.IOTarget(str(target), os.O_RDONLY, 0, MIB)
    w = probe.ProbeWorker(ProbeConfig("read", 4096, interval=0.01, jitter=0.0), io, ProbeStats(60.0), seed=3)
    w.start()
    time.sleep(0.3)
    target.rename(tmp_path / "moved")  # reads open per request: ENOENT from now on
    time.sleep(0.5)
    failed_at = w.completed
    assert w.error_counts().get("ENOENT", 0) >= 1
    assert w.error_counts()["ENOENT"] <= 8, "backing off: 10 ms, doubling, not one error per slot"
    (tmp_path / "moved").rename(target)
    time.sleep(1.5)  # the back-off is at most 0.01 * 2**8 = 2.56 s after 8 errors; well under, here
    w.stop()
    assert w.join(2.0)
    w.drain()
    assert w.completed > failed_at, "probing resumed once the file was back"
    assert recorded(w) == w.completed
    assert w.last_error == "ENOENT"


def test_a_short_transfer_is_an_error_not_a_sample(tmp_path, loop_kind):
    short = tmp_path / "short"
    short.write_bytes(b"x" * 100)
    io = probe.IOTarget(str(short), os.O_RDONLY, 0, 16 * MIB)
    w = probe.ProbeWorker(ProbeConfig("read", 4096, interval=0.01, jitter=0.0), io, ProbeStats(60.0), seed=3)
    run_for(w, 0.3)
    assert w.error_counts().get("SHORT", 0) >= 1 and w.completed == 0 and recorded(w) == 0


def test_reads_hold_the_device_open_only_when_told(make_loop, loop_kind):
    path = make_loop(16 * MIB)
    for hold_open in (False, True):
        w = worker(path, "read", 0.2, hold_open=hold_open)
        w.start()
        time.sleep(0.5)
        held = descriptors_on(path)
        w.stop()
        assert w.join(2.0)
        w.close()
        assert w.completed >= 2 and w.error_counts() == {}
        assert held == (1 if hold_open else 0), "a read probe holds the device between requests only if told"
        assert descriptors_on(path) == 0


def test_the_c_loop_checks_its_arguments():
    if timer._timedio is None:
        pytest.skip("no C module")
    buffer, seed = bytearray(4096), random.getrandbits(64)
    with pytest.raises(ValueError, match="inflight"):
        timer._timedio.Loop("/dev/null", os.O_RDONLY, buffer, bytearray(4), "pread", False, 0.0, seed, 0)
    with pytest.raises(ValueError, match="syscall"):
        timer._timedio.Loop("/dev/null", os.O_RDONLY, buffer, bytearray(8), "preadv9", False, 0.0, seed, 0)


def test_both_timers_know_every_op_and_end_their_runs_alike():
    """Every op's request is one both timers make, and a run ends with the same statuses in both."""
    for op in ops.OPS.values():
        assert op.syscall in timer.REQUESTS, op
    if timer._timedio is not None:
        for status in timer.Status:
            assert getattr(timer._timedio, f"RUN_{status.name}") == status.value
