"""The tools of `volprobe SUBCOMMAND`, one module each, registered by name as the collectors are.

Each tool is a function from its arguments (after the subcommand's name) to an exit code; it parses its own
flags. A configuration it refuses exits 2 (volprobe.command.report).
"""

from __future__ import annotations

# The tools register themselves on import, in the order `volprobe --help` names them.
from . import check_config, compare, devices, ping, warmup  # noqa: F401
from .registry import TOOLS, Run, Tool, register

__all__ = ["TOOLS", "Run", "Tool", "register"]
