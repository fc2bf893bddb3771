"""The protobuf exposition: what Prometheus asks for to receive native histograms.

A body is MetricFamily messages (proto/metrics.proto), each preceded by its length as a varint ("delimited").
Every family of the registry is written, each in its type; a classic histogram that carries native buckets
(SeriesFamily.native, filled by the probe collector) gets both in one Histogram message, so a scraper keeps the
classic series, the native one, or both (Prometheus' always_scrape_classic_histograms).

It is chosen by content negotiation only: a scraper must name it in its Accept header, with the highest
weight of what it names (Prometheus does, when scrape_native_histograms is on). Anything else, a malformed or
hostile header included, gets the text formats as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from .native import NativeBuckets

CONTENT_TYPE = "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
MEDIA_TYPE = "application/vnd.google.protobuf"
MESSAGE = "io.prometheus.client.MetricFamily"
MAX_ACCEPT = 4096  # longer headers are not parsed for it: the text formats answer them

# The MetricType of each prometheus_client type (the enum's wire values); UNTYPED for any other.
_TYPES = {
    "counter": 0,
    "gauge": 1,
    "info": 1,
    "stateset": 1,
    "summary": 2,
    "histogram": 4,
    "gaugehistogram": 5,
}
UNTYPED, GAUGE = 3, 1


@functools.cache
def messages() -> Any:
    """The generated message module, imported at the first protobuf scrape: the protobuf library costs about
    3 MiB of RSS, which an exporter no scraper asks protobuf of never pays."""
    from .proto import metrics_pb2

    return metrics_pb2


def wanted(accept: str) -> bool:
    """Whether the Accept header asks for the delimited MetricFamily protobuf before anything else: its media
    range has the highest q-value of the header's (ties go to the first named). Malformed parts are skipped."""
    if len(accept) > MAX_ACCEPT:
        return False
    best_q, best_is_protobuf = -1.0, False
    for part in accept.split(","):
        media, *params = (piece.strip() for piece in part.split(";"))
        options: dict[str, str] = {}
        for param in params:
            key, sep, value = param.partition("=")
            if sep:
                options[key.strip().lower()] = value.strip().strip('"')
        try:
            q = float(options.get("q", "1"))
        except ValueError:
            continue
        if not 0.0 < q <= 1.0:
            continue  # q=0 is "not acceptable"; out of range is malformed
        is_protobuf = (
            media.lower() == MEDIA_TYPE and options.get("proto") == MESSAGE and options.get("encoding") == "delimited"
        )
        if q > best_q:
            best_q, best_is_protobuf = q, is_protobuf
    return best_is_protobuf


def generate(registry: Collector) -> bytes:
    """The delimited MetricFamily messages of every family the registry collects."""
    out = bytearray()
    for metric in registry.collect():
        message = family_message(metric.name, metric.documentation, metric.type, metric.samples, _natives(metric))
        if message is None:
            continue
        data = message.SerializeToString()
        out += varint(len(data))
        out += data
    return bytes(out)


def varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint: 7 bits a byte, least significant first."""
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _natives(metric: Any) -> dict[tuple[tuple[str, str], ...], Callable[[], NativeBuckets]]:
    return getattr(metric, "native", None) or {}


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _labels(message: Any, labels: dict[str, str]) -> None:
    for name, value in sorted(labels.items()):
        message.label.add(name=name, value=value)


def family_message(
    name: str,
    documentation: str,
    typ: str,
    samples: Iterable[Sample],
    natives: dict[tuple[tuple[str, str], ...], Callable[[], NativeBuckets]] | None = None,
) -> Any:
    """One family as a MetricFamily message (None for a type the format cannot carry)."""
    kind = _TYPES.get(typ, UNTYPED)
    family = messages().MetricFamily(help=documentation, type=kind)
    if typ == "counter":
        family.name = f"{name}_total"
        for s in samples:
            if s.name == family.name:
                metric = family.metric.add()
                _labels(metric, s.labels)
                metric.counter.value = s.value
    elif typ in ("histogram", "gaugehistogram", "summary"):
        family.name = name
        _grouped(family, name, typ, samples, natives or {})
    else:  # gauge, info, stateset, unknown: one value per series
        family.name = f"{name}_info" if typ == "info" else name
        for s in samples:
            metric = family.metric.add()
            _labels(metric, s.labels)
            if kind == GAUGE:
                metric.gauge.value = s.value
            else:
                metric.untyped.value = s.value
    return family


def _grouped(
    family: Any,
    name: str,
    typ: str,
    samples: Iterable[Sample],
    natives: dict[tuple[tuple[str, str], ...], Callable[[], NativeBuckets]],
) -> None:
    """Histograms and summaries: their samples gathered by series (labels without le and quantile)."""
    metrics: dict[tuple[tuple[str, str], ...], Any] = {}

    def metric_of(labels: dict[str, str]) -> Any:
        key = _key(labels)
        metric = metrics.get(key)
        if metric is None:
            metric = metrics[key] = family.metric.add()
            _labels(metric, labels)
        return metric

    count_suffix, sum_suffix = ("_gcount", "_gsum") if typ == "gaugehistogram" else ("_count", "_sum")
    for s in samples:
        suffix = s.name[len(name) :]
        if typ == "summary":
            if suffix == "" and "quantile" in s.labels:
                labels = {k: v for k, v in s.labels.items() if k != "quantile"}
                metric_of(labels).summary.quantile.add(quantile=float(s.labels["quantile"]), value=s.value)
            elif suffix == "_count":
                metric_of(s.labels).summary.sample_count = int(s.value)
            elif suffix == "_sum":
                metric_of(s.labels).summary.sample_sum = s.value
            continue
        if suffix == "_bucket" and "le" in s.labels:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            bound = float(s.labels["le"])
            metric_of(labels).histogram.bucket.add(cumulative_count=int(s.value), upper_bound=bound)  # +Inf too
        elif suffix == count_suffix:
            metric_of(s.labels).histogram.sample_count = int(s.value)
        elif suffix == sum_suffix:
            metric_of(s.labels).histogram.sample_sum = s.value
    for key, metric in metrics.items():
        make = natives.get(key)
        if make is not None:
            _native(metric.histogram, make())


def _native(histogram: Any, buckets: NativeBuckets) -> None:
    histogram.schema = buckets.schema
    histogram.zero_threshold = buckets.zero_threshold
    histogram.zero_count = buckets.zero_count
    for offset, length in buckets.spans:
        histogram.positive_span.add(offset=offset, length=length)
    histogram.positive_delta.extend(buckets.deltas)
