"""Configuration files (volprobe.yml, the web config) read as bytes until proven text: at most MAX_BYTES, UTF-8,
and YAML nested at most MAX_DEPTH deep. PyYAML composes a document by recursing once per level, so a deeper one
would end in RecursionError, a huge one in MemoryError: both are refused here, with the reason, as any other
mistake in a file is (a reload keeps the running configuration, a start exits 2).

Aliases are bounded too. PyYAML builds an alias as the very object its anchor names, so a document of a few
lines ("billion laughs": nine anchors, each a list of ten aliases to the one before) holds 10^9 values once
walked, and volprobe's checks walk it: the error message for one such value took 11 GiB and over two minutes.
A document whose aliases add more than MAX_ALIASED values or MAX_ALIASED_CHARACTERS of text, nest it deeper than
MAX_DEPTH, or sit inside the node they name is refused. (Go's yaml.v2 refuses "excessive aliasing" for
Prometheus and Kubernetes likewise, by a ratio of its own.)
"""

from __future__ import annotations

import os

import yaml
from yaml.composer import ComposerError
from yaml.nodes import MappingNode, Node, SequenceNode

MAX_BYTES = 1 << 20  # a configuration of a thousand targets is a few hundred KiB
MAX_DEPTH = 32  # volprobe.yml nests 6 deep (document, targets, target, probes, probe, value), the web config 4
# What aliases may add, counted as the values and the text they stand for: a thousand targets sharing one list of
# two probes (`probes: *probes`) add about ten thousand values and 50 KB. Error messages show values, so the text
# is bounded too: a long path named by an alias at every target would otherwise be shown at every target.
MAX_ALIASED = 100_000
MAX_ALIASED_CHARACTERS = MAX_BYTES


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
    """ComposerError if the document, every alias replaced by what it names, holds more than MAX_ALIASED values
    or MAX_ALIASED_CHARACTERS of scalar text beyond what is written, is nested more than MAX_DEPTH deep, or has
    an alias inside the node it names (a cycle). Iterative, and each node is expanded and measured once (a node
    named by many aliases costs one look per alias): the document is never expanded to be measured."""
    measure: dict[int, tuple[int, int, int]] = {}  # id(node) -> (values, characters, depth) it stands for
    open_: set[int] = set()  # nodes whose children are being measured: the current node's ancestors
    stack: list[tuple[Node, bool]] = [(root, False)]
    written_characters = 0  # of the scalars as written, each once
    while stack:
        node, children_measured = stack.pop()
        key = id(node)
        if children_measured:
            open_.discard(key)
            if isinstance(node, MappingNode | SequenceNode):
                parts = [measure[id(child)] for child in _children(node)]
                values = 1 + sum(p[0] for p in parts)
                characters = sum(p[1] for p in parts)
                depth = 1 + max((p[2] for p in parts), default=0)
            else:
                values, characters, depth = 1, len(str(node.value)), 1
                written_characters += characters
            if depth > MAX_DEPTH:
                raise ComposerError(None, None, f"nested more than {MAX_DEPTH} deep through aliases", node.start_mark)
            measure[key] = (values, characters, depth)
            continue
        if key in measure:  # named again by an alias: measured already
            continue
        if key in open_:
            raise ComposerError(None, None, "an alias inside the node it names", node.start_mark)
        open_.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in measure)
    values, characters, _ = measure[id(root)]
    written_values = len(measure)
    if values - written_values > MAX_ALIASED:
        raise ComposerError(
            None,
            None,
            f"aliases make its {written_values} values {values}, more than {MAX_ALIASED} added",
            root.start_mark,
        )
    if characters - written_characters > MAX_ALIASED_CHARACTERS:
        raise ComposerError(
            None,
            None,
            f"aliases make its {written_characters} characters of values {characters}, more than "
            f"{MAX_ALIASED_CHARACTERS} added",
            root.start_mark,
        )


def _children(node: Node) -> list[Node]:
    if isinstance(node, MappingNode):
        return [item for pair in node.value for item in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []
