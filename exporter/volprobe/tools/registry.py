"""The tools' registry: each tool module registers itself here by name, on import."""

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
