"""The protobuf exposition: the generated module matches its source, the body is read back by a decoder written
here from the wire format (not the protobuf library that wrote it), content negotiation picks it only when
asked for first, and a real Prometheus 3 takes volprobe's native histograms from it."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from volprobe import protobuf
from volprobe.proto import metrics_pb2

from .support import golden, protobuf_library
from .support.families import PROMETHEUS_ACCEPT, PROMETHEUS_PROTOBUF_ACCEPT, Frozen, odd_families
from .support.harness import sample_value, start_prometheus, wait_until, write_config

PROTO = Path(protobuf.__file__).parent / "proto"


# -- an independent decoder of the wire format -----------------------------------------------------------------


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes) -> dict[int, list[Any]]:
    """Field number -> values: ints for varints, floats for 64-bit fields, bytes for length-delimited ones."""
    fields: dict[int, list[Any]] = {}
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 1:
            (value,) = struct.unpack_from("<d", data, at)
            at += 8
        elif wire == 2:
            length, at = _varint(data, at)
            value, at = data[at : at + length], at + length
        else:
            raise AssertionError(f"wire type {wire} is not used by these messages")
        fields.setdefault(number, []).append(value)
    return fields


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _packed(values: list[bytes], signed: bool) -> list[int]:
    result = []
    for blob in values:  # proto2 repeated scalars are not packed unless asked; accept both
        at = 0
        while at < len(blob):
            n, at = _varint(blob, at)
            result.append(_zigzag(n) if signed else n)
    return result


def decode(body: bytes) -> list[dict[str, Any]]:
    """The families of a delimited body as plain dicts."""
    families, at = [], 0
    while at < len(body):
        length, at = _varint(body, at)
        f = _fields(body[at : at + length])
        at += length
        metrics = []
        for raw in f.get(4, []):
            m = _fields(raw)
            labels = {}
            for pair in m.get(1, []):
                p = _fields(pair)
                labels[p[1][0].decode()] = p.get(2, [b""])[0].decode()
            metric: dict[str, Any] = {"labels": labels}
            for number, kind in ((2, "gauge"), (3, "counter"), (5, "untyped")):
                if number in m:
                    metric[kind] = _fields(m[number][0]).get(1, [0.0])[0]
            if 4 in m:
                s = _fields(m[4][0])
                quantiles = {_fields(q)[1][0]: _fields(q)[2][0] for q in s.get(3, [])}
                metric["summary"] = {"count": s.get(1, [0])[0], "sum": s.get(2, [0.0])[0], "quantiles": quantiles}
            if 7 in m:
                h = _fields(m[7][0])
                buckets = [(_fields(b)[2][0], _fields(b).get(1, [0])[0]) for b in h.get(3, [])]
                histogram: dict[str, Any] = {"count": h.get(1, [0])[0], "sum": h.get(2, [0.0])[0], "buckets": buckets}
                if 5 in h:
                    spans = [(_zigzag(_fields(s)[1][0]), _fields(s)[2][0]) for s in h.get(12, [])]
                    deltas = [_zigzag(d) for d in h[13]] if h.get(13) and isinstance(h[13][0], int) else []
                    if h.get(13) and isinstance(h[13][0], bytes):
                        deltas = _packed(h[13], signed=True)
                    histogram["native"] = {
                        "schema": _zigzag(h[5][0]),
                        "zero_threshold": h.get(6, [0.0])[0],
                        "zero_count": h.get(7, [0])[0],
                        "spans": spans,
                        "deltas": deltas,
                    }
                metric["histogram"] = histogram
            metrics.append(metric)
        families.append(
            {
                "name": f[1][0].decode(),
                "help": f.get(2, [b""])[0].decode(),
                "type": f.get(3, [0])[0],
                "metrics": metrics,
            }
        )
    return families


def native_counts(native: dict[str, Any]) -> dict[int, int]:
    counts, index, count, deltas = {}, 0, 0, iter(native["deltas"])
    for n, (offset, length) in enumerate(native["spans"]):
        index = offset if n == 0 else index + offset
        for _ in range(length):
            count += next(deltas)
            if count:
                counts[index] = count
            index += 1
    return counts


# -- the generated module --------------------------------------------------------------------------------------


def test_the_generated_module_is_what_protoc_makes_of_its_source(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            "metrics.proto",
        ],
        check=True,
        cwd=PROTO,
    )
    for name in ("metrics_pb2.py", "metrics_pb2.pyi"):
        assert (tmp_path / name).read_text() == (PROTO / name).read_text(), f"regenerate {name} (see metrics.proto)"


def test_the_type_numbers_are_the_generated_enums_and_the_exporter_never_loads_the_library():
    pb = metrics_pb2
    assert protobuf._TYPES == {
        "counter": pb.COUNTER,
        "gauge": pb.GAUGE,
        "info": pb.GAUGE,
        "stateset": pb.GAUGE,
        "summary": pb.SUMMARY,
        "histogram": pb.HISTOGRAM,
        "gaugehistogram": pb.GAUGE_HISTOGRAM,
    }
    assert (protobuf.UNTYPED, protobuf.GAUGE) == (pb.UNTYPED, pb.GAUGE)
    # volprobe encodes the messages itself: the library (about 3 MiB of RSS) is the tests' reference only.
    check = (
        "import sys, volprobe.app, volprobe.server\n"
        "from volprobe import protobuf\n"
        "from prometheus_client import REGISTRY\n"
        "assert protobuf.generate(REGISTRY)\n"
        "assert 'google.protobuf' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0


def test_the_encoding_is_the_librarys_byte_for_byte():
    """volprobe's encoder against the protobuf library's messages, on the whole golden registry (every family
    volprobe exports), on odd families (every type, hostile names and values), and on probe histograms with
    their native buckets, before and after a halving of the schema."""
    cases = {"golden": golden.registry(), "odd": Frozen(odd_families()), "native": Frozen(probe_histograms())}
    for name, registry in cases.items():
        ours, theirs = protobuf.generate(registry), protobuf_library.generate(registry)
        assert ours == theirs, name
        assert decode(ours), name


# -- what the body holds -----------------------------------------------------------------------------------------


def test_every_kind_of_family_is_written_in_its_type_and_read_back_alike():
    body = protobuf.generate(Frozen(odd_families()))
    families = {f["name"]: f for f in decode(body)}
    by_type = {name: f["type"] for name, f in families.items()}
    assert by_type["odd_requests_total"] == metrics_pb2.COUNTER
    assert by_type["odd_gauge"] == metrics_pb2.GAUGE
    assert by_type["odd_seconds"] == metrics_pb2.HISTOGRAM
    counter = families["odd_requests_total"]
    assert {m["labels"]["path"]: m["counter"] for m in counter["metrics"]} == {
        '/a "quoted" \\ path\nwith a newline': 3.0,
        "ünïcode": 2.5,
    }
    assert counter["help"] == 'Help with "quotes", a \\ backslash\nand a newline.'
    gauges = {m["labels"]["a"]: m["gauge"] for m in families["odd_gauge"]["metrics"]}
    assert math.isnan(gauges["x"]) and gauges["y"] == math.inf and gauges["w"] == -math.inf
    assert math.copysign(1.0, gauges["z"]) == -1.0
    for f in odd_families():  # every sample of every family is in the body, under its series
        assert any(name.startswith(f.name) for name in families), f.name


def probe_histograms() -> list[Any]:
    """The probe latency family of one probe's 1000 probes, 50 to 87 us, with its native buckets; and of one whose
    probes spread over six decades, too many buckets for schema 7."""
    from volprobe import stats
    from volprobe.collectors.probe import HistogramSeries
    from volprobe.metrics import PROBE_LATENCY

    family = PROBE_LATENCY.series_family()
    for device, latencies_ns in (
        ("loop9", [50_000 + 37 * i for i in range(1000)]),
        ("loop8", [int(1_000 * 1.014**i) for i in range(1000)]),
    ):
        probe = stats.ProbeStats(window_s=60.0)
        for i, latency in enumerate(latencies_ns):
            probe.record(latency, "first" if i < 10 else "repeat", 1_000_000_000 + i)
        first, repeat = probe.snapshot("first", 2_000_000_000), probe.snapshot("repeat", 2_000_000_000)
        merged = [a + b for a, b in zip(first.cumulative, repeat.cumulative, strict=True)]
        HistogramSeries(PROBE_LATENCY, {"target": "t", "device": device, "op": "read"}, first.bounds[:-1]).add(
            family, merged, first.sum_seconds + repeat.sum_seconds, [first.lifetime, repeat.lifetime]
        )
    return [family]


def test_a_probe_histogram_carries_its_classic_and_its_native_buckets_with_the_same_count():
    (decoded,) = decode(protobuf.generate(Frozen(probe_histograms())))
    metric, spread = decoded["metrics"]
    assert spread["histogram"]["native"]["schema"] < 7  # more than MAX_BUCKETS buckets at 7: halved
    histogram = metric["histogram"]
    assert histogram["count"] == 1000 and histogram["buckets"][-1] == (math.inf, 1000)
    native = histogram["native"]
    assert native["schema"] == 7 and native["zero_count"] == 0
    assert sum(native_counts(native).values()) == 1000
    # The native buckets hold the samples where they are: 50 us to 87 us.
    lowest, highest = min(native_counts(native)), max(native_counts(native))
    assert 2 ** ((lowest - 1) / 128) < 50e-6 * 1.01 and 2 ** (highest / 128) > 87e-6 * 0.99


# -- content negotiation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        (PROMETHEUS_PROTOBUF_ACCEPT, True),
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited", True),
        (PROMETHEUS_ACCEPT["3"], False),  # Prometheus 3 without native histograms
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text", False),
        ("application/vnd.google.protobuf;proto=other.Message;encoding=delimited", False),
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0", False),
        (
            "text/plain;q=0.9,application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
            "encoding=delimited;q=0.5",
            False,
        ),
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=x", False),
        (";;;,,,=;q=;proto=", False),
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited," * 400, False),
        ("", False),
    ],
)
def test_protobuf_is_chosen_only_when_asked_for_first(accept, chosen):
    assert protobuf.wanted(accept) is chosen


def test_hostile_accept_headers_get_a_valid_text_exposition(tmp_path, start_exporter, make_loop):
    device = make_loop(16 * 2**20)
    exporter = start_exporter("--config", str(write_config(tmp_path, f"targets: [{{name: d, device: {device}}}]\n")))
    url = f"http://127.0.0.1:{exporter.port}/metrics"
    for accept in [";;;,,,=;q=;proto=", "application/vnd.google.protobuf;q=1e309", "\x7f" * 100, "a" * 8000]:
        request = urllib.request.Request(url, headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
            assert response.status == 200
            assert response.headers["Content-Type"].startswith(("text/plain", "application/openmetrics-text"))
        assert b"volprobe_build_info" in body and not body.startswith(b"\x00")


# -- a real Prometheus 3 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["3", "2"])
def test_prometheus_takes_the_native_histograms_and_counts_what_the_exporter_counts(
    tmp_path, start_exporter, make_loop, version
):
    """Prometheus 3.16 with scrape_native_histograms (the classic series kept too), and Debian's 2.42 with its
    feature flag, store each probe's latency as one native histogram: its count is the classic _count of the same
    scrape (3.16), or at most the exporter's own count read after it (2.42, which keeps only the native one)."""
    device = make_loop(64 * 2**20)
    targets = f"targets: [{{name: d, device: {device}, probes: [{{op: read, interval: 100ms}}]}}]\n"
    exporter = start_exporter("--config", str(write_config(tmp_path, targets)))
    native_settings = (
        "scrape_native_histograms: true\n    always_scrape_classic_histograms: true\n    " if version == "3" else ""
    )
    config = (
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: volprobe\n"
        f"    {native_settings}static_configs: [{{targets: ['127.0.0.1:{exporter.port}']}}]\n"
    )
    args = ("--enable-feature=native-histograms",) if version == "2" else ()
    prometheus = start_prometheus(config, tmp_path / "prometheus", version=version, args=args)
    try:
        seen: list[tuple[float, float | None]] = []

        def counted() -> bool:
            native = prometheus.query('histogram_count(volprobe_probe_latency_seconds{target="d"})')
            classic = prometheus.query('volprobe_probe_latency_seconds_count{target="d"}')
            if native and float(native[0]["value"][1]) >= 20:
                seen.append((float(native[0]["value"][1]), float(classic[0]["value"][1]) if classic else None))
            return bool(seen)

        wait_until(counted, 60, f"a native histogram's count in Prometheus {version}", every=0.5)
        native_count, classic_count = seen[0]
        if version == "3":
            assert native_count == classic_count, seen  # the same scrape, the same probes
        else:
            assert classic_count is None  # 2.42 keeps the native histogram only
            assert native_count <= sample_value(exporter.metrics(), "volprobe_probe_latency_seconds_count", target="d")
        median = prometheus.query('histogram_quantile(0.5, volprobe_probe_latency_seconds{target="d"})')
        assert median and 0 < float(median[0]["value"][1]) < 1.0
        assert prometheus.query('volprobe_probe_info{target="d"}'), "the other families come in the protobuf too"
    finally:
        prometheus.stop()
