"""Warm-up (volume initialization): read every block of a device once, resumably, at a bounded rate.

Volumes restored from snapshots, and fresh lazily allocated ones, are slow until every block has been touched
once. This is the AWS initialization procedure (`fio --rw=read --bs=1M --iodepth=32 --direct=1`) as a
resumable job: `jobs` threads read `block_size` blocks in order with O_DIRECT, optionally at idle I/O
priority; with mode "write" every block of the region raw write probes may use is first written (only on a
blank device, through a descriptor checked as theirs is: targets.open_raw_exclusive), then every block read.
The first and last MiB, where signatures live, are read but never written.

Progress is checkpointed atomically (write, fsync, rename) every `checkpoint_interval` to a state file: the
blocks done, as extents. After a crash or kill -9 the job resumes from it and ends with every block read, at
most one checkpoint interval (plus the blocks in flight) read twice. A state file that is corrupt, or was
made for another device, size or block size, is reported and the job starts over.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .capabilities import Capabilities, set_idle_priority
from .config import WarmupConfig
from .safety import GUARD_BYTES
from .state import SectionCheckpoint, StateStore, move_aside, read_state_file, write_atomically
from .timer import WriteData

if TYPE_CHECKING:
    from .targets import ResolvedTarget

log = logging.getLogger(__name__)

STATES = ("queued", "pending", "running", "done", "failed")
STATE_VERSION = 1


@dataclass(frozen=True)
class Identity:
    """What a state file must match to be resumed."""

    device: str  # the most stable name available: volume id, WWN, serial, else the path
    size: int
    block_size: int
    mode: str

    def to_json(self) -> dict[str, object]:
        return {"device": self.device, "size": self.size, "block_size": self.block_size, "mode": self.mode}


@dataclass
class Progress:
    """Shared between the workers, the checkpointer and scrapes."""

    size: int  # of the device
    block_size: int
    phases: int = 1  # 2 in write mode: every block is written, then read
    state: str = "pending"
    phase: str = "read"
    base_bytes: int = 0  # work of the phases already finished
    done_blocks: int = 0  # in the current phase
    resumed_blocks: int = 0
    started: float = 0.0
    finished: float = 0.0
    error: str = ""
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes done) for the rate

    @property
    def nblocks(self) -> int:
        return -(-self.size // self.block_size)

    @property
    def total_bytes(self) -> int:
        return self.size * self.phases

    @property
    def done_bytes(self) -> int:
        return self.base_bytes + min(self.size, self.done_blocks * self.block_size)

    @property
    def ratio(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0

    def rate(self) -> float:
        """Bytes per second over the last ten seconds or so."""
        if len(self.recent) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self.recent[0], self.recent[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def eta(self) -> float | None:
        if self.state == "done":
            return 0.0
        rate = self.rate()
        return (self.total_bytes - self.done_bytes) / rate if rate > 0 else None


class Extents:
    """Blocks done, as a low-water mark (everything below is done) and the done blocks above it.

    Blocks are handed out in order, so the set above the mark stays about as small as the number of jobs.
    """

    # A saved checkpoint with more blocks than this above its mark is corrupt: a real one has about as many as
    # the warm-up has jobs, and a hostile `[[1, 10**12]]` must not become a set of 10**12 ints. Only a worker
    # stuck in a hung read while the others read 64 GiB past it (at 1 MiB blocks) could save more: that
    # warm-up starts over.
    MAX_ABOVE = 65536

    def __init__(self, nblocks: int) -> None:
        self.nblocks = nblocks
        self.mark = 0
        self.above: set[int] = set()

    def add(self, block: int) -> None:
        if block == self.mark:
            self.mark += 1
            while self.mark in self.above:
                self.above.discard(self.mark)
                self.mark += 1
        elif block > self.mark:
            self.above.add(block)

    def __contains__(self, block: int) -> bool:
        return block < self.mark or block in self.above

    def __len__(self) -> int:
        return self.mark + len(self.above)

    def to_list(self) -> list[list[int]]:
        ranges = [[0, self.mark]] if self.mark else []
        for block in sorted(self.above):
            if ranges and ranges[-1][1] == block:
                ranges[-1][1] = block + 1
            else:
                ranges.append([block, block + 1])
        return ranges

    @classmethod
    def from_list(cls, nblocks: int, ranges: object) -> Extents:
        if not isinstance(ranges, list):
            raise ValueError("extents are not a list")
        extents = cls(nblocks)
        above = 0
        for item in ranges:
            if not (isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item)):
                raise ValueError(f"bad extent {item!r:.80}")
            start, end = item
            if not 0 <= start < end <= nblocks:
                raise ValueError(f"extent {item} outside the device's {nblocks} blocks")
            if start == 0:
                extents.mark = max(extents.mark, end)
                continue
            above += end - start  # counted before the blocks are added one by one
            if above > cls.MAX_ABOVE:
                raise ValueError(f"more than {cls.MAX_ABOVE} blocks done above the first gap")
            for block in range(start, end):
                extents.add(block)
        # Ranges in another order than to_list's ([[5, 6], [0, 5]]): what the mark reached is not above it.
        above_mark, extents.above = extents.above, set()
        for block in sorted(above_mark):
            extents.add(block)
        return extents

    def pending(self) -> Iterator[int]:
        for block in range(self.mark, self.nblocks):
            if block not in self.above:
                yield block


class Checkpoint(Protocol):
    """Where a warm-up keeps its progress: a file of its own (`volprobe warmup --state`), or a section of the
    volume's state (volprobe.state.SectionCheckpoint) in the exporter."""

    where: str

    def read(self) -> object | None:
        """The saved document, None if there is none; OSError or ValueError if it cannot be read."""

    def write(self, document: dict[str, Any]) -> None:
        """Replace the saved document atomically; OSError if it cannot be written."""


class FileCheckpoint:
    def __init__(self, path: str) -> None:
        self.path = self.where = path

    def read(self) -> object | None:
        """As a volume state is read (volprobe.state.read_state_file): ValueError for anything but a small
        regular file of sane JSON, neither a link followed nor a FIFO waited on."""
        document: object = read_state_file(self.path)
        return document

    def set_aside(self) -> str:
        """Keep a corrupt checkpoint for a human, as a corrupt volume state is; the next save starts a new one."""
        try:
            return f"moved to {move_aside(self.path, 'corrupt')}"
        except OSError as err:
            return f"could not be moved aside ({err.strerror})"

    def write(self, document: dict[str, Any]) -> None:
        write_atomically(self.path, json.dumps(document))


def _checkpoint(where: str | Checkpoint) -> Checkpoint:
    return FileCheckpoint(where) if isinstance(where, str) else where


def load_state(
    where: str | Checkpoint, identity: Identity, nblocks: int, earlier: tuple[Identity, ...] = ()
) -> tuple[Extents, str, str | None]:
    """(blocks done, phase, warning). No saved state is a fresh start; a corrupt or foreign one, with a warning.
    `earlier`: identities the same volume had in earlier versions, whose states are this one's."""
    checkpoint = _checkpoint(where)
    name = checkpoint.where

    def corrupt(why: str) -> tuple[Extents, str, str]:
        # Set aside where the checkpoint keeps a file (FileCheckpoint, SectionCheckpoint of a legacy file); a
        # section of a volume's state is replaced by the next save.
        set_aside = getattr(checkpoint, "set_aside", None)
        where = set_aside() if set_aside else ""
        why += f"; {where}" if where else ""
        return Extents(nblocks), "", f"state {name} {why}; starting over"

    try:
        document = checkpoint.read()
    except OSError as err:  # permissions, I/O: the file may be fine, and is left where it is
        return Extents(nblocks), "", f"state {name} is unreadable or corrupt ({err}); starting over"
    except ValueError as err:
        return corrupt(f"is unreadable or corrupt ({err})")
    if document is None:
        return Extents(nblocks), "", None
    if not isinstance(document, dict) or document.get("version") != STATE_VERSION:
        return corrupt("is not a volprobe warm-up state")
    if document.get("identity") not in [i.to_json() for i in (identity, *earlier)]:
        return (
            Extents(nblocks),
            "",
            (f"state {name} belongs to {document.get('identity')!r:.200}, not {identity.to_json()}; starting over"),
        )
    try:
        extents = Extents.from_list(nblocks, document.get("done"))
    except ValueError as err:
        return corrupt(f"is corrupt ({err})")
    phase = document.get("phase", "read")
    if phase not in ("write", "read", "done"):
        return corrupt(f"has an unknown phase {phase!r:.40}")
    return extents, phase, None


def save_state(where: str | Checkpoint, identity: Identity, phase: str, extents: Extents) -> None:
    """Atomically replace the saved state: a crash leaves the old one or the new one, never half of one."""
    document = {
        "version": STATE_VERSION,
        "identity": identity.to_json(),
        "phase": phase,
        "done": extents.to_list(),
        "saved": int(time.time()),
    }
    _checkpoint(where).write(document)


class RateLimiter:
    """A token bucket shared by the workers: bytes per second, with a burst of BURST_S seconds."""

    BURST_S = 0.05

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._tat = time.monotonic()

    def take(self, nbytes: int, stop: threading.Event) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._tat - self.BURST_S, now)
            self._tat = max(self._tat, now) + nbytes / self.rate
        if start > now:
            stop.wait(start - now)


@dataclass
class WarmupJob:
    path: str
    identity: Identity
    jobs: int = 4
    rate: float | None = None
    checkpoint: Checkpoint | None = None  # where progress is kept; None: not resumable
    idle_priority: bool = True
    checkpoint_interval: float = 5.0
    opener: Callable[[int], int] | None = None  # opens the device (flags) -> fd; write mode passes O_EXCL etc.
    on_progress: Callable[[Progress], None] | None = None
    earlier_identities: tuple[Identity, ...] = ()  # see load_state
    # Where whether the idle I/O class could be had is recorded: the exporter's, or the job's own.
    capabilities: Capabilities = field(default_factory=Capabilities)
    progress: Progress = field(init=False)

    @classmethod
    def for_target(
        cls,
        target: ResolvedTarget,
        spec: WarmupConfig,
        store: StateStore | None,
        *,
        state_path: str | None = None,
        capabilities: Capabilities | None = None,
    ) -> WarmupJob:
        """The warm-up of a resolved device target; resolve() has made every check (block size, blankness for
        write mode). Progress is kept in `state_path` if given, else in the volume's state in `store`. Whether the
        idle I/O class could be had goes to `capabilities` (the exporter's), else to the job's own."""
        device = target.block
        opener = target.open_raw if spec.mode == "write" else None
        checkpoint: Checkpoint | None = None
        if state_path:
            checkpoint = FileCheckpoint(state_path)
        elif store is not None and store.directory:
            # A checkpoint file of an earlier version (named after the target) is carried over, not lost.
            legacy = FileCheckpoint(os.path.join(store.directory, legacy_state_file(target.name)))
            checkpoint = SectionCheckpoint(store.volume(device), "warmup", legacy)
        stable = device.volume_id or device.wwn or device.serial or device.backing_file or os.path.realpath(target.path)
        identity = Identity(stable, device.size_bytes, spec.block_size, spec.mode)
        # Before loop devices were known by their backing file, their warm-ups were keyed on the device path.
        earlier: tuple[Identity, ...] = ()
        if device.backing_file and stable == device.backing_file:
            earlier = (Identity(os.path.realpath(target.path), device.size_bytes, spec.block_size, spec.mode),)
        return cls(
            target.path,
            identity,
            spec.jobs,
            spec.rate,
            checkpoint,
            spec.idle_priority,
            opener=opener,
            earlier_identities=earlier,
            capabilities=capabilities if capabilities is not None else Capabilities(),
        )

    @property
    def state_path(self) -> str | None:
        return self.checkpoint.where if self.checkpoint else None

    def __post_init__(self) -> None:
        phases = 2 if self.identity.mode == "write" else 1
        self.progress = Progress(self.identity.size, self.identity.block_size, phases)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._save_failed = False

    def _save(self, phase: str, extents: Extents) -> None:
        """Checkpoint; a state that cannot be written costs resumability, not the warm-up."""
        if self.checkpoint is None:
            return
        try:
            save_state(self.checkpoint, self.identity, phase, extents)
        except OSError as err:
            if not self._save_failed:
                log.warning("warm-up of %s: cannot save progress to %s: %s", self.path, self.checkpoint.where, err)
            self._save_failed = True

    def stop(self) -> None:
        self._stop.set()

    def _open(self, flags: int) -> int:
        return self.opener(flags) if self.opener else os.open(self.path, flags | os.O_CLOEXEC)

    def run(self) -> Progress:
        """Run to the end (or until stop()); returns the final progress. Errors end in state "failed"."""
        progress = self.progress
        try:
            self._run()
        except Exception as err:
            progress.state, progress.error = "failed", str(err)
            log.error("warm-up of %s failed: %s", self.path, err)
        return progress

    def _saved(self) -> tuple[Extents, str, str | None]:
        nblocks = self.progress.nblocks
        if not self.checkpoint:
            return Extents(nblocks), "", None
        return load_state(self.checkpoint, self.identity, nblocks, self.earlier_identities)

    def saved_phase(self) -> str:
        """The phase its checkpoint holds for this very warm-up (same volume, size, block size and mode):
        "write", "read", "done", or "" for none (or one of another warm-up, or unreadable)."""
        return self._saved()[1]

    def _run(self) -> None:
        progress, identity = self.progress, self.identity
        nblocks = progress.nblocks
        extents, phase, warning = self._saved()
        if warning:
            log.warning("%s", warning)
        phases = ["write", "read"] if identity.mode == "write" else ["read"]
        if phase == "done":
            progress.base_bytes, progress.done_blocks = progress.total_bytes - progress.size, nblocks
            progress.state, progress.phase = "done", "read"
            log.info("warm-up of %s: already done (%s), nothing to read", self.path, identity.device)
            return
        if len(extents):
            log.info("warm-up of %s resumes: %d of %d blocks done (%s)", self.path, len(extents), nblocks, phase)
        if phase in phases:
            progress.base_bytes = phases.index(phase) * progress.size
            phases = phases[phases.index(phase) :]
        else:
            extents = Extents(nblocks)
        progress.started = time.monotonic()
        progress.state = "running"
        for current in phases:
            progress.phase = current
            progress.resumed_blocks = len(extents)
            self._pass(current, extents)
            if self._stop.is_set():
                self._save(current, extents)
                if progress.state == "running":  # not over a `failed` its owner set meanwhile
                    progress.state = "pending"
                return
            progress.base_bytes += progress.size
            progress.done_blocks = 0
            extents = Extents(nblocks)
        done = Extents(nblocks)
        done.mark = nblocks
        # Saved before it is shown done: what a scrape sees done is done after a kill -9 too (and an earlier
        # version's checkpoint already set aside).
        self._save("done", done)
        progress.base_bytes -= progress.size
        progress.done_blocks = nblocks
        if progress.state == "running":  # not over a `failed` its owner set meanwhile (a stop that timed out)
            progress.state = "done"
        progress.finished = time.monotonic()

    def _pass(self, phase: str, extents: Extents) -> None:
        progress = self.progress
        progress.done_blocks = len(extents)
        pending = extents.pending()
        limiter = RateLimiter(self.rate)
        errors: list[BaseException] = []
        flags = os.O_DIRECT | (os.O_RDWR | os.O_DSYNC if phase == "write" else os.O_RDONLY)
        fd = self._open(flags)

        def worker() -> None:
            if self.idle_priority:
                set_idle_priority(self.capabilities)
            buffer = mmap.mmap(-1, progress.block_size)
            data = WriteData(buffer) if phase == "write" else None
            try:
                while not self._stop.is_set():
                    with self._lock:
                        block = next(pending, None)
                    if block is None:
                        return
                    offset = block * progress.block_size
                    length = min(progress.block_size, progress.size - offset)
                    limiter.take(length, self._stop)
                    view = memoryview(buffer)[:length]
                    if data is not None:
                        # Only inside the raw write probes' region: the first and last MiB are never written,
                        # so nothing there can be clobbered and the device stays recognisably blank.
                        start = max(offset, GUARD_BYTES)
                        end = min(offset + length, progress.size - GUARD_BYTES)
                        if end > start:
                            data.stamp()
                            moved = os.pwritev(fd, [view[start - offset : end - offset]], start)
                            done = length if moved == end - start else moved
                        else:
                            done = length
                    else:
                        done = os.preadv(fd, [view], offset)
                    if done != length:
                        raise OSError(f"short {phase} at {offset}: {done} of {length} bytes")
                    with self._lock:
                        extents.add(block)
                        progress.done_blocks += 1
            except BaseException as err:
                errors.append(err)
                self._stop.set()

        threads = [threading.Thread(target=worker, name=f"warm-up {i}", daemon=True) for i in range(self.jobs)]
        for thread in threads:
            thread.start()
        next_checkpoint = time.monotonic() + self.checkpoint_interval
        try:
            while any(t.is_alive() for t in threads):
                # Wake for progress every 0.2 s, and exactly on time for checkpoints.
                deadline = time.monotonic() + min(0.2, max(0.0, next_checkpoint - time.monotonic()))
                for thread in threads:
                    thread.join(max(0.0, deadline - time.monotonic()))
                now = time.monotonic()
                with self._lock:
                    progress.recent.append((now, progress.done_bytes))
                    while len(progress.recent) > 2 and progress.recent[0][0] < now - 10:
                        progress.recent.pop(0)
                    snapshot = Extents(extents.nblocks)
                    snapshot.mark, snapshot.above = extents.mark, set(extents.above)
                if self.on_progress:
                    self.on_progress(progress)
                if now >= next_checkpoint:
                    self._save(phase, snapshot)
                    next_checkpoint += self.checkpoint_interval
        finally:
            os.close(fd)
        if errors:
            self._save(phase, extents)
            raise errors[0]


def legacy_state_file(target_name: str) -> str:
    """The checkpoint file name of versions that kept one file per target, before volume states."""
    return f"warmup-{re.sub(r'[^A-Za-z0-9_.-]', '_', target_name)}.json"
