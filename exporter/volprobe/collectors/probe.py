"""Probe latency, errors, misses, in-flight age and specification, from the workers' in-memory counters."""

from __future__ import annotations

import time

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from .. import metrics
from ..stats import SUMMARY_QUANTILES, TOUCHES
from . import Sources, register

# Errors that exist at 0 from a probe's start: the first one is then an increase, which alerts and panels see.
# Others (ENXIO, SHORT, ...) appear when they first happen; volprobe_probe_failures_total counts them all.
PRESET_ERRNOS = ("EIO",)


@register("probe", "probe latency, errors and specification")
class ProbeCollector:
    def __init__(self, sources: Sources) -> None:
        self.exporter = sources.exporter

    def collect(self) -> list[Metric]:
        latency = metrics.PROBE_LATENCY.family()
        recent = metrics.PROBE_LATENCY_RECENT.family()
        missed = metrics.PROBE_MISSED.family()
        errors = metrics.PROBE_ERRORS.family()
        failures = metrics.PROBE_FAILURES.family()
        inflight = metrics.PROBE_INFLIGHT.family()
        zero_reads = metrics.PROBE_ZERO_READS.family()
        interval = metrics.PROBE_INTERVAL.family()
        info = metrics.PROBE_INFO.family()
        recent_name = metrics.PROBE_LATENCY_RECENT.name
        now = time.perf_counter_ns()
        zero_by_target: dict[tuple[str, str], int] = {}
        for running in self.exporter.probes.running():
            labels = running.labels
            values = [labels["target"], labels["device"], labels["op"]]
            for touch in TOUCHES:
                snap = running.stats.snapshot(touch, now)
                latency.add_metric(
                    [*values, touch], [(floatToGoString(b), c) for b, c in snap.buckets], snap.sum_seconds
                )
                touch_labels = {**labels, "touch": touch}
                for q, value in zip(SUMMARY_QUANTILES, snap.quantiles, strict=True):
                    recent.add_sample(recent_name, {**touch_labels, "quantile": floatToGoString(q)}, value)
                recent.add_sample(metrics.PROBE_LATENCY_RECENT.count, touch_labels, snap.count)
                recent.add_sample(metrics.PROBE_LATENCY_RECENT.sum, touch_labels, snap.sum_seconds)
            worker, spec = running.worker, running.spec
            missed.add_metric(values, worker.missed)
            counts = worker.error_counts()
            for name in sorted({*PRESET_ERRNOS, *counts}):
                errors.add_metric([*values, name], counts.get(name, 0))
            failures.add_metric(values, sum(counts.values()))
            inflight.add_metric([labels["target"], labels["op"]], worker.inflight_seconds(now))
            interval.add_metric(values, spec.interval * worker.slowdown)
            info.add_metric([*values, str(spec.block_size), f"{spec.interval:g}s", str(spec.sync).lower()], 1)
            if not spec.kind.writes:
                key = (labels["target"], labels["device"])
                zero_by_target[key] = zero_by_target.get(key, 0) + worker.zero_reads
        for (target, device), count in sorted(zero_by_target.items()):
            zero_reads.add_metric([target, device], count)
        return [latency, recent, missed, errors, failures, inflight, zero_reads, interval, info]
