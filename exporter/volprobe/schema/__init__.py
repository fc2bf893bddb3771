"""One declarative schema for volprobe's configuration files, and the one walker that reads them.

A key is declared once, as a field of the dataclass that holds it, with its kind (type and bounds),
default and one line of documentation:

    interval: float = setting(1.0, POSITIVE_DURATION, "time between two probes")

and a nested mapping, or a list of them, as `section(TheirDataclass, "what it is")`. The walker validates a
parsed document against those declarations and builds the dataclasses; every problem names its key path
(`targets[0].warmup.mode: ...`), and all problems of a document are reported together. Rules that tie keys
together (a device or a directory, not both) stay in the module that owns the file, in code.

`python -m volprobe.schema --markdown` prints the configuration reference of the three files (volprobe.yml,
the web config, the mixin's) that the README holds between its `<!-- schema:begin -->` and `<!-- schema:end -->`
markers; `python -m volprobe.schema --write README.md` rewrites that section in place.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .. import units

SCHEMA = "volprobe.schema"  # the metadata key of a declared field
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Invalid(ValueError):
    """A value refused at places inside it: (index or key, message) pairs, e.g. (0, "is not a string")."""

    def __init__(self, problems: list[tuple[int | str, str]]) -> None:
        super().__init__("; ".join(message for _, message in problems))
        self.problems = problems


@dataclass(frozen=True)
class Kind(Generic[T_co]):
    """A type with its bounds: `parse` returns the typed value or raises ValueError with the message.
    `valid` and `invalid` are values of a document it accepts and refuses (the fuzz tests generate from them)."""

    name: str  # as the reference shows it, e.g. "duration > 0"
    parse: Callable[[Any], T_co]
    valid: tuple[object, ...] = ()
    invalid: tuple[object, ...] = ()
    show: Callable[[Any], str] | None = None  # a default as the reference writes it (1s, 64MiB)


@dataclass(frozen=True)
class Setting:
    kind: Kind[Any]
    doc: str
    shown: str = ""  # the default as the reference says it, where its value does not tell (0: the op's)


@dataclass(frozen=True)
class Section:
    """A nested mapping held by a dataclass; `many`: a list of them; `inline`: its keys sit in the parent's."""

    cls: type[Any]
    doc: str
    many: bool = False
    inline: bool = False


REQUIRED: Any = dataclasses.MISSING  # the default of a key that must be written


def setting(default: Any, kind: Kind[Any], doc: str, shown: str = "") -> Any:
    """A field declared as a key of the file. Mutable defaults (dict, list) are copied for each instance."""
    meta = {SCHEMA: Setting(kind, doc, shown)}
    if default is REQUIRED:
        return field(metadata=meta)
    if isinstance(default, dict | list):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type[Any], doc: str, *, default: Any = dataclasses.MISSING, many: bool = False) -> Any:
    """A field holding a nested mapping (or with `many`, a list of them). Without a default, an instance of
    `cls` with its own defaults; `default=None` for a section that is off unless written."""
    meta = {SCHEMA: Section(cls, doc, many=many)}
    if default is dataclasses.MISSING:
        return field(default_factory=cls, metadata=meta)
    return field(default=default, metadata=meta)


def inline(cls: type[Any], doc: str) -> Any:
    """A field holding a dataclass whose keys are written in the parent's mapping, beside the parent's own."""
    return field(default_factory=cls, metadata={SCHEMA: Section(cls, doc, inline=True)})


def inherited(cls: type[Any], name: str, doc: str) -> Any:
    """A key that sets, for every instance, the default of another section's key: same kind, unset is None."""
    declared = declarations(cls)[name]
    assert isinstance(declared, Setting), name
    return field(default=None, metadata={SCHEMA: Setting(declared.kind, doc)})


def declarations(cls: type[Any]) -> dict[str, Setting | Section]:
    """The declared keys of a dataclass, in order."""
    return {f.name: f.metadata[SCHEMA] for f in dataclasses.fields(cls) if SCHEMA in f.metadata}


def keys(cls: type[Any]) -> list[str]:
    """The keys a mapping of this section may hold: its own, and those of its inline sections."""
    names: list[str] = []
    for name, declared in declarations(cls).items():
        if isinstance(declared, Section) and declared.inline:
            names.extend(keys(declared.cls))
        else:
            names.append(name)
    return names


def default_of(cls: type[Any], name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return REQUIRED
    raise KeyError(name)


_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def key_path(key: str, name: object) -> str:
    """`key.name`; a name that is not a plain word (spaces, dots, not a string) is quoted: `key[' ']`."""
    if isinstance(name, int) and not isinstance(name, bool):
        return f"{key}[{name}]"
    if isinstance(name, str) and _PLAIN_KEY.fullmatch(name):
        return f"{key}.{name}" if key else name
    return f"{key}[{name!r}]"


def flag(kind: Kind[T], text: Any, name: str) -> T:
    """A command-line flag's value, read by the same kind as the config key it stands for; ValueError names
    the flag as a config error names its key (`--interval: '0s' must be longer than zero`)."""
    try:
        return kind.parse(text)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


# -- the walker ---------------------------------------------------------------------------------------------


MAX_MESSAGE = 1000  # characters of a problem's message (its key aside)


def failure(err: BaseException) -> str:
    """An exception no check foresaw (OverflowError, RecursionError, a bug), as a problem's message in one line."""
    reason = " ".join(str(err).split())[:200] or "no reason given"
    return f"cannot be read: {reason} ({type(err).__name__})"


def unexpected(value: Any, err: BaseException) -> str:
    """What a value that made its check fail unexpectedly is told: still this value's problem, named, never a
    traceback."""
    shown = repr(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{shown} {failure(err)}"


class Walker:
    """Collects problems while walking a document parsed by yaml.safe_load. `null_unsets`: a key set to null
    keeps its default (volprobe.yml); otherwise null is a value, which its kind judges (the mixin)."""

    def __init__(self, null_unsets: bool = True) -> None:
        self.problems: list[str] = []
        self.null_unsets = null_unsets
        self.at = ""  # the key looked at last: what an exception that escapes a check is said of

    def fail(self, key: str, message: str) -> None:
        if len(message) > MAX_MESSAGE:  # a value of a MiB, shown in its message, would be a line of a MiB
            message = message[: MAX_MESSAGE - 3] + "..."
        self.problems.append(f"{key}: {message}" if key else message)

    def mapping(self, value: Any, key: str, allowed: Collection[str] | None) -> dict[str, Any]:
        """The mapping at `key` (null is empty); each key not in `allowed` (if given) is a problem."""
        self.at = key
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.fail(key, f"must be a mapping, got {type(value).__name__}")
            return {}
        for name in value:
            if allowed is not None and name not in allowed:
                self.fail(key_path(key, name), f"unknown key (expected one of: {', '.join(sorted(allowed))})")
        return dict(value)

    def value(self, kind: Kind[T], value: Any, key: str) -> tuple[bool, T | None]:
        """(True, the parsed value), or (False, None) with the problem reported at `key`: whatever the check
        raises (an OverflowError, a RecursionError: a value it did not foresee) is a problem of that key."""
        self.at = key
        try:
            return True, kind.parse(value)
        except Invalid as err:
            for where, message in err.problems:
                self.fail(key_path(key, where), message)
        except (ValueError, TypeError) as err:
            self.fail(key, str(err).replace("\n", " "))
        except Exception as err:  # the boundary: any failure of a value's check refuses the value
            self.fail(key, unexpected(value, err))
        return False, None

    def settings(self, cls: type[Any], data: Mapping[str, Any], key: str) -> dict[str, Any]:
        """The keys of `data` that `cls` declares as settings and that are set, parsed: what overrides its
        defaults. Keys of inline sections are not among them."""
        values: dict[str, Any] = {}
        for name, declared in declarations(cls).items():
            if not isinstance(declared, Setting) or name not in data:
                continue
            if data[name] is None and self.null_unsets:
                continue
            ok, parsed = self.value(declared.kind, data[name], key_path(key, name))
            if ok:
                values[name] = parsed
        return values

    def read(
        self, cls: type[Any], value: Any, key: str, named: str | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the settings that are set, parsed; the whole mapping as written) of a section at `key`. `named`:
        what problems of the mapping itself are said of, where not its key (the whole file: its name)."""
        data = self.mapping(value, key if named is None else named, keys(cls))
        return self.settings(cls, data, key), data

    def build(self, cls: type[T], value: Any, key: str, named: str | None = None, **given: Any) -> T:
        """An instance of `cls` from the mapping at `key`: its settings, and its sections built likewise
        (those in `given` are the caller's)."""
        values, data = self.read(cls, value, key, named)
        return self._construct(cls, values, data, key, given)

    def _construct(self, cls: type[T], values: dict[str, Any], data: Mapping[str, Any], key: str, given: Any) -> T:
        for name, declared in declarations(cls).items():
            if not isinstance(declared, Section) or name in given:
                continue
            if declared.inline:
                inner = self.settings(declared.cls, data, key)
                values[name] = self._construct(declared.cls, inner, data, key, {})
            elif data.get(name) is None:
                continue
            elif declared.many:
                values[name] = tuple(self.items(declared.cls, data[name], key_path(key, name)))
            else:
                values[name] = self.build(declared.cls, data[name], key_path(key, name))
        return cls(**values, **given)

    def items(self, cls: type[T], value: Any, key: str) -> Iterator[T]:
        if not isinstance(value, list):
            self.fail(key, f"must be a list, got {type(value).__name__}")
            return
        for index, item in enumerate(value):
            yield self.build(cls, item, f"{key}[{index}]")


# -- kinds ---------------------------------------------------------------------------------------------------


def _positive(
    parse: Callable[[Any], float], what: str, most: float = math.inf, most_text: str = ""
) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        number = parse(value)
        if number <= 0:
            raise ValueError(f"{value!r} must be {what} than zero")
        if number > most:
            raise ValueError(f"{value!r} is more than {most_text}")
        return number

    return check


def _positive_size(value: Any) -> int:
    size = units.parse_size(value)
    if size <= 0:
        raise ValueError(f"{value!r} must be larger than zero")
    return size


def _ratio(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{value!r} is not a number between 0 and 1")
    if not 0 <= value <= 1:
        raise ValueError(f"{value} is outside 0..1")
    return float(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{value!r} is not a positive integer")
    return value


def _positive_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{value!r} is not a positive number")
    return float(value)


def _absolute_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path")
    if "\0" in value:  # no file is named so: the kernel ends a path at it
        raise ValueError(f"{value!r} holds a NUL, which no path can")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def _texts(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{value!r} is not a list of strings")
    return tuple(value)


def _duration_text(value: Any) -> str:
    """A duration kept as written (Prometheus reads it): 0 or longer."""
    units.parse_duration(value)  # refuses anything that is not one (a negative has no unit parse either)
    return str(value)


def _regexes(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("must be a list of regular expressions")
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"{pattern!r} is not a regular expression: {err}") from None
    return tuple(value)


def choice(options: Collection[str]) -> Kind[str]:
    def parse(value: Any) -> str:
        if value not in options:
            raise ValueError(f"{value!r} is not one of {', '.join(options)}")
        return str(value)

    return Kind(" \\| ".join(f"`{o}`" for o in options), parse, tuple(options), ("", "other", 1, True))


def name_kind(pattern: re.Pattern[str], rule: str) -> Kind[str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid name ({rule})")
        return value

    return Kind(f"name ({rule})", parse, ("data", "pg.data-1:a"), ("my disk", "", "x" * 65, 5))


POSITIVE_DURATION: Kind[float] = Kind(
    "duration > 0",
    _positive(units.parse_duration, "longer", units.LONGEST, "a year (366d): out of range"),
    ("500ms", "1s", "1h30m"),
    ("0s", 5, "5", "soon", True),
    units.format_duration,
)
DURATION: Kind[str] = Kind("duration ≥ 0", _duration_text, ("0s", "5m", "1h30m"), ("-1s", 5, "5", "soon", None))
POSITIVE_SIZE: Kind[int] = Kind(
    "size > 0", _positive_size, (4096, "4KiB", "64MiB", "1GB"), (0, -1, "4kb8", True, 1.5), units.format_size
)
RATIO: Kind[float] = Kind("number in 0..1", _ratio, (0, 0.1, 1), (-0.1, 1.5, "0.1", True))
BOOLEAN: Kind[bool] = Kind("true \\| false", _boolean, (True, False), ("yes", 1, "true"))
POSITIVE_INT: Kind[int] = Kind("integer > 0", _positive_int, (1, 4, 64), (0, -1, 1.5, "4", True))
POSITIVE_NUMBER: Kind[float] = Kind("number > 0", _positive_number, (1, 0.5, 2000), (0, -5, "5", True, math.inf))
ABSOLUTE_PATH: Kind[str] = Kind("absolute path", _absolute_path, ("/var/lib/volprobe",), ("relative/path", "", 5))
TEXT: Kind[str] = Kind("string", _text, ("x", 'job="volprobe"'), (5, True, ["x"]))
TEXTS: Kind[tuple[str, ...]] = Kind("list of strings", _texts, (["a", "b"], []), ("a", [1], {"a": "b"}))
REGEXES: Kind[tuple[str, ...]] = Kind(
    "regular expressions", _regexes, (["nvme.*"], ["loop[0-9]+", "^xvd"]), (["nvme["], 5, [5])
)


def duration_map(what: str) -> Kind[dict[str, str]]:
    """A mapping of names (`what`) to durations kept as written, e.g. {read: 50ms}."""

    def parse(value: Any) -> dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"{value!r} is not a mapping of {what} to duration, e.g. {{read: 50ms}}")
        problems: list[tuple[int | str, str]] = []
        for name, text in value.items():
            try:
                _duration_text(text)
            except ValueError as err:
                problems.append((name, str(err)))
        if problems:
            raise Invalid(problems)
        return dict(value)

    return Kind(f"mapping of {what} to duration", parse, ({"read": "20ms"},), ([], {"read": 5}, {"read": "x"}))


# -- the reference -------------------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value == int(value) and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_shown(v) for v in value) + "]" if value else "[]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return ""
    return str(value).replace("|", "\\|")


def reference(cls: type[Any], path: str = "") -> list[str]:
    """Markdown tables of the keys of `cls` at `path`, then of its sections."""
    lines = [f"`{path}`" if path else "top level", "", "| key | type | default | |", "| --- | --- | --- | --- |"]
    nested: list[tuple[str, Section]] = []

    def rows(owner: type[Any]) -> None:
        for name, declared in declarations(owner).items():
            if isinstance(declared, Section) and declared.inline:
                rows(declared.cls)
                continue
            if isinstance(declared, Section):
                nested.append((name, declared))
                what = "list of mappings" if declared.many else "mapping"
                lines.append(f"| `{name}` | {what} | | {declared.doc} |")
                continue
            default = default_of(owner, name)
            show = declared.kind.show
            if default is REQUIRED:
                text = "required"
            else:
                text = declared.shown or (show(default) if show and default is not None else _shown(default))
            lines.append(f"| `{name}` | {declared.kind.name} | {text} | {declared.doc} |")

    rows(cls)
    for name, declared in nested:
        lines.append("")
        child = f"{path}.{name}" if path else name
        lines.extend(reference(declared.cls, child + ("[]" if declared.many else "")))
    return lines
