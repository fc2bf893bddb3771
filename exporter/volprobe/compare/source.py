"""What `volprobe compare` reads: the Prometheus HTTP query API (Prometheus, Thanos, Mimir), /api/v1/query and
/api/v1/query_range only, and the per-period histograms and counters of one side built from it: the latency
histogram's native buckets (Prometheus 3 with scrape_native_histograms), its classic `_bucket` series, or both
until `choose` picks one kind for both sides. The server's answers are checked as they are read: a malformed one
is a SourceError, never a traceback."""

from __future__ import annotations

import base64
import json
import math
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import metrics, ops
from . import native
from .verdict import Histogram

KINDS = ("auto", "native", "classic")  # --histograms


class SourceError(Exception):
    """The server could not be asked, or answered with an error."""


@dataclass(frozen=True)
class Auth:
    bearer_token_file: str | None = None
    username: str | None = None
    password_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False


class PrometheusAPI:
    def __init__(self, url: str, auth: Auth | None = None, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.auth = auth or Auth()
        self.timeout = timeout
        self._context = self._tls() if self.url.startswith("https:") else None

    def _tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.auth.ca_file)
        if self.auth.cert_file:
            context.load_cert_chain(self.auth.cert_file, self.auth.key_file)
        if self.auth.insecure_skip_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.auth.bearer_token_file:
            token = Path(self.auth.bearer_token_file).read_text().strip()
            headers["Authorization"] = f"Bearer {token}"
        elif self.auth.username is not None:
            password = Path(self.auth.password_file).read_text().strip() if self.auth.password_file else ""
            pair = base64.b64encode(f"{self.auth.username}:{password}".encode()).decode()
            headers["Authorization"] = f"Basic {pair}"
        return headers

    def _get(self, path: str, params: dict[str, str]) -> object:
        """The `data.result` of a successful answer, whatever its shape (the callers check it)."""
        form = urllib.parse.urlencode(params).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=form, headers=self._headers(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._context) as response:
                body = json.load(response)
        except urllib.error.HTTPError as err:
            try:
                detail = json.load(err).get("error", "")
            except (ValueError, AttributeError, RecursionError):
                detail = ""
            raise SourceError(f"{self.url}{path}: HTTP {err.code} {detail}".strip()) from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise SourceError(f"{self.url}{path}: {getattr(err, 'reason', err)}") from None
        except RecursionError:  # JSON nested deeper than the parser goes
            raise SourceError(f"{self.url}{path}: an answer nested too deep to be the query API's") from None
        if not isinstance(body, dict):
            raise SourceError(f"{self.url}{path}: the answer is not a JSON object")
        if body.get("status") != "success":
            raise SourceError(f"{self.url}{path}: {body.get('errorType', '')} {body.get('error', '')}".strip())
        data = body.get("data")
        if not isinstance(data, dict) or "result" not in data:
            raise SourceError(f"{self.url}{path}: a successful answer without data.result")
        return data["result"]

    def _malformed(self, path: str, expr: str, err: Exception) -> SourceError:
        return SourceError(f"{self.url}{path}: a malformed answer to {expr}: {err}")

    def query(self, expr: str, at: float) -> list[tuple[dict[str, str], float]]:
        result = self._get("/api/v1/query", {"query": expr, "time": f"{at:.3f}"})
        try:
            return [(_labels(item["metric"]), float(item["value"][1])) for item in _items(result)]
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise self._malformed("/api/v1/query", expr, err) from None

    def query_range(
        self, expr: str, start: float, end: float, step: float
    ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        result = self._get("/api/v1/query_range", params)
        try:
            return [
                (_labels(item["metric"]), [(float(t), float(v)) for t, v in item.get("values", [])])
                for item in _items(result)
            ]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
            raise self._malformed("/api/v1/query_range", expr, err) from None

    def query_range_histograms(self, expr: str, start: float, end: float, step: float) -> list[native.Series]:
        """A range query's native histogram samples ("histograms", not "values"), per series."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        result = self._get("/api/v1/query_range", params)
        try:
            return native.parse_matrix(result)
        except native.MalformedHistogram as err:
            raise self._malformed("/api/v1/query_range", expr, err) from None


def _items(result: object) -> list[dict[str, Any]]:
    if not isinstance(result, list) or not all(isinstance(item, dict) for item in result):
        raise TypeError("the result is not a list of series")
    return result


def _labels(labels: object) -> dict[str, str]:
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise TypeError(f"labels {labels!r:.60}")
    return labels


@dataclass(frozen=True)
class Spec:
    """What was probed: apples are compared with apples only."""

    op: str
    block_size: str
    interval: str
    sync: str

    def __str__(self) -> str:
        return f"{self.op} {self.block_size} bytes every {self.interval}, O_DSYNC {self.sync}"


@dataclass
class Side:
    """One side's periods: histograms and counters, by period end time. `histograms` are those `choose` picked,
    from `native` (each period's native histograms, of every series) or `classic` (each period's {le: cumulative
    count}); None where that kind was not fetched."""

    selector: str
    ends: list[float]
    histograms: list[Histogram] = field(default_factory=list)
    native: list[list[native.NativeHistogram]] | None = None
    classic: list[dict[float, float]] | None = None
    specs: set[Spec] = field(default_factory=set)
    devices: set[tuple[str, str]] = field(default_factory=set)  # (instance, device): names repeat across nodes
    failures: list[float] = field(default_factory=list)
    throttled_seconds: list[float] = field(default_factory=list)
    zero_reads: list[float] = field(default_factory=list)
    first_touch_penalty: list[float] = field(default_factory=list)  # median first / median repeat, per period


def _nearest(ends: list[float], t: float) -> float:
    return min(ends, key=lambda e: abs(e - t))


def _by_time(series: list[tuple[dict[str, str], list[tuple[float, float]]]], ends: list[float]) -> list[float]:
    """A summed value per period end (0 where no series had a point)."""
    totals = dict.fromkeys(ends, 0.0)
    for _, points in series:
        for t, v in points:
            if not math.isnan(v):
                totals[_nearest(ends, t)] += v
    return [totals[e] for e in ends]


def promql_duration(seconds: float) -> str:
    """A range in PromQL's syntax, which takes whole numbers of a unit only ("7.5s" is a parse error)."""
    return f"{seconds:.0f}s" if seconds == round(seconds) else f"{round(seconds * 1000)}ms"


def fetch(
    api: PrometheusAPI, selector: str, op: str, start: float, end: float, period: float, histograms: str = "auto"
) -> Side:
    """Every period of [start, end] (`period` seconds each, the last one ending at `end`) for one side; the native
    histograms, the classic buckets or both (`histograms` auto: both, for `choose`)."""
    count = max(1, int((end - start) // period))
    first_end = end - (count - 1) * period
    ends = [first_end + i * period for i in range(count)]
    window = promql_duration(period)
    match = f"{selector}, op={json.dumps(op)}"
    side = Side(selector, ends)
    if histograms in ("auto", "native"):
        side.native = [[] for _ in ends]
        expr = f"sum(increase({metrics.PROBE_LATENCY.name}{{{match}}}[{window}]))"
        position = {e: i for i, e in enumerate(ends)}
        for _, samples in api.query_range_histograms(expr, first_end, end, period):
            for t, histogram in samples:
                side.native[position[_nearest(ends, t)]].append(histogram)
    if histograms in ("auto", "classic"):
        buckets = api.query_range(
            f"sum by (le) (increase({metrics.PROBE_LATENCY.bucket}{{{match}}}[{window}]))", first_end, end, period
        )
        cumulative: dict[float, dict[float, float]] = {e: {} for e in ends}
        for labels, points in buckets:
            try:
                le = float(labels["le"])
            except (KeyError, ValueError):
                raise SourceError(f"{selector}: a bucket series without a numeric le: {labels}") from None
            for t, v in points:
                cumulative[_nearest(ends, t)][le] = v
        side.classic = [cumulative[e] for e in ends]
    for labels, _ in api.query(f"max_over_time({metrics.PROBE_INFO.name}{{{match}}}[{end - start:.0f}s])", end):
        side.specs.add(
            Spec(op, labels.get("block_size_bytes", "?"), labels.get("interval", "?"), labels.get("sync", "?"))
        )
        side.devices.add((labels.get("instance", ""), labels.get("device", "")))
    failures = api.query_range(
        f"sum(increase({metrics.PROBE_FAILURES.total}{{{match}}}[{window}]))", first_end, end, period
    )
    side.failures = _by_time(failures, ends)
    if side.devices:
        devices = "|".join(sorted({device for _, device in side.devices if device}))
        throttled = api.query_range(
            f'sum by (instance, device) (increase({metrics.THROTTLE_SECONDS.total}{{device=~"{devices}"}}[{window}]))',
            first_end,
            end,
            period,
        )
        mine = [
            (labels, points)
            for labels, points in throttled
            if (labels.get("instance", ""), labels.get("device", "")) in side.devices
        ]
        side.throttled_seconds = _by_time(mine, ends)
    side.first_touch_penalty = _penalties(api, match, ends, window)
    if not ops.get(op).writes:  # only reads are checked for zeros
        zero = api.query_range(
            f"sum(increase({metrics.PROBE_ZERO_READS.total}{{{selector}}}[{window}]))", first_end, end, period
        )
        side.zero_reads = _by_time(zero, ends)
    return side


def _penalties(api: PrometheusAPI, match: str, ends: list[float], window: str) -> list[float]:
    """Per period: the probes' median on never-touched blocks over their median on blocks touched before (the
    exporter's exact recent medians, averaged over the period); NaN where a period has no repeats or firsts.
    Well above 1, the volume is still warming up: its blocks are slow until first touched."""
    recent = f'{metrics.PROBE_LATENCY_RECENT.name}{{{match}, quantile="0.5", touch="%s"}}'
    expr = f"avg(avg_over_time({recent % 'first'}[{window}])) / avg(avg_over_time({recent % 'repeat'}[{window}]))"
    values = dict.fromkeys(ends, math.nan)
    for _, points in api.query_range(expr, ends[0], ends[-1], ends[1] - ends[0] if len(ends) > 1 else 60):
        for t, v in points:
            values[_nearest(ends, t)] = v
    return [values[e] for e in ends]


def classic_histograms(side: Side) -> list[Histogram]:
    """The side's periods from its classic buckets (one layout throughout, as verdict.Histogram needs)."""
    periods = side.classic or []
    layouts = {tuple(sorted(c)) for c in periods if c}
    if len(layouts) > 1:
        raise SourceError(f"{side.selector}: the bucket layout changed within the span ({len(layouts)} layouts)")
    bounds = layouts.pop() if layouts else (math.inf,)
    return [Histogram.from_cumulative({b: c.get(b, 0.0) for b in bounds}) for c in periods]


def _native_probes(period: list[native.NativeHistogram]) -> float:
    return sum(b.count for h in period for b in h.buckets)


def native_covers(side: Side) -> bool:
    """Native histograms hold this side's probes over the span: some, and in every period whose classic buckets
    have probes (a Prometheus that took native histograms only from some day on falls back to classic)."""
    if not side.native or not any(_native_probes(p) > 0 for p in side.native):
        return False
    classic = side.classic or [{} for _ in side.native]
    return all(
        _native_probes(n) > 0 or max(c.values(), default=0.0) <= 0 for n, c in zip(side.native, classic, strict=True)
    )


def choose(baseline: Side, candidate: Side, wanted: str) -> str:
    """Which histograms both sides are read from ("native" or "classic", `wanted` or, for auto, native where both
    sides have it over the span), with each side's `histograms` set from them. Native histograms of both sides
    share one layout (native.layout), so their quantiles and ratios are read alike."""
    sides = {"baseline": baseline, "candidate": candidate}
    if wanted == "native":
        for name, side in sides.items():
            if not side.native or not any(_native_probes(p) > 0 for p in side.native):
                raise SourceError(
                    f"{name} {{{side.selector}}}: no native histogram of {metrics.PROBE_LATENCY.name} in the span "
                    "(Prometheus 3 takes them with scrape_native_histograms: true; --histograms classic reads the "
                    "classic buckets)"
                )
    kind = (
        "native" if wanted == "native" or (wanted == "auto" and all(map(native_covers, sides.values()))) else "classic"
    )
    if kind == "native":
        bounds = native.layout(h for side in sides.values() for period in side.native or [] for h in period)
        for side in sides.values():
            side.histograms = [native.to_histogram(period, bounds) for period in side.native or []]
    else:
        for side in sides.values():
            side.histograms = classic_histograms(side)
    return kind
