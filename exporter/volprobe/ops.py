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
    syscall: str  # the request, by its name in the timers: "pread" or "pwrite"
    writes: bool  # stamps its buffer, opens exclusively, only where writes are allowed; reads check for zeros
    default_block_size: int
    arrow: str  # ioping's notation in `volprobe ping`

    def open_flags(self, sync: bool = False) -> int:
        """Flags of a probe's descriptor: direct I/O always, O_DSYNC for a synchronous write."""
        return self.flags | os.O_DIRECT | (os.O_DSYNC if sync and self.writes else 0)

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

OPS: dict[str, Op] = {op.name: op for op in (READ, WRITE)}
NAMES: tuple[str, ...] = tuple(OPS)

# The probes of a target whose configuration names none (and of discovered devices, which are only ever read).
DEVICE_DEFAULTS: tuple[Op, ...] = (READ,)
DIRECTORY_DEFAULTS: tuple[Op, ...] = (WRITE, READ)  # a directory's writes go to its probe file


def get(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r} (expected one of: {', '.join(NAMES)})") from None
