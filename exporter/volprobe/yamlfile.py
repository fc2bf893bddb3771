"""Configuration files (volprobe.yml, the web config) read as bytes until proven text: at most MAX_BYTES, UTF-8,
and YAML nested at most MAX_DEPTH deep. PyYAML composes a document by recursing once per level, so a deeper one
would end in RecursionError, a huge one in MemoryError: both are refused here, with the reason, as any other
mistake in a file is (a reload keeps the running configuration, a start exits 2).

Aliases are bounded too. PyYAML builds an alias as the very object its anchor names, so a document of a few
lines ("billion laughs": nine anchors of ten aliases each to the one before) holds 10^9 values once walked, and
volprobe's checks walk it: the error message for one such value took 11 GiB and over two minutes. As Go's
yaml.v2 does for Prometheus, a document whose aliases add more than MAX_ALIASED values, or nest it deeper than
MAX_DEPTH through them, is refused.
"""

from __future__ import annotations

import os

import yaml
from yaml.composer import ComposerError
from yaml.nodes import MappingNode, Node, SequenceNode

MAX_BYTES = 1 << 20  # a configuration of a thousand targets is a few hundred KiB
MAX_DEPTH = 32  # volprobe.yml nests 6 deep (document, targets, target, probes, probe, value), the web config 4
# What aliases may add, counted as the values they stand for: a thousand targets sharing one list of two probes
# (`probes: *probes`) add about ten thousand.
MAX_ALIASED = 100_000


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

    def compose_document(self) -> Node | None:
        document: Node | None = super().compose_document()
        if document is not None:
            _check_aliases(document)
        return document


def _check_aliases(root: Node) -> None:
    """ComposerError if the document, every alias replaced by what it names, has MAX_ALIASED values more than it
    has written, or is nested more than MAX_DEPTH deep (or an alias is inside the node it names: a cycle).
    Iterative, and each node is looked at once: the document is never expanded to be measured."""
    size: dict[int, int] = {}  # id(node) -> the values it stands for, itself included
    depth: dict[int, int] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    open_: set[int] = set()  # nodes whose children are being measured
    while stack:
        node, measured = stack.pop()
        key = id(node)
        children = _children(node)
        if measured:
            open_.discard(key)
            size[key] = 1 + sum(size[id(child)] for child in children)
            depth[key] = 1 + max((depth[id(child)] for child in children), default=0)
            if depth[key] > MAX_DEPTH:
                raise ComposerError(None, None, f"nested more than {MAX_DEPTH} deep through aliases", node.start_mark)
            continue
        if key in size:
            continue
        if key in open_:
            raise ComposerError(None, None, "an alias inside the node it names", node.start_mark)
        open_.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in size)
    written = len(size)
    if size[id(root)] - written > MAX_ALIASED:
        raise ComposerError(
            None,
            None,
            f"aliases make its {written} values {size[id(root)]}, more than {MAX_ALIASED} added",
            root.start_mark,
        )


def _children(node: Node) -> list[Node]:
    if isinstance(node, MappingNode):
        return [item for pair in node.value for item in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []
