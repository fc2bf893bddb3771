"""Latency statistics: a log-linear high-resolution histogram, a sliding window of it, Prometheus buckets.

The high-resolution histogram follows the scheme of fio's stat.h: values (nanoseconds) below 128 have a
bucket each; above, every power-of-two range [2^m, 2^(m+1)) is split into 64 equal buckets. A bucket is
reported by its midpoint, so any value it stands for is off by at most half a bucket width:

    relative error <= (2^(m-6) / 2) / 2^m = 1/128 = 0.78 %

Quantiles use the nearest-rank definition (the ceil(q*n)-th smallest sample). The bucket holding that rank
holds the exact order statistic, so a reported quantile is within RELATIVE_ERROR of the exact one.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

PLAT_BITS = 6
PLAT_VAL = 1 << PLAT_BITS
RELATIVE_ERROR = 1 / (2 * PLAT_VAL)

SUMMARY_QUANTILES = (0.5, 0.9, 0.99, 0.999)
TOUCHES = ("first", "repeat")

# 26 bounds from 10 us to 20 s, dense where SSD and NVMe volumes answer: six per decade (x1.67 at most) from
# 10 us to 10 ms, then sparser towards stalls. With the touch split kept off the histogram, a read and a write
# probe export half the series they did with LEGACY_BUCKETS; bench/series measures what it costs in accuracy.
DEFAULT_BUCKETS: tuple[float, ...] = (
    *(float(f"{m}e-6") for m in (10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750)),
    *(float(f"{m}e-3") for m in (1, 1.5, 2, 3, 5, 7.5, 10, 25, 50, 100, 250)),
    1.0,
    5.0,
    20.0,
)
# The bounds volprobe had first: seven steps per decade (the widest x1.5), 45 buckets; `defaults.buckets: legacy`.
LEGACY_BUCKETS: tuple[float, ...] = (
    *(float(f"{mantissa}e{exponent}") for exponent in range(-5, 1) for mantissa in (1, 1.5, 2, 3, 4, 5, 7)),
    10.0,
    15.0,
    20.0,
)
MAX_BUCKETS = 50


def bucket_index(ns: int) -> int:
    """Index of the high-resolution bucket holding `ns` nanoseconds."""
    if ns < 2 * PLAT_VAL:
        return max(ns, 0)
    shift = ns.bit_length() - 1 - PLAT_BITS
    return (shift + 1) * PLAT_VAL + ((ns >> shift) - PLAT_VAL)


def bucket_midpoint(index: int) -> float:
    """The value (nanoseconds) a bucket stands for: the middle of the integers it covers."""
    if index < 2 * PLAT_VAL:
        return float(index)
    shift = index // PLAT_VAL - 1
    low = (PLAT_VAL + index % PLAT_VAL) << shift
    return low + ((1 << shift) - 1) / 2


def quantiles_from_counts(counts: Mapping[int, int], qs: Sequence[float]) -> list[float]:
    """Nearest-rank quantiles, in nanoseconds, of a sparse {bucket index: count} histogram (NaN if empty)."""
    total = sum(counts.values())
    if total == 0:
        return [math.nan for _ in qs]
    ranks = [max(1, math.ceil(q * total)) for q in qs]
    order = sorted(range(len(qs)), key=lambda i: ranks[i])
    result = [math.nan] * len(qs)
    seen = 0
    pending = iter(order)
    current = next(pending, None)
    for index in sorted(counts):
        seen += counts[index]
        while current is not None and ranks[current] <= seen:
            result[current] = bucket_midpoint(index)
            current = next(pending, None)
        if current is None:
            break
    return result


class SlidingHistogram:
    """High-resolution histogram over the last `window` seconds, kept as `slices` rotating sparse parts.

    The window covers between (slices-1)/slices and all of `window`: old samples leave one slice at a time.
    Their sum is kept as they come and go, so a scrape reads it instead of adding up every slice again.
    """

    def __init__(self, window_s: float, slices: int = 10) -> None:
        self.window_ns = int(window_s * 1e9)
        self.slices = slices
        self.slice_ns = max(1, self.window_ns // slices)
        self._parts: deque[tuple[int, dict[int, int]]] = deque()
        self._total: dict[int, int] = {}  # the sum of the parts

    def add(self, ns: int, now_ns: int) -> None:
        self.add_index(bucket_index(ns), now_ns)

    def add_index(self, index: int, now_ns: int) -> None:
        """add() of a value whose bucket index is known."""
        number = now_ns // self.slice_ns
        if not self._parts or self._parts[-1][0] != number:
            self._parts.append((number, {}))
            self._expire(number)
        counts = self._parts[-1][1]
        counts[index] = counts.get(index, 0) + 1
        self._total[index] = self._total.get(index, 0) + 1

    def _expire(self, number: int) -> None:
        """Take the parts that slice `number` leaves out of the window off the sum."""
        total = self._total
        while self._parts and self._parts[0][0] <= number - self.slices:
            for index, count in self._parts.popleft()[1].items():
                left = total[index] - count
                if left:
                    total[index] = left
                else:
                    del total[index]

    def counts(self, now_ns: int) -> dict[int, int]:
        """The window's counts at now_ns (a copy)."""
        self._expire(now_ns // self.slice_ns)
        return dict(self._total)


def validate_buckets(bounds: Iterable[float]) -> tuple[float, ...]:
    result = tuple(float(b) for b in bounds)
    if not result:
        raise ValueError("needs at least one bucket")
    if len(result) > MAX_BUCKETS:
        raise ValueError(f"{len(result)} buckets; at most {MAX_BUCKETS} keep the series count sane")
    if any(b <= 0 for b in result) or any(a >= b for a, b in itertools.pairwise(result)):
        raise ValueError("bucket bounds must be positive and strictly increasing")
    return result


@dataclass
class TouchSeries:
    """Everything recorded for one (probe, touch) pair."""

    bucket_counts: list[int]
    window: SlidingHistogram
    count: int = 0
    sum_ns: int = 0
    lifetime: dict[int, int] = field(default_factory=dict)  # high-resolution counts since the start, sparse


@dataclass(frozen=True)
class LatencySnapshot:
    """A consistent copy of one touch's statistics, taken at scrape time. Scrapes may share one (see
    ProbeStats.snapshot): nothing may change it, its lists included."""

    bounds: tuple[float, ...]  # upper bounds in seconds, ending with +Inf
    cumulative: list[int]  # the count of samples <= each bound
    count: int
    sum_seconds: float
    quantiles: list[float]  # seconds, for SUMMARY_QUANTILES, NaN when the window is empty
    window_count: int
    lifetime: dict[int, int] = field(default_factory=dict)  # a copy: high-resolution counts since the start

    @property
    def buckets(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs."""
        return list(zip(self.bounds, self.cumulative, strict=True))


@dataclass
class ProbeStats:
    """Latency statistics of one probe, split by touch; recorded by the worker, read by scrapes.

    record() only queues the sample: folding into the histograms happens in batches (every PENDING_LIMIT
    samples, and at each scrape), so the worker's per-probe path stays short and warm.

    A snapshot is kept until a new sample lands or the window moves on a slice: scrapes that come faster than
    the probes (several Prometheus servers, a person's curl) read it again instead of recomputing it.
    """

    window_s: float
    buckets: tuple[float, ...] = DEFAULT_BUCKETS
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    PENDING_LIMIT = 64
    FLOOR_GROUP = 10

    def __post_init__(self) -> None:
        self._bounds_ns = [round(b * 1e9) for b in self.buckets]
        self._series = {
            touch: TouchSeries([0] * (len(self.buckets) + 1), SlidingHistogram(self.window_s)) for touch in TOUCHES
        }
        self._pending: deque[tuple[int, str, int]] = deque()  # append and popleft are thread-safe
        self._group: list[int] = []
        self.floor_s: float | None = None  # lowest median of FLOOR_GROUP consecutive probes: unloaded latency
        # touch -> ((samples, window slice) it was taken at, the snapshot): all a snapshot depends on
        self._snapshots: dict[str, tuple[tuple[int, int], LatencySnapshot]] = {}

    def record(self, latency_ns: int, touch: str, now_ns: int) -> None:
        self._pending.append((latency_ns, touch, now_ns))
        if len(self._pending) >= self.PENDING_LIMIT:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Move queued samples into the histograms; the caller holds the lock."""
        pending, bounds, series = self._pending, self._bounds_ns, self._series
        while pending:
            latency_ns, touch, now_ns = pending.popleft()
            target = series[touch]
            target.bucket_counts[bisect.bisect_left(bounds, latency_ns)] += 1
            target.count += 1
            target.sum_ns += latency_ns
            index = bucket_index(latency_ns)
            target.lifetime[index] = target.lifetime.get(index, 0) + 1
            target.window.add_index(index, now_ns)
            self._group.append(latency_ns)
            if len(self._group) == self.FLOOR_GROUP:
                median = sorted(self._group)[self.FLOOR_GROUP // 2] / 1e9
                self.floor_s = median if self.floor_s is None else min(self.floor_s, median)
                self._group.clear()

    def floor(self) -> float | None:
        """The unloaded latency: the lowest median of FLOOR_GROUP consecutive probes seen so far."""
        with self._lock:
            self._fold()
            return self.floor_s

    def snapshot(self, touch: str, now_ns: int) -> LatencySnapshot:
        series = self._series[touch]
        with self._lock:
            self._fold()
            taken_at = (series.count, now_ns // series.window.slice_ns)
            kept = self._snapshots.get(touch)
            if kept is not None and kept[0] == taken_at:
                return kept[1]
            counts = list(series.bucket_counts)
            total, sum_ns = series.count, series.sum_ns
            window_counts = series.window.counts(now_ns)
            lifetime = dict(series.lifetime)
        quantiles = [q / 1e9 for q in quantiles_from_counts(window_counts, SUMMARY_QUANTILES)]
        snap = LatencySnapshot(
            (*self.buckets, math.inf),
            list(itertools.accumulate(counts)),
            total,
            sum_ns / 1e9,
            quantiles,
            sum(window_counts.values()),
            lifetime,
        )
        self._snapshots[touch] = (taken_at, snap)  # two scrapes at once: the later one's stays, both are right
        return snap
