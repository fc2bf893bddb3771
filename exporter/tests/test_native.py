"""Native histogram buckets from the high-resolution histogram: the bucket arithmetic, the mapping's error bound,
and the schema lowering above the bucket limit."""

from __future__ import annotations

import math
import random

import pytest

from volprobe import native, stats


def test_a_value_lands_in_the_bucket_whose_bounds_hold_it_at_every_schema():
    rng = random.Random(30)
    for schema in range(native.MIN_SCHEMA, 9):
        for _ in range(2000):
            value = math.exp(rng.uniform(math.log(1e-7), math.log(100.0)))
            index = native.bucket_of(value, schema)
            lower, upper = native.upper_bound(index - 1, schema), native.upper_bound(index, schema)
            assert lower * (1 - 1e-12) < value <= upper * (1 + 1e-12), (schema, value, index)
        for power in range(-30, 8):  # a boundary belongs to the bucket below it (upper-inclusive)
            if schema >= 0 or power % 2**-schema == 0:
                index = native.bucket_of(2.0**power, schema)
                assert native.upper_bound(index, schema) == pytest.approx(2.0**power, rel=1e-12)


def _high_resolution(latencies_ns: list[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for ns in latencies_ns:
        index = stats.bucket_index(ns)
        counts[index] = counts.get(index, 0) + 1
    return counts


def _latencies(rng: random.Random, n: int) -> list[int]:
    """Shaped as volumes answer: a lognormal body around a median of 50 us to 5 ms, with a tail of stalls."""
    median = math.exp(rng.uniform(math.log(50e3), math.log(5e6)))
    body = [int(median * math.exp(rng.gauss(0, rng.uniform(0.05, 0.8)))) for _ in range(n)]
    return body + [int(median * rng.uniform(5, 200)) for _ in range(n // 100)]


def _native_quantile_bucket(buckets: native.NativeBuckets, q: float) -> tuple[float, float]:
    """(lower, upper) bounds, in seconds, of the native bucket holding the q-quantile's rank (nearest rank)."""
    counts = buckets.counts()
    total = sum(counts.values()) + buckets.zero_count
    rank, seen = max(1, math.ceil(q * total)), buckets.zero_count
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            return native.upper_bound(index - 1, buckets.schema), native.upper_bound(index, buckets.schema)
    raise AssertionError("rank beyond the count")


def test_a_quantile_from_the_native_buckets_is_within_one_bucket_of_the_exporters_own():
    """Wherever Prometheus interpolates inside the native bucket that holds a quantile's rank, it stays within
    that bucket, and the exporter's own quantile (its high-resolution bucket's midpoint) is inside it too: the
    error is at most the bucket's relative width, 2^(1/128) - 1 = 0.54% at schema 7."""
    rng = random.Random(7)
    width = 2 ** (2.0**-native.SCHEMA) - 1
    assert width < 0.0055
    at_schema_7 = 0
    for _ in range(300):
        counts = _high_resolution(_latencies(rng, rng.randrange(50, 3000)))
        buckets = native.from_counts(counts)
        at_schema_7 += buckets.schema == native.SCHEMA
        ours = stats.quantiles_from_counts(counts, stats.SUMMARY_QUANTILES)
        for q, exact_ns in zip(stats.SUMMARY_QUANTILES, ours, strict=True):
            lower, upper = _native_quantile_bucket(buckets, q)
            assert lower < exact_ns / 1e9 <= upper, (q, exact_ns, lower, upper)
            assert upper / lower - 1 <= (2 ** (2.0**-buckets.schema) - 1) * (1 + 1e-9)
    assert at_schema_7 >= 290, "nearly all such histograms keep the full resolution, and so the 0.54% bound"


def test_every_observation_is_kept_and_the_spans_decode_to_the_buckets():
    rng = random.Random(11)
    for _ in range(200):
        counts = _high_resolution(_latencies(rng, rng.randrange(1, 2000)))
        buckets = native.from_counts(counts)
        direct: dict[int, int] = {}
        for index, count in counts.items():
            key = native.bucket_of(stats.bucket_midpoint(index) / 1e9, buckets.schema)
            direct[key] = direct.get(key, 0) + count
        assert buckets.counts() == direct
        assert sum(buckets.counts().values()) + buckets.zero_count == sum(counts.values())
        assert sum(length for _, length in buckets.spans) == len(buckets.deltas)


def test_above_the_bucket_limit_the_schema_halves_and_no_observation_is_lost():
    """Latencies from 20 us to 20 s fill far more than MAX_BUCKETS buckets at schema 7: the schema comes down
    until they fit, and the result is what mapping straight to that schema gives (pairs merged, as
    Prometheus merges them)."""
    rng = random.Random(5)
    spread = [int(math.exp(rng.uniform(math.log(20e3), math.log(20e9)))) for _ in range(20000)]
    counts = _high_resolution(spread)
    buckets = native.from_counts(counts)
    assert buckets.schema < native.SCHEMA
    assert len(buckets.counts()) <= native.MAX_BUCKETS
    assert sum(buckets.counts().values()) == len(spread)
    assert buckets.counts() == native.from_counts(counts, schema=buckets.schema, max_buckets=10**6).counts()
    finer = native.from_counts(counts, schema=buckets.schema + 1, max_buckets=10**6).counts()
    assert len(finer) > native.MAX_BUCKETS, "the schema came down no further than it had to"


def test_an_empty_histogram_is_a_native_one_with_a_no_op_span():
    buckets = native.from_counts({})
    assert buckets.spans == ((0, 0),) and buckets.deltas == () and buckets.zero_count == 0
    assert buckets.counts() == {}


def test_small_gaps_are_filled_with_empty_buckets_and_larger_ones_start_a_span():
    spans, deltas = native._spans_and_deltas({10: 3, 11: 5, 14: 1, 30: 2})
    assert spans == ((10, 5), (15, 1))  # 12 and 13 empty inside the first span; 15..29 skipped
    assert deltas == (3, 2, -5, 0, 1, 1)
