"""The shipped rules, rendered with test-sized windows, evaluated by a real Prometheus; and its alerts' state."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from volprobe import mixin
from volprobe.mixin import rules

from .harness import RunningPrometheus

TEST_SIZED = {
    "rate_window": "30s",
    "daily_window": "5m",
    "baseline_window": "2m",
    "long_interval": "2s",  # the long group (daily quantiles, baseline) as often as the rest, in minutes of test
    # Twice the 30 s rate window, as the defaults (5m, 10m): the p99 must stay above the objective for longer than one
    # window holds a host stall's slow probes (on a loaded CI host, a healthy lab volume's p99 over 30 s read 55 ms).
    "latency_objective_for": "60s",
    "regression_for": "6s",
    # Under test_e2e's load (six lab volumes, fio, Prometheus on two cores) the lab's tail latency wobbles
    # by up to ~15 ms (a healthy 0.5 ms volume once showed a write p99 of 14.3 ms); its raise is +24 ms.
    "regression_min_increase": "16ms",
    # A day of a week's baseline, scaled to the 2m one: the regression alert waits for a baseline this old.
    "baseline_min_history": "20s",
    "throttle_for": "10s",
    "limit_for": "10s",
    "stall_threshold": "5s",
    "stall_for": "0s",
    "errors_for": "0s",
    "missing_window": "1m",
    "missing_for": "10s",
    "exporter_down_for": "10s",
    "warmup_stall_window": "1m",
    "warmup_stall_for": "10s",
}


def start_with_rules(
    start_prometheus: Callable[[str, str], RunningPrometheus],
    directory: Path,
    port: int,
    every: str,
    version: str = "2",
    **settings: str,
) -> RunningPrometheus:
    """A real Prometheus (`version` 2 or 3, from the start_prometheus fixture) scraping the exporter on `port` and
    evaluating the shipped rules, test-sized (with these mixin `settings` changed), `every`."""
    rules_path = directory / "volprobe-rules.yml"
    rules_path.write_text(rules.render(mixin.from_mapping({**TEST_SIZED, **settings})))
    return start_prometheus(
        f"""
global: {{scrape_interval: {every}, evaluation_interval: {every}}}
rule_files: [{rules_path}]
scrape_configs:
  - job_name: volprobe
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
""",
        version,
    )


def firing(alerts: list[dict[str, Any]], name: str, **labels: str) -> bool:
    """Whether an alert `name` whose labels include `labels` is firing."""
    return any(
        a["labels"].get("alertname") == name
        and a["state"] == "firing"
        and all(a["labels"].get(k) == v for k, v in labels.items())
        for a in alerts
    )


def alert_expression(name: str, **settings: str) -> str:
    """The expression of the shipped alert `name`, rendered test-sized with these mixin `settings` changed."""
    document = rules.document(mixin.from_mapping({**TEST_SIZED, **settings}))
    (expr,) = [r["expr"] for g in document["groups"] for r in g["rules"] if r.get("alert") == name]
    return str(expr)
