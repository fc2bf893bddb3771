"""Families of every kind, odd values and labels included, and the Accept headers real Prometheus servers send:
shared by the exposition tests (text, OpenMetrics, protobuf)."""

from __future__ import annotations

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar, Timestamp


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
    gauge.add_metric(["w", "z"], float("-inf"), timestamp=Timestamp(1700000000, 5000))
    histogram = HistogramMetricFamily("odd_seconds", "h", labels=["op"])
    histogram.add_metric(["read"], [("0.001", 1), ("1.0", 2), ("+Inf", 3)], 0.5)
    summary = SummaryMetricFamily("odd_summary", "s", count_value=4, sum_value=1e-9)
    quantiles = SummaryMetricFamily("odd_quantiles", "q", labels=["op"])
    quantiles.add_metric(["read"], count_value=2, sum_value=0.25)
    quantiles.add_sample("odd_quantiles", {"op": "read", "quantile": "0.99"}, 0.2)
    quantiles.add_sample("odd_quantiles", {"op": "read", "quantile": "0.5"}, float("nan"))
    info = InfoMetricFamily("odd_build", "i", value={"version": "1.0", "commit": 'a"b'})
    states = StateSetMetricFamily("odd_state", "st", value={"up": True, "down": False})
    gauge_histogram = GaugeHistogramMetricFamily("odd_queue", "gh", buckets=[("1.0", 4), ("+Inf", 5)], gsum_value=3)
    unknown = Metric("odd_unknown", "u", "unknown")
    unknown.add_sample("odd_unknown", {}, 7)
    sized = GaugeMetricFamily("odd_size", "with a unit", unit="bytes")
    sized.add_metric([], 4096)
    unnamed = GaugeMetricFamily("odd.dotted.name", "not a legacy name")
    unnamed.add_metric([], 1)
    ruled = GaugeMetricFamily("odd:ratio", "a recording rule's colon")
    ruled.add_metric([], 0.5)
    exemplified = CounterMetricFamily("odd_traced", "with an exemplar", labels=["op"])
    exemplified.add_metric(["read"], 1, exemplar=Exemplar({"trace_id": "abc"}, 0.5, 1700000000.0))
    return [
        counter,
        gauge,
        histogram,
        summary,
        quantiles,
        info,
        states,
        gauge_histogram,
        unknown,
        sized,
        unnamed,
        ruled,
        exemplified,
        GaugeMetricFamily("odd_empty", "none"),
    ]


PROMETHEUS_ACCEPT = {
    "2": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "2.49": "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "3.0": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "3": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.7,"
    "application/openmetrics-text;version=0.0.1;q=0.6,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "text/plain;version=0.0.4;q=0.4,*/*;q=0.3",
    "3 legacy": "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.7,"
    "application/openmetrics-text;version=0.0.1;q=0.6,text/plain;version=1.0.0;escaping=underscores;q=0.5,"
    "text/plain;version=0.0.4;q=0.4,*/*;q=0.3",
}

PROMETHEUS_PROTOBUF_ACCEPT = (  # Prometheus 3.16 with scrape_native_histograms: true, as it sends it
    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.5,"
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "application/openmetrics-text;version=0.0.1;q=0.3,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.2,"
    "text/plain;version=0.0.4;q=0.1,*/*;q=0.05"
)
