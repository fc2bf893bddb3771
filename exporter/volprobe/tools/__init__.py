"""The tools of `volprobe SUBCOMMAND`, one module each, registered by name as the collectors are.

Each tool is a function from its arguments (after the subcommand's name) to an exit code; it parses its own
flags. A configuration it refuses exits 2 (volprobe.command.report).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Run = Callable[[Sequence[str]], int]


@dataclass(frozen=True)
class Tool:
    name: str
    run: Run


TOOLS: dict[str, Tool] = {}


def register(name: str) -> Callable[[Run], Run]:
    """Function decorator: make a tool known as `volprobe NAME`."""

    def add(run: Run) -> Run:
        TOOLS[name] = Tool(name, run)
        return run

    return add


# The tools register themselves on import, in the order `volprobe --help` names them.
from . import check_config, compare, devices, ping, warmup  # noqa: E402, F401
