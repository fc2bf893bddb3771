"""Fleet: every probed volume, worst first, with counts of the throttled, failing, warming and stuck."""

from __future__ import annotations

from collections.abc import Callable

from grafana_foundation_sdk.builders import common, dashboard, table
from grafana_foundation_sdk.models.dashboard import DataTransformerConfig, DynamicConfigValue

from ... import metrics, ops, units
from .. import MixinConfig
from .panels import DS, Layout, new_dashboard, quantile, query, series, single_stat, table_query
from .variables import TARGET_INFO, Scope, claim_variables, with_variables

THROTTLE_ACTIVE = metrics.THROTTLE_ACTIVE.name
FAILURES = metrics.PROBE_FAILURES.total  # present at 0 from a probe's start: the first failure is an increase
COLUMNS = {  # the table's columns: refId -> title
    "A": "write p99",
    "B": "write p50",
    "C": "read p99",
    "D": "read p50",
    "E": "throttled",
    "F": "errors",
    "G": "warm-up",
}


def build(c: MixinConfig) -> dashboard.Dashboard:
    scope = Scope.of(c)
    layout = Layout()
    d = with_variables(
        new_dashboard(c, "fleet", "volprobe / Fleet", "Every probed volume: latency, throttling, errors, warm-up."),
        scope,
        *claim_variables(scope),
    )
    by = scope.by("instance, target, device")

    def p(q: float, op: str) -> str:
        return scope.selected(quantile(c, q, f'{scope.base}, op="{op}"', by))

    d = d.with_panel(worst_first(c, scope, layout, p))
    for op in (ops.WRITE.name, ops.READ.name):
        d = d.with_panel(
            series(
                layout,
                f"{op.capitalize()} p99 by volume",
                "s",
                [query("A", p(0.99, op), "{{instance}} {{target}}")],
                description=f"p99 of each volume's queue-depth-1 {op} probes, from the histogram over $__rate_interval.",
            )
        )
    base, selected = scope.base, scope.selected
    failing = selected(
        f"sum by ({scope.by('instance, target, op')}) (increase({FAILURES}{{{base}}}[$__rate_interval]))"
    )
    running = selected(f'{metrics.WARMUP_STATE.name}{{{base}, state="running"}}')
    inflight = selected(f"{metrics.PROBE_INFLIGHT.name}{{{base}}}")
    disk = scope.by("instance, device")
    for title, expr, unit, description in (
        (
            "Throttled disks",
            f"sum(max by ({disk}) ({THROTTLE_ACTIVE}{{{base}}}) and on ({disk}) "
            f"({TARGET_INFO}{{{base}}} and on ({scope.by('instance, target')}) {scope.selected_targets})) or vector(0)",
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
        d = d.with_panel(single_stat(layout, title, description, unit, expr))
    return d


def worst_first(c: MixinConfig, scope: Scope, layout: Layout, p: Callable[[float, str], str]) -> table.Panel:
    """One row per volume: its p99 and p50 per op (p: the quantile's query), throttled, errors and warm-up,
    each linked to its Volume dashboard."""
    base, by = scope.base, scope.by("instance, target, device")
    device = scope.by("job, instance, device")
    panel_id, position = layout.place(24, 10)
    panel = (
        table.Panel()
        .id(panel_id)
        .title("Volumes, worst write p99 first")
        .datasource(DS)
        .grid_pos(position)
        .description("One row per volume. Throttled: the disk sits on a provider cap. Zero reads: thin blocks.")
    )
    for ref, expr in (
        ("A", p(0.99, ops.WRITE.name)),
        ("B", p(0.5, ops.WRITE.name)),
        ("C", p(0.99, ops.READ.name)),
        ("D", p(0.5, ops.READ.name)),
        (
            "E",
            scope.selected(
                f"max by ({by}) ({TARGET_INFO}{{{base}}} * on ({device}) group_left () "
                f"max by ({device}) ({THROTTLE_ACTIVE}{{{base}}}))"
            ),
        ),
        ("F", scope.selected(f"sum by ({by}) (increase({FAILURES}{{{base}}}[$__rate_interval]))")),
        ("G", scope.selected(f"max by ({by}) ({metrics.WARMUP_PROGRESS.name}{{{base}}})")),
    ):
        panel = panel.with_target(table_query(ref, expr))
    return (
        panel.with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": {f"Value #{ref}": title for ref, title in COLUMNS.items()},
                },
            )
        )
        .sort_by([common.TableSortByFieldState().display_name(COLUMNS["A"]).desc(True)])
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
