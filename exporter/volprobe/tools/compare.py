"""`volprobe compare`: two runs of the same volumes side by side (volprobe.compare)."""

from __future__ import annotations

from collections.abc import Sequence

from .registry import register


@register("compare")
def run_compare(argv: Sequence[str]) -> int:
    from ..compare import command  # only this tool needs it (and its plotting, matplotlib)

    return command.run(argv)
