"""The probes: a worker per probe, one synchronous O_DIRECT request at a time, paced by deadline.

Only the syscall sits between the two clock reads. Everything else a probe needs (choosing the offset,
stamping the write buffer, checking a read for zeros, recording the sample) happens outside them.

A worker (ProbeWorker) picks its offsets a batch at a time and hands each batch to its timer (timer.py: in C,
or in Python without the C module), which paces, stamps, issues, times and checks them; the worker handles
every failure the same way whichever timer ran (count, back off, let go of a worthless descriptor, reopen
through every check), and scrapes move the timer's results into the statistics (drained()). With the C timer
Python wakes per batch and per failure, not per probe: woken cold for each probe it cost about twice the
probe's own syscalls (BENCHMARKS.md, cpu). The C timer's requests are made by the process's probe engine
(_timedio.c), one thread for every probe, while the worker's thread sleeps in run(), and the timer re-checks a
held descriptor during the run (Timer.pin, HELD_RECHECK_S). `volprobe ping` runs the same worker, one probe a
batch.
"""

from __future__ import annotations

import array
import errno
import logging
import mmap
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, overload

from . import supervise, timer
from .config import ProbeConfig
from .logs import fields
from .osthread import name_this_thread, set_timer_slack
from .safety import Refused
from .stats import TOUCHES, LatencySnapshot, ProbeStats
from .timer import Status

TIMER = timer.KIND  # "c" or "python": volprobe_build_info{timer}

log = logging.getLogger(__name__)

MAX_ERROR_BACKOFF_S = 30.0
# The C timer returns to Python about this often (and at every failure, stop, slow-down or change found by a
# re-check): a cold wake of the worker costs about 150 us, which spread over 30 s of probes was a sixth of a
# probe's CPU. What the worker did per batch that must happen more often is the timer's (HELD_RECHECK_S).
BATCH_S = 300.0
MAX_BATCH = 512
# A probe that keeps nothing gives its timer one request a run, due at once: an interval it cannot overrun, so
# that slots are counted missed by its worker's pacer alone.
UNHELD_TIMER_INTERVAL_NS = 1 << 62
# A held descriptor is checked when opened; then the timer, before a request this long after the last check,
# compares it with its pin (Timer.pin: what the check judged) and ends the run on any change, for the full check
# again. The checks judge nothing the pin leaves out, so a descriptor as pinned would pass them.
HELD_RECHECK_S = 30.0
PIN_TRIES = 3  # a descriptor that changes during each of this many checks in a row is refused
# A probe may wake up to 1% of its interval late (at most 10 ms), on the same slot grid: the kernel then serves
# probes due close together with one wake-up of a CPU, which on an idle VM costs more than the probe itself.
# Each probe's jitter already moves it by up to 10% of its interval; the request is timed on its own.
TIMER_SLACK_SHARE = 0.01
MAX_TIMER_SLACK_NS = 10_000_000
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
        self._reserve_next()
        block = self.permutation(self.fresh_used)
        self.fresh_used += 1
        return block, "first"

    def _reserve_next(self) -> None:
        """Reserve the next fresh position in the cursor; if it cannot be written, carry on (and say so once)."""
        if self.cursor is not None and not self.cursor.reserve(self.fresh_used + 1):
            if not self._unsaved:
                log.warning(
                    "fresh offsets cannot be reserved in the state directory: first touch holds for this run, but "
                    "after a restart blocks touched from now on may count as first again"
                )
            self._unsaved = True

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


class SequentialPicker(OffsetPicker):
    """A log's offsets (commit probes): block after block from the start, wrapped at the end, as a WAL is
    written. Positions count on past the end (the cursor keeps them across restarts, so the log carries on
    where it stopped); a block is "first" on the first pass over the file, "repeat" once the log wrapped."""

    def __init__(self, nblocks: int, rng: random.Random, cursor: Cursor | None = None) -> None:
        super().__init__(nblocks, 0.0, rng, key=0, cursor=cursor)
        self.fresh_used = cursor.start if cursor is not None else 0

    def _pick(self) -> tuple[int, str]:
        self._reserve_next()
        position = self.fresh_used
        self.fresh_used += 1
        return position % self.nblocks, "first" if position < self.nblocks else "repeat"

    def close(self) -> None:
        """Record the exact position: every pick took one, those never handed out are given back."""
        if self.cursor is not None:
            self.cursor.release(self.fresh_used - len(self._queue))


class NoOffsets:
    """The picks of a probe whose requests have no offset (metadata: each sequence makes a new file, "first")."""

    def next(self) -> tuple[int, str]:
        return 0, "first"

    def put_back(self, picks: list[tuple[int, str]]) -> None:
        pass

    def close(self) -> None:
        pass


class Picks(Sequence[tuple[int, str]]):
    """A batch's picks, kept compact: a batch may hold MAX_BATCH, each worker keeps one, and as (block, touch)
    tuples that was about 90 bytes a pick. The blocks are an int64 array, whether each is a first touch a
    bytearray; read as the list of (block, touch) they stand for."""

    __slots__ = ("blocks", "first")

    def __init__(self, picks: Iterable[tuple[int, str]] = ()) -> None:
        self.blocks = array.array("q")
        self.first = bytearray()
        for pick in picks:
            self.append(pick)

    def append(self, pick: tuple[int, str]) -> None:
        self.blocks.append(pick[0])
        self.first.append(pick[1] == "first")

    def __len__(self) -> int:
        return len(self.blocks)

    @overload
    def __getitem__(self, index: int) -> tuple[int, str]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[int, str]]: ...

    def __getitem__(self, index: int | slice) -> tuple[int, str] | list[tuple[int, str]]:
        if isinstance(index, slice):
            return list(zip(self.blocks[index], map(_touch, self.first[index]), strict=True))
        return self.blocks[index], _touch(self.first[index])

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return zip(self.blocks, map(_touch, self.first), strict=True)


def _touch(first: int) -> str:
    return "first" if first else "repeat"


def new_picker(
    offsets: str, nblocks: int, revisit: float, rng: random.Random, cursor: Cursor | None = None
) -> OffsetPicker | NoOffsets:
    """The picker of an op's `offsets` (ops.Op.offsets)."""
    if offsets == "sequential":
        return SequentialPicker(nblocks, rng, cursor)
    if offsets == "none":
        return NoOffsets()
    return OffsetPicker(nblocks, revisit, rng, cursor=cursor)


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
    held: bool = False  # the target holds the device open anyway (a raw write probe): reads keep theirs too
    # False (a pod volume's probe file, targets.TargetConfig.hold): opened through the opener for each probe and
    # closed after it, never kept between probes (ProbeWorker paces those probes itself).
    keep: bool = True

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
    """One probe's side of its target: the descriptor (opened through every check, re-checked, let go of), the
    offsets, the page-aligned buffer and the timer that makes the requests. run() is the one way to probe:
    the worker's batches, and once()."""

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
        self.picker = new_picker(spec.kind.offsets, nblocks, spec.revisit, rng, cursor)
        self.buffer = mmap.mmap(-1, block_size)  # anonymous mappings are page aligned, as O_DIRECT needs
        self._inflight = array.array("q", [0])  # start of the request in flight (ns), 0 when none; see scrapes
        # A probe that keeps nothing is paced by its worker, which opens just before the slot: its timer's own
        # slot is then due at once, without jitter (the worker's pacer has it).
        jitter = spec.jitter if io.keep else 0.0
        # The process's probe engine makes the requests of a probe that keeps its slot (timer.py); one that keeps
        # nothing wakes its worker for each probe anyway, which then makes the request itself.
        seed = rng.getrandbits(64)
        self.timer = timer.new(io.path, io.flags, self.buffer, self._inflight, spec.kind, jitter, seed, io.keep)
        self.engine = self.timer.engine
        # Writes keep their descriptor (a raw device's O_EXCL keeps others out while volprobe writes; a probe
        # file is ours). Reads open the device for each request unless told to hold it: holding it open between
        # probes would stop an administrator from detaching a loop device or removing a dm, md or zram device.
        # A descriptor that must be checked when opened (a probe file, a raw device) is opened once, through
        # the checks, and held: the timer's per-request open goes by name, unchecked. Where the target holds
        # its device anyway (io.held), letting go would free nothing.
        self.hold_open = spec.kind.writes or spec.hold_open or io.opener is not None or io.held
        # io.keep False: through the opener's checks for each probe, closed after it (ProbeWorker's unheld loop).
        self.keep = io.keep
        assert self.keep or io.opener is not None, "a probe that keeps nothing opens through its checks"
        if fd is not None and (not self.hold_open or not self.keep):
            os.close(fd)
            fd = None
        self.fd = fd
        # Whether the held descriptor must be checked before the next run (open_checked): when it was opened, or a
        # run's re-check found it changed. A descriptor handed over was checked by its opener, but not pinned.
        self._must_check = True

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
        """open() (which checks what it opened), and check a held descriptor (size, links) again if it is new or
        a run found it changed; on any failure, let go. The timer is given the descriptor as each check judged it
        (Timer.pin), and re-checks it during runs."""
        try:
            fresh = self.fd is None
            if fresh:
                self.open()
            if self.fd is None or self.io.verify is None or not self.keep:
                return  # nothing held past this probe: the opener's checks were enough
            if fresh or self._must_check:
                self._check_and_pin(self.fd, self.io.verify)
        except OSError:
            self.let_go()
            raise

    def _check_and_pin(self, fd: int, verify: Callable[[int], None]) -> None:
        """Pin fd, check it, and make sure it did not change meanwhile: what the timer then compares it with is
        what the check judged (a state that was refused and then undone during the check is taken again)."""
        for _ in range(PIN_TRIES):
            self.timer.pin(fd)
            verify(fd)
            if self.timer.holds(fd):
                self._must_check = False
                return
        raise Refused(f"changed while it was checked, {PIN_TRIES} times in a row", self.io.path)

    def changed(self) -> None:
        """A run's re-check found the held descriptor changed: the next open_checked() checks it all again."""
        self._must_check = True

    def offset_of(self, block: int) -> int:
        return self.io.region_start + block * self.block_size

    def run(self, batch: Sequence[tuple[int, str]]) -> tuple[int, Status, Outcome | None]:
        """Probe the batch's blocks (picks) in order, each in its slot: (how many succeeded, how the run ended,
        the failure that ended it). The results wait in the timer for take(). The descriptor must be open (the
        held one: open_checked()); it is let go of when a failure shows it worthless."""
        offsets = array.array("q", [self.offset_of(block) for block, _ in batch])
        assert not self.hold_open or self.fd is not None, "open_checked() first"
        recheck_ns = int(HELD_RECHECK_S * 1e9) if self.io.verify is not None and self.keep else 0
        done, status, code, moved = self.timer.run(offsets, self.fd if self.fd is not None else -1, recheck_ns)
        ended = Status(status)
        if ended in (Status.DONE, Status.STOPPED):
            return done, ended, None
        if ended == Status.CHANGED:  # offsets[done] was not made: the worker has the descriptor checked again
            self.changed()
            return done, ended, None
        offset, touch = offsets[done], batch[done][1]
        if ended == Status.SHORT:
            detail = f"{self.op} at {offset}: {moved} of {self.block_size} bytes"
            return done, ended, Outcome(offset, touch, error="SHORT", detail=detail)
        if code in REOPEN_ERRNOS:
            self.let_go()
        where = f"open {self.io.path}" if ended == Status.OPEN_FAILED else f"{self.op} at {offset}"
        if code == errno.EEXIST:
            # Only a request that creates its own names (the metadata sequence, O_EXCL and RENAME_NOREPLACE) meets
            # EEXIST: something volprobe did not make took one of them. Nothing was opened or written there; the
            # next request draws fresh names.
            detail = f"{where}: a name it creates was taken by a file volprobe did not make; left alone"
            return done, ended, Outcome(offset, touch, error="REFUSED", detail=detail)
        name = errno.errorcode.get(code, "EUNKNOWN")
        return done, ended, Outcome(offset, touch, error=name, detail=f"{where}: {os.strerror(code)}")

    def once(self) -> Outcome:
        """One probe now, through the held descriptor if there is one (the tests' single request)."""
        pick = self.picker.next()
        self.timer.schedule(time.perf_counter_ns(), 1)
        _, _, failure = self.run([pick])
        if failure is not None:
            return failure
        ((_, latency_ns, end_ns, zero),) = self.timer.take()
        return Outcome(self.offset_of(pick[0]), pick[1], latency_ns, end_ns, zero=zero)


class ProbeWorker:
    """Runs one probe (a ProbeConfig on one target's IOTarget) in its own thread, paced by deadline: picks its
    offsets a batch at a time, hands them to the timer, and handles each failure (count, back off, reopen).

    on_outcome, if given, sees every outcome, in the thread that drains or fails (`volprobe ping` prints them),
    and takes over the logging of failures; max_batch limits the probes a batch (ping: 1, each as it is made).
    """

    def __init__(
        self,
        spec: ProbeConfig,
        io: IOTarget,
        stats: ProbeStats,
        *,
        name: str = "",
        device: str = "",
        fd: int | None = None,
        seed: int | None = None,
        cursor: Cursor | None = None,
        max_batch: int = MAX_BATCH,
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> None:
        self.spec = spec
        self.name = name or io.path  # the target's name, for logs and the thread's name
        self.device = device  # the target's device's kernel name, for logs ("" if none)
        self.op = spec.op
        self.interval_s = spec.interval
        self.stats = stats
        self.rng = random.Random(seed)
        self.probe = ProbeIO(spec, io, self.rng, fd, cursor)
        self.timer = self.probe.timer
        self.max_batch = max_batch
        self.on_outcome = on_outcome
        self._stopping = False
        self._stop_requested = threading.Event()  # wakes a back-off
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._slowdown = 1.0
        self._timer_slack_ns = -1  # as last set on the worker's thread (-1: not yet)
        self._batch: Sequence[tuple[int, str]] = ()  # the picks the timer is working through
        self._missed_unheld = 0  # slots a probe that keeps nothing skipped (its worker paces it: _unheld_loop)
        # Read by scrapes; written only by the worker thread.
        self.errors: dict[str, int] = {}
        self.last_error = ""
        self._last_logged = 0.0

    # -- control ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"probe {self.name} {self.op}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._stop_requested.set()
        self.timer.stop()

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
        """Stretch the interval (throttle back-off); 1 restores the configured rate. Applies at once (a probe that
        keeps nothing: from its next slot)."""
        self._slowdown = factor
        if self.probe.keep:
            self.timer.set_interval(self._interval_ns())

    @property
    def completed(self) -> int:
        return self.timer.completed

    @property
    def missed(self) -> int:
        return self.timer.missed + self._missed_unheld

    @property
    def zero_reads(self) -> int:
        return self.timer.zero_reads

    def drain(self) -> None:
        """Move the timer's finished probes into the statistics (the worker before and after each batch, the
        throttle watch; scrapes call drained(), so they are never behind)."""
        with self._lock:
            self._drain()

    def drained(self, now_ns: int) -> tuple[tuple[LatencySnapshot, ...], tuple[int, ...]]:
        """Drain, then each touch's statistics and the nanoseconds in each step of its sequences (ops.Op.steps;
        empty for a single request), as of that one drain: a scrape's latency histogram and its step counters
        hold the same requests, whatever finishes meanwhile."""
        with self._lock:
            self._drain()
            return tuple(self.stats.snapshot(touch, now_ns) for touch in TOUCHES), self.timer.steps

    def _drain(self) -> None:
        batch, record, listener = self._batch, self.stats.record, self.on_outcome
        for index, latency_ns, end_ns, zero in self.timer.take():  # the timer's steps follow what take() returns
            block, touch = batch[index]
            record(latency_ns, touch, end_ns)
            if listener is not None:
                listener(Outcome(self.probe.offset_of(block), touch, latency_ns, end_ns, zero=zero))

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

    def _failed(self, outcome: Outcome) -> None:
        with self._lock:
            self.errors[outcome.error] = count = self.errors.get(outcome.error, 0) + 1
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        else:
            now = time.monotonic()
            # A failing device fails every probe: log a new kind of error at once, the same one once a minute.
            if outcome.error != self.last_error or now - self._last_logged >= 60:
                where = fields(
                    target=self.name, device=self.device, path=self.probe.io.path, op=self.op, errno=outcome.error
                )
                log.warning("probe %s %s: %s (%d so far)", self.name, self.op, outcome.detail, count, extra=where)
                self._last_logged = now
        self.last_error = outcome.error

    def _backoff_ns(self, failures: int) -> int:
        return int(min(self.interval_s * 2 ** min(failures, 32), MAX_ERROR_BACKOFF_S) * 1e9)

    def _run(self) -> None:
        name_this_thread(f"vp {self.op} {self.name}")

        def probe_loop() -> None:
            try:
                if self.probe.keep:
                    self._probe_loop()
                else:
                    self._unheld_loop()
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
        """About BATCH_S of probes per run (so Python wakes that often), within [8, MAX_BATCH], and no more than
        the timer and the worker take."""
        paced = max(8, min(MAX_BATCH, int(BATCH_S / (self.interval_s * self._slowdown))))
        return max(1, min(paced, self.timer.max_batch, self.max_batch))

    def _take_batch(self, picker: OffsetPicker | NoOffsets) -> Picks:
        """The next batch's picks; if picking fails part-way, those taken are put back, not lost."""
        batch = Picks()
        try:
            for _ in range(self._batch_size()):
                batch.append(picker.next())
        except BaseException:
            picker.put_back(batch[:])
            raise
        return batch

    def _probe_loop(self) -> None:
        """The timer does the probes; the worker picks offsets a batch at a time and handles each failure."""
        clock = time.perf_counter_ns
        probe = self.probe
        picker = probe.picker
        self.timer.schedule(clock(), self._interval_ns())
        failures = 0
        retry_at = 0  # after a failed open: not before this (perf_counter_ns)
        while not self._stopping:
            if probe.hold_open:
                wait = retry_at - clock()
                if wait > 0:
                    self._stop_requested.wait(wait / 1e9)  # backing off; a stop ends it at once
                    continue
                try:  # a new or changed held descriptor is checked: a resized device stops its writes
                    probe.open_checked()
                except OSError as err:
                    failures += 1
                    self._failed(Outcome(-1, "", error=error_name(err), detail=f"open: {err}"))
                    retry_at = clock() + self._backoff_ns(failures)
                    self.timer.schedule(retry_at, self._interval_ns())
                    continue
            batch = self._take_batch(picker)
            slack = min(MAX_TIMER_SLACK_NS, int(self._interval_ns() * TIMER_SLACK_SHARE))
            # The Python timer sleeps in this thread (the engine sets its own thread's slack, the same way)
            if not probe.engine and slack != self._timer_slack_ns:
                set_timer_slack(slack)
                self._timer_slack_ns = slack
            self.drain()
            with self._lock:
                self._batch = batch
            done, ended, failure = probe.run(batch)
            self.drain()
            if done:
                failures = 0
            if ended == Status.DONE:
                continue
            if ended == Status.STOPPED:
                picker.put_back(batch[done:])
                break
            if ended == Status.CHANGED:  # checked again at the top (open_checked), before the next request
                picker.put_back(batch[done:])
                continue
            assert failure is not None
            picker.put_back(batch[done + 1 :])
            failures += 1
            self._failed(failure)
            # Back off, and restart the schedule after it: slots skipped while backing off are not "missed".
            retry_at = clock() + self._backoff_ns(failures)
            self.timer.schedule(retry_at, self._interval_ns())

    def _unheld_loop(self) -> None:
        """The loop of a probe that keeps nothing open between probes (a pod volume, which the kubelet must be able
        to unmount at any time): the worker waits for each slot itself, holding nothing, then opens the file
        through every check (its directory recognised on the descriptor, the file judged on its descriptor and
        pinned to the one made), has the timer make the one request at once, and closes both before the next
        wait. One probe a run: Python wakes for each."""
        clock = time.perf_counter_ns
        probe = self.probe
        picker = probe.picker
        pacer = timer.Pacer(self.spec.jitter, self.rng)
        pacer.schedule(clock(), self._interval_ns())
        failures = 0
        while not self._stopping:
            interval = self._interval_ns()
            if interval != pacer.interval_ns:  # a throttle back-off (or its end): from now on
                pacer.schedule(clock(), interval)
            wait = pacer.deadline_ns - clock()
            if wait > 0:
                self._stop_requested.wait(wait / 1e9)
                continue
            try:
                try:
                    probe.open_checked()  # fd is None here: opened, recognised and judged now
                except OSError as err:
                    failures += 1
                    self._failed(Outcome(-1, "", error=error_name(err), detail=f"open: {err}"))
                    pacer.schedule(clock() + self._backoff_ns(failures), interval)
                    continue
                batch = [picker.next()]
                self.drain()
                with self._lock:
                    self._batch = batch
                self.timer.schedule(clock(), UNHELD_TIMER_INTERVAL_NS)  # due now: the slot was waited for above
                done, ended, failure = probe.run(batch)
                self.drain()
            finally:
                probe.close()  # the file; the directory was let go of as soon as the file was open
            self._missed_unheld += pacer.advance(clock())
            if done:
                failures = 0
            if ended == Status.DONE:
                continue
            if ended == Status.STOPPED:
                picker.put_back(batch[done:])
                break
            assert failure is not None
            failures += 1
            self._failed(failure)
            pacer.schedule(clock() + self._backoff_ns(failures), interval)
