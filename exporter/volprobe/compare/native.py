"""Native histograms as the Prometheus query API gives them, made into `verdict.Histogram`s. Pure: the input is
the decoded JSON of /api/v1/query_range, which is read as hostile (a malformed answer is a MalformedHistogram,
never a traceback).

A native histogram in the API's JSON (Prometheus 3: util/jsonutil.MarshalHistogram):

    {"count": "42", "sum": "0.05", "buckets": [[3, "-2.9e-39", "2.9e-39", "1"], [0, "0.00099", "0.001", "12"]]}

each bucket [boundary rule, lower, upper, count], rule 0 for (lower, upper] (the positive buckets), 3 for the
zero bucket [-threshold, threshold]; empty buckets are left out. The buckets are sparse and their layout moves:
each period has its own populated buckets, maybe another schema (the exporter halves it above 512 buckets,
Prometheus lowers it to add histograms up), maybe custom bounds (schema -53, whose first bucket starts at -Inf
and last ends at +Inf). `layout` makes one set of bounds that every bucket of every period fits in whole, and
`to_histogram` counts each period's buckets in it; quantiles are then read from one layout, as for the classic
buckets, at the finest resolution all periods allow.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .verdict import Histogram

RULES = (0, 1, 2, 3)  # lower exclusive/upper inclusive, lower inclusive/upper exclusive, both open, both closed
SAME = 1e-9  # bounds this close (relative) are one: another server's arithmetic may be an ulp off Prometheus'


class MalformedHistogram(ValueError):
    """The JSON is not a native histogram, or not one of latencies."""


@dataclass(frozen=True)
class Bucket:
    lower: float
    upper: float
    count: float


@dataclass(frozen=True)
class NativeHistogram:
    count: float
    buckets: tuple[Bucket, ...]  # populated buckets, ascending


Series = tuple[dict[str, str], list[tuple[float, NativeHistogram]]]


def _number(value: object, what: str) -> float:
    """A float from the API's JSON: a string ("1.5", "+Inf", "NaN") as Prometheus writes them, or a number."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise MalformedHistogram(f"{what}: {_short(value)} is not a number")
    try:
        return float(value)
    except ValueError:
        raise MalformedHistogram(f"{what}: {_short(value)} is not a number") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_histogram(value: object) -> NativeHistogram:
    """One histogram object of the API's JSON; its buckets checked: numbers, lower <= upper, a finite count >= 0,
    no two overlapping, none of negative values (latencies are not)."""
    if not isinstance(value, dict):
        raise MalformedHistogram(f"a histogram: {_short(value)} is not an object")
    count = _number(value.get("count"), "a histogram's count")
    if not math.isfinite(count) or count < 0:
        raise MalformedHistogram(f"a histogram's count: {count!r}")
    raw = value.get("buckets", [])  # left out when every bucket is empty
    if not isinstance(raw, list):
        raise MalformedHistogram(f"a histogram's buckets: {_short(raw)} is not a list")
    buckets = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 4:
            raise MalformedHistogram(f"a bucket: {_short(item)} is not [rule, lower, upper, count]")
        rule, lower, upper, n = item
        if isinstance(rule, bool) or rule not in RULES:
            raise MalformedHistogram(f"a bucket's boundary rule: {_short(rule)} (0 to 3)")
        bucket = Bucket(
            _number(lower, "a bucket's lower bound"),
            _number(upper, "a bucket's upper bound"),
            _number(n, "a bucket's count"),
        )
        if not bucket.lower <= bucket.upper:  # NaN too
            raise MalformedHistogram(f"a bucket's bounds: {bucket.lower!r} > {bucket.upper!r}")
        if not math.isfinite(bucket.count) or bucket.count < 0:
            raise MalformedHistogram(f"a bucket's count: {bucket.count!r}")
        if bucket.upper < 0 and bucket.count > 0:
            raise MalformedHistogram(f"a bucket of negative values ({bucket.lower!r}, {bucket.upper!r}): no latency")
        if bucket.count > 0:
            buckets.append(bucket)
    buckets.sort(key=lambda b: (b.upper, b.lower))
    for below, above in itertools.pairwise(buckets):
        if above.lower < below.upper - SAME * abs(below.upper):
            raise MalformedHistogram(
                f"overlapping buckets ({below.lower!r}, {below.upper!r}] and ({above.lower!r}, {above.upper!r}]"
            )
    return NativeHistogram(count, tuple(buckets))


def _time(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MalformedHistogram(f"a sample's time: {_short(value)}")
    return float(value)


def parse_matrix(result: object) -> list[Series]:
    """The `result` of a range query: per series, its labels and its (time, histogram) points. Series with float
    samples only ("values", not "histograms": a classic series under the same name) have no points here."""
    if not isinstance(result, list):
        raise MalformedHistogram(f"the result: {_short(result)} is not a list of series")
    found: list[Series] = []
    for item in result:
        if not isinstance(item, dict):
            raise MalformedHistogram(f"a series: {_short(item)} is not an object")
        labels = item.get("metric", {})
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise MalformedHistogram(f"a series' labels: {_short(labels)}")
        points = item.get("histograms", [])
        if not isinstance(points, list):
            raise MalformedHistogram(f"a series' histograms: {_short(points)} is not a list")
        parsed = []
        for point in points:
            if not isinstance(point, list) or len(point) != 2:
                raise MalformedHistogram(f"a histogram sample: {_short(point)} is not [time, histogram]")
            parsed.append((_time(point[0]), parse_histogram(point[1])))
        found.append((labels, parsed))
    return found


def _edges(bucket: Bucket) -> tuple[float, float]:
    """A bucket's span on the latency axis: one reaching 0 or below (the zero bucket [-threshold, threshold], a
    custom first bucket from -Inf) starts at 0, where verdict.Histogram's first bucket starts."""
    return max(bucket.lower, 0.0), max(bucket.upper, 0.0)


def _snap(values: Iterable[float]) -> dict[float, float]:
    """Each value to the first of the values within SAME (relative) of it, ascending."""
    snapped: dict[float, float] = {}
    anchor = math.nan
    for value in sorted(set(values)):
        if math.isnan(anchor) or math.isinf(value) or value - anchor > SAME * abs(value):
            anchor = value
        snapped[value] = anchor
    return snapped


def layout(histograms: Iterable[NativeHistogram]) -> tuple[float, ...]:
    """The bounds common to all these histograms (every period of both sides): their buckets' boundaries, less
    any that lies strictly inside some populated bucket. Ascending, positive, ending with +Inf; each bucket of
    each histogram then lies wholly in one bucket of the layout. Schemas nest (a bucket of schema s-1 is two of
    schema s), so where periods differ in schema the layout has the coarser one's bounds, and only there."""
    spans = [_edges(b) for h in histograms for b in h.buckets]
    snapped = _snap(edge for span in spans for edge in span)
    spans = [(snapped[low], snapped[high]) for low, high in spans]
    # The union of the buckets' open interiors: a boundary inside one of them cannot be a bound.
    interiors: list[list[float]] = []
    for low, high in sorted(spans):
        if low >= high:
            continue  # a zero bucket of threshold 0 has no interior
        if interiors and low < interiors[-1][1]:
            interiors[-1][1] = max(interiors[-1][1], high)
        else:
            interiors.append([low, high])
    starts = [low for low, _ in interiors]
    bounds = []
    for edge in sorted({edge for span in spans for edge in span if edge > 0}):
        i = bisect.bisect_left(starts, edge) - 1  # the last interior starting below the edge
        if i < 0 or edge >= interiors[i][1]:
            bounds.append(edge)
    if not bounds or not math.isinf(bounds[-1]):
        bounds.append(math.inf)
    return tuple(bounds)


def to_histogram(histograms: Sequence[NativeHistogram], bounds: tuple[float, ...]) -> Histogram:
    """These histograms (one period's, of one or more series) added up in `bounds` (from `layout` over them and
    more): each bucket counted whole in the bound's bucket that holds it."""
    counts = [0.0] * len(bounds)
    for histogram in histograms:
        for bucket in histogram.buckets:
            low, high = (_near(bounds, edge) for edge in _edges(bucket))
            i = bisect.bisect_left(bounds, high)  # the first bound at or above the bucket's upper edge
            if i == len(bounds) or (i > 0 and bounds[i - 1] > low):
                raise ValueError(f"bucket ({bucket.lower!r}, {bucket.upper!r}] straddles a bound of the layout")
            counts[i] += bucket.count
    return Histogram(bounds, tuple(counts))


def _near(bounds: Sequence[float], edge: float) -> float:
    """The bound within SAME of an edge (as `layout` made it one), else the edge."""
    if math.isinf(edge):
        return edge
    i = bisect.bisect_left(bounds, edge)
    for bound in bounds[max(0, i - 1) : i + 1]:
        if abs(bound - edge) <= SAME * abs(edge):
            return bound
    return edge
