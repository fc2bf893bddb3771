"""`volprobe compare` on native histograms: the query API's JSON read as hostile, one bucket layout common to
every period of both sides (sparse buckets, mixed schemas, the zero bucket), the choice between native and
classic, and the reports saying which."""

from __future__ import annotations

import http.server
import itertools
import json
import math
import subprocess
import threading
import time
from collections.abc import Iterator
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from volprobe import native as exporter_native
from volprobe.compare import command, native, source, verdict

from .support.harness import FIXTURES, MIB, volprobe_command, wait_until
from .support.verdicts import verdicts_consistent_with

ZERO = 2.0**-128  # the exporter's zero threshold


# -- the API's JSON, as Prometheus writes it ---------------------------------------------------------------------


def go_float(value: float) -> str:
    """A float as Prometheus' JSON writes it (jsonutil.MarshalFloat: shortest digits, 'e' below 1e-6)."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value != 0 and (abs(value) < 1e-6 or abs(value) >= 1e21):
        return repr(value)
    return format(Decimal(repr(value)), "f")


def histogram_json(counts: dict[int, float], schema: int = 7, zero: float = 0.0, threshold: float = ZERO) -> dict:
    """{bucket index: count} at `schema` (and a zero bucket) as the JSON of one native histogram."""
    buckets = []
    if zero:
        buckets.append([3, go_float(-threshold), go_float(threshold), go_float(zero)])
    for index in sorted(counts):
        if counts[index]:
            lower = exporter_native.upper_bound(index - 1, schema)
            upper = exporter_native.upper_bound(index, schema)
            buckets.append([0, go_float(lower), go_float(upper), go_float(counts[index])])
    total = zero + sum(counts.values())
    body: dict = {"count": go_float(total), "sum": go_float(0.001 * total)}
    if buckets:  # left out when all are empty, as Prometheus does
        body["buckets"] = buckets
    return body


def native_histogram(counts: dict[int, float], schema: int = 7, zero: float = 0.0) -> native.NativeHistogram:
    return native.parse_histogram(histogram_json(counts, schema, zero))


def around(value: float, schema: int) -> int:
    return exporter_native.bucket_of(value, schema)


# -- parsing -----------------------------------------------------------------------------------------------------


def real_answer(name: str) -> list[native.Series]:
    """A real answer of Prometheus 3.16 (exporter/tests/fixtures/compare/README says how it was made)."""
    return native.parse_matrix(json.loads((FIXTURES / "compare" / name).read_text())["data"]["result"])


def test_a_range_query_answer_of_prometheus_3_is_read_bucket_for_bucket():
    ((labels, points),) = real_answer("native-range.json")
    assert labels == {} and len(points) == 3  # sum() keeps no label; one point per step
    assert [t for t, _ in points] == pytest.approx([points[0][0] + 10 * i for i in range(3)])
    for _, histogram in points:
        # increase() extrapolates to the window's edges: counts are fractions, their total the histogram's count.
        assert sum(b.count for b in histogram.buckets) == pytest.approx(histogram.count)
        for bucket in histogram.buckets:
            assert bucket.upper / bucket.lower == pytest.approx(2 ** (1 / 128), rel=1e-12)  # the exporter's schema 7
            index = exporter_native.bucket_of(bucket.upper, 7)
            assert bucket.upper == pytest.approx(exporter_native.upper_bound(index, 7), rel=1e-15)
    bounds = native.layout(h for _, h in points)
    for _, histogram in points:
        converted = native.to_histogram([histogram], bounds)
        assert converted.total == pytest.approx(histogram.count)
        assert max(b / a for a, b in itertools.pairwise(bounds[:-1])) > 1.0055, "gaps between populated buckets"


def test_the_same_probes_at_two_schemas_are_read_at_the_coarser_one_where_it_has_buckets():
    """Prometheus lowered the schema of one job's copy (native_histogram_bucket_limit: 8) to 0, buckets x2 wide:
    laid out together, the schema-0 bounds are the layout around the probes' latencies, and each copy's
    quantiles lie in the same bucket."""
    series = {labels["job"]: points for labels, points in real_answer("native-two-schemas.json")}
    assert set(series) == {"volprobe", "coarse"}
    coarse = [b for _, h in series["coarse"] for b in h.buckets]
    assert all(b.upper / b.lower == 2 for b in coarse)  # schema 0: powers of two
    bounds = native.layout(h for points in series.values() for _, h in points)
    low, high = min(b.lower for b in coarse), max(b.upper for b in coarse)
    inside = [b for b in bounds if low <= b <= high]
    assert inside == [2.0**e for e in range(round(math.log2(low)), round(math.log2(high)) + 1)]
    for (_, fine), (_, rough) in zip(series["volprobe"], series["coarse"], strict=True):
        a, b = native.to_histogram([fine], bounds), native.to_histogram([rough], bounds)
        assert a.total == pytest.approx(fine.count) and b.total == pytest.approx(rough.count)
        for q in (0.5, 0.9):
            fine_q, rough_q = verdict.quantile(a, q), verdict.quantile(b, q)
            assert (fine_q.lower, fine_q.upper) == (rough_q.lower, rough_q.upper), q
            assert fine_q.upper / fine_q.lower == 2


def test_a_histogram_is_read_with_its_zero_bucket_and_without_its_empty_ones():
    h = native_histogram({around(0.001, 7): 12.5, around(0.0011, 7): 3}, zero=2)
    assert h.count == 17.5
    assert [b.count for b in h.buckets] == [2, 12.5, 3]
    assert h.buckets[0].lower == -ZERO and h.buckets[0].upper == ZERO
    empty = native.parse_histogram({"count": "0", "sum": "0"})
    assert empty.count == 0 and empty.buckets == ()
    zeros = native.parse_histogram({"count": "0", "sum": "0", "buckets": [[0, "0.001", "0.002", "0"]]})
    assert zeros.buckets == (), "an empty bucket holds nothing to place"


def test_a_matrix_keeps_series_apart_and_float_series_have_no_histograms():
    result = [
        {"metric": {"job": "a"}, "histograms": [[1700000000, histogram_json({10: 1})], [1700000060.5, {"count": "0"}]]},
        {"metric": {"job": "b"}, "values": [[1700000000, "3"]]},
    ]
    parsed = native.parse_matrix(result)
    assert [labels for labels, _ in parsed] == [{"job": "a"}, {"job": "b"}]
    assert [t for t, _ in parsed[0][1]] == [1700000000.0, 1700000060.5]
    assert parsed[1][1] == []


GOOD = histogram_json({around(0.001, 7): 5})


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ({"not": "a list"}, "not a list of series"),
        (["a series"], "is not an object"),
        ([{"metric": ["x"]}], "labels"),
        ([{"metric": {"a": 1}}], "labels"),
        ([{"metric": {}, "histograms": {}}], "is not a list"),
        ([{"metric": {}, "histograms": [[1700000000]]}], "not [time, histogram]"),
        ([{"metric": {}, "histograms": [["1700000000", GOOD]]}], "a sample's time"),
        ([{"metric": {}, "histograms": [[math.nan, GOOD]]}], "a sample's time"),
        ([{"metric": {}, "histograms": [[True, GOOD]]}], "a sample's time"),
        ([{"metric": {}, "histograms": [[1, "12"]]}], "is not an object"),
    ],
)
def test_a_malformed_matrix_is_refused_with_what_is_wrong(result, message):
    with pytest.raises(native.MalformedHistogram, match=message.replace("[", r"\[")):
        native.parse_matrix(result)


@pytest.mark.parametrize(
    ("histogram", "message"),
    [
        ({"sum": "1"}, "count: None is not a number"),
        ({"count": "many"}, "count: 'many' is not a number"),
        ({"count": True}, "count: True is not a number"),
        ({"count": "NaN"}, "count: nan"),
        ({"count": "-3"}, "count: -3.0"),
        ({"count": "+Inf"}, "count: inf"),
        ({"count": "1", "buckets": "[0, 1, 2, 3]"}, "buckets: .* is not a list"),
        ({"count": "1", "buckets": [[0, "0.001", "0.002"]]}, r"is not \[rule, lower, upper, count\]"),
        ({"count": "1", "buckets": [{"lower": "0.001"}]}, r"is not \[rule, lower, upper, count\]"),
        ({"count": "1", "buckets": [[7, "0.001", "0.002", "1"]]}, "boundary rule: 7"),
        ({"count": "1", "buckets": [["0", "0.001", "0.002", "1"]]}, "boundary rule: '0'"),
        ({"count": "1", "buckets": [[False, "0.001", "0.002", "1"]]}, "boundary rule: False"),
        ({"count": "1", "buckets": [[0, "0.002", "0.001", "1"]]}, "bounds: 0.002 > 0.001"),
        ({"count": "1", "buckets": [[0, "NaN", "0.001", "1"]]}, "bounds: nan"),
        ({"count": "1", "buckets": [[0, "0.001", None, "1"]]}, "upper bound: None"),
        ({"count": "1", "buckets": [[0, "0.001", "0.002", "-1"]]}, "bucket's count: -1.0"),
        ({"count": "1", "buckets": [[0, "0.001", "0.002", "Inf"]]}, "bucket's count: inf"),
        ({"count": "1", "buckets": [[0, "0.001", "0.002", ["1"]]]}, "bucket's count: \\['1'\\]"),
        ({"count": "1", "buckets": [[1, "-0.002", "-0.001", "1"]]}, "negative values"),
        (
            {"count": "2", "buckets": [[0, "0.001", "0.003", "1"], [0, "0.002", "0.004", "1"]]},
            "overlapping buckets",
        ),
    ],
)
def test_a_malformed_histogram_is_refused_with_what_is_wrong(histogram, message):
    with pytest.raises(native.MalformedHistogram, match=message):
        native.parse_histogram(histogram)


# -- the common layout --------------------------------------------------------------------------------------------


def test_one_histogram_keeps_its_own_buckets_and_counts():
    index = around(0.001, 7)
    h = native_histogram({index: 10, index + 1: 20, index + 5: 1})
    bounds = native.layout([h])
    upper = [exporter_native.upper_bound(i, 7) for i in (index - 1, index, index + 1, index + 4, index + 5)]
    assert bounds == (*upper, math.inf)  # the gap between index + 1 and index + 5 stays one empty bucket
    assert native.to_histogram([h], bounds).counts == (0, 10, 20, 0, 1, 0)


def test_sparse_periods_share_the_union_of_their_boundaries():
    index = around(0.001, 7)
    first, second = native_histogram({index: 4}), native_histogram({index + 3: 6})
    bounds = native.layout([first, second])
    assert len(bounds) == 5  # (0, lower1], bucket 1, the gap, bucket 2, (upper2, +Inf]
    a, b = native.to_histogram([first], bounds), native.to_histogram([second], bounds)
    assert a.counts == (0, 4, 0, 0, 0) and b.counts == (0, 0, 0, 6, 0)
    assert (a + b).total == 10


def test_mixed_schemas_keep_the_coarser_bounds_only_where_the_coarser_has_buckets():
    """A period at schema 6 (the exporter halved it, or Prometheus lowered it to add histograms up) beside one at
    schema 7: where both have buckets the layout is schema 6's, elsewhere schema 7's; every bucket of each
    period lies whole in one of the layout's, so no count is split or moved across a bound."""
    low = around(0.001, 7)
    fine = native_histogram({low + i: 1 + i for i in range(40)}, schema=7)
    coarse_low = around(0.00105, 6)
    coarse = native_histogram({coarse_low + i: 10 for i in range(5)}, schema=6)
    bounds = native.layout([fine, coarse])
    coarse_bounds = {exporter_native.upper_bound(coarse_low + i, 6) for i in range(-1, 5)}
    assert coarse_bounds <= set(bounds)
    inside = [b for b in bounds if min(coarse_bounds) < b < max(coarse_bounds)]
    assert set(inside) <= coarse_bounds, "no schema-7 bound inside the schema-6 buckets"
    finer = [b for b in bounds if b < min(coarse_bounds) * 0.999 and b > 0.001]
    assert finer and all(b / a == pytest.approx(2 ** (1 / 128)) for a, b in itertools.pairwise(finer))
    for h in (fine, coarse):
        converted = native.to_histogram([h], bounds)
        assert converted.total == pytest.approx(sum(b.count for b in h.buckets))
        for bucket in h.buckets:  # lies whole between two neighbouring bounds
            i = next(i for i, bound in enumerate(bounds) if bound >= bucket.upper * (1 - 1e-12))
            assert i == 0 or bounds[i - 1] <= bucket.lower * (1 + 1e-12)
    # Quantiles of the whole span are taken in the common layout, both sides alike.
    whole = verdict.total([native.to_histogram([fine], bounds), native.to_histogram([coarse], bounds)])
    p50 = verdict.quantile(whole, 0.5)
    assert p50.lower < p50.estimate <= p50.upper and p50.upper / p50.lower <= 2 ** (1 / 64) * (1 + 1e-12)


def test_schema_lowered_twice_and_negative_schemas_nest_too():
    histograms = [native_histogram({around(0.002, s) + i: 1 for i in range(3)}, schema=s) for s in (7, 5, 3, 0, -2)]
    bounds = native.layout(histograms)
    for h in histograms:
        assert native.to_histogram([h], bounds).total == 3
    # Around 2 ms the coarsest (schema -2: x16 buckets) holds everything: its bounds are the only ones there.
    coarse = [exporter_native.upper_bound(around(0.002, -2) + i, -2) for i in range(-1, 3)]
    assert [b for b in bounds if coarse[0] <= b <= coarse[-1]] == pytest.approx(coarse)


def test_the_zero_bucket_is_counted_below_the_lowest_bound():
    index = around(0.001, 7)
    h = native_histogram({index: 8}, zero=2)
    bounds = native.layout([h])
    assert bounds[0] == ZERO
    assert native.to_histogram([h], bounds).counts == (2, 0, 8, 0)
    assert verdict.quantile(native.to_histogram([h], bounds), 0.1).upper == ZERO
    # A wider zero bucket (another exporter's threshold, or Prometheus' widening when adding up) swallows the
    # bounds inside it.
    wide = native.parse_histogram(
        {"count": "3", "buckets": [[3, "-0.0015", "0.0015", "1"], [0, "0.0015", "0.002", "2"]]}
    )
    bounds = native.layout([h, wide])
    assert bounds[:2] == (0.0015, 0.002)
    assert native.to_histogram([h], bounds).counts[0] == 10
    # Threshold 0: the zero bucket [0, 0] is the first bucket's too.
    exact = native.parse_histogram({"count": "1", "buckets": [[3, "0", "0", "1"]]})
    assert native.to_histogram([exact], native.layout([exact, h])).counts[0] == 1


def test_custom_buckets_from_minus_to_plus_infinity_fit_too():
    """Schema -53 (classic buckets carried as one native histogram): its first bucket starts at -Inf, its last
    ends at +Inf."""
    nhcb = native.parse_histogram(
        {
            "count": "6",
            "buckets": [[0, "-Inf", "0.001", "1"], [0, "0.001", "0.0015", "4"], [0, "0.0015", "+Inf", "1"]],
        }
    )
    bounds = native.layout([nhcb, native_histogram({around(0.0012, 7): 3})])
    assert bounds == (0.001, 0.0015, math.inf)
    assert native.to_histogram([nhcb], bounds).counts == (1, 4, 1)


def test_bounds_an_ulp_apart_are_one_bound():
    a = native.parse_histogram({"count": "1", "buckets": [[0, "0.001", "0.002", "1"]]})
    b = native.parse_histogram({"count": "1", "buckets": [[0, repr(0.002 * (1 + 2e-16)), "0.003", "1"]]})
    bounds = native.layout([a, b])
    assert bounds == (0.001, 0.002, 0.003, math.inf)
    assert native.to_histogram([b], bounds).counts == (0, 0, 1, 0)


def test_no_buckets_at_all_is_one_empty_bucket():
    assert native.layout([]) == (math.inf,)
    empty = native.parse_histogram({"count": "0"})
    assert native.to_histogram([empty], native.layout([empty])).counts == (0.0,)


periods_strategy = st.lists(
    st.tuples(
        st.integers(min_value=-4, max_value=8),  # schema
        st.dictionaries(st.integers(min_value=-40, max_value=40), st.integers(min_value=0, max_value=50), max_size=30),
        st.integers(min_value=0, max_value=3),  # zero bucket count
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(periods_strategy)
def test_any_mix_of_schemas_fits_whole_in_the_common_layout(periods):
    """Periods of any schemas with buckets anywhere around 1 ms: each bucket lies whole in one bucket of the
    layout, no count is lost, no bound of the layout lies strictly inside any populated bucket, and every
    boundary that lies inside none is a bound."""
    histograms = []
    for schema, counts, zero in periods:
        indexes = {around(0.001, schema) + i: n for i, n in counts.items()}
        above_zero = {  # above the zero bucket, as Prometheus keeps them (coarse schemas reach it)
            i: n for i, n in indexes.items() if ZERO < exporter_native.upper_bound(i - 1, schema) < 1e300
        }
        histograms.append(native_histogram(above_zero, schema, zero))
    bounds = native.layout(histograms)
    assert list(bounds) == sorted(set(bounds)) and bounds[-1] == math.inf and bounds[0] > 0
    for h in histograms:
        converted = native.to_histogram([h], bounds)
        assert converted.total == sum(b.count for b in h.buckets)
        for bucket in h.buckets:
            low, high = max(bucket.lower, 0.0), bucket.upper
            assert not any(low * (1 + 1e-12) < b < high * (1 - 1e-12) for b in bounds), (bucket, bounds)
    # And no coarser than that: every boundary inside no bucket is a bound.
    spans = [(max(b.lower, 0.0), b.upper) for h in histograms for b in h.buckets]
    for edge in {edge for span in spans for edge in span if edge > 0}:
        if not any(low * (1 + 1e-12) < edge < high * (1 - 1e-12) for low, high in spans):
            assert edge in bounds, (edge, bounds)


# -- native or classic -------------------------------------------------------------------------------------------

ENDS = [1000.0, 2000.0, 3000.0]


def side(natives: list[list[native.NativeHistogram]] | None, classic: list[dict[float, float]] | None) -> source.Side:
    return source.Side('target="x"', list(ENDS), native=natives, classic=classic)


def classic_periods(probes: list[float]) -> list[dict[float, float]]:
    return [{0.001: n / 4, 0.002: n, math.inf: n} if n else {} for n in probes]


def native_periods(probes: list[float], median: float = 0.0012) -> list[list[native.NativeHistogram]]:
    return [[native_histogram({around(median, 7): n})] if n else [] for n in probes]


def test_auto_reads_native_where_both_sides_have_it_in_one_layout():
    base = side(native_periods([100, 100, 100]), classic_periods([100, 100, 100]))
    cand = side(native_periods([100, 100, 100], median=0.0017), classic_periods([100, 100, 100]))
    assert source.choose(base, cand, "auto") == "native"
    assert base.histograms[0].bounds == cand.histograms[0].bounds
    assert [h.total for h in base.histograms] == [100, 100, 100]
    assert source.choose(base, cand, "classic") == "classic"
    assert base.histograms[0].bounds == (0.001, 0.002, math.inf)


@pytest.mark.parametrize(
    ("base_native", "cand_native", "cand_classic"),
    [
        ([100, 100, 100], None, [100, 100, 100]),  # the candidate's Prometheus took no native histograms
        ([100, 100, 100], [0, 0, 0], [100, 100, 100]),
        ([100, 100, 100], [0, 100, 100], [100, 100, 100]),  # native from the second period on only
    ],
)
def test_auto_falls_back_to_classic_for_both_unless_both_have_native_over_the_span(
    base_native, cand_native, cand_classic
):
    base = side(native_periods(base_native), classic_periods([100, 100, 100]))
    cand = side(native_periods(cand_native) if cand_native else None, classic_periods(cand_classic))
    assert source.choose(base, cand, "auto") == "classic"
    assert base.histograms[0].bounds == cand.histograms[0].bounds == (0.001, 0.002, math.inf)


def test_auto_reads_native_on_a_server_that_keeps_no_classic_buckets_and_gaps_are_gaps_in_both():
    base = side(native_periods([100, 0, 100]), classic_periods([0, 0, 0]))
    cand = side(native_periods([100, 0, 100]), classic_periods([100, 0, 100]))
    assert source.choose(base, cand, "auto") == "native"
    assert [h.total for h in base.histograms] == [100, 0, 100]


def test_native_forced_names_the_side_without_any():
    base = side(native_periods([100, 100, 100]), None)
    cand = side(native_periods([0, 0, 0]), None)
    with pytest.raises(source.SourceError, match=r'candidate \{target="x"\}: no native histogram'):
        source.choose(base, cand, "native")
    with pytest.raises(source.SourceError, match=r'baseline \{target="x"\}: no native histogram'):
        source.choose(cand, base, "native")
    partial = side(native_periods([0, 100, 100]), None)  # forced: what there is is read, the gap warned about
    assert source.choose(base, partial, "native") == "native"
    assert [h.total for h in partial.histograms] == [0, 100, 100]


def test_a_period_of_a_fractional_second_is_a_range_promql_parses():
    assert source.promql_duration(86400.0) == "86400s"
    assert source.promql_duration(7.5) == "7500ms"  # "7.5s" is a parse error in PromQL


# -- the reports -------------------------------------------------------------------------------------------------


def report(kind: str) -> command.Report:
    base = side(native_periods([1000, 1000, 1000]), classic_periods([1000, 1000, 1000]))
    cand = side(native_periods([1000, 1000, 1000], 0.0017), classic_periods([1000, 1000, 1000]))
    for s in (base, cand):
        s.specs = {source.Spec("write", "8192", "1s", "true")}
    assert source.choose(base, cand, kind) == kind
    results = verdict.compare(base.histograms, cand.histograms, quantiles=(0.5,))
    return command.Report(base, cand, "write", 1000.0, 0.1, results, [], False, kind)


@pytest.mark.parametrize("kind", ["native", "classic"])
def test_every_format_says_which_histograms_it_read(kind):
    r = report(kind)
    assert json.loads(command.as_json(r))["histograms"] == kind
    assert f"- histograms: {kind} (" in command.as_markdown(r)
    assert f"histograms: {kind} (" in command.as_text(r)
    assert f"<li>histograms: {kind} (" in command.as_html(r)
    p50 = json.loads(command.as_json(r))["quantiles"][0]
    low, high = p50["candidate"]["bucket"]
    assert high / low == (pytest.approx(2 ** (1 / 128)) if kind == "native" else 2.0)


# -- a hostile server ------------------------------------------------------------------------------------------


@pytest.fixture
def hostile() -> Iterator[tuple[str, list[bytes]]]:
    """An HTTP server answering every request with the next body queued (the last one again when they run out)."""
    bodies: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = bodies.pop(0) if len(bodies) > 1 else bodies[0]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    server.shutdown()
    server.server_close()


def matrix(result: object) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}).encode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[1, 2]", "not a JSON object"),
        (b'{"status": "success"}', "without data.result"),
        (b'{"status": "success", "data": []}', "without data.result"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
        (b"\xff\xfe not json", "/api/v1/query_range"),
        (matrix({"a": 1}), "malformed answer to sum(increase(volprobe_probe_latency_seconds"),
        (
            matrix([{"metric": {}, "histograms": [[1e9, {"count": "1", "buckets": [[0, "1", "0.5", "1"]]}]]}]),
            "bounds: 1.0 > 0.5",
        ),
        (matrix([{"metric": {}, "values": "nope"}]), "malformed answer"),
    ],
)
@pytest.mark.parametrize("histograms", ["auto", "native", "classic"])
def test_a_hostile_server_is_an_error_that_says_what_was_wrong_never_a_traceback(
    hostile, capsys, body, message, histograms
):
    url, bodies = hostile
    bodies.append(body)
    sides = ["--baseline", 'target="a"', "--candidate", 'target="b"']
    status = command.run(["--prometheus", url, *sides, "--histograms", histograms, "--since", "3h", "--period", "1h"])
    err = capsys.readouterr().err
    assert status == command.EXIT_ERROR and "Traceback" not in err, err
    if histograms == "classic" and "volprobe_probe_latency_seconds" in message:
        message = "malformed answer to sum by (le)"
    if histograms == "classic" and "bounds" in message:
        return  # the classic query does not read histograms: some other check refuses the answer
    assert message in err, err


# -- live: the real exporter on lab volumes, scraped by Prometheus 3.16 ----------------------------------------

# Four periods, one more than the fewest a verdict is given on (verdict.MIN_PERIODS): over three, a resample drew
# the same period three times in 3.7% of the draws, more than the interval's 2.5% tail, so the interval's end was
# the noisiest single period's ratio (one CI run: p90 seen 3.4% apart overall, "inconclusive"). Over four, 0.4%.
LIVE_PERIODS = 4
LIVE_PERIOD_S = 15
TOLERANCE = 0.10  # compare's default
# How far an exact median of the exporter's own window may lie outside the span's p50 bucket: the window also holds
# the probes of the seconds before the span and just after it. CI runs saw 1.2% and 2.1% (and test_compare 1.5%).
# The resolution itself is NATIVE_WIDTH's bound on the bucket, not this.
OTHER_PROBES = 0.03
NATIVE_WIDTH = 2 ** (1 / 64)  # two schema-7 buckets, or one of schema 6: the widest a p50 bucket may be here


def native_scrape_config(port: int) -> str:
    return f"""
global: {{scrape_interval: 1s}}
scrape_configs:
  - job_name: volprobe
    scrape_native_histograms: true
    always_scrape_classic_histograms: true
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.lab
@pytest.mark.alone  # .ci/run: after the others
@pytest.mark.xdist_group("lab-latency")  # conftest.py
def test_native_histograms_of_lab_volumes_live(tmp_path, lab_volume, start_exporter, start_prometheus):
    """The real exporter on three lab volumes (8 KiB writes of 1 ms, 1 ms again and 1.45 ms) scraped every second
    by Prometheus 3.16 with native histograms and the classic series; four periods of 15 s compared live.

    auto reads the native histograms: the slow volume is worse, with the ratio the exporter itself measured (its
    exact recent medians) within 5%, and each median within 3% of a p50 bucket at most 1.1% wide (the exact
    medians also hold the probes of the seconds before the span and just after it, and CI runs saw them 1.2% and
    2.1% outside the span's bucket); the twins' median ratio is what the probes saw within 5%, and their median
    and p90 are equivalent where compare's own interval says so (or, where what the probes saw of them differs by
    more than 5%, verdicts that what they saw does not contradict). --histograms classic on the same data reads the
    classic buckets, x1.33 to x1.5 wide there."""
    volumes = {
        "base": lab_volume(size=64 * MIB, write_latency=0.001, calibrate=False).device,
        "twin": lab_volume(size=64 * MIB, write_latency=0.001, calibrate=False).device,
        "slow": lab_volume(size=64 * MIB, write_latency=0.00145, calibrate=False).device,
    }
    # revisit 0: every write is a first touch, so the exporter's exact recent median (by touch) is of them all.
    probes = "interval: 20ms, sync: false, revisit: 0}], allow_raw_writes: true"
    config = tmp_path / "volprobe.yml"
    config.write_text(
        "targets:\n"
        + "".join(
            f"  - {{name: {n}, device: {d}, probes: [{{op: write, block_size: 8KiB, {probes}}}\n"
            for n, d in volumes.items()
        )
    )
    exporter = start_exporter("--config", str(config))
    prometheus = start_prometheus(native_scrape_config(exporter.port), version="3")
    native_count = 'histogram_count(volprobe_probe_latency_seconds{target="%s"})'
    wait_until(lambda: all(prometheus.query(native_count % n) for n in volumes), 30, "native histograms", every=0.5)
    started = time.time()
    end = started + LIVE_PERIODS * LIVE_PERIOD_S

    def scraped_past_end() -> bool:  # every volume's latest sample in Prometheus is from after the span
        found = prometheus.query("timestamp(volprobe_probe_latency_seconds_count)")
        return len(found) == len(volumes) and all(float(item["value"][1]) > end + 1 for item in found)

    wait_until(scraped_past_end, LIVE_PERIODS * LIVE_PERIOD_S + 30, "scrapes past the span's end", every=0.5)
    samples = exporter.metrics()  # the exact quantiles of the same probes (the exporter's 5m window holds them all)
    exact = {
        (labels["target"], labels["quantile"]): v
        for labels, v in samples["volprobe_probe_latency_recent_seconds"]
        if labels["touch"] == "first"
    }

    def live(candidate: str, *args: str) -> tuple[int, dict]:
        command = volprobe_command(
            "compare", "--prometheus", f"http://127.0.0.1:{prometheus.port}",
            "--baseline", 'target="base"', "--candidate", f'target="{candidate}"',
            "--start", str(started), "--end", str(end), "--period", f"{LIVE_PERIOD_S}s", "--format", "json", *args,
        )  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.stdout, result.stderr
        return result.returncode, json.loads(result.stdout)

    status, worse = live("slow")
    assert worse["histograms"] == "native" and worse["periods"] == LIVE_PERIODS, worse
    p50 = worse["quantiles"][0]
    assert p50["verdict"] == "worse" and status == 1, (p50, exact)
    assert p50["ratio"] == pytest.approx(exact[("slow", "0.5")] / exact[("base", "0.5")], rel=0.05), (p50, exact)
    for side, name in (("baseline", "base"), ("candidate", "slow")):
        low, high = p50[side]["bucket"]
        assert low * (1 - OTHER_PROBES) <= exact[(name, "0.5")] <= high * (1 + OTHER_PROBES), (p50, exact)
        assert high / low <= NATIVE_WIDTH * (1 + 1e-9), (side, low, high)

    status, equal = live("twin", "--quantiles", "0.5,0.9")
    assert equal["histograms"] == "native", equal
    # The twins are equal as the lab sets them; what the probes saw of them can still differ by 10% or more
    # (each volume's chain adds its own overhead, uncalibrated). The reference is what the probes saw.
    seen = [exact[("twin", q)] / exact[("base", q)] for q in ("0.5", "0.9")]
    verdicts = [q["verdict"] for q in equal["quantiles"]]
    assert status == verdict.EXIT_STATUS[equal["verdict"]], equal
    said = [(q["verdict"], q["interval"]) for q in equal["quantiles"]]
    # The median's ratio over the span is what the probes saw, within the buckets' 5%.
    assert equal["quantiles"][0]["ratio"] == pytest.approx(seen[0], rel=0.05), (said, seen)
    if all(abs(ratio - 1) <= 0.05 for ratio in seen):
        # Well inside the 10% tolerance, each quantile's verdict is the one its own interval gives: equivalent
        # where the interval lies within the tolerance. Over four periods the interval's ends are about the
        # farthest single period's ratio, and one period can reach past 10% (CI: the twins seen 3.3% apart at p90,
        # and in another run 1% apart at p50, each inconclusive), which compare must then say.
        for result in equal["quantiles"]:
            low, high = result["interval"]
            within = low >= 1 - TOLERANCE and high <= 1 + TOLERANCE
            assert result["verdict"] == ("equivalent" if within else "inconclusive"), (said, seen)
    for said, ratio in zip(verdicts, seen, strict=True):
        # In any case, no quantile's verdict contradicts what the probes saw, within the buckets' 5%.
        assert said in verdicts_consistent_with(ratio, tolerance=TOLERANCE, slack=0.05), (equal, seen)

    status, classic = live("slow", "--histograms", "classic")
    assert classic["histograms"] == "classic" and status in (1, 3), classic
    for side in ("baseline", "candidate"):
        low, high = classic["quantiles"][0][side]["bucket"]
        assert high / low >= 4 / 3 * (1 - 1e-9), (side, low, high)  # the default buckets, x1.33 to x1.5 here
