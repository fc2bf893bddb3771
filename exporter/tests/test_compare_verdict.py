"""The maths of `volprobe compare`: bucket quantiles, the bootstrap ratio over periods, verdicts."""

from __future__ import annotations

import bisect
import math
import random

import pytest

from volprobe.compare import verdict
from volprobe.stats import DEFAULT_BUCKETS

BOUNDS = (*DEFAULT_BUCKETS, math.inf)


def histogram(samples: list[float]) -> verdict.Histogram:
    counts = [0.0] * len(BOUNDS)
    for s in samples:
        counts[bisect.bisect_left(BOUNDS, s)] += 1
    return verdict.Histogram(BOUNDS, tuple(counts))


def days(median: float, n_days: int, per_day: int, seed: int, spread: float = 0.05) -> list[verdict.Histogram]:
    """Periods of lognormal latencies whose median wanders from day to day by `spread`."""
    rng = random.Random(seed)
    result = []
    for _ in range(n_days):
        day_median = median * math.exp(rng.gauss(0, spread))
        result.append(histogram([day_median * math.exp(rng.gauss(0, 0.3)) for _ in range(per_day)]))
    return result


def test_a_quantile_lies_in_its_bucket_as_histogram_quantile_puts_it():
    h = verdict.Histogram.from_cumulative({0.001: 10, 0.002: 30, 0.005: 40, math.inf: 40})
    p50 = verdict.quantile(h, 0.5)
    assert (p50.lower, p50.upper) == (0.001, 0.002)
    assert p50.estimate == pytest.approx(0.001 * 2 ** ((20 - 10) / 20))  # rank 20 of 40, 10 below: geometric
    assert p50.bound_error == pytest.approx((0.002 - p50.estimate) / p50.estimate)
    top = verdict.quantile(verdict.Histogram.from_cumulative({0.001: 0, math.inf: 5}), 0.99)
    assert top.estimate == 0.001 and math.isinf(top.upper) and math.isinf(top.bound_error)
    assert math.isnan(verdict.quantile(verdict.Histogram.from_cumulative({0.001: 0, math.inf: 0}), 0.5).estimate)


def test_a_counter_reset_inside_a_period_never_makes_negative_buckets():
    h = verdict.Histogram.from_cumulative({0.001: 5, 0.002: 3, math.inf: 9})
    assert h.counts == (5, 0, 4) and h.total == 9


def test_a_candidate_40_percent_slower_is_worse_with_the_ratio_near_1_4():
    results = verdict.compare(days(0.002, 7, 3000, 1), days(0.0028, 7, 3000, 2), quantiles=(0.5, 0.9))
    for r in results:
        assert r.verdict == "worse", r
        assert r.low <= r.ratio <= r.high
        # The true ratio lies within what the two buckets allow; the median's estimate within 5% of it.
        assert r.candidate.lower / r.baseline.upper <= 1.4 <= r.candidate.upper / r.baseline.lower
    assert results[0].ratio == pytest.approx(1.4, rel=0.05)
    assert verdict.overall(results) == "worse"


def test_equal_sides_are_equivalent_and_a_faster_one_is_better():
    same = verdict.compare(days(0.002, 7, 3000, 3), days(0.002, 7, 3000, 4), quantiles=(0.5, 0.9))
    assert [r.verdict for r in same] == ["equivalent", "equivalent"], same
    assert verdict.overall(same) == "equivalent"
    faster = verdict.compare(days(0.002, 7, 3000, 5), days(0.001, 7, 3000, 6), quantiles=(0.5,))
    assert faster[0].verdict == "better" and verdict.overall(faster) == "better"


def test_too_few_periods_or_probes_are_inconclusive_and_say_how_many_more():
    one_day = verdict.compare(days(0.002, 1, 3000, 7), days(0.0028, 1, 3000, 8), quantiles=(0.5,))
    assert one_day[0].verdict == "inconclusive" and "2 more periods" in one_day[0].reason
    few = verdict.compare(days(0.002, 7, 100, 9), days(0.002, 7, 100, 10), quantiles=(0.999,))
    assert few[0].verdict == "inconclusive" and "9300 more probes per side" in few[0].reason
    assert verdict.overall([*few, *one_day]) == "inconclusive"


def test_a_noisy_difference_near_the_tolerance_is_inconclusive():
    # Days vary by 30%: a 10% difference cannot be told from the day-to-day noise in a week.
    results = verdict.compare(
        days(0.002, 7, 3000, 11, spread=0.3), days(0.0022, 7, 3000, 12, spread=0.3), quantiles=(0.5,)
    )
    assert results[0].verdict == "inconclusive", results[0]
    assert results[0].low < 1.1 < results[0].high or results[0].low < 0.9 < results[0].high
