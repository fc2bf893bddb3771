"""Configuration files (volprobe.yml, the web config) read as bytes until proven text: at most MAX_BYTES, UTF-8,
and YAML nested at most MAX_DEPTH deep. PyYAML composes a document by recursing once per level, so a deeper one
would end in RecursionError, a huge one in MemoryError: both are refused here, with the reason, as any other
mistake in a file is (a reload keeps the running configuration, a start exits 2).
"""

from __future__ import annotations

import os

import yaml
from yaml.composer import ComposerError
from yaml.nodes import Node

MAX_BYTES = 1 << 20  # a configuration of a thousand targets is a few hundred KiB
MAX_DEPTH = 32  # volprobe.yml nests 6 deep (document, targets, target, probes, probe, value), the web config 4


def read(path: str) -> tuple[str, os.stat_result]:
    """The text of the file at `path`, and its fstat (what was read, through the same descriptor). ValueError,
    with the reason, if it is more than MAX_BYTES or not UTF-8; OSError if it cannot be read."""
    with open(path, "rb") as f:
        info = os.fstat(f.fileno())
        if info.st_size > MAX_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than a configuration may be ({MAX_BYTES}, 1 MiB)")
        data = f.read(MAX_BYTES + 1)  # one byte more: a file that grew since fstat (or a pipe) is refused too
    if len(data) > MAX_BYTES:
        raise ValueError(f"more than {MAX_BYTES} bytes (1 MiB), more than a configuration may be")
    try:
        return data.decode("utf-8"), info
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(f"not UTF-8 text: byte 0x{data[err.start]:02x} at line {line} (offset {err.start})") from None


class Loader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a document nested more than MAX_DEPTH deep (a ComposerError, a YAMLError
    like any other), before its recursion goes any deeper."""

    _depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self._depth >= MAX_DEPTH:
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise ComposerError(None, None, f"nested more than {MAX_DEPTH} deep", mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
