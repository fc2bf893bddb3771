"""The volprobe mixin: one configuration that generates the Prometheus rules (alerts/) and the Grafana
dashboards (dashboards/). Regenerate with your own thresholds:

    python -m volprobe.mixin --config my-mixin.yml --out .

The configuration file holds only the keys you change; every other key keeps its default (see MixinConfig,
or the README's configuration reference).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from .. import ops, schema, units
from ..config import ConfigError
from ..schema import setting

__all__ = ["DEFAULTS", "MixinConfig", "fields", "from_mapping", "load"]


def _duration_or_empty(value: Any) -> str:
    if value == "":
        return ""
    return schema.DURATION.parse(value)


# A duration written as Prometheus reads it (5m, 1h30m), or empty: Prometheus's global evaluation_interval.
INTERVAL: schema.Kind[str] = schema.Kind("duration, or empty", _duration_or_empty, ("", "15s", "5m"), ("soon", 5))
DURATION, TEXT, RATIO = schema.DURATION, schema.TEXT, schema.POSITIVE_NUMBER


def _label_name(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", value):
        raise ValueError(f"{value!r} is not a Prometheus label name")
    return value


LABEL_NAME: schema.Kind[str] = schema.Kind("label name", _label_name, ("cluster", "k8s_cluster"), ("", "my label", 5))


@dataclass(frozen=True)
class MixinConfig:
    """Each key is a setting(default, kind, doc): the one place a new key is added."""

    selector: str = setting('job="volprobe"', TEXT, "which series are volprobe's (a label matcher)")
    cluster_label: str = setting(
        "cluster", LABEL_NAME, "the label that tells clusters apart (kubernetes-mixin's clusterLabel)"
    )
    kube_state_metrics_selector: str = setting(
        'job="kube-state-metrics"', TEXT, "which are kube-state-metrics' 2.x: its PV series name each target's PVC"
    )
    rate_window: str = setting("5m", DURATION, "rate() window of the recording rules (the 5m quantiles) and alerts")
    daily_window: str = setting("1d", DURATION, "window of the daily quantiles, for comparisons over days")
    baseline_window: str = setting("7d", DURATION, "the regression baseline: median of the 5m p99 over this")
    latency_objective: dict[str, str] = setting(
        # The ops every volume has; commit and metadata are opt-in, and their objective is the user's to set.
        {op.name: "50ms" for op in (ops.READ, ops.WRITE)},
        schema.duration_map("op"),
        "objective on the p99 over rate_window, per op",
    )
    latency_objective_for: str = setting("10m", DURATION, "for: of the latency objective alert")
    # etcd's disk guidance: the 99th percentile of a WAL commit's fdatasync under 10 ms. etcd-mixin waits 10m on
    # its own fsync alert; a slow minute is no verdict on the disk.
    commit_latency_threshold: str = setting(
        "10ms", DURATION, "commit probes: alert when their p99 over rate_window is above this (etcd's 10 ms)"
    )
    commit_latency_for: str = setting("10m", DURATION, "for: of the commit latency alert")
    regression_factor: float = setting(2.0, RATIO, "regression: p99 above this many times its baseline")
    regression_min_increase: str = setting("1ms", DURATION, "regression: and at least this much above it")
    regression_for: str = setting("15m", DURATION, "for: of the regression alert")
    baseline_min_history: str = setting(
        "1d", DURATION, "regression: only against a baseline already recorded this long ago (a day of history)"
    )
    throttle_for: str = setting("5m", DURATION, "for: of the throttling alert")
    limit_ratio: float = setting(0.9, RATIO, "share of a provisioned limit that alerts")
    limit_for: str = setting("15m", DURATION, "for: of the limit alert")
    stall_threshold: str = setting("30s", DURATION, "a probe outstanding this long is a stall")
    stall_for: str = setting("0s", DURATION, "for: of the stall alert")
    errors_for: str = setting("1m", DURATION, "for: of the probe errors alert")
    reload_failed_for: str = setting("10m", DURATION, "for: of the failed reload alerts (config and web config)")
    thread_restart_window: str = setting(
        "1h", DURATION, "a thread restart is seen this long after it; failing again within it keeps one alert"
    )
    thread_restart_for: str = setting("0s", DURATION, "for: of the thread restart alert")
    missing_window: str = setting("15m", DURATION, "a target that had series this recently and has none is missing")
    missing_for: str = setting("5m", DURATION, "for: of the missing target alert")
    exporter_down_for: str = setting("5m", DURATION, "for: of the exporter down alert")
    warmup_stall_window: str = setting("30m", DURATION, "a warm-up without progress this long is stalled")
    warmup_stall_for: str = setting("5m", DURATION, "for: of the warm-up stall alert")
    mount_hung_for: str = setting("1m", DURATION, "for: of the hung mount alert (after mount_check.timeout)")
    runbook_url: str = setting(
        "https://github.com/volprobe/volprobe/blob/main/alerts/runbook.md#{anchor}",
        TEXT,
        "each alert's runbook; {anchor} is the alert's name in lower case",
    )
    dashboard_uid_prefix: str = setting("volprobe", TEXT, "prefix of the dashboards' uids")
    dashboard_tags: tuple[str, ...] = setting(("volprobe",), schema.TEXTS, "tags of the dashboards")
    histograms: str = setting(
        "classic",
        schema.choice(("classic", "native")),
        "what the rules' and dashboards' latency queries read: the classic buckets (Prometheus 2), or native "
        "histograms (Prometheus 3 with scrape_native_histograms)",
    )
    diskstats: str = setting(
        "volprobe",
        schema.choice(("volprobe", "node_exporter")),
        "whose diskstats the rules (the disks' rates, the limit alert) and the Volume dashboard read: volprobe's "
        "volprobe_disk_*, or node_exporter's node_disk_* (volprobe run with --no-collector.diskstats), matched to "
        "volprobe's on device and the host of instance (its :port dropped)",
    )
    node_exporter_selector: str = setting(
        'job="node"', TEXT, "with diskstats: node_exporter, which series are node_exporter's (a label matcher)"
    )
    interval: str = setting("", INTERVAL, "evaluation interval of the rule groups; empty: Prometheus's global")
    long_interval: str = setting(
        "5m", INTERVAL, "of the long-window group (daily quantiles, 7-day baseline), built from recorded rates"
    )

    def seconds(self, name: str) -> float:
        return units.parse_duration(getattr(self, name))


DEFAULTS = MixinConfig()


def load(path: str | Path | None) -> MixinConfig:
    """DEFAULTS with the keys of a YAML file applied; every problem names its key."""
    if path is None:
        return DEFAULTS
    try:
        document = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError([f"{path}: {err}"]) from None
    return from_mapping(document, str(path))


def from_mapping(document: Any, source: str = "mixin") -> MixinConfig:
    if not isinstance(document, dict):
        raise ConfigError([f"{source}: must be a mapping"])
    walker = schema.Walker(null_unsets=False)
    config = walker.build(MixinConfig, document, "")
    if walker.problems:
        raise ConfigError([f"{source}: {p}" for p in walker.problems])
    return config
