"""The outcome of `volprobe compare`: both sides' periods, each quantile's comparison and the warnings, which
every output format writes (text, markdown, JSON, HTML)."""

from __future__ import annotations

from dataclasses import dataclass

from . import source, verdict


@dataclass
class Report:
    baseline: source.Side
    candidate: source.Side
    op: str
    period: float
    tolerance: float
    results: list[verdict.Comparison]
    warnings: list[str]
    different_specs: bool
    histograms: str  # which the quantiles come from: "native" or "classic" (source.choose)

    @property
    def verdict(self) -> str:
        return verdict.overall(self.results)
