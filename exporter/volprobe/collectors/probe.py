"""Probe latency, errors, misses, in-flight age and specification, from the workers' in-memory counters.

A probe's labels hold for its life, so its series are rendered once (ProbeSeries) and each scrape only writes
the values: with 64 targets the scrape costs a fraction of what building every sample's labels again did.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from .. import metrics, native
from ..exposition import Series, SeriesFamily
from ..stats import SUMMARY_QUANTILES, TOUCHES, LatencySnapshot
from ..view import ProbeReading, RuntimeView
from .registry import register

# Errors that exist at 0 from a probe's start: the first one is then an increase, which alerts and panels see.
# Others (ENXIO, SHORT, ...) appear when they first happen; volprobe_probe_failures_total counts them all.
PRESET_ERRNOS = ("EIO",)

LATENCY, RECENT = metrics.PROBE_LATENCY, metrics.PROBE_LATENCY_RECENT


class HistogramSeries:
    """The bucket, count and sum series of one histogram, in the order they are written."""

    def __init__(self, spec: metrics.MetricSpec[Any], labels: dict[str, str], bounds: tuple[float, ...]) -> None:
        bounds_text = [*(floatToGoString(bound) for bound in bounds), "+Inf"]
        buckets = [spec.series(spec.bucket, {**labels, "le": le}) for le in bounds_text]
        self.series = (*buckets, spec.series(spec.count, labels), spec.series(spec.sum, labels))
        self.key = tuple(sorted(labels.items()))

    def add(
        self,
        family: SeriesFamily,
        cumulative: list[int],
        sum_seconds: float,
        lifetimes: Sequence[Mapping[int, int]] = (),
    ) -> None:
        """Its series' values; with `lifetimes` (snapshots' copies, never changed), the high-resolution counts
        its native buckets are made from, summed only if the protobuf exposition asks."""
        family.extend(self.series, [*cumulative, cumulative[-1], sum_seconds])
        if lifetimes:
            family.native[self.key] = lambda: native.from_counts(_summed(lifetimes))


class SummarySeries:
    """The quantile, count and sum series of one summary, in the order they are written."""

    def __init__(self, spec: metrics.MetricSpec[Any], labels: dict[str, str]) -> None:
        quantiles = [spec.series(spec.name, {**labels, "quantile": floatToGoString(q)}) for q in SUMMARY_QUANTILES]
        self.series = (*quantiles, spec.series(spec.count, labels), spec.series(spec.sum, labels))

    def add(self, family: SeriesFamily, snap: LatencySnapshot) -> None:
        family.extend(self.series, [*snap.quantiles, snap.count, snap.sum_seconds])


class ProbeSeries:
    """Every series of one running probe, rendered when it is first scraped."""

    def __init__(self, reading: ProbeReading) -> None:
        self.identity = reading.identity  # kept alive by this entry only as long as the collector keeps it
        self.labels = labels = reading.labels
        self.buckets = reading.buckets
        spec = reading.spec
        self.latency = HistogramSeries(LATENCY, labels, reading.buckets)
        self.recent = {touch: SummarySeries(RECENT, {**labels, "touch": touch}) for touch in TOUCHES}
        self.missed = metrics.PROBE_MISSED.series(metrics.PROBE_MISSED.total, labels)
        self.failures = metrics.PROBE_FAILURES.series(metrics.PROBE_FAILURES.total, labels)
        inflight_labels = {"target": labels["target"], "op": labels["op"]}
        self.inflight = metrics.PROBE_INFLIGHT.series(metrics.PROBE_INFLIGHT.name, inflight_labels)
        self.interval = metrics.PROBE_INTERVAL.series(metrics.PROBE_INTERVAL.name, labels)
        info_labels = {
            **labels,
            "block_size_bytes": str(spec.block_size),
            "interval": f"{spec.interval:g}s",
            "sync": str(spec.sync).lower(),
            "source": reading.source,
        }
        self.info = metrics.PROBE_INFO.series(metrics.PROBE_INFO.name, info_labels)
        self._errors: dict[str, Series] = {}
        step_labels = {"target": labels["target"], "device": labels["device"]}
        self.steps = [
            metrics.PROBE_STEP_SECONDS.series(metrics.PROBE_STEP_SECONDS.total, {**step_labels, "step": step})
            for step in spec.kind.steps
        ]

    @functools.cached_property
    def latency_by_touch(self) -> dict[str, HistogramSeries]:
        """defaults.histogram_by_touch: the histogram split by touch as well."""
        bounds = self.buckets
        split = metrics.PROBE_LATENCY_BY_TOUCH
        return {touch: HistogramSeries(split, {**self.labels, "touch": touch}, bounds) for touch in TOUCHES}

    def error(self, errno_name: str) -> Series:
        """The series of one errno, made when it first happens (kept here, so it goes with the probe)."""
        one = self._errors.get(errno_name)
        if one is None:
            one = self._errors[errno_name] = metrics.PROBE_ERRORS.series(
                metrics.PROBE_ERRORS.total, {**self.labels, "errno": errno_name}
            )
        return one


def _summed(histograms: Sequence[Mapping[int, int]]) -> dict[int, int]:
    """High-resolution histograms as one (a probe's first and repeat touches)."""
    result: dict[int, int] = {}
    for counts in histograms:
        for index, count in counts.items():
            result[index] = result.get(index, 0) + count
    return result


@register("probe", "probe latency, errors and specification")
class ProbeCollector:
    def __init__(self, view: RuntimeView) -> None:
        self.view = view
        self._series: dict[int, ProbeSeries] = {}  # by id() of the probe's identity, which the entry keeps alive
        self._zero_series: dict[tuple[str, str], Series] = {}

    def _series_of(self, readings: Sequence[ProbeReading]) -> list[tuple[ProbeSeries, ProbeReading]]:
        known, fresh, pairs = self._series, {}, []
        for reading in readings:
            key = id(reading.identity)
            entry = known.get(key)
            if entry is None or entry.identity is not reading.identity or entry.labels != reading.labels:
                entry = ProbeSeries(reading)
            fresh[key] = entry
            pairs.append((entry, reading))
        self._series = fresh  # probes gone since the last scrape are forgotten
        return pairs

    def collect(self) -> list[Metric]:
        latency = metrics.PROBE_LATENCY.series_family()
        recent = metrics.PROBE_LATENCY_RECENT.series_family()
        missed = metrics.PROBE_MISSED.series_family()
        errors = metrics.PROBE_ERRORS.series_family()
        failures = metrics.PROBE_FAILURES.series_family()
        inflight = metrics.PROBE_INFLIGHT.series_family()
        zero_reads = metrics.PROBE_ZERO_READS.series_family()
        interval = metrics.PROBE_INTERVAL.series_family()
        info = metrics.PROBE_INFO.series_family()
        steps = metrics.PROBE_STEP_SECONDS.series_family()
        has_steps = False
        by_touch = self.view.histogram_by_touch()
        zero_by_target: dict[tuple[str, str], int] = {}
        for rendered, reading in self._series_of(self.view.probe_readings()):
            snaps = reading.touches
            for touch, snap in zip(TOUCHES, snaps, strict=True):
                rendered.recent[touch].add(recent, snap)
                if by_touch:
                    rendered.latency_by_touch[touch].add(latency, snap.cumulative, snap.sum_seconds, [snap.lifetime])
            if not by_touch:
                first, repeat = snaps
                merged = [a + b for a, b in zip(first.cumulative, repeat.cumulative, strict=True)]
                lifetimes = [first.lifetime, repeat.lifetime]
                rendered.latency.add(latency, merged, first.sum_seconds + repeat.sum_seconds, lifetimes)
            spec = reading.spec
            missed.add(rendered.missed, reading.missed)
            counts = reading.errors
            for name in sorted({*PRESET_ERRNOS, *counts}):
                errors.add(rendered.error(name), counts.get(name, 0))
            failures.add(rendered.failures, sum(counts.values()))
            inflight.add(rendered.inflight, reading.inflight_seconds)
            interval.add(rendered.interval, spec.interval * reading.slowdown)
            info.add(rendered.info, 1)
            for series, step_ns in zip(rendered.steps, reading.steps, strict=False):
                steps.add(series, step_ns / 1e9)
                has_steps = True
            if not spec.kind.writes:
                key = (reading.target, reading.device)
                zero_by_target[key] = zero_by_target.get(key, 0) + reading.zero_reads
        zero_series = {}
        for (target, device), count in sorted(zero_by_target.items()):
            one = self._zero_series.get((target, device))
            if one is None:
                one = metrics.PROBE_ZERO_READS.series(
                    metrics.PROBE_ZERO_READS.total, {"target": target, "device": device}
                )
            zero_series[(target, device)] = one
            zero_reads.add(one, count)
        self._zero_series = zero_series
        families: list[Metric] = [latency, recent, missed, errors, failures, inflight, zero_reads, interval, info]
        # Only with a metadata probe: an exposition of the default probes stays as it was, byte for byte.
        return [*families, steps] if has_steps else families
