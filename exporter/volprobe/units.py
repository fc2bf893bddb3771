"""Parsing and formatting of durations, sizes and rates as written in configs and flags."""

from __future__ import annotations

import math
import re

_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
# Beyond these a value is a typo, and breaks what it reaches: a wait of more than threading.TIMEOUT_MAX raises
# OverflowError (schema.POSITIVE_DURATION bounds volprobe's durations by LONGEST), a size beyond an off_t cannot
# be an offset or a length.
LONGEST = 366 * 86400.0
LARGEST = 2**63 - 1
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h|d)")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_duration(value: object) -> float:
    """Return seconds for `50ms`, `1s`, `5m`, `1h30m`. Bare numbers are refused: the unit is not guessable."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration; write it with a unit, e.g. 500ms, 1s, 5m")
    text = value.strip()
    pos, total = 0, 0.0
    # Each part matched where the last ended: finditer() would search on from every digit of a unitless number
    # (5,000 digits: a tenth of a second; a MiB of them: hours).
    while match := _DURATION_PART.match(text, pos):
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ValueError(f"{_short(value)} is not a duration; write it with a unit, e.g. 500ms, 1s, 5m")
    if not math.isfinite(total):  # a number of 400 digits
        raise ValueError(f"{_short(value)} is not a duration: too long to count")
    return total


def parse_size(value: object) -> int:
    """Return bytes for `4KiB`, `64MiB`, `1G` (binary) or `1GB` (decimal); a bare integer is bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative")
        if value > LARGEST:
            raise ValueError(f"{value} bytes is more than 8EiB")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a size; write e.g. 4KiB, 64MiB")
    text = value.strip()
    if text.lower().endswith("/s"):
        text = text[:-2]
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{value!r} is not a size; write e.g. 4KiB, 64MiB")
    number = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if not number <= LARGEST:  # inf too (a number of 400 digits)
        raise ValueError(f"{_short(value)} is more than 8EiB")
    if number != math.floor(number):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(number)


def _short(value: str) -> str:
    """A value as an error message shows it: its first characters, if it is long."""
    return repr(value) if len(value) <= 40 else repr(value[:37] + "...")


def format_size(n: float) -> str:
    """Human-readable binary size, e.g. 8KiB, 1.5MiB."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= factor:
            value = n / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n:.0f}B"


def format_duration(seconds: float) -> str:
    """Short human-readable duration with a unit that keeps 3 significant digits, e.g. 812us, 2.34ms."""
    if seconds != seconds:  # NaN
        return "-"
    for unit, factor in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= factor:
            return f"{seconds / factor:.3g}{unit}"
    return f"{seconds * 1e9:.0f}ns"
