"""The Prometheus collector: fresh metric families on every scrape, from in-memory state and /proc/diskstats.

Nothing here waits on a probed device. Each part (probe, diskstats, ...) is timed and isolated like
node_exporter's collectors: one that fails is reported by volprobe_scrape_collector_success and the others
are still served.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from . import __version__, diskstats
from .runtime import Exporter
from .stats import SUMMARY_QUANTILES, TOUCHES

log = logging.getLogger(__name__)

PROBE_LABELS = ["target", "device", "op"]

# (diskstats field, metric name without volprobe_disk_, help, scale to base units, kind)
DISK_METRICS: list[tuple[str, str, str, float, str]] = [
    ("reads_completed", "reads_completed", "Reads completed successfully.", 1, "counter"),
    ("reads_merged", "reads_merged", "Reads merged with an adjacent queued read.", 1, "counter"),
    ("sectors_read", "read_bytes", "Bytes read.", diskstats.SECTOR_BYTES, "counter"),
    ("read_time_ms", "read_time_seconds", "Seconds spent by all reads.", 1e-3, "counter"),
    ("writes_completed", "writes_completed", "Writes completed successfully.", 1, "counter"),
    ("writes_merged", "writes_merged", "Writes merged with an adjacent queued write.", 1, "counter"),
    ("sectors_written", "written_bytes", "Bytes written.", diskstats.SECTOR_BYTES, "counter"),
    ("write_time_ms", "write_time_seconds", "Seconds spent by all writes.", 1e-3, "counter"),
    ("io_in_progress", "io_now", "Requests in flight (issued to the driver, not yet completed).", 1, "gauge"),
    ("io_time_ms", "io_time_seconds", "Seconds with at least one request in flight.", 1e-3, "counter"),
    (
        "weighted_io_time_ms",
        "io_time_weighted_seconds",
        "Request-seconds in flight (queue depth x time).",
        1e-3,
        "counter",
    ),
    ("discards_completed", "discards_completed", "Discards completed successfully.", 1, "counter"),
    ("discards_merged", "discards_merged", "Discards merged.", 1, "counter"),
    ("sectors_discarded", "discarded_sectors", "Sectors discarded.", 1, "counter"),
    ("discard_time_ms", "discard_time_seconds", "Seconds spent by all discards.", 1e-3, "counter"),
    ("flushes_completed", "flush_requests", "Flush requests completed successfully.", 1, "counter"),
    ("flush_time_ms", "flush_requests_time_seconds", "Seconds spent by all flush requests.", 1e-3, "counter"),
]


def _family(kind: str, name: str, documentation: str, labels: list[str]) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, documentation, labels=labels)
    return GaugeMetricFamily(name, documentation, labels=labels)


class VolprobeCollector(Collector):
    def __init__(self, exporter: Exporter, proc_root: str | Path = "/proc") -> None:
        self.exporter = exporter
        self.proc_root = Path(proc_root)
        self.parts: list[tuple[str, Callable[[], list[Metric]]]] = [
            ("probe", self.collect_probes),
            ("target", self.collect_targets),
            ("diskstats", self.collect_diskstats),
        ]

    def add_part(self, name: str, func: Callable[[], list[Metric]]) -> None:
        self.parts.append((name, func))

    def collect(self) -> Iterable[Metric]:
        build = GaugeMetricFamily(
            "volprobe_build_info",
            "A metric with a constant '1' value labeled by version and Python version.",
            labels=["version", "python_version"],
        )
        build.add_metric([__version__, platform.python_version()], 1)
        yield build
        success = GaugeMetricFamily(
            "volprobe_scrape_collector_success", "Whether a collector succeeded.", labels=["collector"]
        )
        duration = GaugeMetricFamily(
            "volprobe_scrape_collector_duration_seconds",
            "Duration of a collector scrape.",
            labels=["collector"],
        )
        for name, func in self.parts:
            start = time.perf_counter()
            try:
                families = func()
                ok = 1.0
            except Exception:
                log.exception("collector %s failed", name)
                families, ok = [], 0.0
            duration.add_metric([name], time.perf_counter() - start)
            success.add_metric([name], ok)
            yield from families
        yield success
        yield duration

    # -- probes -------------------------------------------------------------------------------------

    def collect_probes(self) -> list[Metric]:
        _, probes = self.exporter.snapshot()
        touch_labels = [*PROBE_LABELS, "touch"]
        latency = HistogramMetricFamily(
            "volprobe_probe_latency_seconds",
            "Latency of queue-depth-1 direct I/O probes, timed around the syscall alone.",
            labels=touch_labels,
        )
        recent = SummaryMetricFamily(
            "volprobe_probe_latency_recent_seconds",
            "Probe latency quantiles over the sliding window, from a histogram with <=0.78% relative error.",
            labels=touch_labels,
        )
        missed = CounterMetricFamily(
            "volprobe_probe_missed",
            "Probe slots skipped because an earlier probe outlived its slot.",
            labels=PROBE_LABELS,
        )
        errors = CounterMetricFamily(
            "volprobe_probe_errors",
            "Failed probes by errno name (SHORT: short transfer).",
            labels=[*PROBE_LABELS, "errno"],
        )
        inflight = GaugeMetricFamily(
            "volprobe_probe_inflight_seconds",
            "Age of the probe in flight at scrape time; 0 when none.",
            labels=["target", "op"],
        )
        zero_reads = CounterMetricFamily(
            "volprobe_probe_zero_reads",
            "Read probes that returned an all-zero block (never-written blocks of thin volumes).",
            labels=["target", "device"],
        )
        interval = GaugeMetricFamily(
            "volprobe_probe_interval_seconds",
            "Current interval between probes (longer while backing off).",
            labels=PROBE_LABELS,
        )
        info = GaugeMetricFamily(
            "volprobe_probe_info",
            "Probe specification: block size, configured interval, O_DSYNC.",
            labels=[*PROBE_LABELS, "block_size_bytes", "interval", "sync"],
        )
        now = time.perf_counter_ns()
        zero_by_target: dict[tuple[str, str], int] = {}
        for running in probes:
            labels = running.labels
            values = [labels["target"], labels["device"], labels["op"]]
            for touch in TOUCHES:
                snap = running.stats.snapshot(touch, now)
                latency.add_metric(
                    [*values, touch], [(floatToGoString(b), c) for b, c in snap.buckets], snap.sum_seconds
                )
                for q, value in zip(SUMMARY_QUANTILES, snap.quantiles, strict=True):
                    recent.add_sample(
                        "volprobe_probe_latency_recent_seconds",
                        {**labels, "touch": touch, "quantile": floatToGoString(q)},
                        value,
                    )
                recent.add_sample("volprobe_probe_latency_recent_seconds_count", {**labels, "touch": touch}, snap.count)
                recent.add_sample(
                    "volprobe_probe_latency_recent_seconds_sum", {**labels, "touch": touch}, snap.sum_seconds
                )
            worker = running.worker
            missed.add_metric(values, worker.missed)
            for name, count in sorted(worker.error_counts().items()):
                errors.add_metric([*values, name], count)
            inflight.add_metric([labels["target"], labels["op"]], worker.inflight_seconds(now))
            interval.add_metric(values, running.config.interval * worker.slowdown)
            info.add_metric(
                [
                    *values,
                    str(running.config.block_size),
                    f"{running.config.interval:g}s",
                    str(running.config.sync and running.config.op == "write").lower(),
                ],
                1,
            )
            if running.config.op == "read":
                key = (labels["target"], labels["device"])
                zero_by_target[key] = zero_by_target.get(key, 0) + worker.zero_reads
        for (target, device), count in sorted(zero_by_target.items()):
            zero_reads.add_metric([target, device], count)
        return [latency, recent, missed, errors, inflight, zero_reads, interval, info]

    def collect_targets(self) -> list[Metric]:
        targets, _ = self.exporter.snapshot()
        info = GaugeMetricFamily(
            "volprobe_target_info",
            "Identity of a probed target and its block device.",
            labels=[
                "target",
                "device",
                "path",
                "kind",
                "serial",
                "model",
                "vendor",
                "wwn",
                "volume_id",
                "mountpoint",
                "fstype",
                "disks",
            ],
        )
        size = GaugeMetricFamily("volprobe_device_size_bytes", "Size of a probed block device.", labels=["device"])
        seen: set[str] = set()
        for target in targets:
            d = target.device
            info.add_metric(
                [
                    target.name,
                    d.name,
                    target.path,
                    d.kind,
                    d.serial,
                    d.model,
                    d.vendor,
                    d.wwn,
                    d.volume_id,
                    target.mount.mount_point if target.mount else "",
                    target.mount.fstype if target.mount else "",
                    ",".join(target.disks),
                ],
                1,
            )
            if d.name not in seen:
                seen.add(d.name)
                size.add_metric([d.name], d.size_bytes)
        return [info, size]

    # -- diskstats ----------------------------------------------------------------------------------

    def collect_diskstats(self) -> list[Metric]:
        wanted = None if self.exporter.config.diskstats == "all" else self.exporter.probed_devices()
        stats = diskstats.read(self.proc_root)
        families = []
        for field, suffix, help_text, scale, kind in DISK_METRICS:
            family = _family(kind, f"volprobe_disk_{suffix}", help_text, ["device"])
            for name in sorted(stats):
                if wanted is not None and name not in wanted:
                    continue
                value = getattr(stats[name], field)
                if value is not None:
                    family.add_metric([name], value * scale)
            if family.samples:
                families.append(family)
        return families
