"""Parsing of /proc/diskstats (Documentation/admin-guide/iostats.rst).

Kernels print 14 fields per line before 4.18, 18 with the discard fields (4.18+) and 20 with the flush
fields (5.5+). Fields a kernel does not print are None, so they are not exported rather than exported as 0.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

SECTOR_BYTES = 512  # diskstats counts 512-byte sectors whatever the device's block size


@dataclass(frozen=True)
class DiskStats:
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
    values = [int(p) for p in parts[3:]]
    return DiskStats(int(parts[0]), int(parts[1]), parts[2], *values)


def parse(text: str, names: Collection[str] | None = None) -> dict[str, DiskStats]:
    """The devices of a diskstats text (those in `names`, or all), by kernel name. Malformed lines are skipped,
    not fatal."""
    result: dict[str, DiskStats] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        if names is not None:  # the detector samples every second: parse only the lines it watches
            head = line.split(maxsplit=3)
            if len(head) < 3 or head[2] not in names:
                continue
        try:
            stats = parse_line(line)
        except ValueError:
            continue
        result[stats.name] = stats
    return result


def read(proc_root: str | Path = "/proc", names: Collection[str] | None = None) -> dict[str, DiskStats]:
    return parse((Path(proc_root) / "diskstats").read_text(), names)
