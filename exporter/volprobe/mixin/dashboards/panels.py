"""The panel library: the constructions every dashboard repeats, as functions. Each panel and query uses the
`datasource` variable; panel ids and grid positions come from a Layout; legends are shown."""

from __future__ import annotations

from collections.abc import Iterable

from grafana_foundation_sdk.builders import common, dashboard, heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from ... import metrics
from .. import MixinConfig

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every exported name comes from its declaration in volprobe.metrics, so a rename there reaches the dashboards.
LATENCY = metrics.PROBE_LATENCY


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


def new_dashboard(c: MixinConfig, name: str, title: str, description: str) -> dashboard.Dashboard:
    """A dashboard with the mixin's uid prefix and tags, the last 6 hours, refreshed every minute."""
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


def query(
    ref: str, expr: str, legend: str = "", instant: bool = False, fmt: PromQueryFormat | None = None
) -> prometheus.Dataquery:
    q = prometheus.Dataquery().ref_id(ref).expr(expr).datasource(DS)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant()
    if fmt is not None:
        q = q.format(fmt)
    return q


def table_query(ref: str, expr: str) -> prometheus.Dataquery:
    """An instant query whose result is a table: one row per series, a column per label."""
    return query(ref, expr, instant=True, fmt=PromQueryFormat.TABLE)


def legend(*calcs: str) -> common.VizLegendOptions:
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
    targets: Iterable[prometheus.Dataquery],
    width: int = 12,
    height: int = 8,
    description: str = "",
    calcs: tuple[str, ...] = ("mean", "max"),
) -> timeseries.Panel:
    """A time series panel with a legend table of each series' mean and max."""
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


def single_stat(layout: Layout, title: str, description: str, unit: str, expr: str) -> stat.Panel:
    """One number, a quarter of a row wide."""
    panel_id, position = layout.place(6, 4)
    return (
        stat.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(DS)
        .grid_pos(position)
        .unit(unit)
        .with_target(query("A", expr))
    )


def latency_heatmap(c: MixinConfig, layout: Layout, title: str, description: str, matchers: str) -> heatmap.Panel:
    """Probes per latency bucket over time, the buckets as exported, not recalculated: the classic buckets'
    increases by le, or with `histograms: native` the native histogram's increase, returned whole. Grafana draws
    a native histogram (format heatmap) as it is, each native bucket a cell between its own bounds, on a log 2
    y axis of its choosing: the exporter's resolution (0.54% buckets at full), not a coarser one made up here."""
    panel_id, position = layout.place(12, 8)
    if c.histograms == "native":
        target = query(
            "A", f"sum(increase({LATENCY.name}{{{matchers}}}[$__rate_interval]))", fmt=PromQueryFormat.HEATMAP
        )
    else:
        expr = f"sum by (le) (increase({LATENCY.bucket}{{{matchers}}}[$__rate_interval]))"
        target = query("A", expr, "{{le}}", fmt=PromQueryFormat.HEATMAP)
    return (
        heatmap.Panel()
        .id(panel_id)
        .title(title)
        .datasource(DS)
        .grid_pos(position)
        .description(description)
        .with_target(target)
        .calculate(False)
        # Grafana's heatmap reads the y axis unit from its own options, not from the field's unit.
        .y_axis(heatmap.YAxisConfig().unit("s").axis_placement(cm.AxisPlacement.LEFT))
        .cell_values(heatmap.CellValues().unit("short"))
    )


def quantile(c: MixinConfig, q: float, matchers: str, by: str = "op") -> str:
    """The q-quantile of the probes' latency over $__rate_interval: from the classic buckets, summed by le, or with
    `histograms: native` from the native histograms, summed whole."""
    if c.histograms == "native":
        return f"histogram_quantile({q}, sum by ({by}) (rate({LATENCY.name}{{{matchers}}}[$__rate_interval])))"
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({LATENCY.bucket}{{{matchers}}}[$__rate_interval])))"
