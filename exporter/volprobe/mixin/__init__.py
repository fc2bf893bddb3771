"""The volprobe mixin: one configuration that generates the Prometheus rules (alerts/) and the Grafana
dashboards (dashboards/). Regenerate with your own thresholds:

    python -m volprobe.mixin --config my-mixin.yml --out .

The configuration file holds only the keys you change; every other key keeps its default (see DEFAULTS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from .. import units
from ..config import ConfigError


@dataclass(frozen=True)
class MixinConfig:
    # Which series are volprobe's: label matchers that every rule and dashboard query starts with. Name labels
    # the recorded series keep (job, instance, the cluster label): the rules read their own records with it.
    selector: str = 'job="volprobe"'
    # The label that tells clusters apart (kubernetes-mixin's clusterLabel), where Prometheus adds one (an
    # external or target label): every sum and join keeps it, and the dashboards' cluster variable picks it.
    cluster_label: str = "cluster"
    # Which series are kube-state-metrics' (2.x): its PersistentVolume series name each target's PVC (rules.py).
    kube_state_metrics_selector: str = 'job="kube-state-metrics"'
    # Window of the rate() in recording rules (the "5m" quantiles) and of rate/increase in the alerts.
    rate_window: str = "5m"
    # The window of the daily quantiles, for comparisons over days (migrations).
    daily_window: str = "1d"
    # The regression baseline: the median of the 5m p99 over this window.
    baseline_window: str = "7d"
    # Latency objectives on the p99 over rate_window, per op.
    latency_objective: dict[str, str] = field(default_factory=lambda: {"read": "50ms", "write": "50ms"})
    latency_objective_for: str = "10m"
    # Regression: p99 above regression_factor times its baseline, and at least regression_min_increase above it.
    regression_factor: float = 2.0
    regression_min_increase: str = "1ms"
    regression_for: str = "15m"
    throttle_for: str = "5m"
    limit_ratio: float = 0.9
    limit_for: str = "15m"
    stall_threshold: str = "30s"
    stall_for: str = "0s"
    errors_for: str = "1m"
    reload_failed_for: str = "10m"  # the configuration's reload, and the web config's
    # A thread restart is seen for this window after it; failing again within it keeps one alert (see rules.py).
    thread_restart_window: str = "1h"
    thread_restart_for: str = "0s"
    missing_window: str = "15m"
    missing_for: str = "5m"
    exporter_down_for: str = "5m"
    warmup_stall_window: str = "30m"
    warmup_stall_for: str = "5m"
    # Where each alert's runbook is; {anchor} is the alert's name in lower case.
    runbook_url: str = "https://github.com/volprobe/volprobe/blob/main/alerts/runbook.md#{anchor}"
    dashboard_uid_prefix: str = "volprobe"
    dashboard_tags: tuple[str, ...] = ("volprobe",)
    # Evaluation interval of the rule groups; empty: Prometheus's global evaluation_interval.
    interval: str = ""
    # Evaluation interval of the long-window group (daily quantiles, 7-day baseline), built from the recorded
    # short-window rates: a day's quantile need not be recomputed every 15 s.
    long_interval: str = "5m"

    def seconds(self, name: str) -> float:
        return units.parse_duration(getattr(self, name))


DEFAULTS = MixinConfig()
_DURATIONS = [
    f.name
    for f in fields(MixinConfig)
    if f.type == "str" and f.name.endswith(("_window", "_for", "_threshold", "_increase"))
]


def load(path: str | Path | None) -> MixinConfig:
    """DEFAULTS with the keys of a YAML file applied; every problem names its key."""
    if path is None:
        return DEFAULTS
    try:
        document = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError([f"{path}: {err}"]) from None
    return from_mapping(document, str(path))


def _type_problem(kind: Any, value: Any) -> str:
    """What is wrong with a value for a field of this (annotated) type, or ""."""
    kind = str(kind)
    if kind == "str":
        return "" if isinstance(value, str) else f"{value!r} is not a string"
    if kind == "float":
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        return "" if number else f"{value!r} is not a positive number"
    if kind.startswith("dict"):
        good = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        return "" if good else f"{value!r} is not a mapping of op to duration, e.g. {{read: 50ms}}"
    if kind.startswith("tuple"):
        good = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return "" if good else f"{value!r} is not a list of strings"
    return ""


def from_mapping(document: Any, source: str = "mixin") -> MixinConfig:
    if not isinstance(document, dict):
        raise ConfigError([f"{source}: must be a mapping"])
    known = {f.name: f for f in fields(MixinConfig)}
    problems = []
    changes: dict[str, Any] = {}
    for key, value in document.items():
        if key not in known:
            problems.append(f"{key}: unknown key (expected one of: {', '.join(sorted(known))})")
            continue
        problem = _type_problem(known[key].type, value)
        if problem:
            problems.append(f"{key}: {problem}")
            continue
        changes[key] = tuple(value) if key == "dashboard_tags" else value
    if problems:
        raise ConfigError([f"{source}: {p}" for p in problems])
    config = replace(DEFAULTS, **changes)
    for name in _DURATIONS:
        try:
            if units.parse_duration(getattr(config, name)) < 0:
                raise ValueError("negative")
        except ValueError as err:
            problems.append(f"{name}: {err}")
    for op, value in dict(config.latency_objective).items():
        try:
            units.parse_duration(value)
        except ValueError as err:
            problems.append(f"latency_objective.{op}: {err}")
    if problems:
        raise ConfigError([f"{source}: {p}" for p in problems])
    return config
