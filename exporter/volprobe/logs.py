"""The log formats of --log.format: logfmt (the default) and JSON, with the keys Prometheus' own logs use."""

from __future__ import annotations

import json
import logging
import sys
import time


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage().replace('"', '\\"').replace("\n", " | ")
        line = f'ts={_timestamp(record)} level={record.levelname.lower()} logger={record.name} msg="{message}"'
        if record.exc_info:
            line += ' err="' + self.formatException(record.exc_info).replace('"', "'").replace("\n", " | ") + '"'
        return line


class JSONFormatter(logging.Formatter):
    """One JSON object per line, with logfmt's keys (as Prometheus' --log.format=json)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name}
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
