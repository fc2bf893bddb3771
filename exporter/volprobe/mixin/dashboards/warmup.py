"""Warm-up: volume initialization, its progress, ETA, throughput and state, and the first-touch penalty it
removes."""

from __future__ import annotations

from grafana_foundation_sdk.builders import bargauge, dashboard, statetimeline, table
from grafana_foundation_sdk.models.dashboard import DataTransformerConfig

from ... import metrics
from .. import MixinConfig
from .panels import DS, Layout, legend, new_dashboard, query, series, table_query
from .variables import Scope, with_variables

RECENT = metrics.PROBE_LATENCY_RECENT.name  # a summary: its quantiles are the family name itself


def build(c: MixinConfig) -> dashboard.Dashboard:
    scope = Scope.of(c)
    base = scope.base
    layout = Layout()
    d = with_variables(
        new_dashboard(c, "warmup", "volprobe / Warm-up", "Volume initialization: progress, ETA, first-touch penalty."),
        scope,
    )
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
        .with_target(query("A", f"{metrics.WARMUP_PROGRESS.name}{{{base}}}", "{{instance}} {{target}}"))
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
        .with_target(table_query("A", f"{metrics.WARMUP_ETA.name}{{{base}}}"))
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
            [query("A", f"deriv({metrics.WARMUP_DONE.name}{{{base}}}[$__rate_interval])", "{{instance}} {{target}}")],
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
        .with_target(query("A", f"{metrics.WARMUP_STATE.name}{{{base}}} == 1", "{{target}} {{state}}"))
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
                    f'{RECENT}{{{base}, touch="first", quantile="0.5"}}\n'
                    f"  / ignoring (touch) "
                    f'{RECENT}{{{base}, touch="repeat", quantile="0.5"}}',
                    "{{instance}} {{target}} {{op}}",
                ),
            ],
            width=24,
            description="Falls towards 1 as the volume warms: first touches stop costing more than repeats.",
        )
    )
    return d
