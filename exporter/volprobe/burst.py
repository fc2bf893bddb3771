"""The active check of a suspected cap: a brief burst of extra concurrent reads on the disk.

A flat plateau with requests queueing is either a cap (the provider holds the disk's total where it is) or
steady demand on a disk that could do more. When the probes cannot tell the two apart, because they never saw
the disk unloaded (volprobe started while the load already ran), the throttle detector asks the disk: JOBS
extra readers at queue depth 1 for DURATION_S seconds. A capped disk's total stays at the ceiling; an
uncapped one's rises. The burst only reads, with O_DIRECT, at aligned random offsets.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import diskstats

JOBS = 8
DURATION_S = 2.0
CAPPED_RISE = 1.05  # the total rose by at most 5%: it is held at a ceiling
UNCAPPED_RISE = 1.10  # the total rose by 10% or more: the disk had room
ALIGN = 4096


@dataclass(frozen=True)
class Burst:
    """What the disk did while the burst ran, from its diskstats."""

    ops_per_s: float
    bytes_per_s: float
    requests: int  # the burst's own completed reads
    errors: int


def request_size(bytes_per_op: float) -> int:
    """The plateau's own request size, aligned, between 4 KiB and 1 MiB: a bandwidth cap is tested with
    requests as large as the load's."""
    size = int(bytes_per_op) // ALIGN * ALIGN
    return min(1024 * 1024, max(ALIGN, size))


def run(
    path: str,
    size_bytes: int,
    block_size: int,
    disk: str,
    proc_root: str | Path,
    stop: threading.Event,
    jobs: int = JOBS,
    duration_s: float = DURATION_S,
) -> Burst:
    """Read `path` (the disk's device node) with `jobs` threads for `duration_s`; measure the disk meanwhile."""
    blocks = max(1, size_bytes // block_size)
    counts = [0] * jobs
    errors = [0] * jobs
    end = time.monotonic() + duration_s

    def reader(index: int) -> None:
        rng = random.Random()
        buffer = mmap.mmap(-1, block_size)  # page aligned, as O_DIRECT needs
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:
            errors[index] += 1
            return
        try:
            while time.monotonic() < end and not stop.is_set():
                try:
                    os.preadv(fd, [buffer], rng.randrange(blocks) * block_size)
                    counts[index] += 1
                except OSError:
                    errors[index] += 1
                    return
        finally:
            os.close(fd)

    before = diskstats.read(proc_root).get(disk)
    started = time.monotonic()
    threads = [threading.Thread(target=reader, args=(i,), name=f"burst {disk} {i}", daemon=True) for i in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, end + 5 - time.monotonic()))
    elapsed = time.monotonic() - started
    after = diskstats.read(proc_root).get(disk)
    stuck = sum(1 for thread in threads if thread.is_alive())  # a stalled disk: its rate says nothing
    if before is None or after is None or elapsed <= 0 or stuck:
        return Burst(0.0, 0.0, sum(counts), sum(errors) + stuck + 1)
    ops = (after.reads_completed + after.writes_completed) - (before.reads_completed + before.writes_completed)
    moved = (after.bytes_read + after.bytes_written) - (before.bytes_read + before.bytes_written)
    return Burst(ops / elapsed, moved / elapsed, sum(counts), sum(errors))


def verdict(before_ops: float, before_bytes: float, during: Burst) -> str:
    """capped, uncapped or inconclusive, from the disk's total before and during the burst."""
    if during.errors or before_ops <= 0 or before_bytes <= 0:
        return "inconclusive"
    rise = min(during.ops_per_s / before_ops, during.bytes_per_s / before_bytes)
    if rise <= CAPPED_RISE:
        return "capped"
    if rise >= UNCAPPED_RISE:
        return "uncapped"
    return "inconclusive"
