"""Native histogram buckets (Prometheus' sparse exponential buckets) from volprobe's high-resolution histogram.

A native histogram of schema s has a bucket boundary at every 2^(k / 2^s): bucket i holds the values in
(2^((i-1) / 2^s), 2^(i / 2^s)], so each bucket is 2^(2^-s) times as wide as the one before it. volprobe keeps
its latencies in fio's log-linear buckets (stats.py): 64 equal parts of each power of two of nanoseconds, a value
standing for the midpoint of its bucket, within RELATIVE_ERROR (0.78%) of it.

The mapping: each high-resolution bucket's count goes, whole, to the native bucket that holds its midpoint in
seconds. A high-resolution bucket that straddles a native boundary is not split: its values are then counted on
one side of that boundary, which moves none of them further from where volprobe itself places them (the
midpoint) than one native bucket. So a quantile Prometheus takes from these buckets, wherever it interpolates
within the bucket holding the rank, is within one native bucket's relative width of the exporter's own quantile
of the same samples:

    schema 7: 2^(1/128) - 1 = 0.54 %   (SCHEMA; against the exact value, 0.54 % + 0.78 %)

Above MAX_BUCKETS populated buckets the schema is lowered one step at a time, each step merging pairs of
neighbours (what Prometheus does to a histogram over its scrape's native_histogram_bucket_limit): the
resolution halves, no observation is lost.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from .stats import bucket_midpoint

SCHEMA = 7  # buckets 0.54% wide: the bound stays under 1% (schema 6: 1.09%); Prometheus takes up to 8
MIN_SCHEMA = -4  # the coarsest Prometheus accepts
MAX_BUCKETS = 512  # populated buckets: 8 powers of two at full resolution (one per fio bucket at schema 7)
ZERO_THRESHOLD = 2.0**-128  # client_golang's default: no latency is this close to 0
GAP_FILL = 2  # a gap of at most this many empty buckets is written as zeros: cheaper than another span


@dataclass(frozen=True)
class NativeBuckets:
    """The positive buckets of a native histogram, as the protobuf exposition writes them."""

    schema: int
    zero_threshold: float
    zero_count: int
    spans: tuple[tuple[int, int], ...]  # (offset from the previous span's end, or the first index; length)
    deltas: tuple[int, ...]  # each bucket's count less the previous one's (the first: its count)

    def counts(self) -> dict[int, int]:
        """{bucket index: count} of the populated buckets (a decoder's view, for tests and checks)."""
        result: dict[int, int] = {}
        index, count, deltas = 0, 0, iter(self.deltas)
        for n, (offset, length) in enumerate(self.spans):
            index = offset if n == 0 else index + offset
            for _ in range(length):
                count += next(deltas)
                if count:
                    result[index] = count
                index += 1
        return result


def _bounds(schema: int) -> list[float]:
    """For schema > 0, the boundaries within one power of two as fractions in [0.5, 1): 2^(j / 2^s) / 2."""
    return [math.ldexp(2.0 ** (j / 2**schema), -1) for j in range(2**schema)]


_BOUNDS = {schema: _bounds(schema) for schema in range(1, 9)}


def bucket_of(value: float, schema: int) -> int:
    """The index of the native bucket holding a positive value: the least i with value <= 2^(i / 2^schema)."""
    fraction, exponent = math.frexp(value)  # value = fraction * 2^exponent, fraction in [0.5, 1)
    if schema > 0:
        return bisect.bisect_left(_BOUNDS[schema], fraction) + (exponent - 1) * (1 << schema)
    index = exponent - 1 if fraction == 0.5 else exponent  # an exact power of two is an upper bound
    return (index + (1 << -schema) - 1) >> -schema  # schema <= 0: 2^-schema powers of two to a bucket


def upper_bound(index: int, schema: int) -> float:
    """The upper boundary of a native bucket, 2^(index / 2^schema)."""
    return math.pow(2.0, math.ldexp(index, -schema))


def from_counts(counts: Mapping[int, int], schema: int = SCHEMA, max_buckets: int = MAX_BUCKETS) -> NativeBuckets:
    """The native buckets of a high-resolution histogram ({fio bucket index: count}, latencies in ns)."""
    native: dict[int, int] = {}
    zero = 0
    for index, count in counts.items():
        if count <= 0:
            continue
        key = _native_index(index, schema)
        if key is None:
            zero += count
            continue
        native[key] = native.get(key, 0) + count
    while len(native) > max_buckets and schema > MIN_SCHEMA:
        schema, native = schema - 1, halved(native)
    return NativeBuckets(schema, ZERO_THRESHOLD, zero, *_spans_and_deltas(native))


@functools.cache
def _native_index(index: int, schema: int) -> int | None:
    """The native bucket of a high-resolution bucket's midpoint (None: the zero bucket). Remembered: a probe's
    few hundred indexes are mapped at every protobuf scrape."""
    seconds = bucket_midpoint(index) / 1e9
    return None if seconds <= ZERO_THRESHOLD else bucket_of(seconds, schema)


def halved(native: Mapping[int, int]) -> dict[int, int]:
    """The same counts one schema lower: buckets 2j-1 and 2j of schema s make bucket j of schema s-1."""
    merged: dict[int, int] = {}
    for index, count in native.items():
        key = (index + 1) >> 1
        merged[key] = merged.get(key, 0) + count
    return merged


def _spans_and_deltas(native: Mapping[int, int]) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    if not native:
        return ((0, 0),), ()  # a no-op span: an empty native histogram, not a classic one
    spans: list[list[int]] = []
    deltas: list[int] = []
    previous_index, previous_count = 0, 0
    for index in sorted(native):
        gap = index - previous_index - 1
        if spans and gap <= GAP_FILL:
            for _ in range(gap):  # empty buckets inside the span
                deltas.append(-previous_count)
                previous_count = 0
            spans[-1][1] += gap + 1
        else:
            spans.append([index if not spans else gap, 1])
        deltas.append(native[index] - previous_count)
        previous_index, previous_count = index, native[index]
    return tuple((offset, length) for offset, length in spans), tuple(deltas)
