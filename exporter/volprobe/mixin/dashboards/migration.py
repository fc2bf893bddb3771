"""Migration: two volumes side by side over days, each side one target on one instance in one cluster of its
own. A migration compares hosts (the EBS node with the Azure one), and a target name that repeats across
hosts must never merge them."""

from __future__ import annotations

from grafana_foundation_sdk.builders import barchart, dashboard
from grafana_foundation_sdk.models.dashboard import DataTransformerConfig
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from ... import ops, stats
from .. import MixinConfig
from ..rules import daily_quantile
from .panels import DS, LATENCY, Layout, legend, new_dashboard, query, series
from .variables import Scope, cluster_variable, instance_variable, matchers, target_variable, with_variables

SIDES = ("baseline", "candidate")
QUANTILES = ("p50", "p99", "p999")


def build(c: MixinConfig) -> dashboard.Dashboard:
    scope = Scope.of(c)
    layout = Layout()
    op_var = dashboard.CustomVariable("op").label("op").values(",".join((ops.WRITE.name, ops.READ.name)))
    hosts = {
        side: matchers(
            scope.selector, f'{scope.cluster}=~"${side}_cluster"', 'job=~"$job"', f'instance="${side}_instance"'
        )
        for side in SIDES
    }
    picks = []
    for side in SIDES:  # a cluster, an instance and a target per side: an EKS node against an AKS one, say
        picks.append(cluster_variable(scope, f"{side}_cluster", f"{side} cluster", many=False))
        picks.append(
            instance_variable(scope, f"{side}_instance", f"{side} instance", many=False, cluster=f"${side}_cluster")
        )
        picks.append(target_variable(side, side, where=hosts[side]))
    d = with_variables(
        new_dashboard(
            c,
            "migration",
            "volprobe / Migration",
            "Is the candidate volume as good as the baseline? Same probe spec, side by side over days, "
            "each side on its own instance.",
        ),
        scope,
        *picks,
        op_var,
        shared=False,
    )
    d = d.time("now-14d", "now")
    selectors = {side: f'{hosts[side]}, target="${side}", op="$op"' for side in SIDES}
    for name in QUANTILES:
        d = d.with_panel(
            series(
                layout,
                f"Daily {name}: baseline vs candidate",
                "s",
                [
                    query(ref, f"max({daily_quantile(c, name)}{{{selectors[side]}}})", side)
                    for ref, side in zip("AB", SIDES, strict=True)
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
                    f"max({daily_quantile(c, name)}{{{selectors['candidate']}}}) / "
                    f"max({daily_quantile(c, name)}{{{selectors['baseline']}}})",
                    name,
                )
                for ref, name in zip("ABC", QUANTILES, strict=True)
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
    for ref, side in zip("AB", SIDES, strict=True):
        overlay = overlay.with_target(
            query(ref, share_under_bounds(c, selectors[side]), side, instant=True, fmt=PromQueryFormat.TABLE)
        )
    return d.with_panel(overlay.with_transformation(DataTransformerConfig(id_val="merge", options={})))


def share_under_bounds(c: MixinConfig, selector: str) -> str:
    """The share of the probes over $__range at or under each bucket bound, one series per bound labelled le.
    Classic: each bucket's increase over the count's. Native: histogram_fraction(0, bound) of the histogram's
    increase, at the default classic bounds (stats.DEFAULT_BUCKETS), so that the overlay reads as it does on the
    classic series. A native histogram has no bounds of its own to list, and the fraction interpolates only
    inside the native bucket holding a bound, 0.54% wide at full resolution: the share under that bound to within
    the probes in that bucket."""
    if c.histograms != "native":
        return (
            f"sum by (le) (increase({LATENCY.bucket}{{{selector}}}[$__range])) / ignoring (le) group_left "
            f"sum(increase({LATENCY.count}{{{selector}}}[$__range]))"
        )
    histogram = f"sum(increase({LATENCY.name}{{{selector}}}[$__range]))"
    return " or\n".join(
        f'label_replace(histogram_fraction(0, {bound}, {histogram}), "le", "{bound}", "", "")'
        for bound in (*(repr(b) for b in stats.DEFAULT_BUCKETS), "+Inf")
    )
