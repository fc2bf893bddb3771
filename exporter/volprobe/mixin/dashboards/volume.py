"""Volume: one volume in depth. Its probes' latency (distribution, percentiles, first and repeat touch, the
device's own), its disk's I/O against the throttle ceiling and the provisioned limit, and its probes' health."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from grafana_foundation_sdk.builders import common, dashboard, prometheus
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models.dashboard import DashboardLinkType, Panel, Threshold, ThresholdsMode

from ... import metrics, ops, units
from .. import MixinConfig
from ..rules import node_disk
from .panels import LATENCY, Layout, latency_heatmap, new_dashboard, quantile, query, series
from .variables import (
    TARGET_INFO,
    Scope,
    claim_variables,
    host_variable,
    matchers,
    query_variable,
    selected_target_variable,
    with_variables,
)

RECENT = metrics.PROBE_LATENCY_RECENT.name  # a summary: its quantiles are the family name itself
# The probes of the block layer (O_DIRECT reads and writes), which the device's own latency is comparable with;
# the filesystem's (commit, metadata) have panels of their own (filesystem()).
BLOCK_OPS = 'op=~"' + "|".join(op.name for op in ops.OPS.values() if not op.buffered) + '"'


def build(c: MixinConfig) -> dashboard.Dashboard:
    scope = Scope.of(c)
    device_var = query_variable("device", "device", f"label_values({TARGET_INFO}{{{scope.target}}}, device)")
    # A target on an md or dm device spans several disks: each is a series of its own.
    disk_var = query_variable(
        "disk", "disk", f"label_values({metrics.TARGET_DISK_INFO.name}{{{scope.target}}}, disk)", many=True
    )
    d = with_variables(
        new_dashboard(c, "volume", "volprobe / Volume", "One volume in depth: probe latency, diskstats, throttling."),
        scope,
        *claim_variables(scope),
        selected_target_variable(scope),
        device_var,
        disk_var,
        # node_exporter's diskstats are selected by the host of the instance (disk_io): a hidden variable.
        *((host_variable(scope),) if c.diskstats == "node_exporter" else ()),
        one_instance=True,
    )
    for link in links(c):
        d = d.link(link)
    layout = Layout()
    # The filesystem probes' panels come last, so every panel before them keeps its id and place.
    panels = (*latency(c, scope, layout), *disk_io(c, scope, layout), *probe_health(scope, layout))
    for panel in (*panels, *filesystem(c, scope, layout)):
        d = d.with_panel(panel)
    return d


def links(c: MixinConfig) -> Iterator[dashboard.DashboardLink]:
    """To this volume's warm-up, and to the Migration dashboard with this volume as the baseline."""
    for name, title, extra in (
        ("warmup", "Warm-up of this volume", "&${cluster:queryparam}&${instance:queryparam}"),
        (
            "migration",
            "Compare with another volume (Migration)",
            "&var-baseline_instance=${instance:percentencode}&var-baseline=${target:percentencode}"
            "&var-candidate_instance=${instance:percentencode}",
        ),
    ):
        yield (
            dashboard.DashboardLink(title)
            .type(DashboardLinkType.LINK)
            .url(f"/d/{c.dashboard_uid_prefix}-{name}/?${{datasource:queryparam}}&${{job:queryparam}}{extra}")
            .keep_time(True)
            .include_vars(False)
            .target_blank(False)
            .icon("dashboard")
            .tooltip(title)
            # The SDK puts every link in Grafana 12.3's controls menu, a key Grafana 12.2 does not know:
            # without it the links sit in the links bar on every version.
            .placement(None)  # type: ignore[arg-type]
        )


def latency(c: MixinConfig, scope: Scope, layout: Layout) -> Iterator[Builder[Panel]]:
    """The probes' latency: a heatmap per op, the percentiles, the device's own beside them, first touches."""
    target, disk = scope.target, f'{scope.base}, device=~"$disk"'
    for op in (ops.READ.name, ops.WRITE.name):  # apart: a 100 us read and a 2 ms O_DSYNC write would blur
        yield latency_heatmap(
            c,
            layout,
            f"Probe latency distribution, {op}s",
            f"Probes of the {op} probe per latency bucket over time, from the histogram (buckets as exported, "
            "not recalculated).",
            f'{target}, op="{op}"',
        )
    block = f"{target}, {BLOCK_OPS}"
    yield series(
        layout,
        "Percentiles per op",
        "s",
        [
            query("A", quantile(c, 0.5, block), "p50 {{op}}"),
            query("B", quantile(c, 0.99, block), "p99 {{op}}"),
            query("C", quantile(c, 0.999, block), "p99.9 {{op}}"),
        ],
        description="From the histogram buckets over $__rate_interval: the read and write probes (the block "
        "layer); commit and metadata probes have panels of their own below.",
    )
    # The device's own histogram is exported classic only (no native form): its buckets, in either build.
    nvme = metrics.NVME_LATENCY.bucket
    yield series(
        layout,
        "Device-side latency (the provider's own) beside the probes' p99",
        "s",
        [
            query(
                "A",
                f"histogram_quantile(0.99, sum by (device, op, le) (rate({nvme}{{{disk}}}[$__rate_interval])))",
                "device p99 {{op}} {{device}}",
            ),
            query(
                "B",
                f"histogram_quantile(0.5, sum by (device, op, le) (rate({nvme}{{{disk}}}[$__rate_interval])))",
                "device p50 {{op}} {{device}}",
            ),
            query("C", quantile(c, 0.99, block), "probe p99 {{op}}"),
        ],
        description="AWS NVMe devices (EBS, instance store) measure their own latency: all I/O at the device, "
        "the queue in the guest excluded. Beside the read and write probes' p99 (queue-depth 1, through the "
        "guest's stack), a gap is the guest's queue; no gap but both high is the volume. Empty for other devices.",
    )
    yield series(
        layout,
        "First vs repeat touch (p50 over the recent window)",
        "s",
        [query("A", f'{RECENT}{{{target}, quantile="0.5"}}', "{{op}} {{touch}}")],
        description="First-touch probes go to offsets never probed: on thin or restored volumes they pay allocation.",
    )


def disk_io(c: MixinConfig, scope: Scope, layout: Layout) -> Iterator[Builder[Panel]]:
    """All I/O of the target's disk (diskstats): against the throttle ceiling and the provisioned limit, the
    provider's own count of time over its limits, await and queue depth. The diskstats are volprobe's
    (volprobe_disk_*), or with diskstats: node_exporter, node_exporter's node_disk_* of the same device on the
    instance's host (the hidden host variable: $instance without its :port)."""
    target, disk = scope.target, f'{scope.base}, device=~"$disk"'
    name: Callable[[str], str] = str  # a volprobe_disk_* name as it is
    dev = f'{scope.base}, device="$device"'
    if c.diskstats == "node_exporter":
        name = node_disk
        dev = matchers(
            c.node_exporter_selector, f'{scope.cluster}=~"$cluster"', 'instance=~"$host(:[0-9]+)?"', 'device="$device"'
        )
    reads, writes = name(metrics.DISK_READS.spec.total), name(metrics.DISK_WRITES.spec.total)
    read_bytes, written_bytes = name(metrics.DISK_READ_BYTES.spec.total), name(metrics.DISK_WRITTEN_BYTES.spec.total)
    read_time, write_time = name(metrics.DISK_READ_TIME.spec.total), name(metrics.DISK_WRITE_TIME.spec.total)
    yield series(
        layout,
        "IOPS, with the throttle ceiling and the provisioned limit",
        "iops",
        [
            query("A", f"rate({reads}{{{dev}}}[$__rate_interval])", "reads {{device}}"),
            query("B", f"rate({writes}{{{dev}}}[$__rate_interval])", "writes {{device}}"),
            query("C", f"{metrics.THROTTLE_CEILING_OPS.name}{{{disk}}}", "ceiling {{dir}} {{device}}"),
            query("D", f"{metrics.LIMIT_OPS.name}{{{target}}}", "limit"),
        ],
        description="All I/O of the disk (from diskstats, the probes' included), the ceiling the throttle detector "
        "found, and the limit configured for the target.",
    )
    yield series(
        layout,
        "Throughput, with the throttle ceiling and the provisioned limit",
        "Bps",
        [
            query("A", f"rate({read_bytes}{{{dev}}}[$__rate_interval])", "read {{device}}"),
            query("B", f"rate({written_bytes}{{{dev}}}[$__rate_interval])", "written {{device}}"),
            query("C", f"{metrics.THROTTLE_CEILING_BYTES.name}{{{disk}}}", "ceiling {{dir}} {{device}}"),
            query("D", f"{metrics.LIMIT_BYTES.name}{{{target}}}", "limit"),
        ],
        description="Bytes per second of the disk (from diskstats), the ceiling found, and the configured limit.",
    )
    yield series(
        layout,
        "Time over the provider's limits (its own count)",
        "percentunit",
        [
            query(
                "A",
                f"rate({metrics.NVME_EXCEEDED.total}{{{disk}}}[$__rate_interval])",
                "{{scope}} {{limit}} {{device}}",
            ),
        ],
        description="Share of the time demand exceeded the volume's provisioned IOPS or throughput (scope "
        "volume) or the instance's EBS limits (scope instance), as AWS NVMe devices count it. Above 50% for "
        '15 s, volprobe_throttle_active{source="provider"} is 1. Empty for other devices.',
    )
    yield series(
        layout,
        "Await (all requests, from diskstats)",
        "s",
        [
            query(
                "A",
                f"rate({read_time}{{{dev}}}[$__rate_interval]) / rate({reads}{{{dev}}}[$__rate_interval])",
                ops.READ.name,
            ),
            query(
                "B",
                f"rate({write_time}{{{dev}}}[$__rate_interval]) / rate({writes}{{{dev}}}[$__rate_interval])",
                ops.WRITE.name,
            ),
        ],
        description="Average time per request of all the disk's I/O (the workload's, not only the probes').",
    )
    yield series(
        layout,
        "Queue depth",
        "short",
        [
            query("A", f"rate({name(metrics.DISK_IO_TIME_WEIGHTED.spec.total)}{{{dev}}}[$__rate_interval])", "average"),
            query("B", f"{name(metrics.DISK_IO_NOW.spec.name)}{{{dev}}}", "in flight at scrape"),
        ],
        description="Requests in flight: the average (weighted I/O time) and the count at each scrape. A cap shows "
        "as a queue that grows while the IOPS stay flat.",
    )


def probe_health(scope: Scope, layout: Layout) -> Iterator[Builder[Panel]]:
    """Stuck probes, errors, missed slots and zero reads, and the probes' share of the disk's I/O."""
    target, disk = scope.target, f'{scope.base}, device=~"$disk"'
    yield series(
        layout,
        "Age of the probe in flight",
        "s",
        [query("A", f"{metrics.PROBE_INFLIGHT.name}{{{target}}}", "{{op}}")],
        description="Grows while a probe is stuck in the kernel: the volume hangs.",
    )
    yield series(
        layout,
        "Probe errors, missed slots and zero reads",
        "short",
        [
            query(
                "A",
                f"sum by (op, errno) (increase({metrics.PROBE_ERRORS.total}{{{target}}}[$__rate_interval]))",
                "errors {{op}} {{errno}}",
            ),
            query(
                "D",
                f"sum by (op) (increase({metrics.PROBE_FAILURES.total}{{{target}}}[$__rate_interval]))",
                "failures {{op}} (any errno)",
            ),
            query(
                "B",
                f"sum by (op) (increase({metrics.PROBE_MISSED.total}{{{target}}}[$__rate_interval]))",
                "missed {{op}}",
            ),
            query("C", f"increase({metrics.PROBE_ZERO_READS.total}{{{target}}}[$__rate_interval])", "zero reads"),
        ],
        description="Counts per $__rate_interval: failed probes by errno, slots skipped because the previous probe "
        "was still running, and reads that returned only zeros (blocks never written: a volume not yet warm).",
    )
    yield series(
        layout,
        "Probes' share of the disk's I/O, and the probe interval",
        "percentunit",
        [query("A", f"{metrics.PROBE_SHARE.name}{{{disk}}}", "share {{device}}")],
        description="volprobe backs off 10x while the disk is throttled.",
    )


def filesystem(c: MixinConfig, scope: Scope, layout: Layout) -> Iterator[Builder[Panel]]:
    """The filesystem probes of a directory target (opt-in; empty without them): commit latency against the
    commit alert's threshold, metadata sequence latency, and where a sequence spends its time, step by step; and
    whether its mount answers (every directory target's mount check)."""
    target = scope.target
    commit, meta = ops.COMMIT.name, ops.METADATA.name

    def percentiles(op: str) -> list[prometheus.Dataquery]:
        matchers = f'{target}, op="{op}"'
        return [
            query(ref, quantile(c, q, matchers), f"{name} {op}")
            for ref, q, name in (("A", 0.5, "p50"), ("B", 0.99, "p99"), ("C", 0.999, "p99.9"))
        ]

    yield (
        series(
            layout,
            "Commit latency (write + fdatasync)",
            "s",
            percentiles(commit),
            description="Commit probes: a buffered write of one WAL record and fdatasync, as etcd and databases "
            "commit, from the histogram over $__rate_interval. The dashed line is the commit alert's threshold "
            f"({c.commit_latency_threshold}: etcd wants the p99 below 10 ms). Empty without a commit probe.",
        )
        # Red from the threshold up, drawn as a dashed line: where the p99 must stay below.
        .thresholds(
            dashboard.ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps(
                [
                    Threshold(value=None, color="green"),
                    Threshold(value=units.parse_duration(c.commit_latency_threshold), color="red"),
                ]
            )
        )
        .thresholds_style(common.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED))
    )
    yield series(
        layout,
        "Metadata sequence latency",
        "s",
        percentiles(meta),
        description="Metadata probes: create, write, fsync, rename, fsync the directory, unlink (an atomic file "
        "replacement), timed whole, from the histogram over $__rate_interval. Empty without a metadata probe.",
    )
    if c.histograms == "native":
        sequences = f'histogram_count(rate({LATENCY.name}{{{target}, op="{meta}"}}[$__rate_interval]))'
    else:
        sequences = f'rate({LATENCY.count}{{{target}, op="{meta}"}}[$__rate_interval])'
    steps = metrics.PROBE_STEP_SECONDS.total
    yield series(
        layout,
        "Metadata sequence time by step (mean per sequence)",
        "s",
        [
            query(
                "A",
                f"sum by (step) (rate({steps}{{{target}}}[$__rate_interval])) / on () group_left () sum({sequences})",
                "{{step}}",
            )
        ],
        description="Seconds each step of the metadata sequences took, per sequence, over $__rate_interval "
        "(volprobe_probe_metadata_step_seconds_total over the sequences' rate), stacked: the whole is the mean "
        "sequence latency, and a slow rename or directory fsync shows as its band growing.",
    ).stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL))
    answered = metrics.MOUNT_LAST_RESPONSE_TIME.name
    yield series(
        layout,
        "Mount: seconds since it last answered",
        "s",
        [
            query("A", f"time() - ({answered}{{{target}}} > 0)", "since its last answer"),
            # The mount check's verdict, as the same seconds: the age while it is hung, 0 while it answers.
            query(
                "B",
                f"(time() - {answered}{{{target}}}) * (1 - {metrics.MOUNT_RESPONSIVE.name}{{{target}}})",
                "hung for",
            ),
        ],
        description="A directory target's mount is asked for a statfs and a stat every mount_check.interval, "
        "each with a deadline: the age of its last answer stays below the interval while it answers, and grows "
        "while it hangs (an NFS, CephFS or SMB server gone). 'hung for' is that age while volprobe_mount_responsive "
        "is 0. Empty for device targets.",
    )
