"""The protobuf exposition: what Prometheus asks for to receive native histograms.

A body is MetricFamily messages (proto/metrics.proto), each preceded by its length as a varint ("delimited").
Every family of the registry is written, each in its type; a classic histogram that carries native buckets
(SeriesFamily.native, filled by the probe collector) gets both in one Histogram message, so a scraper keeps the
classic series, the native one, or both (Prometheus' always_scrape_classic_histograms).

It is chosen by content negotiation only: a scraper must name it in its Accept header, with the highest
weight of what it names (Prometheus does, when scrape_native_histograms is on). Anything else, a malformed or
hostile header included, gets the text formats as before.

The messages are encoded here, not by the protobuf library: built message by message through the library, a
scrape of 64 volumes took 4.6 times as long as the OpenMetrics text (bench/series, BENCHMARKS.md). The
encoding is the library's byte for byte (the tests compare the two on every kind of family): proto2, fields in
number order, repeated scalars unpacked. What makes it fast is what makes the text fast (exposition.py): a
series' labels are encoded once and remembered, by its text.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.registry import Collector

from .exposition import SeriesFamily, utf8_text
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
_CACHE_LIMIT = 65536

# Field keys (field number << 3 | wire type: 0 varint, 1 64-bit, 2 length-delimited) of proto/metrics.proto.
_FAMILY_NAME, _FAMILY_HELP, _FAMILY_TYPE, _FAMILY_METRIC = b"\x0a", b"\x12", b"\x18", b"\x22"
_LABEL = b"\x0a"  # Metric.label; LabelPair.name is 0x0a too, LabelPair.value 0x12
_GAUGE, _COUNTER, _SUMMARY, _UNTYPED, _HISTOGRAM = b"\x12", b"\x1a", b"\x22", b"\x2a", b"\x3a"
_VALUE = b"\x09"  # Gauge, Counter, Untyped: value (double, field 1)
_COUNT, _SUM = b"\x08", b"\x11"  # Summary and Histogram: sample_count, sample_sum
_QUANTILE = b"\x1a"  # Summary.quantile; Quantile: quantile 0x09, value 0x11
_BUCKET = b"\x1a"  # Histogram.bucket; Bucket: cumulative_count 0x08, upper_bound 0x11
_SCHEMA, _ZERO_THRESHOLD, _ZERO_COUNT = b"\x28", b"\x31", b"\x38"
_SPAN, _DELTA = b"\x62", b"\x68"  # positive_span (BucketSpan: offset 0x08 sint32, length 0x10), positive_delta
_double = struct.Struct("<d").pack


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
        data = family_bytes(metric)
        if data is not None:
            out += varint(len(data))
            out += data
    return bytes(out)


def varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint: 7 bits a byte, least significant first."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _uint64(n: int) -> bytes:
    return varint(n & 0xFFFFFFFFFFFFFFFF)  # as the library writes a negative one: two's complement


def _zigzag(n: int) -> bytes:
    return varint((n << 1) ^ (n >> 63))


def _field(key: bytes, data: bytes) -> bytes:
    """A length-delimited field: a string, or an embedded message."""
    return key + varint(len(data)) + data


def _string(key: bytes, text: str) -> bytes:
    return _field(key, utf8_text(text).encode("utf-8"))


# A series' labels, encoded (its Metric's label fields): by the sorted pairs, and by the text of a SeriesFamily's
# series, which names them. Emptied when it grows past the limit (a churn of series).
_labels_cache: dict[object, bytes] = {}


def _labels(pairs: tuple[tuple[str, str], ...]) -> bytes:
    found = _labels_cache.get(pairs)
    if found is None:
        if len(_labels_cache) >= _CACHE_LIMIT:
            _labels_cache.clear()
        found = _labels_cache[pairs] = b"".join(
            _field(_LABEL, _string(b"\x0a", name) + _string(b"\x12", value)) for name, value in pairs
        )
    return found


def _series_labels(labels: dict[str, str], text: str | None) -> bytes:
    """A counter's or a gauge's labels, encoded: by its series' text when it has one (no sorting)."""
    if text is None:
        return _labels(_key(labels))
    found = _labels_cache.get(text)
    if found is None:
        found = _labels(_key(labels))
        _labels_cache[text] = found
    return found


def _samples(metric: Any) -> Iterable[tuple[str, dict[str, str], float, str | None]]:
    """(sample name, labels, value, the series' text if it has one) of every sample; a SeriesFamily's without
    making Sample objects."""
    if isinstance(metric, SeriesFamily):
        return ((s.name, s.labels, v, s.text) for s, v in zip(metric.series, metric.values, strict=True))
    return ((s.name, s.labels, s.value, None) for s in metric.samples)


def family_bytes(metric: Any) -> bytes | None:
    """One family as an encoded MetricFamily message."""
    name, typ = metric.name, metric.type
    kind = _TYPES.get(typ, UNTYPED)
    if typ == "counter":
        family_name = f"{name}_total"
        metrics = [
            _field(_FAMILY_METRIC, _series_labels(labels, text) + _field(_COUNTER, _VALUE + _double(value)))
            for sample, labels, value, text in _samples(metric)
            if sample == family_name
        ]
    elif typ in ("histogram", "gaugehistogram", "summary"):
        family_name = name
        metrics = _grouped(name, typ, _samples(metric), _natives(metric))
    else:  # gauge, info, stateset, unknown: one value per series
        family_name = f"{name}_info" if typ == "info" else name
        value_key = _GAUGE if kind == GAUGE else _UNTYPED
        metrics = [
            _field(_FAMILY_METRIC, _series_labels(labels, text) + _field(value_key, _VALUE + _double(value)))
            for _, labels, value, text in _samples(metric)
        ]
    head = _string(_FAMILY_NAME, family_name) + _string(_FAMILY_HELP, metric.documentation)
    return head + _FAMILY_TYPE + varint(kind) + b"".join(metrics)


def _natives(metric: Any) -> dict[tuple[tuple[str, str], ...], Callable[[], NativeBuckets]]:
    return getattr(metric, "native", None) or {}


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


class _Series:
    """What a histogram's or a summary's samples say of one of its series, gathered before it is encoded."""

    __slots__ = ("count", "key", "parts", "sum")

    def __init__(self, key: tuple[tuple[str, str], ...]) -> None:
        self.key = key
        self.count: int | None = None
        self.sum: float | None = None
        self.parts: list[bytes] = []  # its buckets or quantiles, encoded, in order


# What a histogram's or a summary's sample is, by its series' text: (part, its series' key, the bound's encoding).
_parts_cache: dict[str, tuple[int, tuple[tuple[str, str], ...], bytes]] = {}
_OTHER, _BUCKET_PART, _QUANTILE_PART, _COUNT_PART, _SUM_PART = range(5)


def _part(name: str, typ: str, sample: str, labels: dict[str, str]) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
    """Which part of its series a sample is, the series' key (its labels without le or quantile), and the
    encoded bound of a bucket (upper_bound) or a quantile (quantile)."""
    suffix = sample[len(name) :]
    counts = ("_gcount", "_gsum") if typ == "gaugehistogram" else ("_count", "_sum")
    if typ == "summary" and suffix == "" and "quantile" in labels:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "quantile"))
        return _QUANTILE_PART, key, b"\x09" + _double(float(labels["quantile"]))
    if typ != "summary" and suffix == "_bucket" and "le" in labels:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        return _BUCKET_PART, key, b"\x11" + _double(float(labels["le"]))  # +Inf too
    if suffix == counts[0]:
        return _COUNT_PART, _key(labels), b""
    if suffix == counts[1]:
        return _SUM_PART, _key(labels), b""
    return _OTHER, (), b""


def _grouped(
    name: str,
    typ: str,
    samples: Iterable[tuple[str, dict[str, str], float, str | None]],
    natives: dict[tuple[tuple[str, str], ...], Callable[[], NativeBuckets]],
) -> list[bytes]:
    """Histograms and summaries: their samples gathered by series (labels without le and quantile)."""
    found: dict[tuple[tuple[str, str], ...], _Series] = {}
    for sample, labels, value, text in samples:
        part = _parts_cache.get(text) if text is not None else None
        if part is None:
            part = _part(name, typ, sample, labels)
            if text is not None:
                if len(_parts_cache) >= _CACHE_LIMIT:
                    _parts_cache.clear()
                _parts_cache[text] = part
        kind, key, bound = part
        if kind == _OTHER:
            continue
        one = found.get(key)
        if one is None:
            one = found[key] = _Series(key)
        if kind == _BUCKET_PART:
            bucket = b"\x08" + _uint64(int(value)) + bound
            one.parts.append(_BUCKET + bytes((len(bucket),)) + bucket)  # at most 20 bytes: a one-byte length
        elif kind == _QUANTILE_PART:
            one.parts.append(_QUANTILE + b"\x12" + bound + b"\x11" + _double(value))  # 18 bytes
        elif kind == _COUNT_PART:
            one.count = int(value)
        else:
            one.sum = value
    summary = typ == "summary"
    encoded = []
    for one in found.values():
        body = b"" if one.count is None else _COUNT + _uint64(one.count)
        if one.sum is not None:
            body += _SUM + _double(one.sum)
        body += b"".join(one.parts)
        make = None if summary else natives.get(one.key)
        if make is not None:
            body += _native(make())
        message = _labels(one.key) + _field(_SUMMARY if summary else _HISTOGRAM, body)
        encoded.append(_field(_FAMILY_METRIC, message))
    return encoded


def _native(buckets: NativeBuckets) -> bytes:
    out = [_SCHEMA, _zigzag(buckets.schema), _ZERO_THRESHOLD, _double(buckets.zero_threshold)]
    out += [_ZERO_COUNT, _uint64(buckets.zero_count)]
    for offset, length in buckets.spans:
        out += [_field(_SPAN, b"\x08" + _zigzag(offset) + b"\x10" + varint(length))]
    for delta in buckets.deltas:
        out += [_DELTA, _zigzag(delta)]
    return b"".join(out)
