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

from . import __version__, diskstats, probe
from .detectors import DIRECTIONS, LIMITS
from .discovery import kubernetes_volume
from .runtime import Exporter
from .stats import SUMMARY_QUANTILES, TOUCHES
from .warmup import STATES

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
            ("throttle", self.collect_throttle),
            ("warmup", self.collect_warmup),
        ]

    def add_part(self, name: str, func: Callable[[], list[Metric]]) -> None:
        self.parts.append((name, func))

    def collect(self) -> Iterable[Metric]:
        build = GaugeMetricFamily(
            "volprobe_build_info",
            "A metric with a constant '1' value labeled by version, Python version and probe timer (c or python).",
            labels=["version", "python_version", "timer"],
        )
        build.add_metric([__version__, platform.python_version(), probe.TIMER], 1)
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
            "Identity of a probed target and its block device (pv and pod_uid: a Kubernetes volume's, from its path).",
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
                "pv",
                "pod_uid",
            ],
        )
        size = GaugeMetricFamily("volprobe_device_size_bytes", "Size of a probed block device.", labels=["device"])
        seen: set[str] = set()
        for target in targets:
            d = target.device
            mountpoint = target.mount.mount_point if target.mount else ""
            pv, pod = kubernetes_volume(target.path, mountpoint)
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
                    mountpoint,
                    target.mount.fstype if target.mount else "",
                    ",".join(target.disks),
                    pv,
                    pod,
                ],
                1,
            )
            if d.name not in seen:
                seen.add(d.name)
                size.add_metric([d.name], d.size_bytes)
        return [info, size]

    # -- throttling ---------------------------------------------------------------------------------------

    def collect_throttle(self) -> list[Metric]:
        targets, _ = self.exporter.snapshot()
        limit_ops = GaugeMetricFamily(
            "volprobe_limit_ops_per_second",
            "Provisioned IOPS limit of a target's disks, from the config.",
            labels=["target", "device"],
        )
        limit_bytes = GaugeMetricFamily(
            "volprobe_limit_bytes_per_second",
            "Provisioned bandwidth limit of a target's disks, from the config.",
            labels=["target", "device"],
        )
        for target in targets:
            for disk in target.disks:
                if target.config.limits.iops:
                    limit_ops.add_metric([target.name, disk], target.config.limits.iops)
                if target.config.limits.bandwidth:
                    limit_bytes.add_metric([target.name, disk], target.config.limits.bandwidth)
        families: list[Metric] = [limit_ops, limit_bytes]
        detector = self.exporter.detector
        if detector is None:
            return families
        active = GaugeMetricFamily(
            "volprobe_throttle_active",
            "1 while the disk sits on a flat ceiling with requests queueing (a provider's cap).",
            labels=["device", "limit", "dir"],
        )
        ceiling_ops = GaugeMetricFamily(
            "volprobe_throttle_ceiling_ops_per_second",
            "Operations per second of the plateau, while one is detected.",
            labels=["device", "dir"],
        )
        ceiling_bytes = GaugeMetricFamily(
            "volprobe_throttle_ceiling_bytes_per_second",
            "Bytes per second of the plateau, while one is detected.",
            labels=["device", "dir"],
        )
        seconds = CounterMetricFamily(
            "volprobe_throttle_seconds",
            "Seconds spent on a plateau, per limit and direction.",
            labels=["device", "limit", "dir"],
        )
        share = GaugeMetricFamily(
            "volprobe_probe_share_ratio",
            "Share of the disk's completed I/Os over the detector window that were probes.",
            labels=["device"],
        )
        for name, state in sorted(detector.snapshot().items()):
            for direction in DIRECTIONS:
                plateau = state.plateaus.get(direction)
                for limit in LIMITS:
                    active.add_metric([name, limit, direction], 1.0 if plateau and plateau.limit == limit else 0.0)
                    seconds.add_metric([name, limit, direction], state.throttled_seconds.get((limit, direction), 0.0))
                if plateau:
                    ceiling_ops.add_metric([name, direction], plateau.ceiling_ops)
                    ceiling_bytes.add_metric([name, direction], plateau.ceiling_bytes)
            ratio = detector.probe_share(name)
            if ratio is not None:
                share.add_metric([name], ratio)
        return [*families, active, ceiling_ops, ceiling_bytes, seconds, share]

    # -- warm-up ---------------------------------------------------------------------------------------------

    def collect_warmup(self) -> list[Metric]:
        labels = ["target", "device"]
        size = GaugeMetricFamily(
            "volprobe_warmup_size_bytes", "Bytes a warm-up moves: the device size (twice in write mode).", labels=labels
        )
        done = GaugeMetricFamily("volprobe_warmup_done_bytes", "Bytes a warm-up has moved.", labels=labels)
        ratio = GaugeMetricFamily("volprobe_warmup_progress_ratio", "Warm-up progress, 0 to 1.", labels=labels)
        eta = GaugeMetricFamily(
            "volprobe_warmup_eta_seconds", "Seconds to the end of the warm-up at its recent rate.", labels=labels
        )
        state = GaugeMetricFamily(
            "volprobe_warmup_state", "1 for the warm-up's current state.", labels=[*labels, "state"]
        )
        for target, job in list(self.exporter.warmups):
            progress = job.progress
            values = [target.name, target.device.name]
            size.add_metric(values, progress.total_bytes)
            done.add_metric(values, progress.done_bytes)
            ratio.add_metric(values, progress.ratio)
            remaining = progress.eta()
            if remaining is not None:
                eta.add_metric(values, remaining)
            for name in STATES:
                state.add_metric([*values, name], 1.0 if progress.state == name else 0.0)
        return [size, done, ratio, eta, state]

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
