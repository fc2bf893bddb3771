"""The log-linear histogram's stated error bound, checked against exact quantiles of raw samples."""

import itertools
import math
import random

import pytest

from volprobe import stats


def exact_quantile(values, q):
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def bucket_bounds(index: int) -> tuple[int, int]:
    """The integers [low, high] that bucket `index` holds, derived from the scheme itself (not from stats):
    one bucket per value below 128, then 64 equal buckets per power-of-two range [2^m, 2^(m+1))."""
    if index < 128:
        return index, index
    m = index // 64 + 5
    width = 1 << (m - 6)
    low = (1 << m) + (index % 64) * width
    return low, low + width - 1


def test_buckets_cover_every_value_and_are_ordered():
    values = sorted({*range(0, 5000), *(2**k + d for k in range(12, 40) for d in (-1, 0, 1))})
    previous_ns, previous_index = None, None
    for ns in values:
        index = stats.bucket_index(ns)
        low, high = bucket_bounds(index)
        assert low <= ns <= high, (ns, index, low, high)
        midpoint = stats.bucket_midpoint(index)
        assert midpoint == (low + high) / 2, (index, midpoint, low, high)
        assert abs(midpoint - ns) <= stats.RELATIVE_ERROR * ns, (ns, index, midpoint)
        if previous_ns == ns - 1:  # consecutive values: the same bucket or the next one, never a gap
            assert index - previous_index in (0, 1), (ns, previous_index, index)
        elif previous_ns is not None:
            assert index > previous_index, (ns, previous_index, index)
        previous_ns, previous_index = ns, index


@pytest.mark.parametrize(
    ("ns", "index"),
    [
        (0, 0),
        (127, 127),  # the last exact bucket
        (128, 128),  # [128, 129]: the first two-wide bucket
        (129, 128),
        (130, 129),
        (255, 191),  # the last bucket of [128, 256)
        (256, 192),  # [256, 259]
        (1000, 317),  # [1000, 1007]: [2^9, 2^10) in steps of 8, step 61 (4 ranges of 64 after the exact 128)
        (999_999, 954),  # 1 ms lies in [999424, 1007615]: [2^19, 2^20) in steps of 8192, step 58
        (1_000_000, 954),
        (2**30 - 1, 1599),
        (2**30, 1600),
    ],
)
def test_known_bucket_indexes(ns, index):
    assert stats.bucket_index(ns) == index
    low, high = bucket_bounds(index)
    assert low <= ns <= high


@pytest.mark.parametrize("ns", [0, 1, 63, 64, 127])
def test_small_values_are_exact(ns):
    assert stats.bucket_midpoint(stats.bucket_index(ns)) == ns


@pytest.mark.parametrize("seed", range(5))
def test_quantiles_within_stated_relative_error_of_exact(seed):
    rng = random.Random(seed)
    # Latencies from 10 us to 20 s: a log-normal body plus a heavy tail, as real volumes show.
    samples = [int(rng.lognormvariate(math.log(2e6), 0.6)) for _ in range(20000)]
    samples += [int(rng.uniform(1e4, 2e10)) for _ in range(200)]
    counts: dict[int, int] = {}
    for ns in samples:
        index = stats.bucket_index(ns)
        counts[index] = counts.get(index, 0) + 1
    qs = [0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999, 1.0]
    for q, estimate in zip(qs, stats.quantiles_from_counts(counts, qs), strict=True):
        exact = exact_quantile(samples, q)
        assert abs(estimate - exact) <= stats.RELATIVE_ERROR * exact, (q, estimate, exact)


def test_the_bound_is_tight_not_loose():
    # Every value of a bucket is within the bound of its midpoint, and the bucket edges come close to it.
    worst = 0.0
    for ns in range(128, 1 << 16):
        mid = stats.bucket_midpoint(stats.bucket_index(ns))
        worst = max(worst, abs(mid - ns) / ns)
    assert worst <= stats.RELATIVE_ERROR
    assert worst > 0.9 * stats.RELATIVE_ERROR


def test_empty_histogram_gives_nan():
    assert all(math.isnan(v) for v in stats.quantiles_from_counts({}, [0.5, 0.99]))


def test_sliding_window_forgets_old_samples():
    window = stats.SlidingHistogram(window_s=10, slices=10)
    second = 1_000_000_000
    for t in range(5):
        window.add(1_000_000, t * second)  # 1 ms samples in the first five seconds
    window.add(9_000_000, 12 * second)  # a 9 ms sample later
    counts = window.counts(12 * second)
    assert sum(counts.values()) == 3  # t=3,4 are still inside the last 10 s (slices 3..12), t<=2 left
    counts = window.counts(30 * second)
    assert counts == {}


@pytest.mark.parametrize("seed", range(5))
def test_the_window_kept_as_it_goes_equals_its_samples_counted_again(seed):
    """The window's running sum, read at random times between samples, against the samples of the last
    `slices` slices counted from scratch (pauses longer than the window included)."""
    rng = random.Random(seed)
    window = stats.SlidingHistogram(window_s=10, slices=5)
    samples: list[tuple[int, int]] = []  # (time, bucket index)
    now = 0
    for _ in range(3000):
        now += rng.choice([1, 50_000_000, 700_000_000, 3_000_000_000, 25_000_000_000])
        if rng.random() < 0.8:
            ns = int(rng.lognormvariate(12, 1.5))
            window.add(ns, now)
            samples.append((now, stats.bucket_index(ns)))
        else:
            oldest = now // window.slice_ns - window.slices
            expected: dict[int, int] = {}
            for at, index in samples:
                if at // window.slice_ns > oldest:
                    expected[index] = expected.get(index, 0) + 1
            assert window.counts(now) == expected


def test_probe_stats_prometheus_buckets_and_summary():
    probe = stats.ProbeStats(window_s=60)
    now = 10**12
    for ms in (1, 2, 3, 4, 100):
        probe.record(ms * 1_000_000, "first", now)
    probe.record(5_000_000, "repeat", now)
    first = probe.snapshot("first", now)
    assert first.count == 5 and first.buckets[-1] == (math.inf, 5)
    assert dict(first.buckets)[0.002] == 2  # le is inclusive: 1 ms and 2 ms
    assert dict(first.buckets)[0.05] == 4
    assert first.sum_seconds == pytest.approx(0.110)
    assert first.quantiles[0] == pytest.approx(0.003, rel=stats.RELATIVE_ERROR)  # p50 of 5 samples: 3rd
    assert first.quantiles[-1] == pytest.approx(0.100, rel=stats.RELATIVE_ERROR)
    assert probe.snapshot("repeat", now).count == 1


def test_a_snapshot_is_kept_until_a_sample_lands_or_the_window_moves():
    """Scrapes faster than the probes read the same snapshot again; a new sample, or the window moving on a
    slice (old samples leaving it), makes a new one, and never changes one already handed out."""
    probe = stats.ProbeStats(window_s=60)  # slices of 6 s
    second = 1_000_000_000
    now = 1000 * second
    probe.record(1_000_000, "first", now)
    taken = probe.snapshot("first", now)
    assert probe.snapshot("first", now + second) is taken  # the same slice, nothing new
    probe.record(2_000_000, "first", now + second)
    again = probe.snapshot("first", now + second)
    assert again is not taken and (again.count, again.window_count) == (2, 2)
    assert (taken.count, taken.window_count, taken.cumulative[-1]) == (1, 1, 1)  # as it was handed out
    assert probe.snapshot("repeat", now + second).count == 0  # each touch its own
    later = probe.snapshot("first", now + 61 * second)  # both samples have left the window, none came
    assert later is not again and later.count == 2 and later.window_count == 0 and math.isnan(later.quantiles[0])
    assert probe.snapshot("first", now + 61 * second + second // 2) is later  # the same slice again


def _ratios(bounds: tuple[float, ...]) -> dict[float, float]:
    """Each bound's ratio to the one below it."""
    return {b: b / a for a, b in itertools.pairwise(bounds)}


def test_default_buckets_cover_10us_to_20s_dense_where_volumes_answer():
    assert stats.DEFAULT_BUCKETS[0] == 1e-5 and stats.DEFAULT_BUCKETS[-1] == 20.0
    assert len(stats.DEFAULT_BUCKETS) == 26  # a read and a write probe: half the series of the legacy layout
    ratios = _ratios(stats.DEFAULT_BUCKETS)
    assert max(r for b, r in ratios.items() if b <= 0.01) <= 5 / 3 + 1e-9  # 10 us .. 10 ms
    assert max(r for b, r in ratios.items() if b <= 0.05) <= 2.5 + 1e-9  # up to the latency alert's 50 ms
    assert 0.05 in stats.DEFAULT_BUCKETS and 5.0 in stats.DEFAULT_BUCKETS  # the alert and stall thresholds


def test_legacy_buckets_are_the_first_releases():
    assert len(stats.LEGACY_BUCKETS) == 45 and max(_ratios(stats.LEGACY_BUCKETS).values()) <= 1.5 + 1e-9


def test_bucket_validation():
    with pytest.raises(ValueError):
        stats.validate_buckets([1, 1])
    with pytest.raises(ValueError):
        stats.validate_buckets([i + 1 for i in range(51)])
    assert stats.validate_buckets([0.001, 0.01]) == (0.001, 0.01)
