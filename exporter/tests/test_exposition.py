"""The fast text exposition writes exactly what prometheus_client's generate_latest writes."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from volprobe import config, exposition
from volprobe.collectors import VolprobeCollector
from volprobe.discovery import Host
from volprobe.exposition import SeriesFamily, TextExposition, generate_text, series
from volprobe.runtime import Exporter

from .support.harness import MIB


class Frozen(Collector):
    """The same families on every collect(): both encoders see identical input."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def odd_families() -> list[Metric]:
    counter = CounterMetricFamily("odd_requests", 'Help with "quotes", a \\ backslash\nand a newline.', labels=["path"])
    counter.add_metric(['/a "quoted" \\ path\nwith a newline'], 3, created=1700000000.5)
    counter.add_metric(["ünïcode"], 2.5)
    gauge = GaugeMetricFamily("odd_gauge", "plain", labels=["a", "b"])
    gauge.add_metric(["x", ""], float("nan"))
    gauge.add_metric(["y", "z"], float("inf"), timestamp=1700000000.25)
    gauge.add_metric(["z", "z"], -0.0)
    histogram = HistogramMetricFamily("odd_seconds", "h", labels=["op"])
    histogram.add_metric(["read"], [("0.001", 1), ("+Inf", 3)], 0.5)
    summary = SummaryMetricFamily("odd_summary", "s", count_value=4, sum_value=1e-9)
    info = InfoMetricFamily("odd_build", "i", value={"version": "1.0", "commit": 'a"b'})
    states = StateSetMetricFamily("odd_state", "st", value={"up": True, "down": False})
    unnamed = GaugeMetricFamily("odd.dotted.name", "not a legacy name")
    unnamed.add_metric([], 1)
    return [counter, gauge, histogram, summary, info, states, unnamed, GaugeMetricFamily("odd_empty", "none")]


def test_odd_families_render_the_same():
    registry = Frozen(odd_families())
    assert generate_text(registry) == generate_latest(registry)


def test_what_one_writer_remembers_never_changes_a_later_scrape():
    """The server keeps one TextExposition: series and numbers it remembered from a scrape must not leak into
    the next, whose labels and values differ."""
    text = TextExposition()
    for scrape in range(3):
        gauge = GaugeMetricFamily("scraped_gauge", "changes between scrapes", labels=["a"])
        gauge.add_metric(["x"], scrape)
        gauge.add_metric([f"y{scrape}"], 0.5 * scrape)
        gauge.add_metric(["z"], -0.0 if scrape == 1 else 0.0)
        registry = Frozen([*odd_families(), gauge])
        assert text.generate(registry) == generate_latest(registry)


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
    finally:
        exporter.stop()
