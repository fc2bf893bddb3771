"""The probe engine: one thread per probe, one synchronous O_DIRECT request at a time, paced by deadline.

Only the syscall sits between the two clock reads. Everything else a probe needs (choosing the offset,
stamping the write buffer, checking a read for zeros, recording the sample) happens outside them.

A worker's probes run in C (_timedio.Loop) a batch of offsets at a time: Python picks about BATCH_S seconds'
worth of offsets, the C loop paces, stamps, issues, times and checks them, and scrapes move its results
into the statistics (drain()). Python wakes per batch and per failure, not per probe: woken cold for each
probe it cost about twice the probe's own syscalls (BENCHMARKS.md, cpu). Without the C module, the same
loop runs in Python one probe at a time.
"""

from __future__ import annotations

import array
import errno
import logging
import mmap
import os
import random
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from . import supervise
from .config import ProbeConfig
from .osthread import name_this_thread
from .safety import Refused
from .stats import ProbeStats

try:  # the C timer (see _timedio.c); optional at build time
    from . import _timedio
except ImportError:
    _timedio = None

TIMER = "c" if _timedio is not None else "python"

log = logging.getLogger(__name__)

SECTOR = 512
MAX_ERROR_BACKOFF_S = 30.0
MAX_SLEEP_NS = 1_000_000_000  # a worker notices stop and slow-down requests within a second
BATCH_S = 30.0  # the C loop returns to Python about this often (and at every failure, stop or slow-down)
RECHECK_S = 1.0  # a held write descriptor is checked again (fstat, size) before a batch, at most this often
# errnos after which the descriptor is worthless: the device went away or was replaced, or the filesystem went
# read-only (an ext4 error): letting go of the probe file lets the operator unmount it for fsck.
REOPEN_ERRNOS = {errno.ENXIO, errno.ENODEV, errno.ENOENT, errno.EBADF, errno.ESTALE, errno.ENOMEDIUM, errno.EROFS}
_M64 = (1 << 64) - 1


class BlockPermutation:
    """A keyed pseudo-random permutation of range(n): a 4-round Feistel network with cycle walking.

    The k-th fresh probe goes to block perm(k), so fresh offsets never repeat and look random to the
    storage, and whether an offset was probed before is known exactly with O(1) memory.
    """

    ROUNDS = 4

    def __init__(self, n: int, key: int) -> None:
        if n <= 0:
            raise ValueError("a permutation needs at least one element")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        rng = random.Random(key)
        self.keys = [rng.getrandbits(64) for _ in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            mixed = ((right ^ key) * 0x9E3779B97F4A7C15) & _M64
            mixed ^= mixed >> 29
            left, right = right, left ^ (mixed & self.mask)
        return (left << self.half) | right

    def __call__(self, index: int) -> int:
        x = self._encrypt(index)
        while x >= self.n:  # the domain is at most 4n, so this loops fewer than 4 times on average
            x = self._encrypt(x)
        return x


class OffsetPicker:
    """Chooses the next block: a fresh one, or with probability `revisit` one probed before.

    Picks are made BATCH at a time: one warm pass instead of a cold one after every probe's idle wait.

    With a cursor (volprobe.state.ProbeCursor), the permutation's key and the position of the next fresh
    offset come from the volume's state, and each fresh offset is reserved there before it is used: "first"
    then means never probed on this volume, across restarts. Revisits skip the cursor's gaps (offsets reserved
    but mostly never used before a crash). If a reservation cannot be written, the picker carries on with the
    same key and position and retries the write at the next fresh offset.
    """

    BATCH = 32

    def __init__(
        self, nblocks: int, revisit: float, rng: random.Random, key: int | None = None, cursor: Cursor | None = None
    ) -> None:
        self.nblocks = nblocks
        self.revisit = revisit
        self.rng = rng
        self.cursor = cursor
        if cursor is not None:
            key = cursor.key
        self.permutation = BlockPermutation(nblocks, rng.getrandbits(64) if key is None else key)
        self.fresh_used = min(nblocks, cursor.start) if cursor is not None else 0
        self.gaps = _merged([(a, min(b, self.fresh_used)) for a, b in (cursor.gaps if cursor else []) if a < b])
        self._gap_total = sum(b - a for a, b in self.gaps)
        self._queue: list[tuple[int, str]] = []
        self._unsaved = False

    def _revisit(self) -> int:
        """A position handed out before, uniformly, outside the gaps."""
        k = self.rng.randrange(self.fresh_used - self._gap_total)
        for start, end in self.gaps:
            if k < start:
                break
            k += end - start
        return k

    def _pick(self) -> tuple[int, str]:
        revisitable = self.fresh_used > self._gap_total
        if revisitable and (self.fresh_used >= self.nblocks or self.rng.random() < self.revisit):
            return self.permutation(self._revisit()), "repeat"
        if self.fresh_used >= self.nblocks:  # every block was handed out, but only before a crash
            return self.permutation(self.rng.randrange(self.nblocks)), "repeat"
        if self.cursor is not None and not self.cursor.reserve(self.fresh_used + 1):
            if not self._unsaved:
                log.warning(
                    "fresh offsets cannot be reserved in the state directory: first touch holds for this run, but "
                    "after a restart blocks touched from now on may count as first again"
                )
            self._unsaved = True
        block = self.permutation(self.fresh_used)
        self.fresh_used += 1
        return block, "first"

    def close(self) -> None:
        """Record the exact position (fresh offsets picked but never handed out are not used)."""
        if self.cursor is not None:
            unused = sum(1 for _, touch in self._queue if touch == "first")
            self.cursor.release(self.fresh_used - unused)

    def next(self) -> tuple[int, str]:
        """(block index, "first" or "repeat")."""
        if not self._queue:
            picks: list[tuple[int, str]] = []
            try:
                for _ in range(self.BATCH):
                    picks.append(self._pick())
            finally:  # a failed pick (the cursor's write) keeps those made before it: they come next
                self._queue = picks[::-1]
        return self._queue.pop()

    def put_back(self, picks: list[tuple[int, str]]) -> None:
        """Picks handed out but never used: they come next, in order (and close() knows them as unused)."""
        self._queue.extend(reversed(picks))


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[0] < r[1]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class Cursor(Protocol):
    """Where fresh offsets are remembered (volprobe.state.ProbeCursor)."""

    key: int
    start: int
    gaps: list[tuple[int, int]]

    def reserve(self, needed: int) -> bool: ...

    def release(self, used: int) -> None: ...


@dataclass(frozen=True)
class IOTarget:
    """Where one probe does its I/O: a file or device, the byte region it may touch, and how it opens."""

    path: str
    flags: int  # os.open flags, O_DIRECT included
    region_start: int
    region_end: int
    opener: Callable[[], int] | None = None  # opens for writing: every safety check, on the descriptor
    verify: Callable[[int], None] | None = None  # re-checks a held descriptor (size, links); raises Refused
    release: Callable[[], None] | None = None  # lets go of what the opener holds (a probe file's directory)

    def open(self) -> int:
        if self.opener is not None:
            return self.opener()
        return os.open(self.path, self.flags | os.O_CLOEXEC)

    def let_go(self) -> None:
        if self.release is not None:
            self.release()


def error_name(err: OSError) -> str:
    """The `errno` label of a failure: REFUSED when a safety check turned the descriptor down."""
    return "REFUSED" if isinstance(err, Refused) else errno.errorcode.get(err.errno or 0, "EUNKNOWN")


class Pacer:
    """Fixed-rate deadlines with optional jitter; slots passed while a probe ran are skipped, not replayed."""

    def __init__(self, interval_s: float, jitter: float, rng: random.Random, now_ns: int) -> None:
        self.rng = rng
        self.jitter = jitter
        self.set_interval(interval_s, now_ns)

    def set_interval(self, interval_s: float, now_ns: int) -> None:
        self.interval_ns = max(1, int(interval_s * 1e9))
        self.start_ns = now_ns
        self.slot = 0

    def deadline(self) -> int:
        offset = int(self.rng.random() * self.jitter * self.interval_ns) if self.jitter else 0
        return self.start_ns + self.slot * self.interval_ns + offset

    def advance(self, now_ns: int) -> int:
        """Move to the next slot that has not started yet; return how many slots were skipped."""
        due = (now_ns - self.start_ns) // self.interval_ns + 1
        skipped = max(0, due - (self.slot + 1))
        self.slot = max(self.slot + 1, due)
        return skipped


class WriteData:
    """A page-aligned random buffer; every write stamps a never-repeating counter into each 512-byte sector,
    so no two writes (nor two sectors of one write) carry the same bytes: compression, dedupe and zero
    detection in the storage cannot make writes look fast."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.view = memoryview(buffer)
        self.view[:] = os.urandom(len(buffer))
        self.sectors = len(buffer) // SECTOR
        self.counter = random.getrandbits(63)

    def stamp(self) -> None:
        self.counter += 1
        stamp = struct.pack("<Q", self.counter)
        for i in range(8):
            self.view[i::SECTOR] = stamp[i : i + 1] * self.sectors


class Outcome(NamedTuple):
    """One probe's result: a latency, or an error named by errno (or SHORT for a short transfer)."""

    offset: int
    touch: str
    latency_ns: int = 0
    end_ns: int = 0
    error: str = ""
    detail: str = ""
    zero: bool = False


class ProbeIO:
    """Does one synchronous, direct, aligned request at a time on one target and times exactly the syscall.

    prepare() does everything a probe needs before its request (the offset, the write data), so that issue()
    runs nothing but the timed request: a worker prepares before it sleeps, and issues as it wakes.
    """

    def __init__(
        self, spec: ProbeConfig, io: IOTarget, rng: random.Random, fd: int | None = None, cursor: Cursor | None = None
    ) -> None:
        block_size = spec.block_size
        nblocks = (io.region_end - io.region_start) // block_size
        if nblocks < 1:
            raise ValueError(f"{io.path}: no room for a {block_size}-byte block in the probe region")
        self.op = spec.op
        self.io = io
        self.block_size = block_size
        self.picker = OffsetPicker(nblocks, spec.revisit, rng, cursor=cursor)
        self.buffer = mmap.mmap(-1, block_size)  # anonymous mappings are page aligned, as O_DIRECT needs
        self._bufs = [self.buffer]
        self._empty = [memoryview(self.buffer)[:0]]
        self.write_data = WriteData(self.buffer) if spec.kind.writes else None
        self._zeros = bytes(block_size)
        # Writes keep their descriptor (a raw device's O_EXCL keeps others out while volprobe writes; a probe
        # file is ours). Reads open the device for each request unless told to hold it: holding it open between
        # probes would stop an administrator from detaching a loop device or removing a dm, md or zram device.
        # A descriptor that must be checked when opened (a probe file, a raw device) is opened once, through
        # the checks, and held: the C loop's per-request open goes by name, unchecked.
        self.hold_open = spec.kind.writes or spec.hold_open or io.opener is not None
        if fd is not None and not self.hold_open:
            os.close(fd)
            fd = None
        self.fd = fd
        self._inflight = array.array("q", [0])  # start of the request in flight (ns), 0 when none; see scrapes
        self._offset = -1
        self._touch = ""
        self._checked_ns = time.monotonic_ns()  # when the held descriptor was last checked (open_checked)

    @property
    def inflight_since_ns(self) -> int:
        return self._inflight[0]

    def open(self) -> None:
        """Open the descriptor a write probe keeps; reads open per request."""
        if self.hold_open and self.fd is None:
            self.fd = self.io.open()

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None

    def let_go(self) -> None:
        """The descriptor is worthless (the device went away, the filesystem went read-only): close it and let
        go of what its opener holds, so an operator can unmount; the next open checks everything again."""
        self.close()
        self.io.let_go()

    def open_checked(self) -> None:
        """open() (which checks what it opened), or re-check a held descriptor (size, links) if the last
        check is more than RECHECK_S old; on any failure, let go."""
        try:
            if self.fd is None:
                self.open()
                self._checked_ns = time.monotonic_ns()
            elif self.io.verify is not None and time.monotonic_ns() - self._checked_ns >= RECHECK_S * 1e9:
                self.io.verify(self.fd)
                self._checked_ns = time.monotonic_ns()
        except OSError:
            self.let_go()
            raise

    def prepare(self) -> None:
        block, self._touch = self.picker.next()
        self._offset = self.io.region_start + block * self.block_size
        if self.write_data is not None:
            self.write_data.stamp()

    def _timed_in_python(self, fd: int, offset: int, deadline_ns: int) -> tuple[int, int, int]:
        """The fallback without the C timer. A zero-length request first does no I/O but brings this code
        path into the CPU caches, so the timed request measures the kernel and device, not a cold interpreter."""
        clock = time.perf_counter_ns
        wait = deadline_ns - clock()
        if wait > 0:
            time.sleep(wait / 1e9)
        opened = fd < 0
        if opened:
            fd = os.open(self.io.path, self.io.flags | os.O_CLOEXEC)
        bufs = self._bufs
        inflight = self._inflight
        try:
            if self.write_data is not None:
                os.pwritev(fd, self._empty, offset)
                inflight[0] = t0 = clock()
                done = os.pwritev(fd, bufs, offset)
                t1 = clock()
            else:
                os.preadv(fd, self._empty, offset)
                inflight[0] = t0 = clock()
                done = os.preadv(fd, bufs, offset)
                t1 = clock()
        finally:
            inflight[0] = 0
            if opened:
                os.close(fd)
        return done, t0, t1

    def issue(self, deadline_ns: int = 0) -> Outcome:
        """The prepared request, at deadline_ns (perf_counter_ns clock) or now. The descriptor must be open;
        it is closed when the device went away."""
        offset = self._offset
        fd = self.fd if self.hold_open else -1
        assert fd is not None and offset >= 0, "open() and prepare() first"
        try:
            if _timedio is not None:
                timed = _timedio.write if self.write_data is not None else _timedio.read
                done, t0, t1 = timed(fd, self.buffer, offset, deadline_ns, self._inflight, self.io.path, self.io.flags)
            else:
                done, t0, t1 = self._timed_in_python(fd, offset, deadline_ns)
        except OSError as err:
            if err.errno in REOPEN_ERRNOS:
                self.let_go()
            name = error_name(err)
            where = f"open {self.io.path}" if err.filename else f"{self.op} at {offset}"
            return Outcome(offset, self._touch, error=name, detail=f"{where}: {err.strerror}")
        if done != self.block_size:
            detail = f"{self.op} at {offset}: {done} of {self.block_size} bytes"
            return Outcome(offset, self._touch, error="SHORT", detail=detail)
        zero = self.write_data is None and self.buffer[:] == self._zeros
        return Outcome(offset, self._touch, t1 - t0, t1, zero=zero)

    def once(self) -> Outcome:
        """prepare() and issue(): one probe now."""
        self.prepare()
        return self.issue()


class ProbeWorker:
    """Runs one probe (a ProbeConfig on one target's IOTarget) in its own thread, paced by deadline."""

    def __init__(
        self,
        spec: ProbeConfig,
        io: IOTarget,
        stats: ProbeStats,
        *,
        name: str = "",
        fd: int | None = None,
        seed: int | None = None,
        cursor: Cursor | None = None,
    ) -> None:
        self.spec = spec
        self.name = name or io.path  # the target's name, for logs and the thread's name
        self.op = spec.op
        self.interval_s = spec.interval
        self.jitter = spec.jitter
        self.stats = stats
        self.rng = random.Random(seed)
        self.probe = ProbeIO(spec, io, self.rng, fd, cursor)
        self._stopping = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._slowdown = 1.0
        self._loop = _c_loop(self.probe, spec, self.rng)
        self._batch: list[tuple[int, str]] = []  # the picks the C loop is working through
        # Read by scrapes; written only by the worker thread (or by the C loop: see the properties).
        self._missed = 0
        self._zero_reads = 0
        self._completed = 0
        self.errors: dict[str, int] = {}
        self.last_error = ""
        self._last_logged = 0.0

    # -- control ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"probe {self.name} {self.op}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._loop is not None:
            self._loop.stop()

    def join(self, timeout: float) -> bool:
        """Wait for the thread; False if it is still stuck in the kernel (a stalled device)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Release the descriptor once the thread is gone (a thread stuck in the kernel keeps it)."""
        if self._thread is None or not self._thread.is_alive():
            self.probe.close()

    def set_slowdown(self, factor: float) -> None:
        """Stretch the interval (throttle back-off); 1 restores the configured rate. Applies within a second."""
        self._slowdown = factor
        if self._loop is not None:
            self._loop.set_interval(self._interval_ns())

    @property
    def completed(self) -> int:
        return self._completed + (self._loop.completed if self._loop is not None else 0)

    @property
    def missed(self) -> int:
        return self._missed + (self._loop.missed if self._loop is not None else 0)

    @property
    def zero_reads(self) -> int:
        return self._zero_reads + (self._loop.zero_reads if self._loop is not None else 0)

    def drain(self) -> None:
        """Move the C loop's finished probes into the statistics: scrapes call this, so they are never behind."""
        if self._loop is None:
            return
        with self._lock:
            batch, record = self._batch, self.stats.record
            for index, latency_ns, end_ns, _zero in self._loop.take():
                record(latency_ns, batch[index][1], end_ns)

    @property
    def slowdown(self) -> float:
        return self._slowdown

    def inflight_seconds(self, now_ns: int | None = None) -> float:
        since = self.probe.inflight_since_ns
        if not since:
            return 0.0
        return max(0, (now_ns or time.perf_counter_ns()) - since) / 1e9

    def error_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.errors)

    # -- the loop -----------------------------------------------------------------------------------

    def _count_error(self, name: str, detail: str) -> None:
        with self._lock:
            self.errors[name] = self.errors.get(name, 0) + 1
            count = self.errors[name]
        now = time.monotonic()
        # A failing device fails every probe: log a new kind of error at once, the same one once a minute.
        if name != self.last_error or now - self._last_logged >= 60:
            log.warning("probe %s %s: %s (%d so far)", self.name, self.op, detail, count)
            self._last_logged = now
        self.last_error = name

    def _backoff_ns(self, failures: int) -> int:
        return int(min(self.interval_s * 2 ** min(failures, 32), MAX_ERROR_BACKOFF_S) * 1e9)

    def _run(self) -> None:
        name_this_thread(f"vp {self.op} {self.name}")

        def probe_loop() -> None:
            try:
                if self._loop is not None:
                    self._run_batches(self._loop)
                else:
                    self._run_one_by_one()
            except Exception:
                # A restart goes on with the same stats, counters and picker, but not with a descriptor the
                # failed run may have left anywhere: the next run opens it again, through every check.
                self.probe.close()
                raise

        try:
            supervise.run("probe", probe_loop, lambda: self._stopping, f"probe {self.name} {self.op}")
        finally:
            self.probe.picker.close()
            self.probe.close()  # a worker that outlived its stop still releases its descriptor (and O_EXCL)

    def _interval_ns(self) -> int:
        """The interval in force: the configured one stretched by the throttle back-off."""
        return max(1, int(self.interval_s * self._slowdown * 1e9))

    def _batch_size(self) -> int:
        """About BATCH_S of probes per trip into C (so Python wakes that often), within [8, 512]."""
        return max(8, min(512, int(BATCH_S / (self.interval_s * self._slowdown))))

    def _take_batch(self, picker: OffsetPicker) -> list[tuple[int, str]]:
        """The next batch's picks; if picking fails part-way, those taken are put back, not lost."""
        batch: list[tuple[int, str]] = []
        try:
            for _ in range(self._batch_size()):
                batch.append(picker.next())
        except BaseException:
            picker.put_back(batch)
            raise
        return batch

    def _run_batches(self, loop: _timedio.Loop) -> None:
        """The C loop does the probes; Python picks offsets a batch at a time and handles each failure."""
        clock = time.perf_counter_ns
        probe = self.probe
        picker = probe.picker
        loop.schedule(clock(), self._interval_ns())
        failures = 0
        retry_at = 0  # after a failed open: not before this (perf_counter_ns)
        while not self._stopping:
            if probe.hold_open:
                wait = retry_at - clock()
                if wait > 0:
                    time.sleep(min(wait, MAX_SLEEP_NS) / 1e9)  # backing off; wake each second for stop
                    continue
                try:  # a held descriptor is checked again (RECHECK_S): a resized device stops its writes
                    probe.open_checked()
                except OSError as err:
                    failures += 1
                    self._count_error(error_name(err), f"open: {err}")
                    retry_at = clock() + self._backoff_ns(failures)
                    loop.schedule(retry_at, self._interval_ns())
                    continue
            batch = self._take_batch(picker)
            offsets = array.array("q", [probe.io.region_start + block * probe.block_size for block, _ in batch])
            self.drain()
            with self._lock:
                self._batch = batch
            done, status, code, moved = loop.run(offsets, probe.fd if probe.hold_open else -1)
            self.drain()
            if probe.write_data is not None:
                probe.write_data.counter = loop.counter
            if done:
                failures = 0
            if status == _timedio.RUN_DONE:
                continue
            if status == _timedio.RUN_STOPPED:
                picker.put_back(batch[done:])
                break
            picker.put_back(batch[done + 1 :])
            failures += 1
            offset = offsets[done]
            if status == _timedio.RUN_SHORT:
                self._count_error("SHORT", f"{self.op} at {offset}: {moved} of {probe.block_size} bytes")
            else:
                if code in REOPEN_ERRNOS:
                    probe.let_go()
                where = f"open {probe.io.path}" if status == _timedio.RUN_OPEN_FAILED else f"{self.op} at {offset}"
                self._count_error(errno.errorcode.get(code, "EUNKNOWN"), f"{where}: {os.strerror(code)}")
            # Back off, and restart the schedule after it: slots skipped while backing off are not "missed".
            retry_at = clock() + self._backoff_ns(failures)
            loop.schedule(retry_at, self._interval_ns())

    def _run_one_by_one(self) -> None:
        """Without the C module: one probe per trip through Python."""
        clock = time.perf_counter_ns
        probe = self.probe
        pacer = Pacer(self.interval_s, self.jitter, self.rng, clock())
        slowdown = self._slowdown
        failures = 0
        deadline = pacer.deadline()
        ready = False
        retry_at = 0  # after a failed open: not before this (perf_counter_ns)
        while not self._stopping:
            if slowdown != self._slowdown:
                slowdown = self._slowdown
                pacer.set_interval(self.interval_s * slowdown, clock())
                deadline = pacer.deadline()
            if not ready:  # open the device if needed and prepare the request, before sleeping
                wait = retry_at - clock()
                if wait > 0:
                    time.sleep(min(wait, MAX_SLEEP_NS) / 1e9)  # backing off; wake each second for stop
                    continue
                try:
                    probe.open_checked()
                    probe.prepare()
                    ready = True
                except OSError as err:
                    failures += 1
                    self._count_error(error_name(err), f"open: {err}")
                    retry_at = deadline = clock() + self._backoff_ns(failures)
                    pacer.set_interval(self.interval_s * slowdown, deadline)
                    continue
            if deadline - clock() > MAX_SLEEP_NS:
                time.sleep(MAX_SLEEP_NS / 1e9)  # long intervals: wake each second for stop and slow-down
                continue
            outcome = probe.issue(deadline)  # sleeps until the deadline, then the request, in one call
            ready = False
            if outcome.error:
                failures += 1
                self._count_error(outcome.error, outcome.detail)
                # Back off, and restart the schedule after it: slots skipped while backing off are not "missed".
                deadline = clock() + self._backoff_ns(failures)
                pacer.set_interval(self.interval_s * slowdown, deadline)
                continue
            failures = 0
            self._completed += 1
            self.stats.record(outcome.latency_ns, outcome.touch, outcome.end_ns)
            if outcome.zero:
                self._zero_reads += 1
            self._missed += pacer.advance(clock())
            deadline = pacer.deadline()


def _c_loop(probe: ProbeIO, spec: ProbeConfig, rng: random.Random) -> _timedio.Loop | None:
    """The probe's C loop (see _timedio.c), or None without the C module."""
    if _timedio is None:
        return None
    counter = probe.write_data.counter if probe.write_data is not None else 0
    return _timedio.Loop(
        probe.io.path,
        probe.io.flags,
        probe.buffer,
        probe._inflight,
        probe.write_data is not None,
        spec.jitter,
        rng.getrandbits(64),
        counter,
    )
