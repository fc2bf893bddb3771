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

A configuration is data: the Loader resolves plain scalars by volprobe's own rules, not all of YAML 1.1's. A
scalar is null, a boolean, a decimal (or 0x hexadecimal, 0b binary) integer of at most MAX_INTEGER_DIGITS digits,
a decimal float, or else a string: no timestamps (`2001-02-30` stays text for its key to judge), no
sexagesimal (`1:30`), no octal (`010` is the string "010"), no `=`. A tag written in the file names one of those
types (or a list or a mapping) and its text must be one, or the file is refused at that line: nothing in a
file runs a constructor that can fail on its text.
"""

from __future__ import annotations

import os
import re
import stat

import yaml
import yaml.composer
from yaml.composer import ComposerError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .schema import key_path

MAX_BYTES = 1 << 20  # a configuration of a thousand targets is a few hundred KiB
MAX_DEPTH = 32  # volprobe.yml nests 6 deep (document, targets, target, probes, probe, value), the web config 4
# What aliases may add, counted as the values and the text they stand for: a thousand targets sharing one list of
# two probes (`probes: *probes`) add about ten thousand values and 50 KB. Error messages show values, so the text
# is bounded too: a long path named by an alias at every target would otherwise be shown at every target.
MAX_ALIASED = 100_000
MAX_ALIASED_CHARACTERS = MAX_BYTES
MAX_INTEGER_DIGITS = 30  # a size in bytes has 20 at most; int() of thousands of digits costs, or fails
_TAG = "tag:yaml.org,2002:"
NULL, BOOL, INT, FLOAT, STR, SEQ, MAP, MERGE = (
    _TAG + t for t in ("null", "bool", "int", "float", "str", "seq", "map", "merge")
)
# The plain scalars that are not strings, as volprobe reads them (see the module's doc), and where they may start.
SCALARS = {
    NULL: (re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]),
    BOOL: (
        re.compile(r"^(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$"),
        list("yYnNtTfFoO"),
    ),
    INT: (
        re.compile(r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F][0-9a-fA-F_]*|0b[01][01_]*)$"),
        list("-+0123456789"),
    ),
    FLOAT: (
        re.compile(
            r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
            r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
        ),
        list("-+0123456789."),
    ),
    MERGE: (re.compile(r"^(?:<<)$"), ["<"]),
}
# What YAML's reader refuses (yaml.reader.Reader.NON_PRINTABLE), and the byte order mark: refused by read() first,
# naming the line, rather than by the reader in a message of three lines.
_NOT_TEXT = re.compile("[^\t\n\r\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]")
_FILE_TYPES = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def read_bytes(path: str, what: str = "a configuration") -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file at `path`, at most MAX_BYTES, and its fstat (what was read, through the same
    descriptor). ValueError, with the reason, if it is not a regular file (a directory, a FIFO: opened without
    blocking, and never read) or is larger; OSError if it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ValueError(f"is {_FILE_TYPES.get(stat.S_IFMT(info.st_mode), 'not a file')}, not a regular file")
    with open(fd, "rb") as f:
        if info.st_size > MAX_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than {what} may be ({MAX_BYTES}, 1 MiB)")
        data = f.read(MAX_BYTES + 1)  # one byte more: a file that grew since fstat is refused too
    if len(data) > MAX_BYTES:
        raise ValueError(f"more than {MAX_BYTES} bytes (1 MiB), more than {what} may be")
    return data, info


def read(path: str) -> tuple[str, os.stat_result]:
    """The text of the file at `path`, and its fstat: read_bytes(), and ValueError, with the reason and the
    line, if it is not UTF-8 or holds what is not text (a NUL, a control character, a byte order mark)."""
    data, info = read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        key = key_at(data.decode("utf-8", "replace"), len(data[: err.start].decode("utf-8")))
        raise ValueError(
            f"{key + ': ' if key else ''}not UTF-8 text: byte 0x{data[err.start]:02x} at line {line} "
            f"(offset {err.start})"
        ) from None
    odd = _NOT_TEXT.search(text)
    if odd:
        line = text.count("\n", 0, odd.start()) + 1
        column = odd.start() - (text.rfind("\n", 0, odd.start()) + 1) + 1
        where = f"at line {line}, column {column}"
        key = key_at(text, odd.start())
        named = f"{key}: " if key else ""
        if odd.group() == "\ufeff":
            raise ValueError(f"{named}a byte order mark (U+FEFF) {where}: save it as UTF-8 without one")
        raise ValueError(f"{named}a control character (U+{ord(odd.group()):04X}) {where}: not text")
    return text, info


class NotData(ComposerError):
    """A node the file may not hold (a type of no configuration, or a value its type cannot hold), at `key`."""

    def __init__(self, key: str, problem: str, node: Node) -> None:
        super().__init__(None, None, problem, node.start_mark)
        self.key = key


def describe(err: yaml.YAMLError) -> str:
    """A YAML error in one line: where (line, column) and what."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(getattr(err, "problem", None) or getattr(err, "context", None) or err).split())
    if isinstance(err, NotData):
        key = err.key if len(err.key) <= 200 else err.key[:197] + "..."  # a key may be a MiB long
        return f"{key + ': ' if key else ''}{problem}, at {where}"
    return f"not valid YAML{' at ' if where else ''}{where}: {problem}"


class Loader(yaml.SafeLoader):
    """yaml.SafeLoader with volprobe's scalars (SCALARS) that refuses a document nested more than MAX_DEPTH deep
    (a ComposerError, a YAMLError like any other), before its recursion goes any deeper, one whose aliases add
    too much, and one with a scalar its type cannot hold (check_scalars)."""

    yaml_implicit_resolvers: dict[str, list[tuple[str, re.Pattern[str]]]] = {}
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
            check_scalars(document)
        return document


for _tag, (_pattern, _first) in SCALARS.items():
    Loader.add_implicit_resolver(_tag, _pattern, _first)


def check_scalars(root: Node) -> None:
    """NotData (a ComposerError), naming the key and the line, for a node whose tag is not one a configuration
    holds (a timestamp, binary, a set, a tag of the file's own), or whose text is not of its tag (`!!int x`,
    `!!bool maybe`), or an integer of more than MAX_INTEGER_DIGITS digits: before any constructor sees it.
    Iterative, each node once (by the first path that reaches it)."""
    seen: set[int] = set()
    stack: list[tuple[Node, str]] = [(root, "")]
    while stack:
        node, key = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        tag = node.tag
        if isinstance(node, ScalarNode):
            text = str(node.value)
            if tag in SCALARS and not SCALARS[tag][0].match(text):
                raise NotData(key, f"{text[:40]!r} is not {_NAMES[tag]}", node)
            if tag == INT and len(_NOT_DIGITS.sub("", text)) > MAX_INTEGER_DIGITS:
                digits = len(_NOT_DIGITS.sub("", text))
                raise NotData(key, f"an integer of {digits} digits, more than {MAX_INTEGER_DIGITS}", node)
            if tag not in SCALARS and tag != STR:
                raise NotData(key, f"{_tag_name(tag)} is not a type a configuration holds", node)
        elif tag != (MAP if isinstance(node, MappingNode) else SEQ):
            raise NotData(key, f"{_tag_name(tag)} is not a type a configuration holds", node)
        else:
            stack.extend(reversed(_named_children(node, key)))  # the first problem in the file's order


def _named_children(node: Node, key: str) -> list[tuple[Node, str]]:
    """The children of a mapping or list, each with its key path (a mapping's key: the path of its value)."""
    if isinstance(node, SequenceNode):
        return [(child, key_path(key, index)) for index, child in enumerate(node.value)]
    named: list[tuple[Node, str]] = []
    for name_node, value in node.value:
        path = key_path(key, name_node.value) if isinstance(name_node, ScalarNode) else key
        named += [(name_node, path), (value, path)]
    return named


def key_at(text: str, index: int) -> str:
    """The key path of the value (or key) the character at `index` of `text` is in; "" if none, or if `text` does
    not compose. For a problem found before YAML is parsed (a byte that is not UTF-8, a NUL) to name its key:
    `text` is the file with each such character replaced by U+FFFD."""
    try:
        node: Node | None = yaml.compose(_NOT_TEXT.sub("\ufffd", text), Loader=_Composer)
    except Exception:  # the file is refused for that character anyway; it just names no key
        return ""
    key, found = "", ""
    while node is not None:
        children, node = _named_children(node, key) if isinstance(node, MappingNode | SequenceNode) else [], None
        for child, path in children:
            if child.start_mark.index <= index < max(child.end_mark.index, child.start_mark.index + 1):
                node, key, found = child, path, path
                break
    return found


class _Composer(Loader):
    """What key_at() composes with: Loader's bound on nesting, its aliases and scalars left unchecked (the tree
    is only descended, along one path)."""

    yaml_implicit_resolvers: dict[str, list[tuple[str, re.Pattern[str]]]] = {}

    def compose_document(self) -> Node | None:
        return yaml.composer.Composer.compose_document(self)


_NOT_DIGITS = re.compile(r"^[-+]?(?:0[xb])?|_")
_NAMES = {NULL: "null", BOOL: "a boolean", INT: "an integer", FLOAT: "a number", MERGE: "a merge key (<<)"}


def _tag_name(tag: str) -> str:
    return f"!!{tag.removeprefix(_TAG)}" if tag.startswith(_TAG) else repr(tag)[:60]


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
