"""The fast exposition writes exactly what prometheus_client's encoders write: the text format as
exposition.generate_latest, OpenMetrics as openmetrics.exposition.generate_latest (in the escapings Prometheus
asks for), on odd families and on the exporter's own registry."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import math
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    GaugeMetricFamily,
)
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from volprobe import config, exposition
from volprobe.collectors import VolprobeCollector
from volprobe.discovery import Host
from volprobe.exposition import (
    OPENMETRICS_ESCAPINGS,
    SeriesFamily,
    TextExposition,
    generate_openmetrics,
    generate_text,
    series,
)
from volprobe.runtime import Exporter
from volprobe.server import ExporterHTTPServer, SharedRender
from volprobe.webconfig import WebConfigWatcher

from .support import golden
from .support.families import PROMETHEUS_ACCEPT, Frozen, odd_families
from .support.harness import MIB, wait_until


def openmetrics_latest(registry: Collector, escaping: str) -> bytes:
    """What prometheus_client answers a scrape for OpenMetrics 1.0.0 in `escaping` with."""
    return openmetrics.generate_latest(registry, escaping=escaping, version="1.0.0")


def left_to_prometheus_client(monkeypatch, render) -> list[str]:
    """The families `render()` left to prometheus_client's OpenMetrics encoder."""
    left: list[str] = []
    encoder = openmetrics.generate_latest

    def recording(registry: Collector, **options) -> bytes:
        left.extend(metric.name for metric in registry.collect())
        return encoder(registry, **options)

    with monkeypatch.context() as patched:
        patched.setattr(openmetrics, "generate_latest", recording)
        render()
    return left


def test_odd_families_render_the_same():
    registry = Frozen(odd_families())
    assert generate_text(registry) == generate_latest(registry)


@pytest.mark.parametrize("escaping", OPENMETRICS_ESCAPINGS)
def test_odd_families_render_the_same_in_openmetrics(escaping, monkeypatch):
    """Escaped help and label values, NaN and infinities, timestamps (seconds, as given), units, _created
    samples, info, stateset and gauge histogram families; the families it does not write itself (names out
    of the legacy set or with a colon, exemplars) are left to prometheus_client in the escaping asked for."""
    registry = Frozen(odd_families())
    assert generate_openmetrics(registry, escaping) == openmetrics_latest(registry, escaping)
    left = left_to_prometheus_client(monkeypatch, lambda: generate_openmetrics(registry, escaping))
    assert left == ["odd.dotted.name", "odd:ratio", "odd_traced"]


def test_openmetrics_in_other_escapings_is_refused():
    """dots and values change legacy names too: a caller must use prometheus_client's encoder for them."""
    for escaping in (openmetrics.DOTS, openmetrics.VALUES):
        with pytest.raises(ValueError, match="escaping"):
            generate_openmetrics(Frozen(odd_families()), escaping)


@pytest.mark.parametrize("escaping", OPENMETRICS_ESCAPINGS)
def test_the_golden_registry_renders_the_same_in_both_formats(escaping, monkeypatch):
    """Every family /metrics serves (volprobe's, process_*, python_info) over the golden view: the same bytes
    as prometheus_client's, none of them left to it, and the OpenMetrics parsed by prometheus_client's parser."""
    registry = golden.registry()
    assert generate_text(registry) == generate_latest(registry)
    rendered = generate_openmetrics(registry, escaping)
    assert rendered == openmetrics_latest(registry, escaping)
    assert left_to_prometheus_client(monkeypatch, lambda: generate_openmetrics(registry, escaping)) == []
    parsed = {family.name: family for family in text_string_to_metric_families(rendered.decode())}
    assert parsed["volprobe_probe_latency_seconds"].type == "histogram"
    assert parsed["volprobe_probe_errors"].type == "counter"


def test_what_one_writer_remembers_never_changes_a_later_scrape():
    """The server keeps one TextExposition for both formats: series and numbers it remembered from a scrape
    must not leak into the next, whose labels and values differ, in either format."""
    text = TextExposition()
    for scrape in range(3):
        gauge = GaugeMetricFamily("scraped_gauge", "changes between scrapes", labels=["a"])
        gauge.add_metric(["x"], scrape)
        gauge.add_metric([f"y{scrape}"], 0.5 * scrape)
        gauge.add_metric(["z"], -0.0 if scrape == 1 else 0.0)
        registry = Frozen([*odd_families(), gauge])
        assert text.generate(registry) == generate_latest(registry)
        for escaping in OPENMETRICS_ESCAPINGS:
            assert text.generate_openmetrics(registry, escaping) == openmetrics_latest(registry, escaping)


def test_a_series_family_writes_zeros_nan_and_infinities_as_generate_latest_does():
    """Zero and NaN are not kept in the number cache (-0.0 == 0.0, NaN != NaN) but written straight: in either
    order, and once remembered, each keeps its own text."""
    values = [0, 0.0, -0.0, math.nan, math.inf, -math.inf, 1e6, 123456789, 0.1, -0.0, 0]
    family = SeriesFamily("odd_values", "values", "gauge")
    for i, value in enumerate(values):
        family.add(series("odd_values", {"i": str(i)}), value)
    backwards = SeriesFamily("odd_values", "values", "gauge")
    for i, value in reversed(list(enumerate(values))):
        backwards.add(series("odd_values", {"i": str(i)}), value)
    text = TextExposition()
    for families in ([family], [backwards], [family]):
        assert text.generate(Frozen(families)) == generate_latest(Frozen(families))
        assert text.generate_openmetrics(Frozen(families)) == openmetrics_latest(Frozen(families), "underscores")


def test_a_series_has_no_colon():
    """Colons are for recording rules; and prometheus_client's OpenMetrics turns them into underscores in
    sample names only, so a Series' one text would not do for both formats."""
    with pytest.raises(ValueError, match="colon"):
        series("odd:ratio", {"a": "x"})


def test_numbers_in_use_outlast_one_off_floats(monkeypatch):
    """The number cache keeps what every scrape writes (counts, bounds) however many one-off floats (sums, ages)
    pass through it: each scrape formats its new numbers only."""
    formatted: list[float] = []

    def formatting(value: float) -> str:
        formatted.append(value)
        return floatToGoString(value)

    monkeypatch.setattr(exposition, "floatToGoString", formatting)
    text = TextExposition()
    for scrape in range(20):
        gauge = GaugeMetricFamily("scraped_gauge", "counts and one-off sums", labels=["a"])
        gauge.add_metric(["count"], 42)
        for i in range(1000):
            gauge.add_metric([f"sum{i}"], scrape * 1000 + i + 0.5)
        assert text.generate(Frozen([gauge])) == generate_latest(Frozen([gauge]))
    assert formatted.count(42) == 1 and len(formatted) == 1 + 20 * 1000


@pytest.mark.root
def test_the_exporters_own_registry_renders_the_same(make_loop):
    loops = [make_loop(16 * MIB) for _ in range(3)]
    document = {"targets": [{"name": f"t{i}", "device": loop} for i, loop in enumerate(loops)]}
    exporter = Exporter(config.parse(document), Host())
    exporter.start()
    try:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(VolprobeCollector(exporter))
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        exporter.probes.running()[0].worker.join(0.5)  # let a few probes land
        frozen = Frozen(list(registry.collect()))
        assert generate_text(frozen) == generate_latest(frozen)
        for escaping in OPENMETRICS_ESCAPINGS:
            assert generate_openmetrics(frozen, escaping) == openmetrics_latest(frozen, escaping)
        families = list(text_string_to_metric_families(generate_openmetrics(frozen).decode()))
        assert {s.labels["target"] for f in families for s in f.samples if "target" in s.labels} == {"t0", "t1", "t2"}
    finally:
        exporter.stop()


# -- the server: what Prometheus asks for -------------------------------------------------------------------


# The Accept headers Prometheus scrapes with. 2.42 (Debian's): scrape.go's scrapeAcceptHeader. From 2.49:
# acceptHeader(DefaultScrapeProtocols), q counted down from the number of protocols it knows. 3.x adds text 1.0.0
# and, to both 1.0.0 formats, the escaping of metric_name_escaping_scheme: allow-utf-8 unless names are validated
# legacy, then underscores; 3.0 knew five protocols, 3.16 (the one .ci/run builds) six. Prometheus "2" and "3"
# send theirs in the test below.
@contextlib.contextmanager
def serving(registry: Collector) -> Iterator[tuple[ExporterHTTPServer, list[str], list[str]]]:
    """An ExporterHTTPServer on a free loopback port, with the Accept headers of its scrapes and the escapings
    of the OpenMetrics it rendered itself recorded."""
    server = ExporterHTTPServer(("127.0.0.1", 0), registry, WebConfigWatcher(None))
    accepts: list[str] = []
    fast: list[str] = []
    render, fast_openmetrics = server._render, server.text.generate_openmetrics

    def recording_render(accept: str) -> tuple[bytes, str]:
        accepts.append(accept)
        return render(accept)

    def recording_openmetrics(registry: Collector, escaping: str) -> bytes:
        fast.append(escaping)
        return fast_openmetrics(registry, escaping)

    server.renders = SharedRender(recording_render)
    server.text.generate_openmetrics = recording_openmetrics
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.ready.set()
    try:
        yield server, accepts, fast
    finally:
        server.shutdown()
        server.server_close()


def scrape(port: int, accept: str) -> tuple[str, bytes]:
    """(Content-Type, body) of /metrics asked for as Prometheus does: `accept`, gzip."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics", headers={"Accept": accept, "Accept-Encoding": "gzip"})
        response = connection.getresponse()
        body = response.read()
        assert response.status == 200 and response.getheader("Content-Encoding") == "gzip"
        return response.getheader("Content-Type", ""), gzip.decompress(body)
    finally:
        connection.close()


@pytest.mark.parametrize("prometheus", PROMETHEUS_ACCEPT)
def test_prometheus_gets_openmetrics_rendered_fast(prometheus):
    """Each Accept header Prometheus scrapes with gets OpenMetrics 1.0.0, written by TextExposition, the same
    bytes as prometheus_client's encoder for that header; gzipped as before."""
    registry = golden.registry()
    accept = PROMETHEUS_ACCEPT[prometheus]
    escaping = "underscores" if prometheus in ("2", "2.49", "3 legacy") else "allow-utf-8"
    encoder, content_type = choose_encoder(accept)
    with serving(registry) as (server, _, fast):
        assert scrape(server.server_address[1], accept) == (content_type, encoder(registry))
    assert content_type.startswith("application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert fast == [escaping]
    parsed = {family.name for family in text_string_to_metric_families(encoder(registry).decode())}
    assert "volprobe_probe_latency_seconds" in parsed


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text;version=1.0.0;escaping=dots",
        "application/openmetrics-text;version=1.0.0;escaping=values",
        "application/openmetrics-text;version=2.0.0",
        "text/plain;version=1.0.0;escaping=allow-utf-8",
    ],
)
def test_what_it_does_not_write_itself_is_left_to_prometheus_client(accept):
    """Other escapings and versions: prometheus_client's encoder, as choose_encoder picks it."""
    registry = golden.registry()
    encoder, content_type = choose_encoder(accept)
    with serving(registry) as (server, _, fast):
        assert scrape(server.server_address[1], accept) == (content_type, encoder(registry))
    assert fast == []


@pytest.mark.parametrize("prometheus", ["2", "3", "3 legacy"])
def test_prometheus_scrapes_and_stores_the_fast_openmetrics(prometheus, start_prometheus):
    """A real Prometheus (3 also with legacy name validation, which asks for underscores) sends the Accept header
    above and stores what it gets: counters, histograms, gauges."""
    version = prometheus.split()[0]
    legacy = "metric_name_validation_scheme: legacy" if prometheus == "3 legacy" else ""
    with serving(golden.registry()) as (server, accepts, fast):
        scraper = start_prometheus(
            f"""
global: {{scrape_interval: 1s, scrape_timeout: 1s, {legacy}}}
scrape_configs:
  - job_name: volprobe
    static_configs: [{{targets: ["127.0.0.1:{server.server_address[1]}"]}}]
""",
            version=version,
        )
        wanted = ("volprobe_build_info", "volprobe_probe_latency_seconds_bucket", "volprobe_probe_errors_total")
        wait_until(
            lambda: scraper.query('up{job="volprobe"} == 1') and all(scraper.query(name) for name in wanted),
            timeout=30,
            what="volprobe's series stored",
        )
    assert accepts and set(accepts) == {PROMETHEUS_ACCEPT[prometheus]}
    assert fast and set(fast) == {"allow-utf-8" if prometheus == "3" else "underscores"}
