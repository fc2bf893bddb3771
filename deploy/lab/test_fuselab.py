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


@pytest.mark.alone  # .ci/run: after the others; beside them a baseline getattr once took 20 ms by itself
def test_latency_per_operation_and_o_direct(fuse_directory) -> None:
    lab = fuse_directory()
    path = str(lab.path)
    assert os.statvfs(path).f_bsize > 0 and os.stat(path).st_dev != os.stat(lab.backing).st_dev

    # O_DIRECT|O_DSYNC as volprobe's write probes: the kernel passes it through, the lab opens the backing file
    # so, and a synchronous write reaches the daemon as a write and an fsync.
    fd = os.open(f"{path}/probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_DSYNC, 0o600)
    buffer = mmap.mmap(-1, 8192)
    buffer[:] = os.urandom(8192)
    before = lab.status()["counts"]
    assert os.pwritev(fd, [buffer], 8192) == 8192
    after = lab.status()["counts"]
    assert after.get("write", 0) - before.get("write", 0) == 1 and after.get("fsync", 0) > before.get("fsync", 0)
    back = mmap.mmap(-1, 8192)
    assert os.preadv(fd, [back], 8192) == 8192 and back[:] == buffer[:]
    assert (lab.backing / "probe").read_bytes()[8192:16384] == buffer[:]

    names = iter(range(1000))

    def create() -> None:
        os.close(os.open(f"{path}/c{next(names)}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))

    def unlink() -> float:
        name = f"u{next(names)}"
        (lab.backing / name).write_bytes(b"")  # made behind the mount's back: only the unlink goes through it
        os.stat(f"{path}/{name}")
        start = time.perf_counter()
        os.unlink(f"{path}/{name}")
        return time.perf_counter() - start

    flip = iter(range(1000))

    def rename() -> None:
        a, b = ("probe", "probe2") if next(flip) % 2 == 0 else ("probe2", "probe")
        os.rename(f"{path}/{a}", f"{path}/{b}")

    opened = f"{path}/opened"
    (lab.backing / "opened").write_bytes(b"")
    actions = {
        "statfs": lambda: os.statvfs(path),
        "getattr": lambda: os.stat(path),
        "open": lambda: os.close(os.open(opened, os.O_RDONLY)),
        "create": create,
        "read": lambda: os.preadv(fd, [back], 8192),
        "write": lambda: os.pwritev(fd, [buffer], 8192),  # a write and an fsync (O_DSYNC)
        "fsync": lambda: os.pwritev(fd, [buffer], 8192),
        "rename": rename,
        "unlink": unlink,
    }
    added = 0.02
    for op, action in actions.items():

        def measure(action=action) -> float:
            times = []
            for _ in range(3):
                start = time.perf_counter()
                took = action()
                times.append(took if isinstance(took, float) else time.perf_counter() - start)
            return min(times)

        baseline = measure()
        lab.set_latency(op, added)
        assert lab.status()["latency"][op] == added
        slowed = measure()
        lab.set_latency(op, 0)
        # The added part within a ratio of the setting (up to 2: a loaded machine wakes the daemon late).
        assert 0.9 <= (slowed - baseline) / added <= 2.0, (op, baseline, slowed)
    os.close(fd)


def test_a_directory_lists_what_its_backing_holds(fuse_directory) -> None:
    """A listing through the mount is the backing directory's: volprobe lists a probe directory to clear the
    temporaries of a crashed start (each entry needs its inode: readdir(3) skips inode 0, which hid them all)."""
    lab = fuse_directory()
    (lab.backing / "sub").mkdir()
    for name in ("a", ".volprobe-probe.tmp.1.x", "sub/b"):
        (lab.backing / name).write_bytes(b"x")
    assert sorted(os.listdir(lab.path)) == sorted(os.listdir(lab.backing)) == [".volprobe-probe.tmp.1.x", "a", "sub"]
    assert os.listdir(lab.path / "sub") == ["b"]
    assert {e.name: e.inode() for e in os.scandir(lab.path)} == {e.name: e.inode() for e in os.scandir(lab.backing)}


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
