"""Parsing of /proc/diskstats (Documentation/admin-guide/iostats.rst).

Kernels print 14 fields per line before 4.18, 18 with the discard fields (4.18+) and 20 with the flush
fields (5.5+). Fields a kernel does not print are None, so they are not exported rather than exported as 0.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import NamedTuple

SECTOR_BYTES = 512  # diskstats counts 512-byte sectors whatever the device's block size


class DiskStats(NamedTuple):  # a tuple: the throttle sampler makes one per followed disk every second
    major: int
    minor: int
    name: str
    reads_completed: int
    reads_merged: int
    sectors_read: int
    read_time_ms: int
    writes_completed: int
    writes_merged: int
    sectors_written: int
    write_time_ms: int
    io_in_progress: int
    io_time_ms: int
    weighted_io_time_ms: int
    discards_completed: int | None = None
    discards_merged: int | None = None
    sectors_discarded: int | None = None
    discard_time_ms: int | None = None
    flushes_completed: int | None = None
    flush_time_ms: int | None = None

    @property
    def bytes_read(self) -> int:
        return self.sectors_read * SECTOR_BYTES

    @property
    def bytes_written(self) -> int:
        return self.sectors_written * SECTOR_BYTES


def parse_line(line: str) -> DiskStats:
    parts = line.split()
    if len(parts) not in (14, 18, 20):
        raise ValueError(f"diskstats line has {len(parts)} fields, expected 14, 18 or 20: {line!r}")
    return DiskStats(int(parts[0]), int(parts[1]), parts[2], *map(int, parts[3:]))


def parse(text: str, names: Collection[str] | None = None, hints: dict[str, int] | None = None) -> dict[str, DiskStats]:
    """The devices of a diskstats text (those in `names`, or all), by kernel name. Malformed lines are skipped,
    not fatal. `hints`: each name's line number in an earlier text, looked at first, and kept up to date."""
    if names is not None:  # the throttle detector samples every second: only the lines it watches
        found = (_parse_named(name, line) for name, line in _lines_of(text, names, hints))
        return {stats.name: stats for stats in found if stats is not None}
    result: dict[str, DiskStats] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            stats = parse_line(line)
        except ValueError:
            continue
        result[stats.name] = stats
    return result


def _lines_of(text: str, names: Collection[str], hints: dict[str, int] | None) -> Iterator[tuple[str, str]]:
    """(name, its line) for each name that has one: at its hinted line number (devices keep their places from
    one read to the next), else by a search of the text, not by splitting every line. A name sits between
    single spaces after the device numbers; _parse_named checks that it is the name field."""
    lines = text.split("\n") if hints else []
    for name in names:
        key = f" {name} "
        at = hints.get(name, -1) if hints else -1
        if 0 <= at < len(lines) and key in lines[at]:
            yield name, lines[at]
            continue
        found = text.find(key)
        if found < 0:
            continue
        start, end = text.rfind("\n", 0, found) + 1, text.find("\n", found)
        if hints is not None:
            hints[name] = text.count("\n", 0, start)
        yield name, text[start : end if end >= 0 else len(text)]


def _parse_named(name: str, line: str) -> DiskStats | None:
    try:
        stats = parse_line(line)
    except ValueError:
        return None
    return stats if stats.name == name else None


def read(proc_root: str | Path = "/proc", names: Collection[str] | None = None) -> dict[str, DiskStats]:
    with Reader(proc_root) as reader:
        return reader.read(names)


class Reader:
    """/proc/diskstats held open and read again from its start: for a sampler that reads it every second, the
    open (a path walk through procfs) costs more than the read. os.pread, not open(): the text layer's
    buffering costs as much again."""

    def __init__(self, proc_root: str | Path = "/proc") -> None:
        self.path = os.path.join(proc_root, "diskstats")
        self._fd: int | None = None
        self._hints: dict[str, int] = {}  # name -> its line number in the last read
        self._lock = threading.Lock()  # scrapes may read at once

    def read(self, names: Collection[str] | None = None) -> dict[str, DiskStats]:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            chunks, offset = [], 0
            while chunk := os.pread(self._fd, 1 << 16, offset):
                chunks.append(chunk)
                offset += len(chunk)
            return parse(b"".join(chunks).decode("ascii", "replace"), names, self._hints)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
