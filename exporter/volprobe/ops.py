"""The kinds of probe: what each opens its target with, whether it writes, its default request size.

Every module that needs to tell a read from a write asks this table, so a new kind of probe is one row here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    name: str
    flags: int  # os.open access flags; O_DIRECT (and O_DSYNC for synchronous writes) are added where opened
    writes: bool
    default_block_size: int
    arrow: str  # ioping's notation in `volprobe ping`

    def open_flags(self, sync: bool = False) -> int:
        """Flags of a probe's descriptor: direct I/O always, O_DSYNC for a synchronous write."""
        return self.flags | os.O_DIRECT | (os.O_DSYNC if sync and self.writes else 0)


READ = Op("read", os.O_RDONLY, writes=False, default_block_size=4096, arrow="<<<")
WRITE = Op("write", os.O_RDWR, writes=True, default_block_size=8192, arrow=">>>")

OPS: dict[str, Op] = {op.name: op for op in (READ, WRITE)}
NAMES: tuple[str, ...] = tuple(OPS)


def get(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r} (expected one of: {', '.join(NAMES)})") from None
