"""What compare may say of two sides, judged against what the exporter's probes saw of them."""

from __future__ import annotations


def verdicts_consistent_with(ratio: float, tolerance: float, slack: float) -> set[str]:
    """The verdicts on one quantile that the sides' exact ratio (candidate / baseline) does not contradict, once a
    ratio read from buckets may be off by `slack`: inconclusive always; equivalent within the tolerance; worse or
    better beyond it on its side."""
    allowed = {"inconclusive"}
    if abs(ratio - 1) <= tolerance + slack:
        allowed.add("equivalent")
    if ratio > 1 + tolerance - slack:
        allowed.add("worse")
    if ratio < 1 - tolerance + slack:
        allowed.add("better")
    return allowed
