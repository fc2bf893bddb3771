"""The shipped recording and alerting rules at fleet scale: 64 volumes' worth of series, evaluated by a real
Prometheus, each rule group's evaluation well under its interval (kubernetes-mixin's rule of thumb: a tenth)."""

from __future__ import annotations

import time

import pytest

from volprobe import mixin
from volprobe.mixin import rules

from .support.harness import MIB

VOLUMES = 64
SCRAPE_S = 2
INTERVAL_S = 5  # the short groups' interval here (the shipped rules use Prometheus's global one)
LONG_INTERVAL_S = 5  # the long group's (shipped: 5m), short so that it evaluates within the test


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.alone  # a budget in seconds: measured with nothing beside it (.ci/run)
def test_rule_groups_evaluate_in_a_tenth_of_their_interval_for_64_volumes(
    tmp_path, make_loop, start_exporter, start_prometheus
):
    """One real exporter (a read and a write probe on a loop device) scraped as 64 instances: the series of
    64 volumes, each a real exposition. The history is a minute, not days: the long windows' cost grows with
    the samples they read; this measures the per-series cost of every group at fleet cardinality."""
    loop = make_loop(64 * MIB)
    config = tmp_path / "volprobe.yml"
    config.write_text(
        f"targets: [{{name: v, device: {loop}, allow_raw_writes: true, "
        "probes: [{op: read, interval: 100ms}, {op: write, interval: 100ms}]}]\n"
    )
    exporter = start_exporter("--config", str(config))
    settings = mixin.from_mapping({"interval": f"{INTERVAL_S}s", "long_interval": f"{LONG_INTERVAL_S}s"})
    rules_path = tmp_path / "rules.yml"
    rules_path.write_text(rules.render(settings))
    instances = "\n".join(
        f'      - {{targets: ["127.0.0.1:{exporter.port}"], labels: {{instance: "node-{i:02d}:10130"}}}}'
        for i in range(VOLUMES)
    )
    prometheus = start_prometheus(f"""
global: {{scrape_interval: {SCRAPE_S}s, evaluation_interval: {INTERVAL_S}s}}
rule_files: [{rules_path}]
scrape_configs:
  - job_name: volprobe
    static_configs:
{instances}
""")
    deadline = time.monotonic() + 90
    groups: dict[str, dict] = {}
    while time.monotonic() < deadline:
        time.sleep(2)
        found = {g["name"]: g for g in prometheus.api("rules")["groups"]}
        quantiles = prometheus.query(f"count({rules.daily_quantile(settings, 'p99')})")
        if (
            quantiles
            and int(float(quantiles[0]["value"][1])) == 2 * VOLUMES
            and all(not g["lastEvaluation"].startswith("0001") for g in found.values())
        ):
            groups = found
            break
    assert groups, f"every group evaluated, with the daily quantiles of {VOLUMES} volumes: {found}"
    series = int(float(prometheus.query("count({__name__=~'volprobe_.+'})")[0]["value"][1]))
    assert series >= VOLUMES * 120, series  # about 129 series per volume (bench/series) with a read and a write probe
    for name, group in groups.items():
        interval = LONG_INTERVAL_S if name.startswith(rules.LONG) else INTERVAL_S
        assert group["interval"] == interval
        print(f"{name}: {group['evaluationTime'] * 1e3:.1f} ms every {interval} s, {len(group['rules'])} rules")
        assert group["evaluationTime"] < interval / 10, (name, group["evaluationTime"])
