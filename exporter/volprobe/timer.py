"""The timers: a probe's requests one after another, paced by deadline, each timed around its syscall alone.

One interface (Timer), two implementations, chosen once, at import:
- _timedio.Loop (_timedio.c), the fast path: run() does a whole batch of offsets without the interpreter
  (wait for the slot, stamp, open, the timed request, close, the zero check, the pacing). A paced probe's cost
  is its wake-up: Python woken cold once a second spends about 200 us of CPU where the C loop spends its syscalls.
  By default the process's probe engine makes the requests of every Loop's run, in one thread that wakes once
  for the probes due together (see _timedio.c, Engine); the caller's thread sleeps until the run ends.
- PythonTimer, the fallback where the C module could not be built: the same steps in Python, one offset a run
  (the interpreter wakes for each probe anyway).

A run returns at the end of its offsets, at stop, or at the first failure; the worker (probe.ProbeWorker)
handles failures, back-off and reopens for both. The request of each kind of probe is named by ops.py's
`syscall` and found in REQUESTS, here and in _timedio.c.

Test hooks: with $VOLPROBE_TEST_TIMER=python the Python timer is used even where the C module was built; with
$VOLPROBE_TEST_TIMER=thread the C timer makes each probe's requests in the probe's own thread, without the engine.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import enum
import errno
import mmap
import os
import random
import stat
import struct
import threading
import time
from collections.abc import Callable
from typing import Protocol

from . import ops
from .safety import device_size

try:  # the C timer (see _timedio.c); optional at build time
    from . import _timedio
except ImportError:
    _timedio = None  # type: ignore[assignment]

TEST_TIMER_ENV = "VOLPROBE_TEST_TIMER"
if os.environ.get(TEST_TIMER_ENV) == "python":
    _timedio = None  # type: ignore[assignment]
# $VOLPROBE_TEST_TIMER=thread: the C timer without the engine, each probe's requests made by its own thread, as
# before the engine (bench/fidelity --engine compares the two).
_ENGINE = os.environ.get(TEST_TIMER_ENV) != "thread"

KIND = "c" if _timedio is not None else "python"  # volprobe_build_info{timer}
SECTOR = 512


class Status(enum.IntEnum):
    """How a run ended (the C loop's RUN_* constants)."""

    DONE = 0  # every offset probed
    STOPPED = 1  # stop() was called
    OPEN_FAILED = 2  # opening the path for a request failed: errno
    IO_FAILED = 3  # the request failed: errno
    SHORT = 4  # the request moved fewer bytes than the buffer holds: bytes
    CHANGED = 5  # the pinned descriptor changed (or could not be looked at) at a re-check: not made, errno or 0


Result = tuple[int, int, int, bool]  # take(): (index in the run's offsets, latency_ns, end_ns, read only zeros)


class Timer(Protocol):
    """A probe's paced requests (see the module comment). run() and schedule() are called by the worker's
    thread; take() by it or by scrapes; stop() and set_interval() from any thread. Times are CLOCK_MONOTONIC
    nanoseconds (time.perf_counter_ns)."""

    @property
    def completed(self) -> int:
        """Requests that succeeded, over all runs."""

    @property
    def missed(self) -> int:
        """Slots skipped because the previous request was still running."""

    @property
    def zero_reads(self) -> int:
        """Reads that returned only zeros."""

    @property
    def engine(self) -> bool:
        """Whether the process's probe engine makes run()'s requests (else the thread that calls it does, and
        sleeps there until each slot)."""

    @property
    def max_batch(self) -> int:
        """The most offsets worth giving one run()."""

    @property
    def steps(self) -> tuple[int, ...]:
        """Nanoseconds spent in each step (ops.Op.steps) of the requests that succeeded, over all runs, as of the
        last take(): the steps of exactly the results take() has returned."""

    def schedule(self, start_ns: int, interval_ns: int) -> None:
        """Restart the schedule: slot 0 is due at start_ns (plus jitter), slot k interval_ns later."""

    def set_interval(self, interval_ns: int) -> None:
        """A new interval from now on; a waiting run() takes it at once."""

    def stop(self) -> None:
        """End the run in progress and all later ones at the next wait (a request in flight finishes)."""

    def pin(self, fd: int) -> None:
        """Take fd as it is now (identity, type, mode, owner; a file's links and size, a device's size) as what
        run() re-checks it against; called just before the worker checks fd, so that any change after that check
        is one a re-check sees."""

    def holds(self, fd: int) -> bool:
        """Whether fd is still as pinned: called after the worker's check, true when nothing changed during it."""

    def run(self, offsets: array.array[int], fd: int, recheck_ns: int = 0) -> tuple[int, int, int, int]:
        """Probe offsets in order, each at its slot, on fd or (fd -1) on the path opened for each request.
        Returns (done, Status, errno, bytes): done requests succeeded; on a failure offsets[done] failed. With
        recheck_ns, a pinned fd is compared with its pin before a request once recheck_ns have passed since it
        was pinned or last compared: if it changed, the run ends with CHANGED and offsets[done] was not made."""

    def take(self) -> list[Result]:
        """The results of the current run not taken yet."""


def _pwrite_fdatasync(fd: int, buffers: list[memoryview], offset: int) -> int:
    """A commit (_timedio.c's request_pwrite_fdatasync): a buffered write, then fdatasync if it was whole."""
    size = sum(len(b) for b in buffers)
    if not size:
        return 0
    moved = os.pwritev(fd, buffers, offset)
    if moved == size:
        os.fdatasync(fd)
    return moved


# The names of the metadata sequence in the directory volprobe owns: _timedio.c's METADATA_NEW and _RENAMED, each
# followed by "." and METADATA_SUFFIX_HEX random hex digits drawn anew for every sequence (metadata_names()).
METADATA_NEW = "volprobe.new"
METADATA_RENAMED = "volprobe.renamed"
METADATA_SUFFIX_HEX = 16
# Created, never opened: O_EXCL|O_NOFOLLOW fails (EEXIST) on whatever is at the name, a device node, a FIFO, a
# hard link or a symlink a root tenant planted, without opening it (_timedio.c's request_metadata says why).
_METADATA_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)


def metadata_names() -> tuple[str, str]:
    """The two names of one sequence: fresh random ones, so a name planted beforehand is never the one used."""
    suffix = os.urandom(METADATA_SUFFIX_HEX // 2).hex()
    return f"{METADATA_NEW}.{suffix}", f"{METADATA_RENAMED}.{suffix}"


def rename_noreplace(directory: int, old: str, new: str) -> None:
    """renameat2(RENAME_NOREPLACE) within `directory`: FileExistsError when `new` exists. A filesystem that has no
    such flag (EINVAL: NFS, some FUSE) gets a plain rename, which can replace a directory entry but never writes
    into what it led to."""
    done = _libc.renameat2(directory, os.fsencode(old), directory, os.fsencode(new), _RENAME_NOREPLACE)
    if done == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        os.rename(old, new, src_dir_fd=directory, dst_dir_fd=directory)
        return
    raise OSError(err, os.strerror(err), new)


def _metadata(directory: int, buffers: list[memoryview], offset: int, steps: list[int] | None = None) -> int:
    """The metadata sequence (_timedio.c's request_metadata): create, write, fsync, rename, fsync the directory,
    unlink; each step's nanoseconds are written to `steps` when the whole sequence succeeded. Whatever fails
    takes the sequence's own names with it."""
    size = sum(len(b) for b in buffers)
    if not size:
        return 0
    made, renamed = metadata_names()
    clock = time.perf_counter_ns
    at = [clock()]
    fd = os.open(made, _METADATA_FLAGS, 0o600, dir_fd=directory)
    whole = False
    try:
        at.append(clock())
        moved = os.writev(fd, buffers)
        at.append(clock())
        if moved != size:
            return moved
        os.fsync(fd)
        whole = True
    finally:
        os.close(fd)
        if not whole:
            with contextlib.suppress(OSError):
                os.unlink(made, dir_fd=directory)
    at.append(clock())
    try:
        rename_noreplace(directory, made, renamed)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(made, dir_fd=directory)
        raise
    at.append(clock())
    try:
        os.fsync(directory)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(renamed, dir_fd=directory)
        raise
    at.append(clock())
    os.unlink(renamed, dir_fd=directory)
    at.append(clock())
    if steps is not None:
        steps[:] = [at[k + 1] - at[k] for k in range(len(at) - 1)]
    return moved


# The requests a probe can make, by ops.Op.syscall: fd, buffers, offset -> bytes moved. _timedio.c has the same.
# A request of several steps also takes `steps`, a list it fills with each step's nanoseconds (see Timer.steps).
REQUESTS: dict[str, Callable[..., int]] = {
    "pread": os.preadv,
    "pwrite": os.pwritev,
    "pwrite_fdatasync": _pwrite_fdatasync,
    "metadata": _metadata,
}
STEPPED = frozenset({"metadata"})


def new(
    path: str,
    flags: int,
    buffer: mmap.mmap,
    inflight: array.array[int],
    op: ops.Op,
    jitter: float,
    seed: int,
    engine: bool = True,
) -> Timer:
    """The timer of one probe: buffer is its page-aligned request buffer (a write's is filled with random
    bytes here, and stamped before each request), inflight an array('q', [0]) that holds the start of the
    request in flight, for scrapes. The C timer when it was built, else the Python one. engine: the C timer's
    requests are made by the process's probe engine (_timedio.c), not by the thread that calls run()."""
    counter = WriteData(buffer).counter if op.writes else 0
    steps = len(op.steps)
    if _timedio is not None:
        loop: Timer = _timedio.Loop(
            path, flags, buffer, inflight, op.syscall, op.writes, jitter, seed, counter, steps, engine and _ENGINE
        )
        return loop
    return PythonTimer(path, flags, buffer, inflight, op.syscall, op.writes, jitter, seed, counter, steps)


def fingerprint(fd: int) -> tuple[int, ...]:
    """_timedio.c's Pin: what the checks of a held descriptor depend on and can change under it (its identity,
    type, mode and owner; a regular file's links and size; a block device's size), not the times every write
    moves, nor a directory's size and links, which its own probe's files move."""
    st = os.fstat(fd)
    rdev = size = nlink = 0
    if stat.S_ISREG(st.st_mode):
        size, nlink = st.st_size, st.st_nlink
    elif stat.S_ISBLK(st.st_mode):
        rdev, size = st.st_rdev, device_size(fd)
    return (st.st_dev, st.st_ino, rdev, size, st.st_mode, st.st_uid, st.st_gid, nlink)


class Pacer:
    """Fixed-rate deadlines with optional jitter; slots passed while a probe ran are skipped, not replayed."""

    def __init__(self, jitter: float, rng: random.Random) -> None:
        self.rng = rng
        self.jitter = jitter
        self.schedule(time.perf_counter_ns(), 1_000_000_000)

    def schedule(self, start_ns: int, interval_ns: int) -> None:
        self.interval_ns = max(1, interval_ns)
        self.start_ns = start_ns
        self.slot = 0
        self._set_deadline()

    def _set_deadline(self) -> None:
        offset = int(self.rng.random() * self.jitter * self.interval_ns) if self.jitter else 0
        self.deadline_ns = self.start_ns + self.slot * self.interval_ns + offset

    def advance(self, now_ns: int) -> int:
        """Move to the next slot that has not started yet; return how many slots were skipped."""
        due = (now_ns - self.start_ns) // self.interval_ns + 1
        skipped = max(0, due - (self.slot + 1))
        self.slot = max(self.slot + 1, due)
        self._set_deadline()
        return skipped


class WriteData:
    """A page-aligned random buffer; every write stamps a never-repeating counter into each 512-byte sector,
    so no two writes (nor two sectors of one write) carry the same bytes: compression, dedupe and zero
    detection in the storage cannot make writes look fast. Given a counter, the buffer is taken as it is."""

    def __init__(self, buffer: mmap.mmap, counter: int | None = None) -> None:
        self.view = memoryview(buffer)
        if counter is None:
            self.view[:] = os.urandom(len(buffer))
        # Stamps go at the head of each sector that holds all 8 bytes of one, as _timedio.c's stamp(): a commit's
        # 2300-byte record is not a whole number of sectors.
        self.sectors = (len(buffer) - 8) // SECTOR + 1 if len(buffer) >= 8 else 0
        self.counter = random.getrandbits(63) if counter is None else counter

    def stamp(self) -> None:
        self.counter += 1
        stamp = struct.pack("<Q", self.counter)
        if not self.sectors:
            return
        end = (self.sectors - 1) * SECTOR + 8
        for i in range(8):
            self.view[i:end:SECTOR] = stamp[i : i + 1] * self.sectors


class PythonTimer:
    """The C loop's steps in Python, one offset a run. A zero-length request before each timed one does no I/O
    but brings the path into the CPU caches, so the timed request measures the kernel and device, not a cold
    interpreter."""

    max_batch = 1
    engine = False

    def __init__(
        self,
        path: str,
        flags: int,
        buffer: mmap.mmap,
        inflight: array.array[int],
        syscall: str,
        writes: bool,
        jitter: float,
        seed: int,
        counter: int,
        steps: int = 0,
    ) -> None:
        if syscall not in REQUESTS:
            raise ValueError(f"unknown syscall {syscall!r}")
        self._path, self._flags = path, flags
        self._steps = [0] * steps  # over the results produced; _taken_steps: over those take() returned
        self._taken_steps = tuple(self._steps)
        self._stepped = syscall in STEPPED
        self._request = REQUESTS[syscall]
        self._buffer = buffer
        self._bufs = [memoryview(buffer)]
        self._empty = [memoryview(buffer)[:0]]
        self._zeros = bytes(len(buffer))
        self._inflight = inflight
        self._write_data = WriteData(buffer, counter) if writes else None
        self._pacer = Pacer(jitter, random.Random(seed))
        self._woken = threading.Event()  # set by stop() and set_interval()
        self._lock = threading.Lock()
        self._pending_interval_ns = 0
        self._stopping = False
        self._results: list[Result] = []
        self._taken = 0
        self._completed = self._missed = self._zero_reads = 0
        self._pin: tuple[int, ...] | None = None
        self._checked_ns = 0

    @property
    def completed(self) -> int:
        return self._completed

    @property
    def missed(self) -> int:
        return self._missed

    @property
    def zero_reads(self) -> int:
        return self._zero_reads

    @property
    def steps(self) -> tuple[int, ...]:
        with self._lock:
            return self._taken_steps

    def schedule(self, start_ns: int, interval_ns: int) -> None:
        self._pacer.schedule(start_ns, interval_ns)

    def set_interval(self, interval_ns: int) -> None:
        with self._lock:
            self._pending_interval_ns = max(1, interval_ns)
        self._woken.set()

    def stop(self) -> None:
        self._stopping = True
        self._woken.set()

    def take(self) -> list[Result]:
        with self._lock:
            taken, self._taken = self._results[self._taken :], len(self._results)
            self._taken_steps = tuple(self._steps)
        return taken

    def _wait_deadline(self) -> bool:
        """Wait for the slot; False when due, True when asked to stop. A new interval restarts the schedule now."""
        while True:
            self._woken.clear()
            if self._stopping:
                return True
            with self._lock:
                requested, self._pending_interval_ns = self._pending_interval_ns, 0
            now = time.perf_counter_ns()
            if requested:
                self._pacer.schedule(now, requested)
            wait = self._pacer.deadline_ns - now
            if wait <= 0:
                return False
            self._woken.wait(wait / 1e9)

    def pin(self, fd: int) -> None:
        self._pin = fingerprint(fd)
        self._checked_ns = time.perf_counter_ns()

    def holds(self, fd: int) -> bool:
        return self._pin is not None and fingerprint(fd) == self._pin

    def _recheck(self, fd: int, recheck_ns: int) -> int | None:
        """_timedio.c's recheck(): None when fd was not due for its re-check or is as pinned, else the errno of
        the fstat that failed, or 0 (it changed)."""
        now = time.perf_counter_ns()
        if fd < 0 or self._pin is None or recheck_ns <= 0 or now - self._checked_ns < recheck_ns:
            return None
        self._inflight[0] = now
        try:
            if fingerprint(fd) != self._pin:
                return 0
        except OSError as err:
            return err.errno or 0
        finally:
            self._inflight[0] = 0
        self._checked_ns = now
        return None

    def run(self, offsets: array.array[int], fd: int, recheck_ns: int = 0) -> tuple[int, int, int, int]:
        with self._lock:  # results not taken are dropped with their steps, as in the C loop
            self._results, self._taken = [], 0
            self._steps = list(self._taken_steps)
        clock, request, inflight, stepped = time.perf_counter_ns, self._request, self._inflight, self._stepped
        status, error, moved, done = Status.DONE, 0, 0, 0
        for offset in offsets:
            if self._wait_deadline():
                status = Status.STOPPED
                break
            changed = self._recheck(fd, recheck_ns)
            if changed is not None:
                status, error = Status.CHANGED, changed
                break
            if self._write_data is not None:
                self._write_data.stamp()
            use = fd
            if fd < 0:
                try:
                    use = os.open(self._path, self._flags | os.O_CLOEXEC)
                except OSError as err:
                    status, error = Status.OPEN_FAILED, err.errno or 0
                    break
            steps = [0] * len(self._steps)
            try:
                request(use, self._empty, offset)
                inflight[0] = start = clock()
                moved = request(use, self._bufs, offset, steps) if stepped else request(use, self._bufs, offset)
                end = clock()
            except OSError as err:
                status, error, moved = Status.IO_FAILED, err.errno or 0, 0
                break
            finally:
                inflight[0] = 0
                if fd < 0:
                    os.close(use)
            if moved != len(self._buffer):
                status = Status.SHORT
                break
            zero = self._write_data is None and self._buffer[:] == self._zeros
            with self._lock:  # a request's steps with its result: take() returns both or neither
                self._results.append((done, end - start, end, zero))
                self._steps[:] = [total + step for total, step in zip(self._steps, steps, strict=True)]
            self._completed += 1
            self._zero_reads += zero
            self._missed += self._pacer.advance(clock())
            done += 1
        return done, int(status), error, moved
