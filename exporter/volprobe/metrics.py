"""Every metric volprobe exports, declared once: name, type, help and labels.

Collectors build their families from these declarations, and the mixin writes its rules and dashboards with
the series names they give (`PROBE_ERRORS.total`, `PROBE_LATENCY.bucket`), so a rename reaches all three;
a test checks that every volprobe_* name in the committed rules and dashboards is declared here. Names are a
public contract: renaming one means keeping the old series as well until dashboards and rules have moved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar, cast, overload

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from . import diskstats
from .exposition import Series, SeriesFamily, series

_FAMILIES: dict[str, Callable[..., Metric]] = {
    "counter": CounterMetricFamily,
    "gauge": GaugeMetricFamily,
    "histogram": HistogramMetricFamily,
    "summary": SummaryMetricFamily,
}


F = TypeVar("F", bound=Metric)


@dataclass(frozen=True, init=False)
class MetricSpec(Generic[F]):
    """One family's declaration. A literal `kind` gives the type family() returns (MetricSpec[GaugeMetricFamily]
    for "gauge"), so that a collector's add_metric() calls are checked against that family's."""

    name: str  # the family name; counters add _total to their sample, histograms and summaries _bucket etc.
    kind: str  # counter, gauge, histogram or summary
    help: str
    labels: tuple[str, ...]

    @overload
    def __init__(
        self: MetricSpec[CounterMetricFamily], name: str, kind: Literal["counter"], help: str, labels: tuple[str, ...]
    ) -> None: ...
    @overload
    def __init__(
        self: MetricSpec[GaugeMetricFamily], name: str, kind: Literal["gauge"], help: str, labels: tuple[str, ...]
    ) -> None: ...
    @overload
    def __init__(
        self: MetricSpec[HistogramMetricFamily],
        name: str,
        kind: Literal["histogram"],
        help: str,
        labels: tuple[str, ...],
    ) -> None: ...
    @overload
    def __init__(
        self: MetricSpec[SummaryMetricFamily], name: str, kind: Literal["summary"], help: str, labels: tuple[str, ...]
    ) -> None: ...
    @overload
    def __init__(self: MetricSpec[Any], name: str, kind: str, help: str, labels: tuple[str, ...]) -> None: ...
    def __init__(self, name: str, kind: str, help: str, labels: tuple[str, ...]) -> None:
        if kind not in _FAMILIES:
            raise ValueError(f"{name}: kind {kind!r} is not one of {', '.join(_FAMILIES)}")
        for attribute, value in (("name", name), ("kind", kind), ("help", help), ("labels", labels)):
            object.__setattr__(self, attribute, value)  # frozen

    def family(self) -> F:
        """A fresh, empty family for one scrape."""
        return cast(F, _FAMILIES[self.kind](self.name, self.help, labels=list(self.labels)))

    def series_family(self) -> SeriesFamily:
        """A fresh, empty family for one scrape, filled from Series made by series()."""
        return SeriesFamily(self.name, self.help, self.kind)

    def series(self, sample_name: str, labels: dict[str, str]) -> Series:
        """One of this family's series, rendered once, for a collector to keep as long as its labels hold."""
        extra = {"histogram": {"le"}, "summary": {"quantile"}}.get(self.kind, set())
        if not set(self.labels) <= set(labels) <= {*self.labels, *extra} or sample_name not in self.series_names():
            raise ValueError(f"{sample_name} {sorted(labels)} is not a series of {self.name} {self.labels}")
        return series(sample_name, labels)

    @property
    def total(self) -> str:
        assert self.kind == "counter", self.name
        return f"{self.name}_total"

    @property
    def bucket(self) -> str:
        assert self.kind == "histogram", self.name
        return f"{self.name}_bucket"

    @property
    def count(self) -> str:
        assert self.kind in ("histogram", "summary"), self.name
        return f"{self.name}_count"

    @property
    def sum(self) -> str:
        assert self.kind in ("histogram", "summary"), self.name
        return f"{self.name}_sum"

    def series_names(self) -> tuple[str, ...]:
        """Every sample name the family exposes."""
        if self.kind == "counter":
            return (self.total,)
        if self.kind == "histogram":
            return (self.bucket, self.count, self.sum)
        if self.kind == "summary":
            return (self.name, self.count, self.sum)
        return (self.name,)

    def __str__(self) -> str:
        """The name a query uses for a gauge, counter or summary quantile."""
        return self.total if self.kind == "counter" else self.name


PROBE = ("target", "device", "op")
PROBE_TOUCH = (*PROBE, "touch")
TARGET = ("target", "device")
DEVICE = ("device",)

# -- build and scrape ---------------------------------------------------------------------------------------

BUILD_INFO = MetricSpec(
    "volprobe_build_info",
    "gauge",
    "A metric with a constant '1' value labeled by version, Python version and probe timer (c or python).",
    ("version", "python_version", "timer"),
)
CAPABILITY_AVAILABLE = MetricSpec(
    "volprobe_capability_available",
    "gauge",
    "1 if the process may use a feature, 0 if it falls back without it (idle_io_priority: ioprio_set for "
    "warm-ups; udev_monitor: netlink udev events for discovery). Present once the feature was needed or checked.",
    ("capability",),
)
CAPABILITIES_KEPT = MetricSpec(
    "volprobe_capabilities_kept_info",
    "gauge",
    "The Linux capabilities volprobe kept at start, comma-separated, or none: every other one was dropped from "
    "every set, the bounding set included, and no_new_privs set.",
    ("capabilities",),
)
CONFIG_RELOAD_SUCCESSFUL = MetricSpec(
    "volprobe_config_last_reload_successful",
    "gauge",
    "Whether the last configuration reload (SIGHUP) succeeded.",
    (),
)
CONFIG_RELOAD_SUCCESS_TIME = MetricSpec(
    "volprobe_config_last_reload_success_timestamp_seconds",
    "gauge",
    "Unix time of the last successful configuration load (start-up or reload).",
    (),
)
WEB_CONFIG_RELOAD_SUCCESSFUL = MetricSpec(
    "volprobe_web_config_last_reload_successful",
    "gauge",
    "Whether the last reload of --web.config.file (or a file it names, as a certificate) succeeded.",
    (),
)
WEB_CONFIG_RELOAD_SUCCESS_TIME = MetricSpec(
    "volprobe_web_config_last_reload_success_timestamp_seconds",
    "gauge",
    "Unix time of the last successful load of --web.config.file (start-up or reload).",
    (),
)
THREAD_RESTARTS = MetricSpec(
    "volprobe_thread_restarts",
    "counter",
    "Unexpected errors that ended a long-lived thread's work (thread: probe, warmup, throttle, provider, "
    "discovery), logged with their traceback; the work restarts after a back-off of 1 s doubling to 60 s. "
    "Every thread value is present from the start, at 0.",
    ("thread",),
)
SCRAPE_SUCCESS = MetricSpec(
    "volprobe_scrape_collector_success", "gauge", "Whether a collector succeeded.", ("collector",)
)
SCRAPE_DURATION = MetricSpec(
    "volprobe_scrape_collector_duration_seconds", "gauge", "Duration of a collector scrape.", ("collector",)
)

# -- probes ---------------------------------------------------------------------------------------------------

PROBE_LATENCY = MetricSpec(
    "volprobe_probe_latency_seconds",
    "histogram",
    "Latency of queue-depth-1 direct I/O probes, timed around the syscall alone.",
    PROBE,
)
# The same family with the touch label, as it was before the split moved to the recent summary alone
# (defaults.histogram_by_touch: true); every rule and panel sums over touch, so both layouts serve them.
PROBE_LATENCY_BY_TOUCH = replace(PROBE_LATENCY, labels=PROBE_TOUCH)
PROBE_LATENCY_RECENT = MetricSpec(
    "volprobe_probe_latency_recent_seconds",
    "summary",
    "Probe latency quantiles over the sliding window, from a histogram with <=0.78% relative error.",
    PROBE_TOUCH,
)
PROBE_MISSED = MetricSpec(
    "volprobe_probe_missed", "counter", "Probe slots skipped because an earlier probe outlived its slot.", PROBE
)
PROBE_ERRORS = MetricSpec(
    "volprobe_probe_errors",
    "counter",
    "Failed probes by errno name (SHORT: short transfer; REFUSED: a safety check turned down what an open "
    "found); EIO is present from the probe's start, at 0.",
    (*PROBE, "errno"),
)
PROBE_FAILURES = MetricSpec(
    "volprobe_probe_failures",
    "counter",
    "Failed probes, whatever the error; present from the probe's start, at 0, so increase() sees the first one.",
    PROBE,
)
PROBE_INFLIGHT = MetricSpec(
    "volprobe_probe_inflight_seconds",
    "gauge",
    "Age of the probe in flight at scrape time; 0 when none.",
    ("target", "op"),
)
PROBE_ZERO_READS = MetricSpec(
    "volprobe_probe_zero_reads",
    "counter",
    "Read probes that returned an all-zero block (never-written blocks of thin volumes).",
    TARGET,
)
PROBE_INTERVAL = MetricSpec(
    "volprobe_probe_interval_seconds", "gauge", "Current interval between probes (longer while backing off).", PROBE
)
# Where a metadata probe's time goes: one counter per step (ops.METADATA.steps, 6 series per metadata probe)
# rather than a histogram per step (6 x 29). rate(step) / rate(latency_count) is the mean time of each step,
# and a slow rename or directory fsync shows as its step's share growing; the histogram has the whole sequence.
PROBE_STEP_SECONDS = MetricSpec(
    "volprobe_probe_metadata_step_seconds",
    "counter",
    "Seconds metadata probes spent in each step of their sequences (create, write, fsync, rename, fsync_dir, "
    "unlink), over the sequences that succeeded.",
    (*TARGET, "step"),
)
PROBE_INFO = MetricSpec(
    "volprobe_probe_info",
    "gauge",
    "Probe specification: block size, configured interval, O_DSYNC, and what its requests go to (device, "
    "probe_file, commit_log or metadata_directory).",
    (*PROBE, "block_size_bytes", "interval", "sync", "source"),
)

# -- targets --------------------------------------------------------------------------------------------------

TARGET_INFO = MetricSpec(
    "volprobe_target_info",
    "gauge",
    "Identity of a probed target and its block device (pv and pod_uid: the Kubernetes volume its path is in, "
    "else one that kubelet mounts from its device; driver: that volume's CSI driver, from its vol_data.json, or "
    "in-tree plugin).",
    (
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
        "driver",
    ),
)
TARGET_DISK_INFO = MetricSpec(
    "volprobe_target_disk_info",
    "gauge",
    "1 for each whole disk a target's I/O lands on (one for a plain disk or partition; each member of an md or "
    "dm device): the disks whose diskstats and throttle series belong to the target.",
    ("target", "device", "disk"),
)
DEVICE_SIZE = MetricSpec("volprobe_device_size_bytes", "gauge", "Size of a probed block device.", DEVICE)

# -- throttling -----------------------------------------------------------------------------------------------

MOUNT_RESPONSIVE = MetricSpec(
    "volprobe_mount_responsive",
    "gauge",
    "1 while a directory target's mount answers statfs and a stat of the directory within mount_check.timeout, "
    "0 while a check is outstanding longer (a hung mount), failed, or none answered yet.",
    TARGET,
)
MOUNT_LAST_RESPONSE_TIME = MetricSpec(
    "volprobe_mount_last_response_timestamp_seconds",
    "gauge",
    "Unix time of a directory target's mount's last answer to a mount check; 0 if it never answered.",
    TARGET,
)
MOUNT_CHECK_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
MOUNT_CHECK_SECONDS = MetricSpec(
    "volprobe_mount_check_duration_seconds",
    "histogram",
    "How long a directory target's mount took to answer each mount check (statfs and a stat; errors too), once it "
    "answered: a hung check counts when it returns, volprobe_mount_responsive says so meanwhile.",
    TARGET,
)
LIMIT_OPS = MetricSpec(
    "volprobe_limit_ops_per_second", "gauge", "Provisioned IOPS limit of a target's disks, from the config.", TARGET
)
LIMIT_BYTES = MetricSpec(
    "volprobe_limit_bytes_per_second",
    "gauge",
    "Provisioned bandwidth limit of a target's disks, from the config.",
    TARGET,
)
THROTTLE_ACTIVE = MetricSpec(
    "volprobe_throttle_active",
    "gauge",
    "1 while the disk is throttled at a limit. source=inferred: it sits on a flat ceiling with requests queueing "
    "(dir read or write); source=provider: the device's own statistics (AWS NVMe) count demand over its limit "
    "(iops, bandwidth, instance_iops, instance_bandwidth; dir total) for most of the last 15 s.",
    ("device", "limit", "dir", "source"),
)
THROTTLE_CEILING_OPS = MetricSpec(
    "volprobe_throttle_ceiling_ops_per_second",
    "gauge",
    "Operations per second of the plateau, while one is detected.",
    ("device", "dir"),
)
THROTTLE_CEILING_BYTES = MetricSpec(
    "volprobe_throttle_ceiling_bytes_per_second",
    "gauge",
    "Bytes per second of the plateau, while one is detected.",
    ("device", "dir"),
)
THROTTLE_SECONDS = MetricSpec(
    "volprobe_throttle_seconds",
    "counter",
    "Seconds spent on a plateau, per limit and direction.",
    ("device", "limit", "dir"),
)
THROTTLE_CHECKS = MetricSpec(
    "volprobe_throttle_checks",
    "counter",
    "Active checks (a burst of reads) of plateaus the probes could not judge, by verdict: capped, uncapped, "
    "inconclusive.",
    ("device", "result"),
)
THROTTLE_UNLOADED = MetricSpec(
    "volprobe_throttle_unloaded_latency_seconds",
    "gauge",
    "The disk's unloaded service time the detector compares the await with: the probes' lowest, or remembered.",
    ("device", "dir"),
)
PROBE_SHARE = MetricSpec(
    "volprobe_probe_share_ratio",
    "gauge",
    "Share of the disk's completed I/Os over the detector window that were probes.",
    DEVICE,
)

# -- the provider's own statistics (AWS NVMe log page 0xD0; names as the EBS CSI driver's, prefixed) --------------

NVME = ("device", "kind")  # kind: ebs or instance_store
NVME_OP = (*NVME, "op")
NVME_OPS = MetricSpec("volprobe_nvme_ops", "counter", "Operations the device completed, by its own count.", NVME_OP)
NVME_BYTES = MetricSpec("volprobe_nvme_bytes", "counter", "Bytes the device moved, by its own count.", NVME_OP)
NVME_SECONDS = MetricSpec(
    "volprobe_nvme_seconds",
    "counter",
    "Time the device spent on completed operations, by its own count.",
    (*NVME, "op"),
)
NVME_EXCEEDED = MetricSpec(
    "volprobe_nvme_exceeded_seconds",
    "counter",
    "Time during which demand exceeded a limit, as the provider counts it: scope volume (the EBS volume's "
    "provisioned IOPS or throughput) or instance (the instance's EBS or local-storage limits).",
    (*NVME, "scope", "limit"),
)
NVME_QUEUE = MetricSpec("volprobe_nvme_queue_length", "gauge", "Requests queued at the device, by its own count.", NVME)
NVME_LATENCY = MetricSpec(
    "volprobe_nvme_latency_seconds",
    "histogram",
    "Latency of completed operations as the device measures it (its own histogram; the sum is its total time).",
    NVME_OP,
)
NVME_UP = MetricSpec(
    "volprobe_nvme_stats_up",
    "gauge",
    "1 if the last read of the device's statistics succeeded, 0 if it failed (the log says why).",
    NVME,
)

# -- state ----------------------------------------------------------------------------------------------------

STATE_STATUS = MetricSpec(
    "volprobe_state_status",
    "gauge",
    "1 for the current status of a volume's remembered state: ok, new (nothing saved yet), corrupt or foreign "
    "(found at start and set aside), unwritable (kept in memory only).",
    ("device", "identity", "status"),
)
STATE_AGE = MetricSpec(
    "volprobe_state_age_seconds",
    "gauge",
    "Seconds since volprobe first remembered the volume (by its identity: volume id, WWN, serial, or name+size).",
    ("device", "identity"),
)

# -- warm-up --------------------------------------------------------------------------------------------------

WARMUP_SIZE = MetricSpec(
    "volprobe_warmup_size_bytes", "gauge", "Bytes a warm-up moves: the device size (twice in write mode).", TARGET
)
WARMUP_DONE = MetricSpec("volprobe_warmup_done_bytes", "gauge", "Bytes a warm-up has moved.", TARGET)
WARMUP_PROGRESS = MetricSpec("volprobe_warmup_progress_ratio", "gauge", "Warm-up progress, 0 to 1.", TARGET)
WARMUP_ETA = MetricSpec(
    "volprobe_warmup_eta_seconds", "gauge", "Seconds to the end of the warm-up at its recent rate.", TARGET
)
WARMUP_STATE = MetricSpec("volprobe_warmup_state", "gauge", "1 for the warm-up's current state.", (*TARGET, "state"))


# -- diskstats: named as node_exporter's node_disk_* ----------------------------------------------------------


@dataclass(frozen=True)
class DiskMetric:
    field: str  # of diskstats.DiskStats
    scale: float  # to base units
    spec: MetricSpec[Any]


def _disk(field: str, suffix: str, kind: str, help_text: str, scale: float = 1) -> DiskMetric:
    return DiskMetric(field, scale, MetricSpec(f"volprobe_disk_{suffix}", kind, help_text, DEVICE))


_MS = 1e-3
DISK_READS = _disk("reads_completed", "reads_completed", "counter", "Reads completed successfully.")
DISK_READS_MERGED = _disk("reads_merged", "reads_merged", "counter", "Reads merged with an adjacent queued read.")
DISK_READ_BYTES = _disk("sectors_read", "read_bytes", "counter", "Bytes read.", diskstats.SECTOR_BYTES)
DISK_READ_TIME = _disk("read_time_ms", "read_time_seconds", "counter", "Seconds spent by all reads.", _MS)
DISK_WRITES = _disk("writes_completed", "writes_completed", "counter", "Writes completed successfully.")
DISK_WRITES_MERGED = _disk("writes_merged", "writes_merged", "counter", "Writes merged with an adjacent queued write.")
DISK_WRITTEN_BYTES = _disk("sectors_written", "written_bytes", "counter", "Bytes written.", diskstats.SECTOR_BYTES)
DISK_WRITE_TIME = _disk("write_time_ms", "write_time_seconds", "counter", "Seconds spent by all writes.", _MS)
DISK_IO_NOW = _disk(
    "io_in_progress", "io_now", "gauge", "Requests in flight (issued to the driver, not yet completed)."
)
DISK_IO_TIME = _disk("io_time_ms", "io_time_seconds", "counter", "Seconds with at least one request in flight.", _MS)
DISK_IO_TIME_WEIGHTED = _disk(
    "weighted_io_time_ms",
    "io_time_weighted_seconds",
    "counter",
    "Request-seconds in flight (queue depth x time).",
    _MS,
)
DISK_DISCARDS = _disk("discards_completed", "discards_completed", "counter", "Discards completed successfully.")
DISK_DISCARDS_MERGED = _disk("discards_merged", "discards_merged", "counter", "Discards merged.")
DISK_DISCARDED_SECTORS = _disk("sectors_discarded", "discarded_sectors", "counter", "Sectors discarded.")
DISK_DISCARD_TIME = _disk("discard_time_ms", "discard_time_seconds", "counter", "Seconds spent by all discards.", _MS)
DISK_FLUSHES = _disk("flushes_completed", "flush_requests", "counter", "Flush requests completed successfully.")
DISK_FLUSH_TIME = _disk(
    "flush_time_ms", "flush_requests_time_seconds", "counter", "Seconds spent by all flush requests.", _MS
)

DISK_METRICS: tuple[DiskMetric, ...] = tuple(v for v in list(globals().values()) if isinstance(v, DiskMetric))
ALL: tuple[MetricSpec[Any], ...] = (
    *(v for v in list(globals().values()) if isinstance(v, MetricSpec)),
    *(d.spec for d in DISK_METRICS),
)


def series_names() -> set[str]:
    """Every sample name volprobe can expose (process_* and python_info come from prometheus_client)."""
    return {name for spec in ALL for name in spec.series_names()}
