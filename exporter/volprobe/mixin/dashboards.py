"""Grafana dashboards, built with grafana-foundation-sdk (pinned 0.0.21) from a MixinConfig.

Four dashboards: Fleet (every volume, worst first), Volume (one volume in depth), Warm-up, and Migration
(two volumes side by side over days). Every panel and query uses the `datasource` variable; rates use
$__rate_interval; panel ids and refIds are set explicitly; legends are shown.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from grafana_foundation_sdk.builders import (
    barchart,
    bargauge,
    common,
    dashboard,
    heatmap,
    prometheus,
    stat,
    statetimeline,
    table,
    timeseries,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models.dashboard import (
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    GridPos,
    VariableRefresh,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from .. import metrics, units
from . import MixinConfig
from .rules import TARGET_PVC, recorded

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
BASE = 'cluster=~"$cluster", job=~"$job", instance=~"$instance"'
TARGET = f'{BASE}, target="$target"'
# Every exported name comes from its declaration in volprobe.metrics, so a rename there reaches the dashboards.
LATENCY = metrics.PROBE_LATENCY
RECENT = metrics.PROBE_LATENCY_RECENT.name  # a summary: its quantiles are the family name itself
BUILD_INFO = metrics.BUILD_INFO.name
TARGET_INFO = metrics.TARGET_INFO.name
THROTTLE_ACTIVE = metrics.THROTTLE_ACTIVE.name
ERRORS = metrics.PROBE_ERRORS.total
FAILURES = metrics.PROBE_FAILURES.total  # present at 0 from a probe's start: the first failure is an increase
INFLIGHT = metrics.PROBE_INFLIGHT.name
WARMUP_PROGRESS = metrics.WARMUP_PROGRESS.name
WARMUP_STATE = metrics.WARMUP_STATE.name
# The targets the namespace and pvc variables select (All is .*): those whose claim matches, from the recorded
# join with kube-state-metrics; and, while both are All, every other target too (a disk no claim is on). That
# second term asks whether "" matches both regexes, through two labels volprobe_target_info never has: a matcher
# on a missing label compares "".
SELECTED_BY = "cluster, job, instance, target"
SELECTED = (
    f'(max by ({SELECTED_BY}) ({TARGET_PVC}{{{BASE}, namespace=~"$namespace", persistentvolumeclaim=~"$pvc"}})'
    f" or max by ({SELECTED_BY}) "
    f'({TARGET_INFO}{{{BASE}, claim_namespace=~"$namespace", persistentvolumeclaim=~"$pvc"}}))'
)


def selected(expr: str) -> str:
    """expr (with cluster, instance and target labels) for the targets the namespace and pvc variables select."""
    return f"{expr} and on (cluster, instance, target) {SELECTED}"


class Layout:
    """Places panels left to right in rows of 24 units; ids count up from 1."""

    def __init__(self) -> None:
        self.x = self.y = 0
        self.row_height = 0
        self.next_id = 1

    def place(self, width: int, height: int) -> tuple[int, GridPos]:
        if self.x + width > 24:
            self.x, self.y = 0, self.y + self.row_height
            self.row_height = 0
        position = GridPos(h=height, w=width, x=self.x, y=self.y)
        self.x += width
        self.row_height = max(self.row_height, height)
        panel_id, self.next_id = self.next_id, self.next_id + 1
        return panel_id, position


def query(ref: str, expr: str, legend: str = "", instant: bool = False, fmt: PromQueryFormat | None = None):
    q = prometheus.Dataquery().ref_id(ref).expr(expr).datasource(DS)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant()
    if fmt is not None:
        q = q.format(fmt)
    return q


def legend(*calcs: str):
    return (
        common.VizLegendOptions()
        .show_legend(True)
        .display_mode(cm.LegendDisplayMode.TABLE if calcs else cm.LegendDisplayMode.LIST)
        .placement(cm.LegendPlacement.BOTTOM)
        .calcs(list(calcs))
    )


def series(
    layout: Layout,
    title: str,
    unit: str,
    targets: Iterable,
    width: int = 12,
    height: int = 8,
    description: str = "",
    calcs: tuple[str, ...] = ("mean", "max"),
):
    panel_id, position = layout.place(width, height)
    panel = (
        timeseries.Panel()
        .id(panel_id)
        .title(title)
        .datasource(DS)
        .unit(unit)
        .grid_pos(position)
        .legend(legend(*calcs))
        .line_width(1)
        .fill_opacity(10)
    )
    if description:
        panel = panel.description(description)
    for target in targets:
        panel = panel.with_target(target)
    return panel


def variables(d, *extra, one_instance: bool = False, shared: bool = True):
    """datasource, cluster, job and instance, then `extra`. one_instance: a single instance, no "All" (the
    Volume dashboard: a target name can repeat on several hosts, whose buckets must never be summed).
    shared=False: datasource and job only (the Migration dashboard picks a cluster and an instance per side)."""
    d = d.with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    if shared:
        d = d.with_variable(cluster_variable("cluster", "cluster"))
    d = d.with_variable(
        dashboard.QueryVariable("job")
        .label("job")
        .datasource(DS)
        .query(
            f'label_values({BUILD_INFO}{{cluster=~"$cluster"}}, job)' if shared else f"label_values({BUILD_INFO}, job)"
        )
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
    )
    if shared:
        d = d.with_variable(instance_variable("instance", "instance", many=not one_instance))
    for variable in extra:
        d = d.with_variable(variable)
    return d


def cluster_variable(name: str, label: str, many: bool = True):
    # Optional: where Prometheus adds a `cluster` label (external or target labels), pick one; where it does
    # not, the only choice is All (.*), which also matches series without the label.
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(f"label_values({BUILD_INFO}, cluster)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(many)
        .include_all(True)
        .all_value(".*")
    )


def instance_variable(name: str, label: str, many: bool, cluster: str = "$cluster"):
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(f'label_values({BUILD_INFO}{{cluster=~"{cluster}", job=~"$job"}}, instance)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(many)
        .include_all(many)
    )


def target_variable(name: str, label: str, where: str = BASE):
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(f"label_values({TARGET_INFO}{{{where}}}, target)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
    )


def claim_variables() -> list:
    """namespace and pvc, from the recorded join (rules.target_pvc_rule); All (.*) also keeps the targets no
    claim is on (SELECTED)."""
    return [
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(f"label_values({TARGET_PVC}{{{where}}}, {source})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        for name, label, where, source in (
            ("namespace", "namespace", BASE, "namespace"),
            ("pvc", "PVC", f'{BASE}, namespace=~"$namespace"', "persistentvolumeclaim"),
        )
    ]


def selected_target_variable():
    """The Volume dashboard's target, among those the namespace and pvc variables select: a query's result,
    since label_values takes one selector and SELECTED is two."""
    return (
        dashboard.QueryVariable("target")
        .label("target")
        .datasource(DS)
        .query(f"query_result({SELECTED})")
        .regex('/target="([^"]+)"/')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
    )


def base(c: MixinConfig, name: str, title: str, description: str):
    return (
        dashboard.Dashboard(title)
        .uid(f"{c.dashboard_uid_prefix}-{name}")
        .tags(list(c.dashboard_tags))
        .description(description)
        .refresh("1m")
        .time("now-6h", "now")
        .timezone("browser")
        .editable()
    )


def quantile(q: float, selector: str, by: str = "op") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({LATENCY.bucket}{{{selector}}}[$__rate_interval])))"


# -- Fleet ----------------------------------------------------------------------------------------------------


def fleet(c: MixinConfig):
    layout = Layout()
    d = variables(
        base(c, "fleet", "volprobe / Fleet", "Every probed volume: latency, throttling, errors, warm-up."),
        *claim_variables(),
    )
    by = "cluster, instance, target, device"  # cluster: node names repeat across clusters

    def p(q: float, op: str) -> str:
        return selected(
            f"histogram_quantile({q}, sum by ({by}, le) "
            f'(rate({LATENCY.bucket}{{{BASE}, op="{op}"}}[$__rate_interval])))'
        )

    panel_id, position = layout.place(24, 10)
    worst = (
        table.Panel()
        .id(panel_id)
        .title("Volumes, worst write p99 first")
        .datasource(DS)
        .grid_pos(position)
        .description("One row per volume. Throttled: the disk sits on a provider cap. Zero reads: thin blocks.")
        .with_target(query("A", p(0.99, "write"), instant=True, fmt=PromQueryFormat.TABLE))
        .with_target(query("B", p(0.5, "write"), instant=True, fmt=PromQueryFormat.TABLE))
        .with_target(query("C", p(0.99, "read"), instant=True, fmt=PromQueryFormat.TABLE))
        .with_target(query("D", p(0.5, "read"), instant=True, fmt=PromQueryFormat.TABLE))
        .with_target(
            query(
                "E",
                selected(
                    f"max by ({by}) ({TARGET_INFO}{{{BASE}}} * on (cluster, job, instance, device) group_left () "
                    f"max by (cluster, job, instance, device) ({THROTTLE_ACTIVE}{{{BASE}}}))"
                ),
                instant=True,
                fmt=PromQueryFormat.TABLE,
            )
        )
        .with_target(
            query(
                "F",
                selected(f"sum by ({by}) (increase({FAILURES}{{{BASE}}}[$__rate_interval]))"),
                instant=True,
                fmt=PromQueryFormat.TABLE,
            )
        )
        .with_target(
            query(
                "G",
                selected(f"max by ({by}) ({WARMUP_PROGRESS}{{{BASE}}})"),
                instant=True,
                fmt=PromQueryFormat.TABLE,
            )
        )
        .with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": {
                        "Value #A": "write p99",
                        "Value #B": "write p50",
                        "Value #C": "read p99",
                        "Value #D": "read p50",
                        "Value #E": "throttled",
                        "Value #F": "errors",
                        "Value #G": "warm-up",
                    },
                },
            )
        )
        .sort_by([common.TableSortByFieldState().display_name("write p99").desc(True)])
        .unit("s")
        # Units per column: only the quantiles are seconds.
        .override_by_name("throttled", [DynamicConfigValue(id_val="unit", value="bool_yes_no")])
        .override_by_name("errors", [DynamicConfigValue(id_val="unit", value="none")])
        .override_by_name("warm-up", [DynamicConfigValue(id_val="unit", value="percentunit")])
        .override_by_name(
            "target",
            [
                DynamicConfigValue(
                    id_val="links",
                    value=[
                        {
                            "title": "Open ${__data.fields.target} on ${__data.fields.instance} (Volume dashboard)",
                            "url": f"/d/{c.dashboard_uid_prefix}-volume/?${{datasource:queryparam}}&${{job:queryparam}}"
                            "&var-instance=${__data.fields.instance}&var-target=${__data.fields.target}"
                            "&${__url_time_range}",
                        }
                    ],
                )
            ],
        )
    )
    d = d.with_panel(worst)
    for op in ("write", "read"):
        d = d.with_panel(
            series(
                layout,
                f"{op.capitalize()} p99 by volume",
                "s",
                [query("A", p(0.99, op), "{{instance}} {{target}}")],
                description=f"p99 of each volume's queue-depth-1 {op} probes, from the histogram over $__rate_interval.",
            )
        )
    failing = selected(f"sum by (cluster, instance, target, op) (increase({FAILURES}{{{BASE}}}[$__rate_interval]))")
    running = selected(f'{WARMUP_STATE}{{{BASE}, state="running"}}')
    inflight = selected(f"{INFLIGHT}{{{BASE}}}")
    for title, expr, unit, description in (
        (
            "Throttled disks",
            f"sum(max by (cluster, instance, device) ({THROTTLE_ACTIVE}{{{BASE}}}) and on (cluster, instance, device) "
            f"({TARGET_INFO}{{{BASE}}} and on (cluster, instance, target) {SELECTED})) or vector(0)",
            "none",
            "Disks whose I/O sits on a flat ceiling (a provider's IOPS or bandwidth cap) right now.",
        ),
        (
            "Failing probes",
            f"count(({failing}) > 0) or vector(0)",
            "none",
            "Probes (target and op) with at least one failed request over $__rate_interval.",
        ),
        (
            "Warm-ups running",
            f"sum({running}) or vector(0)",
            "none",
            "Volumes being read end to end so that their blocks stop costing a first-touch penalty.",
        ),
        (
            "Stuck probes",
            f"count(({inflight}) > {units.parse_duration(c.stall_threshold):g}) or vector(0)",
            "none",
            f"Probes whose request has been in the kernel for more than {c.stall_threshold}: a hung volume.",
        ),
    ):
        panel_id, position = layout.place(6, 4)
        d = d.with_panel(
            stat.Panel()
            .id(panel_id)
            .title(title)
            .description(description)
            .datasource(DS)
            .grid_pos(position)
            .unit(unit)
            .with_target(query("A", expr))
        )
    return d


# -- Volume ---------------------------------------------------------------------------------------------------


def volume(c: MixinConfig):
    layout = Layout()
    device_var = (
        dashboard.QueryVariable("device")
        .label("device")
        .datasource(DS)
        .query(f"label_values({TARGET_INFO}{{{TARGET}}}, device)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
    )
    disk_var = (
        dashboard.QueryVariable("disk")
        .label("disk")
        .datasource(DS)
        .query(f"label_values({metrics.TARGET_DISK_INFO.name}{{{TARGET}}}, disk)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)  # a target on an md or dm device spans several disks: each is a series of its own
        .include_all(True)
    )
    d = variables(
        base(c, "volume", "volprobe / Volume", "One volume in depth: probe latency, diskstats, throttling."),
        *claim_variables(),
        selected_target_variable(),
        device_var,
        disk_var,
        one_instance=True,
    )
    for name, title, extra in (
        ("warmup", "Warm-up of this volume", "&${cluster:queryparam}&${instance:queryparam}"),
        (
            "migration",
            "Compare with another volume (Migration)",
            "&var-baseline_instance=${instance:percentencode}&var-baseline=${target:percentencode}"
            "&var-candidate_instance=${instance:percentencode}",
        ),
    ):
        d = d.link(
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
    dev = f'{BASE}, device="$device"'
    disk = f'{BASE}, device=~"$disk"'
    reads, writes = metrics.DISK_READS.spec.total, metrics.DISK_WRITES.spec.total
    read_bytes, written_bytes = metrics.DISK_READ_BYTES.spec.total, metrics.DISK_WRITTEN_BYTES.spec.total
    read_time, write_time = metrics.DISK_READ_TIME.spec.total, metrics.DISK_WRITE_TIME.spec.total
    for op in ("read", "write"):  # apart: a 100 us read and a 2 ms O_DSYNC write would blur into one smear
        panel_id, position = layout.place(12, 8)
        d = d.with_panel(
            heatmap.Panel()
            .id(panel_id)
            .title(f"Probe latency distribution, {op}s")
            .datasource(DS)
            .grid_pos(position)
            .description(
                f"Probes of the {op} probe per latency bucket over time, from the histogram (buckets as exported, "
                "not recalculated)."
            )
            .with_target(
                query(
                    "A",
                    f'sum by (le) (increase({LATENCY.bucket}{{{TARGET}, op="{op}"}}[$__rate_interval]))',
                    "{{le}}",
                    fmt=PromQueryFormat.HEATMAP,
                )
            )
            .calculate(False)
            # Grafana's heatmap reads the y axis unit from its own options, not from the field's unit.
            .y_axis(heatmap.YAxisConfig().unit("s").axis_placement(cm.AxisPlacement.LEFT))
            .cell_values(heatmap.CellValues().unit("short"))
        )
    d = d.with_panel(
        series(
            layout,
            "Percentiles per op",
            "s",
            [
                query("A", quantile(0.5, TARGET), "p50 {{op}}"),
                query("B", quantile(0.99, TARGET), "p99 {{op}}"),
                query("C", quantile(0.999, TARGET), "p99.9 {{op}}"),
            ],
            description="From the histogram buckets over $__rate_interval.",
        )
    )
    nvme_latency = metrics.NVME_LATENCY.bucket
    d = d.with_panel(
        series(
            layout,
            "Device-side latency (the provider's own) beside the probes' p99",
            "s",
            [
                query(
                    "A",
                    f"histogram_quantile(0.99, sum by (device, op, le) (rate({nvme_latency}{{{disk}}}[$__rate_interval])))",
                    "device p99 {{op}} {{device}}",
                ),
                query(
                    "B",
                    f"histogram_quantile(0.5, sum by (device, op, le) (rate({nvme_latency}{{{disk}}}[$__rate_interval])))",
                    "device p50 {{op}} {{device}}",
                ),
                query("C", quantile(0.99, TARGET), "probe p99 {{op}}"),
            ],
            description="AWS NVMe devices (EBS, instance store) measure their own latency: all I/O at the device, "
            "the queue in the guest excluded. Beside the probes' p99 (queue-depth 1, through the guest's stack), "
            "a gap is the guest's queue; no gap but both high is the volume. Empty for other devices.",
        )
    )
    d = d.with_panel(
        series(
            layout,
            "First vs repeat touch (p50 over the recent window)",
            "s",
            [
                query("A", f'{RECENT}{{{TARGET}, quantile="0.5"}}', "{{op}} {{touch}}"),
            ],
            description="First-touch probes go to offsets never probed: on thin or restored volumes they pay allocation.",
        )
    )
    d = d.with_panel(
        series(
            layout,
            "IOPS, with the throttle ceiling and the provisioned limit",
            "iops",
            [
                query("A", f"rate({reads}{{{dev}}}[$__rate_interval])", "reads {{device}}"),
                query("B", f"rate({writes}{{{dev}}}[$__rate_interval])", "writes {{device}}"),
                query("C", f"{metrics.THROTTLE_CEILING_OPS.name}{{{disk}}}", "ceiling {{dir}} {{device}}"),
                query("D", f"{metrics.LIMIT_OPS.name}{{{TARGET}}}", "limit"),
            ],
            description="All I/O of the disk (from diskstats, the probes' included), the ceiling the throttle detector "
            "found, and the limit configured for the target.",
        )
    )
    d = d.with_panel(
        series(
            layout,
            "Throughput, with the throttle ceiling and the provisioned limit",
            "Bps",
            [
                query("A", f"rate({read_bytes}{{{dev}}}[$__rate_interval])", "read {{device}}"),
                query("B", f"rate({written_bytes}{{{dev}}}[$__rate_interval])", "written {{device}}"),
                query("C", f"{metrics.THROTTLE_CEILING_BYTES.name}{{{disk}}}", "ceiling {{dir}} {{device}}"),
                query("D", f"{metrics.LIMIT_BYTES.name}{{{TARGET}}}", "limit"),
            ],
            description="Bytes per second of the disk (from diskstats), the ceiling found, and the configured limit.",
        )
    )
    d = d.with_panel(
        series(
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
    )
    d = d.with_panel(
        series(
            layout,
            "Await (all requests, from diskstats)",
            "s",
            [
                query(
                    "A",
                    f"rate({read_time}{{{dev}}}[$__rate_interval]) / rate({reads}{{{dev}}}[$__rate_interval])",
                    "read",
                ),
                query(
                    "B",
                    f"rate({write_time}{{{dev}}}[$__rate_interval]) / rate({writes}{{{dev}}}[$__rate_interval])",
                    "write",
                ),
            ],
            description="Average time per request of all the disk's I/O (the workload's, not only the probes').",
        )
    )
    d = d.with_panel(
        series(
            layout,
            "Queue depth",
            "short",
            [
                query("A", f"rate({metrics.DISK_IO_TIME_WEIGHTED.spec.total}{{{dev}}}[$__rate_interval])", "average"),
                query("B", f"{metrics.DISK_IO_NOW.spec.name}{{{dev}}}", "in flight at scrape"),
            ],
            description="Requests in flight: the average (weighted I/O time) and the count at each scrape. A cap shows "
            "as a queue that grows while the IOPS stay flat.",
        )
    )
    d = d.with_panel(
        series(
            layout,
            "Age of the probe in flight",
            "s",
            [
                query("A", f'{INFLIGHT}{{{BASE}, target="$target"}}', "{{op}}"),
            ],
            description="Grows while a probe is stuck in the kernel: the volume hangs.",
        )
    )
    d = d.with_panel(
        series(
            layout,
            "Probe errors, missed slots and zero reads",
            "short",
            [
                query(
                    "A",
                    f"sum by (op, errno) (increase({ERRORS}{{{TARGET}}}[$__rate_interval]))",
                    "errors {{op}} {{errno}}",
                ),
                query(
                    "D",
                    f"sum by (op) (increase({FAILURES}{{{TARGET}}}[$__rate_interval]))",
                    "failures {{op}} (any errno)",
                ),
                query(
                    "B",
                    f"sum by (op) (increase({metrics.PROBE_MISSED.total}{{{TARGET}}}[$__rate_interval]))",
                    "missed {{op}}",
                ),
                query("C", f"increase({metrics.PROBE_ZERO_READS.total}{{{TARGET}}}[$__rate_interval])", "zero reads"),
            ],
            description="Counts per $__rate_interval: failed probes by errno, slots skipped because the previous probe "
            "was still running, and reads that returned only zeros (blocks never written: a volume not yet warm).",
        )
    )
    d = d.with_panel(
        series(
            layout,
            "Probes' share of the disk's I/O, and the probe interval",
            "percentunit",
            [
                query("A", f"{metrics.PROBE_SHARE.name}{{{disk}}}", "share {{device}}"),
            ],
            description="volprobe backs off 10x while the disk is throttled.",
        )
    )
    return d


# -- Warm-up --------------------------------------------------------------------------------------------------


def warmup(c: MixinConfig):
    layout = Layout()
    d = variables(base(c, "warmup", "volprobe / Warm-up", "Volume initialization: progress, ETA, first-touch penalty."))
    panel_id, position = layout.place(12, 8)
    d = d.with_panel(
        bargauge.Panel()
        .id(panel_id)
        .title("Progress per volume")
        .description("Share of each volume's blocks read once by its warm-up.")
        .datasource(DS)
        .grid_pos(position)
        .unit("percentunit")
        .min(0)
        .max(1)
        .with_target(query("A", f"{WARMUP_PROGRESS}{{{BASE}}}", "{{instance}} {{target}}"))
    )
    panel_id, position = layout.place(12, 8)
    d = d.with_panel(
        table.Panel()
        .id(panel_id)
        .title("Time to warm")
        .description("Estimated time left for each warm-up at its current rate.")
        .datasource(DS)
        .grid_pos(position)
        .unit("s")
        .with_target(query("A", f"{metrics.WARMUP_ETA.name}{{{BASE}}}", instant=True, fmt=PromQueryFormat.TABLE))
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True, "__name__": True, "job": True},
                    "renameByName": {"Value": "ETA"},
                },
            )
        )
    )
    d = d.with_panel(
        series(
            layout,
            "Warm-up throughput",
            "Bps",
            [
                query("A", f"deriv({metrics.WARMUP_DONE.name}{{{BASE}}}[$__rate_interval])", "{{instance}} {{target}}"),
            ],
            description="Bytes per second each warm-up reads (it runs in the idle I/O class, at its configured rate).",
        )
    )
    panel_id, position = layout.place(12, 8)
    d = d.with_panel(
        statetimeline.Panel()
        .id(panel_id)
        .title("State")
        .description(
            "Each warm-up's state over time: queued (discovered volumes wait for a slot), pending, running, "
            "done or failed."
        )
        .datasource(DS)
        .grid_pos(position)
        .with_target(query("A", f"{WARMUP_STATE}{{{BASE}}} == 1", "{{target}} {{state}}"))
        .legend(legend())
    )
    d = d.with_panel(
        series(
            layout,
            "First-touch penalty (first / repeat p50)",
            "x",
            [
                query(
                    "A",
                    f'{RECENT}{{{BASE}, touch="first", quantile="0.5"}}\n'
                    f"  / ignoring (touch) "
                    f'{RECENT}{{{BASE}, touch="repeat", quantile="0.5"}}',
                    "{{instance}} {{target}} {{op}}",
                ),
            ],
            width=24,
            description="Falls towards 1 as the volume warms: first touches stop costing more than repeats.",
        )
    )
    return d


# -- Migration ------------------------------------------------------------------------------------------------


def migration(c: MixinConfig):
    """Each side is one target on one instance, in one cluster, of its own: a migration compares hosts (the EBS
    node with the Azure one), and a target name that repeats across hosts must never merge them."""
    layout = Layout()
    op_var = dashboard.CustomVariable("op").label("op").values("write,read")
    sides = ("baseline", "candidate")
    hosts = {side: f'cluster=~"${side}_cluster", job=~"$job", instance="${side}_instance"' for side in sides}
    picks = []
    for side in sides:  # a cluster, an instance and a target per side: an EKS node against an AKS one, say
        picks.append(cluster_variable(f"{side}_cluster", f"{side} cluster", many=False))
        picks.append(instance_variable(f"{side}_instance", f"{side} instance", many=False, cluster=f"${side}_cluster"))
        picks.append(target_variable(side, side, where=hosts[side]))
    d = variables(
        base(
            c,
            "migration",
            "volprobe / Migration",
            "Is the candidate volume as good as the baseline? Same probe spec, side by side over days, "
            "each side on its own instance.",
        ),
        *picks,
        op_var,
        shared=False,
    )
    d = d.time("now-14d", "now")
    selectors = {side: f'{hosts[side]}, target="${side}", op="$op"' for side in sides}
    for name in ("p50", "p99", "p999"):
        d = d.with_panel(
            series(
                layout,
                f"Daily {name}: baseline vs candidate",
                "s",
                [
                    query(ref, f"max({recorded(name + '_daily')}{{{selectors[side]}}})", side)
                    for ref, side in zip("AB", sides, strict=True)
                ],
                width=8,
                description=f"{name} of each day's probes (recorded over {c.daily_window}).",
            )
        )
    d = d.with_panel(
        series(
            layout,
            "Candidate / baseline, daily",
            "x",
            [
                query(
                    ref,
                    f"max({recorded(name + '_daily')}{{{selectors['candidate']}}}) / "
                    f"max({recorded(name + '_daily')}{{{selectors['baseline']}}})",
                    name,
                )
                for ref, name in zip("ABC", ("p50", "p99", "p999"), strict=True)
            ],
            width=12,
            description="Above 1: the candidate is slower.",
        )
    )
    panel_id, position = layout.place(12, 8)
    overlay = (
        barchart.Panel()
        .id(panel_id)
        .title("Cumulative latency distribution over the range: baseline vs candidate")
        .datasource(DS)
        .grid_pos(position)
        .x_field("le")
        .legend(legend())
        .description(
            "Share of probes at or under each latency bucket bound, over the dashboard's time range: "
            "the candidate's bars lower than the baseline's mean slower probes."
        )
    )
    for ref, side in zip("AB", sides, strict=True):
        overlay = overlay.with_target(
            query(
                ref,
                f"sum by (le) (increase({LATENCY.bucket}{{{selectors[side]}}}[$__range])) / ignoring (le) group_left "
                f"sum(increase({LATENCY.count}{{{selectors[side]}}}[$__range]))",
                side,
                instant=True,
                fmt=PromQueryFormat.TABLE,
            )
        )
    overlay = overlay.with_transformation(DataTransformerConfig(id_val="merge", options={}))
    d = d.with_panel(overlay)
    return d


BUILDERS = {"fleet": fleet, "volume": volume, "warmup": warmup, "migration": migration}


def render_all(c: MixinConfig) -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    result = {}
    for name, build in BUILDERS.items():
        model = build(c).build()
        result[f"volprobe-{name}.json"] = json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
    return result
