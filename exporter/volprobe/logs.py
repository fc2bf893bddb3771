"""The log formats of --log.format: logfmt (the default) and JSON, with the keys Prometheus' own logs use.

What a record is about goes in fields of its own, as node_exporter's go-kit/slog logs carry them, not only in
words inside msg: `target`, `device`, `path`, `op`, `errno`, `key` (a configuration key) and `address` (a
listener's, as node_exporter logs it), given to a logging call as `extra=fields(target=..., errno=...)`.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

FIELDS = ("target", "device", "path", "op", "errno", "key", "address")
_BARE = re.compile(r"[^\s\"=\\\x00-\x1f\x7f]+")  # a logfmt value written without quotes


def fields(**values: object) -> dict[str, Any]:
    """`extra=` for a logging call: the fields given that have a value (None and "" are left out)."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise ValueError(f"not a log field: {', '.join(sorted(unknown))}")
    return {name: value for name, value in values.items() if value is not None and value != ""}


def problem_key(problem: str) -> str | None:
    """The configuration key a ConfigError problem names (`targets[0].probes[1].interval: ...`), if it names one."""
    key, sep, _ = problem.partition(": ")
    return key if sep and key and not any(c.isspace() for c in key) and not key.startswith("/") else None


def _fields(record: logging.LogRecord) -> list[tuple[str, str]]:
    return [(name, str(getattr(record, name))) for name in FIELDS if hasattr(record, name)]


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _logfmt(value: str) -> str:
    if _BARE.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage().replace('"', '\\"').replace("\n", " | ")
        line = f"ts={_timestamp(record)} level={record.levelname.lower()} logger={record.name}"
        line += "".join(f" {name}={_logfmt(value)}" for name, value in _fields(record))
        line += f' msg="{message}"'
        if record.exc_info:
            line += ' err="' + self.formatException(record.exc_info).replace('"', "'").replace("\n", " | ") + '"'
        return line


class JSONFormatter(logging.Formatter):
    """One JSON object per line, with logfmt's keys (as Prometheus' --log.format=json)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name}
        line.update(_fields(record))
        line["msg"] = record.getMessage()
        if record.exc_info:
            line["err"] = self.formatException(record.exc_info)
        return json.dumps(line)


LOG_FORMATS: dict[str, type[logging.Formatter]] = {"logfmt": LogfmtFormatter, "json": JSONFormatter}


def setup_logging(level: str, format: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LOG_FORMATS[format]())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
