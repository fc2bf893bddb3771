"""Command line: `volprobe [FLAGS]` runs the exporter (volprobe.app); `volprobe TOOL ...` runs one of the tools
(volprobe.tools: check-config, compare, devices, ping, warmup). Exit 2 on any bad config."""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence

from . import app
from .tools import TOOLS


def main(argv: Sequence[str] | None = None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):  # a path's bytes that are not UTF-8 printed as they are, as ls does
        sys.stdout.reconfigure(errors="surrogateescape")
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in TOOLS:
        return TOOLS[args[0]].run(args[1:])
    return app.main(args)
