"""The kinds of probe: what each opens its target with, the request it makes, whether it writes, its defaults.

Every module that needs to tell one kind of probe from another asks this table, so a new kind of probe is one
row here; if its request is not one the timers make yet, that is one function in each timer too, under the
name its `syscall` gives (_timedio.c's REQUESTS, timer.py's REQUESTS).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    name: str  # the `op` label of its series, and its name in the config and on the command line
    flags: int  # os.open access flags; O_DIRECT (and O_DSYNC for synchronous writes) are added where opened
    syscall: str  # the request, by its name in the timers: "pread", "pwrite", "pwrite_fdatasync", "metadata"
    writes: bool  # stamps its buffer, opens exclusively, only where writes are allowed; reads check for zeros
    default_block_size: int
    arrow: str  # ioping's notation in `volprobe ping`
    # The ops below go through the filesystem as applications do, so they are buffered (no O_DIRECT, no
    # O_DSYNC: the request syncs itself), only on directory targets, and need no sector-aligned block size.
    buffered: bool = False
    # Directory targets: where in the directory its requests go ("" for the probe file, as writes and reads
    # of a directory without its device), and `source` in volprobe_probe_info.
    file: str = ""
    source: str = "probe_file"
    offsets: str = "random"  # random (a keyed permutation, with revisits), sequential (a log, wrapped) or none
    steps: tuple[str, ...] = ()  # the timed steps of a sequence, whose seconds are exported each (metadata)

    def open_flags(self, sync: bool = False) -> int:
        """Flags of a probe's descriptor: direct I/O unless buffered, O_DSYNC for a synchronous direct write."""
        if self.buffered:
            return self.flags
        return self.flags | os.O_DIRECT | (os.O_DSYNC if sync and self.writes else 0)

    @property
    def directory_only(self) -> bool:
        """Probes of a filesystem (a log file, a directory's entries): a device target has neither."""
        return self.buffered

    @property
    def direction(self) -> str:
        """The direction of its requests in the disk's statistics (diskstats, throttle detection)."""
        return "write" if self.writes else "read"

    @property
    def past_tense(self) -> str:
        """What its requests did to their bytes, in a sentence: "4 KiB read", "8 KiB written"."""
        return "written" if self.writes else "read"


READ = Op("read", os.O_RDONLY, "pread", writes=False, default_block_size=4096, arrow="<<<")
WRITE = Op("write", os.O_RDWR, "pwrite", writes=True, default_block_size=8192, arrow=">>>")
# A database's or etcd's commit: a buffered write of one WAL record (2300 bytes, etcd's) at the end of a
# preallocated log, then fdatasync, timed as one request: the journal, barriers and extent conversion that
# O_DIRECT writes skip are in it. fio's `--rw=write --ioengine=sync --fdatasync=1 --bs=2300` is its twin.
COMMIT = Op(
    "commit",
    os.O_RDWR,
    "pwrite_fdatasync",
    writes=True,
    default_block_size=2300,
    arrow="}}}",
    buffered=True,
    file=".volprobe-commit",
    source="commit_log",
    offsets="sequential",
)
# An atomic replacement (a kubelet's or a deployment's): create, write, fsync, rename, fsync the directory,
# unlink, in a directory of volprobe's own (metadata.py); the sequence is timed whole and by step.
METADATA = Op(
    "metadata",
    os.O_RDONLY | os.O_DIRECTORY,
    "metadata",
    writes=True,
    default_block_size=4096,
    arrow="~~~",
    buffered=True,
    file=".volprobe-metadata",
    source="metadata_directory",
    offsets="none",
    steps=("create", "write", "fsync", "rename", "fsync_dir", "unlink"),
)

OPS: dict[str, Op] = {op.name: op for op in (READ, WRITE, COMMIT, METADATA)}
NAMES: tuple[str, ...] = tuple(OPS)

# The probes of a target whose configuration names none (and of discovered devices, which are only ever read).
DEVICE_DEFAULTS: tuple[Op, ...] = (READ,)
DIRECTORY_DEFAULTS: tuple[Op, ...] = (WRITE, READ)  # a directory's writes go to its probe file; commit and
# metadata are opt-in: a volume with the default probes keeps its series count (bench/series)


def get(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r} (expected one of: {', '.join(NAMES)})") from None
