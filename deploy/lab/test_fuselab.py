"""The FUSE lab filesystem itself: per-operation latency, O_DIRECT passthrough, stalls and their clean-up."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest

from .fuselab import mounted

pytestmark = [pytest.mark.root, pytest.mark.lab]


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def test_latency_per_operation_and_o_direct(fuse_directory) -> None:
    lab = fuse_directory()
    path = str(lab.path)
    assert os.statvfs(path).f_bsize > 0 and os.stat(path).st_dev != os.stat(lab.backing).st_dev
    settings = {"statfs": 0.03, "rename": 0.02, "open": 0.025, "fsync": 0.04, "getattr": 0.015}
    for op, seconds in settings.items():
        lab.set_latency(op, seconds)
    assert lab.status()["latency"] == settings

    # O_DIRECT|O_DSYNC as volprobe's write probes: the kernel passes it through, the lab opens the backing file
    # so, and a synchronous write reaches the daemon as a write and an fsync.
    flags = os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_DSYNC
    opened = _timed(lambda: os.close(os.open(f"{path}/probe", flags, 0o600)))
    fd = os.open(f"{path}/probe", flags)
    buffer = mmap.mmap(-1, 8192)
    buffer[:] = os.urandom(8192)
    before = lab.status()["counts"]
    wrote = _timed(os.pwritev, fd, [buffer], 8192)
    after = lab.status()["counts"]
    assert after.get("write", 0) - before.get("write", 0) == 1 and after.get("fsync", 0) > before.get("fsync", 0)
    back = mmap.mmap(-1, 8192)
    assert os.preadv(fd, [back], 8192) == 8192 and back[:] == buffer[:]
    os.close(fd)
    assert (lab.backing / "probe").read_bytes()[8192:16384] == buffer[:]

    renamed = _timed(os.rename, f"{path}/probe", f"{path}/probe2")
    statfs = min(_timed(os.statvfs, path) for _ in range(3))
    stat = min(_timed(os.stat, path) for _ in range(3))
    # Each measured as at least its setting, and not far above it (the daemon's own time, one or two getattrs
    # the kernel sends along the way: a lookup, or the attributes after a write).
    checks = {
        "statfs": (statfs, 0.03),
        "rename": (renamed, 0.02),
        "open": (opened, 0.025),
        "fsync": (wrote, 0.04),
        "getattr": (stat, 0.015),
    }
    for op, (measured, setting) in checks.items():
        assert setting * 0.95 <= measured <= setting * 1.5 + 0.06, (op, measured, setting)

    lab.set_latency("statfs", 0)
    assert min(_timed(os.statvfs, path) for _ in range(3)) < 0.02


def test_stall_blocks_until_released_and_stop_cleans_up(fuse_directory) -> None:
    lab = fuse_directory()
    path = str(lab.path)
    (lab.path / "file").write_bytes(b"x")
    lab.stall("meta")
    answered = threading.Event()

    def statfs() -> None:
        os.statvfs(path)
        answered.set()

    threading.Thread(target=statfs, daemon=True).start()
    _wait(lambda: lab.status()["stalled"] == 1)  # the daemon holds it: blocked, not slow
    assert not answered.is_set()
    lab.release()
    assert answered.wait(5)

    # A stall of everything, with a process blocked in it: stop() still ends the daemon and unmounts.
    lab.stall("all")
    failed: list[BaseException] = []

    def stat() -> None:
        try:
            os.stat(f"{path}/file")
        except OSError as err:
            failed.append(err)

    blocked = threading.Thread(target=stat, daemon=True)
    blocked.start()
    _wait(lambda: lab.status()["stalled"] >= 1)
    lab.stop()
    blocked.join(10)
    assert not blocked.is_alive()
    assert not mounted(lab.path)
    assert lab.process.poll() is not None
