"""End to end: lab volumes, the real exporter, a real Prometheus loading the generated rules (rendered with
test-sized windows), alerts checked through Prometheus's API, and every dashboard query run against it."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from volprobe import mixin
from volprobe.mixin import dashboards

from .support.dashboards import panels, reads_filesystem_probes, substitute
from .support.harness import MIB, PROMETHEUS_VERSIONS, probes_done, prometheus_built, stop_fio
from .support.nvme_pages import counters_page
from .support.rules import TEST_SIZED, firing, start_with_rules

# Minutes: alerts need their `for` durations. One at a time with the other latency tests (conftest.py).
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.alone, pytest.mark.xdist_group("lab-latency")]

ALL_CLAIMS = {"$namespace": ".*", "$storageclass": ".*", "$pvc": ".*"}  # the claim variables at All: every target
# The regression alert's test-sized for: (6 s) is shorter than the 30 s window its p99 is over, so that it fires
# within the test; so two probes a host stall slowed hold it over its threshold for up to one window (a healthy
# volume's write p99 read 24.5 ms, +16 ms over its baseline, in one CI run). The defaults (for: 15m on a 5m window)
# outlast any one burst. On the healthy volume it fails the test once it outlasts the window and a few evaluations.
TRANSIENT_ON_HEALTHY = {"VolprobeLatencyRegression": 40.0}
# No latency alert, pending or firing, on a volume volprobe is warming up: "warm" is slowed as "regress" is.
LATENCY_ALERTS = {"VolprobeLatencyHigh", "VolprobeLatencyRegression", "VolprobeCommitLatencyHigh"}


def test_alerts_fire_where_they_should_and_dashboards_have_data(tmp_path, lab_volume, start_exporter, start_prometheus):
    """Both Prometheus versions (2.42, Debian's, and 3.x) at once, each with the rules, scraping the one exporter:
    each must fire every expected alert and no other, and give every dashboard query data. Where 3.x is not built,
    2.42 alone rather than nothing, unless VOLPROBE_PROMETHEUS_3 says where it must be (.ci/run does)."""
    versions = [version for version in PROMETHEUS_VERSIONS if prometheus_built(version)]
    if "VOLPROBE_PROMETHEUS_3" in os.environ:  # .ci/run builds it and says where: there it must run
        assert "3" in versions, f"Prometheus 3 not built at {os.environ['VOLPROBE_PROMETHEUS_3']}"
    volumes = {
        "healthy": lab_volume(size=64 * MIB, read_latency=0.0005, write_latency=0.0005),
        "capped": lab_volume(size=64 * MIB, read_latency=0.001, iops_limit=300),
        "stalled": lab_volume(size=64 * MIB, read_latency=0.0005),
        "regress": lab_volume(size=64 * MIB, read_latency=0.001, write_latency=0.001),
        "flaky": lab_volume(size=64 * MIB, read_latency=0.0005),  # healthy, then a short burst of failures
        "warm": lab_volume(size=64 * MIB, read_latency=0.0005),
    }
    devices = {name: Path(v.device).name for name, v in volumes.items()}
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "volprobe.yml"
    rw = "probes: [{op: read, interval: 200ms}, {op: write, interval: 200ms}], allow_raw_writes: true"
    ro = "probes: [{op: read, interval: 200ms}]"
    config.write_text(f"""
state_directory: {state}
defaults: {{window: 1m}}
targets:
  - {{name: healthy, device: {volumes["healthy"].device}, {rw}}}
  - {{name: capped, device: {volumes["capped"].device}, {ro}, limits: {{iops: 300, bandwidth: 100MiB}}}}
  - {{name: stalled, device: {volumes["stalled"].device}, {ro}}}
  - {{name: regress, device: {volumes["regress"].device}, {rw}}}
  - {{name: flaky, device: {volumes["flaky"].device}, {ro}}}
  - {{name: warm, device: {volumes["warm"].device}, {ro}, warmup: {{mode: read, rate: 128KiB, jobs: 1}}}}
""")
    # The provider's statistics of "healthy", as an EBS volume would give them (the test hook: no NVMe here), so
    # that the Volume dashboard's provider panels have data too.
    pages = tmp_path / "nvme-pages"
    pages.mkdir()
    (pages / devices["healthy"]).write_bytes(counters_page(60.0))
    exporter = start_exporter("--config", str(config), env={"VOLPROBE_TEST_NVME_PAGES": str(pages)})
    servers = {}
    for version in versions:
        (tmp_path / f"rules-{version}").mkdir()
        servers[version] = start_with_rules(
            start_prometheus, tmp_path / f"rules-{version}", exporter.port, "2s", version
        )
    # The detector learns the unloaded latency from the probes: let them see the capped volume idle first.
    exporter.wait_for(
        lambda s: probes_done(s, "capped") >= 12,
        what="probes of the idle capped volume",
    )
    load = subprocess.Popen(
        [
            "fio",
            "--name=load",
            f"--filename={volumes['capped'].device}",
            "--direct=1",
            "--ioengine=libaio",
            "--iodepth=16",
            "--rw=randread",
            "--bs=4k",
            "--time_based",
            "--runtime=400",
            "--output=/dev/null",
        ],
        start_new_session=True,  # fio forks its jobs: stop_fio() signals the whole group
    )
    started = time.monotonic()
    expected = {
        "throttled": ("VolprobeThrottled", {"device": devices["capped"], "limit": "iops"}),
        "stalled": ("VolprobeProbeStalled", {"target": "stalled"}),
        "regression": ("VolprobeLatencyRegression", {"target": "regress"}),
        "errors": ("VolprobeProbeErrors", {"target": "flaky", "op": "read"}),
    }
    everything = {*expected, "fleet"}
    # Per version: what was seen firing (and the fleet table showing the failures) and when.
    seen: dict[str, dict[str, float]] = {version: {} for version in servers}
    # Per version: alert name -> when it was first seen firing on the healthy volume.
    on_healthy: dict[str, dict[str, float]] = {version: {} for version in servers}
    stalled = raised = False
    burst = "before"  # the flaky volume's burst of failures: before, during, after
    fleet_errors = fleet_query("F")

    def done() -> bool:
        return all(set(found) == everything for found in seen.values()) and not any(on_healthy.values())

    try:
        # Watched for 30 s after the raise at least: "warm" would go pending within a few evaluations.
        while (not done() or time.monotonic() - started < 70) and time.monotonic() - started < 240:
            elapsed = time.monotonic() - started
            if not stalled and elapsed > 28:
                volumes["stalled"].set(stall=True)
                stalled = True
            # The baseline (a median over 2m) holds ~55 s of the healthy latency by then: it stays there for
            # as long again after the raise, and the alert needs 6 s.
            if not raised and elapsed > 40:
                # "warm" slows as much, while volprobe warms it up (128 KiB/s of 64 MiB: all the test long).
                for version, prometheus in servers.items():
                    running = 'volprobe_warmup_state{target="warm", state="running"} == 1'
                    assert prometheus.query(running), f"not warming (Prometheus {version})"
                volumes["regress"].set(read_latency=0.025, write_latency=0.025)
                volumes["warm"].set(read_latency=0.025)
                raised = True
            if burst == "before" and elapsed > 20:
                # The first failure of a healthy probe: Prometheus has its failures counter at 0 already.
                for version, prometheus in servers.items():
                    at_zero = prometheus.query(f'{FAILURES}{{target="flaky"}} == 0')
                    assert at_zero, f"failures counter absent before (Prometheus {version})"
                volumes["flaky"].set(fail_reads=0.5)
                burst = "during"
            if burst == "during" and exporter_failures(exporter, "flaky") >= 1:
                volumes["flaky"].set(fail_reads=0.0)
                burst = "after"
            for version, prometheus in servers.items():
                watch(prometheus, version, elapsed, expected, devices, seen[version], on_healthy[version])
                if burst == "after" and "errors" in seen[version] and "fleet" not in seen[version]:
                    values = {**ALL_CLAIMS, "$cluster": ".*", "$job": "volprobe", "$instance": ".*"}
                    shown = prometheus.query(substitute(fleet_errors, values))
                    if any(r["metric"].get("target") == "flaky" and float(r["value"][1]) > 0 for r in shown):
                        seen[version]["fleet"] = elapsed
            time.sleep(2)
        for version, prometheus in servers.items():
            if set(seen[version]) != everything:
                capped = [line for line in exporter.get().splitlines() if devices["capped"] in line]
                raise AssertionError(
                    f"Prometheus {version} fired: {seen[version]}; alerts: {json.dumps(prometheus.alerts())[:3000]}"
                    f"\ncapped: {capped}\nlog: {exporter.log()[-3000:]}"
                )
        for prometheus in servers.values():
            check_dashboards(prometheus, exporter.port, devices)
    finally:
        volumes["stalled"].set(stall=False)
        stop_fio(load)
    assert exporter.stop() == 0


def watch(
    prometheus,
    version: str,
    elapsed: float,
    expected: dict[str, tuple[str, dict[str, str]]],
    devices: dict[str, str],
    seen: dict[str, float],
    on_healthy: dict[str, float],
) -> None:
    """One look at a Prometheus's alerts: no latency alert on the volume being warmed up, none lasting on the
    healthy one; the expected ones seen firing are noted in `seen` (with when)."""
    alerts = prometheus.alerts()
    on_warm = [a for a in alerts if a["labels"].get("target") == "warm" and a["labels"]["alertname"] in LATENCY_ALERTS]
    assert on_warm == [], f"a latency alert on the volume volprobe warms up (Prometheus {version}): {on_warm}"
    quiet = [
        a
        for a in alerts
        if a["state"] == "firing"
        and (a["labels"].get("target") == "healthy" or a["labels"].get("device") == devices["healthy"])
    ]
    names = {a["labels"]["alertname"] for a in quiet}
    for gone in set(on_healthy) - names:  # one that ended is forgotten
        del on_healthy[gone]
    for name in names:
        on_healthy.setdefault(name, elapsed)
    lasting = [
        a
        for a in quiet
        if elapsed - on_healthy[a["labels"]["alertname"]] > TRANSIENT_ON_HEALTHY.get(a["labels"]["alertname"], -1)
    ]
    assert lasting == [], f"an alert on the healthy volume (Prometheus {version}): {lasting}"
    for key, (name, labels) in expected.items():
        if key not in seen and firing(alerts, name, **labels):
            seen[key] = elapsed


FAILURES = "volprobe_probe_failures_total"


def exporter_failures(exporter, target: str) -> float:
    return sum(v for labels, v in exporter.metrics().get(FAILURES, []) if labels["target"] == target)


def fleet_query(ref_id: str) -> str:
    """The expression of the Fleet dashboard's per-volume table column `ref_id` (F: failures)."""
    model = rendered_dashboards()["volprobe-fleet.json"]
    [table] = [p for p in panels(model) if p.get("type") == "table"]
    [target] = [t for t in table["targets"] if t["refId"] == ref_id]
    return target["expr"].replace("$__rate_interval", "30s")


def rendered_dashboards() -> dict[str, dict]:
    """The dashboards generated with the rules' configuration: the recorded names they query carry its windows
    (the committed ones are these, generated with the defaults: test_mixin.py)."""
    rendered = dashboards.render_all(mixin.from_mapping(TEST_SIZED))
    return {name: json.loads(text) for name, text in rendered.items()}


def check_dashboards(prometheus, port: int, devices: dict[str, str]) -> None:
    """Every query of every dashboard returns data for some choice of its variables; but the filesystem probes'
    panels, which these block volumes do not have: test_e2e_fsops.py runs those."""
    choices = []
    for (target, device), op in itertools.product(devices.items(), ("write", "read")):
        choices.append(
            {
                "$cluster": ".*",
                "$job": "volprobe",
                "$instance": f"127.0.0.1:{port}",
                "$baseline_cluster": ".*",
                "$candidate_cluster": ".*",
                "$baseline_instance": f"127.0.0.1:{port}",
                "$candidate_instance": f"127.0.0.1:{port}",
                "$target": target,
                "$device": device,
                "$disk": device,
                "$op": op,
                **ALL_CLAIMS,
                "$baseline": "healthy",
                "$candidate": "regress",
                "$__rate_interval": "30s",
                "$__range": "3m",
                "$__interval": "2s",
                "${datasource}": "prometheus",
            }
        )
    empty = []
    for name, model in sorted(rendered_dashboards().items()):
        for panel in panels(model):
            for target in panel.get("targets", []):
                if reads_filesystem_probes(target["expr"]):
                    continue
                if not any(prometheus.query(substitute(target["expr"], values)) for values in choices):
                    empty.append(f"{name} / {panel['title']} / {target['refId']}: {target['expr']}")
    assert empty == [], "queries without data:\n" + "\n".join(empty)
