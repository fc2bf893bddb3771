"""End to end on a real Prometheus (2.42 and 3.x), with node_exporter's diskstats in place of volprobe's: volprobe
run with --no-collector.diskstats beside Debian's prometheus-node-exporter, the rules and dashboards built with
`diskstats: node_exporter`. The disks' recorded rates come from node_disk_* under volprobe's job and instance (the
two exporters' instance labels differ in their port only, as on a host), the limit alert fires from them, and every
query of the Volume dashboard that reads node_exporter's series has data, on the host its hidden variable finds."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from volprobe import mixin
from volprobe.mixin import dashboards, rules

from .support.dashboards import SUBSTITUTIONS, panels, substitute
from .support.harness import MIB, PROMETHEUS_VERSIONS, free_port, write_config
from .support.rules import TEST_SIZED, firing

pytestmark = [pytest.mark.root, pytest.mark.slow]

NODE_EXPORTER = "prometheus-node-exporter"  # Debian's package's name for node_exporter
NODE = {**TEST_SIZED, "diskstats": "node_exporter", "node_exporter_selector": 'job="node"'}


@pytest.fixture
def node_exporter(tmp_path: Path) -> Iterator[int]:
    """node_exporter's diskstats collector alone on a free loopback port, loop devices included (its default
    leaves them out, and partitions: on a real host the disks under volprobe's targets are neither)."""
    binary = shutil.which(NODE_EXPORTER)
    if binary is None:
        pytest.skip(f"{NODE_EXPORTER} is not installed (apt-get install {NODE_EXPORTER})")
    port = free_port()
    with open(tmp_path / "node_exporter.log", "w") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--web.listen-address=127.0.0.1:{port}",
                "--collector.disable-defaults",
                "--collector.diskstats",
                r"--collector.diskstats.device-exclude=^(ram|fd)\d+$",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "node_exporter.log"
                ).read_text()
                time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("version", PROMETHEUS_VERSIONS)
def test_node_exporters_diskstats_feed_the_rules_and_the_volume_dashboard(
    tmp_path, make_loop, start_exporter, start_prometheus, node_exporter, version
):
    device = make_loop(64 * MIB)
    name = Path(device).name
    config = write_config(
        tmp_path,
        f"targets:\n  - {{name: db, device: {device}, allow_raw_writes: true, limits: {{iops: 5}},\n"
        "     probes: [{op: read, interval: 200ms}, {op: write, interval: 200ms}]}\n",
    )
    exporter = start_exporter("--config", config, "--no-collector.diskstats")
    assert "volprobe_disk_" not in exporter.get(), "the diskstats collector is off"
    c = mixin.from_mapping(NODE)
    rules_path = tmp_path / "node-exporter-rules.yml"
    rules_path.write_text(rules.render(c))
    prometheus = start_prometheus(
        f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [{rules_path}]
scrape_configs:
  - job_name: volprobe
    static_configs: [{{targets: ["127.0.0.1:{exporter.port}"]}}]
  - job_name: node
    static_configs: [{{targets: ["127.0.0.1:{node_exporter}"]}}]
""",
        version,
    )
    instance = f"127.0.0.1:{exporter.port}"
    model = json.loads(dashboards.render_all(c)["volprobe-volume.json"])
    # The hidden host variable: $instance without its port, from its query and regex as Grafana applies them.
    (host_variable,) = [v for v in model["templating"]["list"] if v["name"] == "host"]
    regex = re.compile(host_variable["regex"].strip("/"))
    hosts_query = re.fullmatch(r"label_values\((.*), *instance\)", host_variable["query"])[1]
    values = {
        **SUBSTITUTIONS,
        "$instance": instance,
        "$target": "db",
        "$device": name,
        "$disk": name,
        "$__rate_interval": "10s",
    }
    queries = [
        (panel["title"], target["refId"], target["expr"])
        for panel in panels(model)
        for target in panel.get("targets", [])
        if "node_disk_" in target["expr"]
    ]
    assert len(queries) == 8, queries
    recorded = f'{{job="volprobe", instance="{instance}", device="{name}"}}'
    empty: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        found = prometheus.query(substitute(hosts_query, values))
        hosts = {m[1] for s in found if (m := regex.fullmatch(s["metric"]["instance"]))}
        if hosts != {"127.0.0.1"}:
            empty = [f"host variable: {hosts}"]
        else:
            values["$host"] = "127.0.0.1"
            empty = [
                f"{title} / {ref}: {expr}"
                for title, ref, expr in queries
                if not prometheus.query(substitute(expr, values))
            ]
            for record in (rules.disk_ops_rate(c), rules.disk_bytes_rate(c)):
                if not prometheus.query(f"{record}{recorded} > 0"):
                    empty.append(record)
            alerts = prometheus.alerts()
            if not firing(alerts, "VolprobeNearProvisionedLimit", instance=instance, device=name, limit="iops"):
                empty.append("VolprobeNearProvisionedLimit")
        if not empty:
            break
        time.sleep(1)
    assert empty == [], "without data:\n" + "\n".join(empty) + f"\nalerts: {prometheus.alerts()}"
    # Only the probed device's diskstats are recorded (node_exporter has every loop device's), under volprobe's
    # job and instance.
    series = prometheus.query(rules.disk_ops_rate(c))
    assert {(s["metric"]["job"], s["metric"]["instance"], s["metric"]["device"]) for s in series} == {
        ("volprobe", instance, name)
    }, series
    assert exporter.stop() == 0
