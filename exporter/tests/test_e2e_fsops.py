"""End to end for the filesystem probes' rules and panels (issue 27): a directory on a fresh ext4 with a commit, a
metadata and a write probe, the real exporter, and a real Prometheus per build of the mixin loading its rules
(the classic buckets on Prometheus 2, native histograms alone on 3). The commit p99 record, the commit alert and
every query of the Volume dashboard's commit, metadata and mount panels have data; the block-layer panels keep to
the read and write probes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from volprobe import mixin, ops
from volprobe.mixin import dashboards, rules

from .support.dashboards import panels, reads_filesystem_probes, substitute
from .support.harness import MIB, RunningPrometheus, wait_until, write_config
from .support.rules import TEST_SIZED

pytestmark = pytest.mark.root

# The threshold far below any commit a disk makes, and no for:, so the alert fires within seconds of the record.
FIRES = {**TEST_SIZED, "commit_latency_threshold": "1us", "commit_latency_for": "0s"}
ALERT = "VolprobeCommitLatencyHigh"
PER_OP = "Percentiles per op"


def volume_queries(c: mixin.MixinConfig, values: dict[str, str]) -> dict[str, str]:
    """The Volume dashboard's queries of the filesystem probes, and of its per-op percentiles: "panel / refId" ->
    the query, its variables given `values`."""
    model = json.loads(dashboards.render_all(c)["volprobe-volume.json"])
    return {
        f"{panel['title']} / {target['refId']}": substitute(target["expr"], values)
        for panel in panels(model)
        for target in panel.get("targets", [])
        if reads_filesystem_probes(target["expr"]) or panel["title"] == PER_OP
    }


def test_commit_and_metadata_panels_and_rules_have_data_in_both_builds(
    tmp_path: Path,
    make_loop: Callable[..., str],
    mount_fs: Callable[..., str],
    start_exporter: Callable[..., Any],
    start_prometheus: Callable[..., RunningPrometheus],
) -> None:
    data = Path(mount_fs(make_loop(64 * MIB))) / "etcd"
    data.mkdir()
    config = write_config(
        tmp_path,
        f"targets: [{{name: etcd, directory: {data}, probe_file_size: 1MiB, probes: [{{op: commit, interval: 50ms}}, "
        "{op: metadata, interval: 100ms}, {op: write, interval: 100ms}]}]\n",
    )
    exporter = start_exporter("--config", config)
    builds = {}
    for histograms, version, scrape in (
        ("classic", "2", ""),
        # Native histograms alone: the native rules and panels read no classic series.
        ("native", "3", "scrape_native_histograms: true, always_scrape_classic_histograms: false, "),
    ):
        c = mixin.from_mapping({**FIRES, "histograms": histograms})
        directory = tmp_path / histograms
        directory.mkdir()
        (directory / "rules.yml").write_text(rules.render(c))
        prometheus = start_prometheus(
            f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [{directory / "rules.yml"}]
scrape_configs:
  - {{job_name: volprobe, {scrape}static_configs: [{{targets: ["127.0.0.1:{exporter.port}"]}}]}}
""",
            version,
        )
        builds[histograms] = (c, prometheus)
    values = {
        "$cluster": ".*",
        "$job": "volprobe",
        "$instance": f"127.0.0.1:{exporter.port}",
        "$target": "etcd",
        "$namespace": ".*",
        "$storageclass": ".*",
        "$pvc": ".*",
        "$__rate_interval": "10s",
    }
    for histograms, (c, prometheus) in builds.items():
        check_build(histograms, c, prometheus, values)
    assert exporter.stop() == 0


def check_build(histograms: str, c: mixin.MixinConfig, prometheus: RunningPrometheus, values: dict[str, str]) -> None:
    queries = volume_queries(c, values)
    assert len(queries) == 3 + 3 + 3 + 1 + 2, sorted(queries)  # per op; commit; metadata; its steps; the mount
    queries["commit p99 record"] = rules.commit_p99(c)
    queries["alert"] = f'ALERTS{{alertname="{ALERT}", alertstate="firing", target="etcd"}}'
    results: dict[str, list[dict[str, Any]]] = {}

    def all_have_data() -> bool:
        results.update({name: prometheus.query(expr) for name, expr in queries.items()})
        return all(results.values())

    try:
        wait_until(all_have_data, 30, f"every query of the {histograms} build has data", every=0.5)
    except AssertionError:
        empty = {name: queries[name] for name, result in results.items() if not result}
        raise AssertionError(f"{histograms}: without data: {json.dumps(empty, indent=1)}") from None

    def ops_of(name: str) -> set[str]:
        return {s["metric"].get("op", "") for s in results[name]}

    # Deliberately apart: the per-op percentiles are the block layer's (here the write probe's); the commit and
    # metadata probes have panels of their own.
    for ref in "ABC":
        assert ops_of(f"{PER_OP} / {ref}") == {ops.WRITE.name}, histograms
        assert ops_of(f"Commit latency (write + fdatasync) / {ref}") == {ops.COMMIT.name}, histograms
        assert ops_of(f"Metadata sequence latency / {ref}") == {ops.METADATA.name}, histograms
    assert ops_of("commit p99 record") == ops_of("alert") == {ops.COMMIT.name}, histograms
    steps = "Metadata sequence time by step (mean per sequence) / A"
    assert sorted(s["metric"]["step"] for s in results[steps]) == sorted(ops.METADATA.steps), histograms
    # Stacked, the steps make the mean sequence, in one query (one evaluation), as test_fsops holds the counters:
    # one scrape's steps and histogram hold the same sequences (a CI run read 1.11 when they did not). The room
    # above 1: rate() extrapolates each series apart.
    metadata = '{target="etcd", op="metadata"}'
    if histograms == "native":
        mean = f"sum(histogram_avg(rate(volprobe_probe_latency_seconds{metadata}[10s])))"
    else:
        mean = (
            f"sum(rate(volprobe_probe_latency_seconds_sum{metadata}[10s]))"
            f" / sum(rate(volprobe_probe_latency_seconds_count{metadata}[10s]))"
        )
    (ratio,) = prometheus.query(f"sum({queries[steps]}) / ({mean})")
    assert 0.8 <= float(ratio["value"][1]) <= 1.05, (histograms, ratio)
