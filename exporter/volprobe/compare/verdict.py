"""The maths of `volprobe compare`: quantiles from histogram buckets, their ratio with a bootstrap interval over
periods, and a verdict. Pure: the inputs are bucket counts per period, already fetched.

A quantile read from buckets is only known to lie in its bucket (lower, upper]: the estimate interpolates
inside it geometrically (latencies spread evenly on a log scale, which Prometheus' linear histogram_quantile
ignores: a lognormal's median read linearly from a x1.5 bucket can be 10% off), and the bucket's bounds are
reported with it, so the resolution of the bucket layout is never hidden.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

QUANTILES = (0.5, 0.9, 0.99, 0.999)
VERDICTS = ("better", "equivalent", "worse", "inconclusive")
EXIT_STATUS = {"better": 0, "equivalent": 0, "worse": 1, "inconclusive": 3}
TAIL_SAMPLES = 10  # a quantile q is judged only with at least this many probes above it: n >= 10 / (1 - q)
MIN_PERIODS = 3  # a bootstrap over fewer periods says nothing about their variation


@dataclass(frozen=True)
class Histogram:
    """Bucket counts of one side over one period (or the whole span): non-cumulative, by upper bound."""

    bounds: tuple[float, ...]  # ascending, ending with +inf
    counts: tuple[float, ...]

    @classmethod
    def from_cumulative(cls, cumulative: Mapping[float, float]) -> Histogram:
        """From `le` -> cumulative count (what the exposition and PromQL give); decreasing counts (a counter
        reset inside increase()) are clamped to zero."""
        bounds = tuple(sorted(cumulative))
        counts, below = [], 0.0
        for bound in bounds:
            counts.append(max(0.0, cumulative[bound] - below))
            below = max(below, cumulative[bound])
        return cls(bounds, tuple(counts))

    @property
    def total(self) -> float:
        return sum(self.counts)

    def __add__(self, other: Histogram) -> Histogram:
        if self.bounds != other.bounds:
            raise ValueError("histograms with different bucket layouts cannot be added")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)))


@dataclass(frozen=True)
class Quantile:
    q: float
    estimate: float  # seconds, geometric inside the bucket; NaN without samples
    lower: float  # the bucket holding it: the quantile is in (lower, upper]
    upper: float

    @property
    def bound_error(self) -> float:
        """The largest relative error the bucket allows the estimate: max distance to a bound / estimate."""
        if not self.estimate or math.isnan(self.estimate) or math.isinf(self.upper):
            return math.inf
        return max(self.estimate - self.lower, self.upper - self.estimate) / self.estimate


def quantile(histogram: Histogram, q: float) -> Quantile:
    total = histogram.total
    if total <= 0:
        return Quantile(q, math.nan, math.nan, math.nan)
    rank = q * total
    lower, seen = 0.0, 0.0
    for bound, count in zip(histogram.bounds, histogram.counts, strict=True):
        if count and seen + count >= rank:
            if math.isinf(bound):  # above the last finite bound: only the bound is known
                return Quantile(q, lower, lower, bound)
            fraction = (rank - seen) / count
            if lower > 0:  # geometric inside the bucket: latencies spread evenly in log, not in linear scale
                return Quantile(q, lower * (bound / lower) ** fraction, lower, bound)
            return Quantile(q, bound * fraction, lower, bound)
        seen += count
        lower = bound
    return Quantile(q, lower, lower, math.inf)


@dataclass(frozen=True)
class Comparison:
    """One quantile, baseline against candidate, over the whole span."""

    q: float
    baseline: Quantile
    candidate: Quantile
    ratio: float  # candidate / baseline: above 1 is slower
    low: float  # bootstrap interval of the ratio (resampling periods)
    high: float
    verdict: str
    reason: str


def _needed(q: float) -> int:
    return math.ceil(TAIL_SAMPLES / (1 - q))


def compare(
    baseline: Sequence[Histogram],
    candidate: Sequence[Histogram],
    tolerance: float = 0.10,
    quantiles: Sequence[float] = QUANTILES,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> list[Comparison]:
    """Per quantile: the ratio over the whole span, its interval from resampling the periods (both sides'
    periods are drawn together, so a slow day on shared infrastructure stays paired), and the verdict:
    better/worse when the whole interval lies beyond the tolerance, equivalent when it lies within it,
    inconclusive otherwise or with too few periods or probes (the reason says how many more are needed)."""
    if len(baseline) != len(candidate):
        raise ValueError("both sides need the same periods")
    whole_base, whole_cand = total(baseline), total(candidate)
    rng = random.Random(seed)
    periods = [i for i in range(len(baseline)) if baseline[i].total > 0 and candidate[i].total > 0]
    draws = [[rng.choice(periods) for _ in periods] for _ in range(resamples)] if periods else []
    pooled = [(total([baseline[i] for i in draw]), total([candidate[i] for i in draw])) for draw in draws]
    results = []
    for q in quantiles:
        b, c = quantile(whole_base, q), quantile(whole_cand, q)
        ratio = c.estimate / b.estimate if b.estimate else math.nan
        ratios = sorted(
            quantile(pc, q).estimate / quantile(pb, q).estimate for pb, pc in pooled if quantile(pb, q).estimate
        )
        tail = (1 - confidence) / 2
        low = ratios[int(tail * (len(ratios) - 1))] if ratios else math.nan
        high = ratios[int((1 - tail) * (len(ratios) - 1))] if ratios else math.nan
        needed = _needed(q)
        fewest = min(whole_base.total, whole_cand.total)
        if fewest < needed:
            verdict, reason = (
                "inconclusive",
                f"{needed - fewest:.0f} more probes per side (p{q * 100:g} needs {needed})",
            )
        elif len(periods) < MIN_PERIODS:
            verdict, reason = "inconclusive", f"{MIN_PERIODS - len(periods)} more periods with probes on both sides"
        elif low > 1 + tolerance:
            verdict, reason = "worse", f"even the interval's low end is {low - 1:+.1%}"
        elif high < 1 - tolerance:
            verdict, reason = "better", f"even the interval's high end is {high - 1:+.1%}"
        elif 1 - tolerance <= low and high <= 1 + tolerance:
            verdict, reason = "equivalent", f"the interval lies within ±{tolerance:.0%}"
        else:
            verdict, reason = "inconclusive", f"the interval {low - 1:+.1%}..{high - 1:+.1%} crosses ±{tolerance:.0%}"
        results.append(Comparison(q, b, c, ratio, low, high, verdict, reason))
    return results


def overall(results: Sequence[Comparison]) -> str:
    """worse if any quantile is worse; else inconclusive if any is; else better if all are; else equivalent."""
    verdicts = {r.verdict for r in results}
    for verdict in ("worse", "inconclusive"):
        if verdict in verdicts:
            return verdict
    return "better" if verdicts == {"better"} else "equivalent"


def total(histograms: Sequence[Histogram]) -> Histogram:
    """The histograms added up (all of one layout)."""
    result = histograms[0]
    for histogram in histograms[1:]:
        result = result + histogram
    return result
