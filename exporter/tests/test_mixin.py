"""Rules and dashboards: generated from one configuration, committed, linted, and checked with real promtool."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from volprobe import metrics, mixin
from volprobe.config import ConfigError
from volprobe.mixin import __main__ as generator
from volprobe.mixin import rules

from .support.dashboards import SUBSTITUTIONS, panels, substitute
from .support.harness import FIXTURES, PROMETHEUS_VERSIONS, REPO, prometheus_tool

# The committed builds: on the classic series (dashboards/), on native histograms (dashboards/native/), and on
# node_exporter's diskstats (dashboards/node_exporter/); each with the mixin keys that build it.
BUILDS = (REPO / "dashboards", REPO / "dashboards" / "native", REPO / "dashboards" / "node_exporter")
BUILD_IDS = ("classic", "native", "node_exporter")
BUILD_KEYS = {"classic": {}, "native": {"histograms": "native"}, "node_exporter": {"diskstats": "node_exporter"}}
DASHBOARDS = sorted(path for build in BUILDS for path in build.glob("*.json"))
RANGE_FUNCTIONS = re.compile(r"\b(rate|irate|increase|deriv|delta|changes)\(([^()]|\([^()]*\))*?\[([^\]]+)\]")


def test_committed_files_match_the_generator():
    for relative, text in generator.outputs(None).items():
        committed = (REPO / relative).read_text()
        assert committed == text, f"{relative} is stale: run `python -m volprobe.mixin --out .` and commit"
    for build in BUILDS:
        names = {p.name for p in build.glob("*.json")}
        assert names == {
            "volprobe-fleet.json",
            "volprobe-volume.json",
            "volprobe-warmup.json",
            "volprobe-migration.json",
        }


@pytest.mark.parametrize("version", PROMETHEUS_VERSIONS)
def test_promtool_checks_the_rules(version):
    promtool = prometheus_tool("promtool", version)
    result = subprocess.run(
        [promtool, "check", "rules", str(REPO / "alerts" / "volprobe-rules.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def promtool_test_rules(version: str, *tests: Path) -> None:
    """`promtool test rules` of that Prometheus version on the unit-test files, which must all pass."""
    result = subprocess.run(
        [prometheus_tool("promtool", version), "test", "rules", *map(str, tests)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", PROMETHEUS_VERSIONS)
def test_promtool_unit_tests_pass(version):
    promtool_test_rules(version, *sorted((REPO / "alerts" / "tests").glob("*.yml")))


def test_every_alert_has_severity_summary_description_runbook_and_a_unit_test():
    document = yaml.safe_load((REPO / "alerts" / "volprobe-rules.yml").read_text())
    alerts = {r["alert"]: r for g in document["groups"] for r in g["rules"] if "alert" in r}
    expected = {
        "VolprobeLatencyHigh",
        "VolprobeLatencyRegression",
        "VolprobeCommitLatencyHigh",
        "VolprobeThrottled",
        "VolprobeNearProvisionedLimit",
        "VolprobeProbeStalled",
        "VolprobeMountHung",
        "VolprobeProbeErrors",
        "VolprobeProbesMissing",
        "VolprobeExporterDown",
        "VolprobeWarmupStalled",
        "VolprobeWarmupFailed",
        "VolprobeConfigReloadFailed",
        "VolprobeWebConfigReloadFailed",
        "VolprobeThreadRestarting",
    }
    assert set(alerts) == expected
    runbook = (REPO / "alerts" / "runbook.md").read_text()
    tested = "".join(p.read_text() for p in (REPO / "alerts" / "tests").glob("*.yml"))
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical")
        annotations = rule["annotations"]
        assert (annotations["summary"] and "{{ $value" in annotations["description"]) or name in (
            "VolprobeProbesMissing",
            "VolprobeExporterDown",
            "VolprobeWarmupStalled",
            "VolprobeWarmupFailed",
            "VolprobeConfigReloadFailed",
            "VolprobeWebConfigReloadFailed",
        )
        assert annotations["runbook_url"].endswith(f"#{name.lower()}")
        assert f"\n## {name}\n" in runbook, f"no runbook section for {name}"
        assert f"alertname: {name}" in tested, f"no promtool test for {name}"


def test_mixin_configuration_changes_thresholds_and_rejects_unknown_keys(tmp_path):
    path = tmp_path / "mixin.yml"
    path.write_text("latency_objective: {read: 5ms, write: 2ms}\nregression_factor: 3\nselector: 'job=\"vp\"'\n")
    text = rules.render(mixin.load(path))
    assert 'op="write"} > 0.002' in text and 'op="read"} > 0.005' in text
    assert "> 3 * target_op" in text and 'job="vp"' in text and 'job="volprobe"' not in text
    path.write_text("latency_objectiv: {read: 5ms}\nthrottle_for: soon\n")
    with pytest.raises(ConfigError) as caught:
        mixin.load(path)
    assert any("latency_objectiv: unknown key" in p for p in caught.value.problems)
    assert any("throttle_for" in p for p in caught.value.problems)


def test_the_commit_alert_reads_the_per_op_p99_record_at_the_configured_threshold():
    """The commit p99 is the per-op p99 record, op="commit", in either build (no copy under another name); the
    alert's threshold and for: come from the mixin configuration, validated by key."""
    for histograms in ("classic", "native"):
        c = mixin.from_mapping(
            {"histograms": histograms, "commit_latency_threshold": "25ms", "commit_latency_for": "3m"}
        )
        assert rules.commit_p99(c) == 'target_op:volprobe_probe_latency_seconds:p99_rate5m{job="volprobe", op="commit"}'
        assert rules.quantile(c, "p99") in recorded_names(c)
        (alert,) = [r for r in rules.alerting_rules(c) if r["alert"] == "VolprobeCommitLatencyHigh"]
        # The comparison, then the warming targets left out and the claim joined (volprobe_test.yml, kube_pvc_test.yml)
        assert alert["expr"].startswith(f"(\n  {rules.commit_p99(c)} > 0.025\n  unless on (") and alert["for"] == "3m"
        assert "above 25ms" in alert["annotations"]["description"]
    with pytest.raises(ConfigError) as caught:
        mixin.from_mapping({"commit_latency_threshold": "fast", "commit_latency_for": -1})
    assert {p.split(":")[1].strip() for p in caught.value.problems} >= {
        "commit_latency_threshold",
        "commit_latency_for",
    }


def test_the_native_build_reads_native_histograms_and_passes_its_promtool_tests(tmp_path):
    """`histograms: native`: the rules read each probe's native histogram (rate, histogram_quantile,
    histogram_count), never a classic bucket or _count series, keep every recorded name, and pass promtool unit
    tests written on native histogram input (fixtures/native_rules_test.yml). Prometheus 2.42 parses them
    too; its promtool cannot read native input, so the tests run on 3.16."""
    native = mixin.from_mapping({"histograms": "native"})
    text = rules.render(native)
    assert LATENCY_BUCKET not in text and f"{metrics.PROBE_LATENCY.count}{{" not in text
    classic_names = {r.get("record") for g in rules.document(mixin.DEFAULTS)["groups"] for r in g["rules"]}
    native_names = {r.get("record") for g in rules.document(native)["groups"] for r in g["rules"]}
    assert native_names - classic_names == {rules.bucket_rate(native)}
    assert classic_names - native_names == {rules.bucket_rate(mixin.DEFAULTS)}
    (tmp_path / "native-rules.yml").write_text(text)
    (tmp_path / "native_rules_test.yml").write_text((FIXTURES / "native_rules_test.yml").read_text())
    for version in PROMETHEUS_VERSIONS:
        checked = subprocess.run(
            [prometheus_tool("promtool", version), "check", "rules", str(tmp_path / "native-rules.yml")],
            capture_output=True,
            text=True,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
    promtool_test_rules("3", tmp_path / "native_rules_test.yml")


LATENCY_BUCKET = metrics.PROBE_LATENCY.bucket
CLASSIC_LATENCY = re.compile(rf"\b{metrics.PROBE_LATENCY.name}_(bucket|count|sum)\b")


def latency_queries_blanked(model: dict, reads: re.Pattern[str]) -> tuple[dict, int]:
    """A copy of a dashboard with each query that `reads` blanked, its legend too if it names le (a classic
    bucket's bound); and how many there were."""
    model = json.loads(json.dumps(model))
    blanked = 0
    for panel in panels(model):
        for target in panel.get("targets", []):
            if reads.search(target["expr"]):
                target["expr"] = "(the probes' latency)"
                if target.get("legendFormat") == "{{le}}":
                    del target["legendFormat"]
                blanked += 1
    return model, blanked


def test_the_native_dashboards_are_the_classic_ones_on_native_histograms():
    """dashboards/native/ holds dashboards/ with each query on the probes' classic buckets, _count or _sum reading
    the native histogram instead, and nothing else changed: the same panels, ids, variables and uids. Those
    queries read the native histogram and never a classic series of it."""
    native_latency = re.compile(rf"\b{metrics.PROBE_LATENCY.name}\{{")
    for path in sorted(BUILDS[0].glob("*.json")):
        classic = json.loads(path.read_text())
        native = json.loads((BUILDS[1] / path.name).read_text())
        assert not CLASSIC_LATENCY.search(json.dumps(native)), path.name
        classic_blanked, replaced = latency_queries_blanked(classic, CLASSIC_LATENCY)
        native_blanked, replacing = latency_queries_blanked(native, native_latency)
        assert replaced == replacing, path.name
        assert native_blanked == classic_blanked, path.name
        assert replaced > 0 or path.name == "volprobe-warmup.json", path.name


VOLPROBE_DISK = re.compile(r"(?<![\w:])volprobe_disk_\w+")  # raw, not a recorded name (device:volprobe_disk_...)
NODE_DISK = re.compile(r"\bnode_disk_\w+")


def test_the_node_exporter_dashboards_are_the_classic_ones_on_node_exporters_diskstats():
    """dashboards/node_exporter/ holds dashboards/ with each query on volprobe_disk_* reading node_exporter's
    series of the same name instead (node_disk_*), on the instance's host (the hidden host variable), and nothing
    else changed: the same panels, ids, variables (but host) and uids."""
    for path in sorted(BUILDS[0].glob("*.json")):
        classic = json.loads(path.read_text())
        node = json.loads((BUILDS[2] / path.name).read_text())
        assert not VOLPROBE_DISK.search(json.dumps(node)), path.name
        classic_blanked, replaced = latency_queries_blanked(classic, VOLPROBE_DISK)
        node_blanked, replacing = latency_queries_blanked(node, NODE_DISK)
        assert replaced == replacing and (replaced > 0) == (path.name == "volprobe-volume.json"), path.name
        if replaced:
            names = [v["name"] for v in node_blanked["templating"]["list"]]
            host = node_blanked["templating"]["list"].pop(names.index("host"))
            assert host["hide"] == 2 and host["regex"] == "/^(.+?)(?::[0-9]+)?$/"
            assert sorted(map(rules.node_disk, VOLPROBE_DISK.findall(json.dumps(classic)))) == sorted(
                NODE_DISK.findall(json.dumps(node))
            )
        assert node_blanked == classic_blanked, path.name


def test_the_node_exporter_build_records_the_disks_rates_from_node_disk_and_passes_its_promtool_tests(tmp_path):
    """`diskstats: node_exporter`: no rule reads volprobe_disk_*; the disks' rates keep their recorded names
    (the limit alert reads them), recorded from node_disk_* for the devices volprobe probes, under volprobe's job
    and instance; promtool 2.42 and 3.x check the rules and pass their unit tests
    (fixtures/node_exporter_rules_test.yml)."""
    node = mixin.from_mapping({"diskstats": "node_exporter"})
    text = rules.render(node)
    assert not VOLPROBE_DISK.search(text) and NODE_DISK.search(text)
    assert recorded_names(node) == recorded_names(mixin.DEFAULTS)
    (tmp_path / "node-exporter-rules.yml").write_text(text)
    test = tmp_path / "node_exporter_rules_test.yml"
    test.write_text((FIXTURES / "node_exporter_rules_test.yml").read_text())
    for version in PROMETHEUS_VERSIONS:
        checked = subprocess.run(
            [prometheus_tool("promtool", version), "check", "rules", str(tmp_path / "node-exporter-rules.yml")],
            capture_output=True,
            text=True,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        promtool_test_rules(version, test)


def test_regeneration_is_one_command(tmp_path):
    config = tmp_path / "mixin.yml"
    config.write_text("dashboard_uid_prefix: acme\n")
    result = subprocess.run(
        [sys.executable, "-m", "volprobe.mixin", "--config", str(config), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "dashboards" / "volprobe-volume.json").read_text())["uid"] == "acme-volume"
    assert (tmp_path / "alerts" / "volprobe-rules.yml").exists()


# -- recorded names: a public contract, renamed with the old names kept for one release -----------------------

PREVIOUS_RULES = FIXTURES / "volprobe-rules-0.1.0.yml"  # alerts/volprobe-rules.yml as 0.1.0 shipped it


def records_by_group(document: dict) -> dict[str, dict[str, str]]:
    """Group name -> {recorded name: expression}."""
    return {g["name"]: {r["record"]: r["expr"] for r in g["rules"] if "record" in r} for g in document["groups"]}


def test_every_name_the_previous_release_recorded_is_still_recorded():
    """Users query the recorded names: each one 0.1.0 recorded is recorded still, either unchanged or, renamed,
    as a copy of its new name in a deprecated group at its source's interval (README, "Renamed recording
    rules")."""
    previous = {
        name for group in records_by_group(yaml.safe_load(PREVIOUS_RULES.read_text())).values() for name in group
    }
    assert len(previous) >= 10, "the fixture holds 0.1.0's rules"
    document = rules.document(mixin.DEFAULTS)
    groups = records_by_group(document)
    intervals = {g["name"]: g.get("interval") for g in document["groups"]}
    where = {name: group for group, records in groups.items() for name in records}
    renamed = rules.renamed(mixin.DEFAULTS)
    for name in sorted(previous):
        assert name in where, f"{name}, recorded by 0.1.0, is no longer recorded"
        if name in renamed:
            new = renamed[name]
            assert where[name].endswith(".deprecated") and groups[where[name]][name] == new, name
            assert intervals[where[name]] == intervals[where[new]], f"{name} is copied at the interval of {new}"
        else:
            assert not where[name].endswith(".deprecated"), f"{name} kept its name: nothing to deprecate"
    assert set(renamed) <= previous, "only names 0.1.0 recorded are deprecated"
    deprecated = {name for group, records in groups.items() if group.endswith(".deprecated") for name in records}
    assert deprecated == set(renamed)


def test_the_readme_lists_each_renamed_recording_rule():
    readme = (REPO / "README.md").read_text()
    table = readme.split("### Renamed recording rules", 1)[1].split("\n#", 1)[0]
    rows = set(re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|", table, re.MULTILINE))
    assert rows == set(rules.renamed(mixin.DEFAULTS).items())


def test_recorded_names_are_level_metric_operations_with_their_window():
    """Prometheus's naming practice: level:metric:operations, the metric one volprobe exports (or, for the
    disk's reads and writes summed, volprobe_disk_*), each rate and quantile with its window."""
    c = mixin.DEFAULTS
    families = (
        {spec.name for spec in metrics.ALL} | metrics.series_names() | {"volprobe_disk_ops", "volprobe_disk_bytes"}
    )
    for group, records in records_by_group(rules.document(c)).items():
        if group.endswith(".deprecated"):
            continue
        for name in records:
            level, metric, operations = name.split(":")
            assert level and metric in families, name
            for operation in operations.split("_"):
                assert operation == "join" or re.fullmatch(r"(rate|median|p\d+)(\d+[smhdw])?", operation), name
                if operation.startswith("rate") or operation.startswith("median"):
                    assert operation[-1] in "smhdw", f"{name}: {operation} names its window"


def previous_rules_renamed(prefix: str) -> dict:
    """0.1.0's recording rules, each recorded name (and each use of it) prefixed: to run beside today's."""
    groups = [g for g in yaml.safe_load(PREVIOUS_RULES.read_text())["groups"] if g["name"] != "volprobe.alerts"]
    names = sorted({r["record"] for g in groups for r in g["rules"]}, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w:])(" + "|".join(map(re.escape, names)) + r")(?![\w:])")
    for group in groups:
        group["name"] = prefix + group["name"]
        for rule in group["rules"]:
            rule["record"] = prefix + rule["record"]
            rule["expr"] = pattern.sub(lambda m: prefix + m.group(1), rule["expr"])
    return {"groups": groups}


@pytest.mark.parametrize("version", PROMETHEUS_VERSIONS)
def test_each_renamed_rule_records_what_its_old_name_did(version, tmp_path):
    """On promtool, from a read and a write probe's buckets and a disk's counters, beside 0.1.0's own rules:
    each new name records what its 0.1.0 name did, and the deprecated old name too, value for value."""
    probe = 'job="volprobe",instance="host:10130",target="db",device="vdb"'
    inputs = []
    for op, per_minute in (("read", (30, 50, 60)), ("write", (0, 20, 60))):
        for le, count in zip(("0.001", "0.01", "+Inf"), per_minute, strict=True):
            inputs.append(
                (f'volprobe_probe_latency_seconds_bucket{{{probe},op="{op}",touch="repeat",le="{le}"}}', count)
            )
        inputs.append((f'volprobe_probe_latency_seconds_count{{{probe},op="{op}",touch="repeat"}}', per_minute[-1]))
    for name in ("reads_completed_total", "writes_completed_total", "read_bytes_total", "written_bytes_total"):
        inputs.append((f'volprobe_disk_{name}{{job="volprobe",instance="host:10130",device="vdb"}}', 600))
    previous = tmp_path / "previous-rules.yml"
    previous.write_text(yaml.safe_dump(previous_rules_renamed("v0_1_0_")))
    tests = []
    for old, new in rules.renamed(mixin.DEFAULTS).items():
        count = 1 if new.startswith("device:") else 2  # a disk; a read and a write probe
        for expr in (f"count({new})", f"count({new} == v0_1_0_{old})", f"count({old} == v0_1_0_{old})"):
            tests.append({"expr": expr, "eval_time": "30m", "exp_samples": [{"labels": "{}", "value": count}]})
    document = {
        "rule_files": [str(REPO / "alerts" / "volprobe-rules.yml"), str(previous)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": f"0+{per_minute}x40"} for s, per_minute in inputs],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "renamed_test.yml"
    path.write_text(yaml.safe_dump(document))
    promtool_test_rules(version, path)


# -- selector and cluster label: every query honours them ------------------------------------------------------

CUSTOM = {"selector": 'job="vp", env="prod"', "cluster_label": "tenant", "node_exporter_selector": 'job="nx"'}
# A series selector: a name (volprobe's, or a recorded one with colons) and its matchers.
SERIES = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{[^{}]*\})?")


def custom_dashboards() -> dict[str, dict]:
    """Every build (classic, native, node_exporter), each dashboard as build/name."""
    from volprobe.mixin import dashboards

    return {
        f"{build}/{name}": json.loads(text)
        for build in BUILD_IDS
        for name, text in dashboards.render_all(mixin.from_mapping({**CUSTOM, **BUILD_KEYS[build]})).items()
    }


def dashboard_queries(model: dict) -> list[str]:
    """Every query of a dashboard: its panels' targets and its query variables."""
    found = [target["expr"] for panel in panels(model) for target in panel.get("targets", [])]
    return found + [v["query"] for v in model["templating"]["list"] if v["type"] == "query"]


def series_selectors(expr: str) -> list[tuple[str, str]]:
    """(name, matchers) of each volprobe series an expression reads, raw or recorded."""
    return [
        (name, braces)
        for name, braces in SERIES.findall(expr)
        if name.startswith("volprobe_") or (":" in name and "volprobe_" in name)
    ]


def test_every_dashboard_query_honours_the_selector_and_the_cluster_label():
    """Rendered with another selector and cluster label: each volprobe series a query or a variable reads is
    selected by the selector and, but for the cluster variable's own query, by the cluster label; each of
    node_exporter's (diskstats: node_exporter) by node_exporter_selector, the cluster label and the instance's
    host."""
    for name, model in custom_dashboards().items():
        for expr in dashboard_queries(model):
            selectors = series_selectors(expr)
            node = [(series, braces) for series, braces in SERIES.findall(expr) if series.startswith("node_")]
            assert selectors or node, f"{name}: {expr}"
            assert not node or name.startswith("node_exporter/"), f"{name}: {expr}"
            for _series, braces in node:
                assert braces.startswith('{job="nx", tenant=~"$cluster", instance=~"$host(:[0-9]+)?"'), expr
            for series, braces in selectors:
                assert braces.startswith("{" + CUSTOM["selector"]), f"{name}: {series} without the selector: {expr}"
                # The cluster variables list the label's values; Migration's job spans both sides' clusters.
                lists_clusters = expr.endswith(", tenant)") or (
                    name.endswith("/volprobe-migration.json") and "job)" in expr
                )
                if not lists_clusters:
                    assert re.search(r'\btenant=~"\$(\w+_)?cluster"', braces), f"{name}: {expr}"
            assert not re.search(r"(?<![\w$])cluster\b(?!\w)", expr.replace("$cluster", "")), f"{name}: {expr}"


def test_every_rule_honours_the_selector_and_the_cluster_label():
    document = rules.document(mixin.from_mapping(CUSTOM))
    for group in document["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"]
            assert not re.search(r"\bcluster\b", expr), expr
            if re.search(r"\b(by|on) \(", expr) and "kube_" not in expr.split("\n", 1)[0]:
                assert re.search(r"\b(by|on) \(tenant, ", expr), expr
            if group["name"].endswith(".deprecated"):
                continue  # a copy of a recorded series, which the selector chose when it was recorded
            for series, braces in series_selectors(expr):
                if ":" not in series or "alert" in rule:  # raw series, and every series an alert reads
                    assert CUSTOM["selector"] in braces, f"{series} without the selector: {expr}"


# -- metric names: every volprobe_* name in the committed files is declared in volprobe/metrics.py ---------------

# Every committed file that names volprobe's series: generated rules and dashboards, their Kubernetes forms, the
# hand-written promtool tests and the runbook.
NAMING_FILES = sorted(
    {
        *DASHBOARDS,
        *(REPO / "alerts").glob("*.yml"),
        *(REPO / "alerts" / "tests").glob("*.yml"),
        REPO / "alerts" / "runbook.md",
        *(REPO / "deploy" / "kubernetes" / "base").glob("*.yaml"),
    }
)
# A name with volprobe_ in it, whole: with its colons, a recorded series such as target_op:volprobe_...:p99.
VOLPROBE_NAME = re.compile(r"[A-Za-z0-9_:]*volprobe_[A-Za-z0-9_:]*")
# volprobe_* words that are not metrics, each with its reason.
NOT_METRICS = {
    "volprobe_test": "alerts/tests/volprobe_test.yml, a file named in a comment of alerts/tests/regression_test.yml",
}
# Prose may name a family (a histogram, a counter without _total); queries and test inputs name series.
PROSE = {"runbook.md"}
# The one family the exporter also writes as a native histogram (collectors/probe.py): a series, in the
# dashboards built for native histograms.
NATIVE = {metrics.PROBE_LATENCY.name}


def recorded_names(c: mixin.MixinConfig = mixin.DEFAULTS) -> set[str]:
    """What the generated rules record (target_op:volprobe_probe_latency_seconds:p99_rate5m, ...)."""
    return {r["record"] for g in rules.document(c)["groups"] for r in g["rules"] if "record" in r}


def volprobe_names(text: str) -> list[str]:
    """The volprobe_* names in a text, escapes (JSON's \\n and \\") blanked so they do not join a name."""
    return [name.rstrip(":") for name in VOLPROBE_NAME.findall(re.sub(r"\\.", " ", text))]


def test_every_metric_name_in_dashboards_rules_tests_and_runbook_is_declared():
    """A metric renamed in volprobe/metrics.py without regenerating (and without updating alerts/tests and the
    runbook by hand) leaves its old name here: fail, and name each file and line."""
    series, families, records = metrics.series_names(), {spec.name for spec in metrics.ALL}, recorded_names()
    unknown = []
    seen = set()
    for path in NAMING_FILES:
        allowed = series | records | set(NOT_METRICS) | (families if path.name in PROSE else set())
        if path.parent == BUILDS[1]:
            allowed |= NATIVE
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in volprobe_names(line):
                seen.add(name)
                if name not in allowed:
                    unknown.append(f"{path.relative_to(REPO)}:{number}: {name}")
    assert not unknown, (
        "names no metric declared in volprobe/metrics.py nor a rule records: declare it, or regenerate "
        "(python -m volprobe.mixin --out .) and update alerts/tests and alerts/runbook.md by hand:\n"
        + "\n".join(unknown)
    )
    assert len(seen) > 30, "the scan found the committed names"
    assert set(NOT_METRICS) <= seen, "an allow-listed word no longer occurs: drop it from NOT_METRICS"


# Labels added to a metric after its first release: an input series without them stands for an older exporter,
# whose series the rules must keep serving (metric names and labels are a public contract).
ADDED_LABELS = {"volprobe_throttle_active": {"source"}, "volprobe_target_info": {"driver"}}
# Labels the scrape adds, not the exporter: cluster (Prometheus's, where it adds one), and the exporter pod's
# own namespace, pod, service, endpoint and node that a ServiceMonitor adds (deploy/kubernetes/base): the rules
# must not take the exporter's namespace for a volume's (kube_pvc_test.yml).
SCRAPE_LABELS = {"cluster", "namespace", "pod", "service", "endpoint", "node"}


def test_promtool_test_inputs_carry_the_declared_labels():
    """Input series of alerts/tests have exactly the labels volprobe exports (plus job, instance and maybe
    cluster), or those of an older exporter (ADDED_LABELS)."""
    declared = {}
    for spec in metrics.ALL:
        for name in spec.series_names():
            declared[name] = {"job", "instance", *spec.labels}
        if spec.kind == "histogram":
            declared[spec.bucket].add("le")
        if spec.kind == "summary":
            declared[spec.name].add("quantile")
    wrong = []
    for path in sorted((REPO / "alerts" / "tests").glob("*.yml")):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for series in test.get("input_series", []):
                name, labels = re.fullmatch(r"([A-Za-z0-9_:]+)\{(.*)\}", series["series"]).groups()
                if name not in declared:  # recorded series and up (an undeclared volprobe_* fails the test above)
                    continue
                keys = set(re.findall(r'(\w+)="', labels)) - SCRAPE_LABELS
                if keys not in (declared[name], declared[name] - ADDED_LABELS.get(name, set())):
                    wrong.append(f"{path.name}: {name} has {sorted(keys)}, expected {sorted(declared[name])}")
    assert not wrong, "\n".join(wrong)


# -- dashboard lint, in the spirit of grafana/dashboard-linter -------------------------------------------------


@pytest.fixture(params=DASHBOARDS, ids=[str(p.relative_to(REPO / "dashboards").with_suffix("")) for p in DASHBOARDS])
def model(request) -> dict:
    return json.loads(request.param.read_text())


def test_datasource_variable_used_by_every_panel_and_target(model):
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels(model):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}"


def test_job_and_instance_variables(model):
    variables = {v["name"]: v for v in model["templating"]["list"]}
    # The Migration dashboard picks a cluster and an instance per side (test_the_migration_dashboard_pins...).
    sides = ("baseline_", "candidate_") if model["uid"].endswith("-migration") else ("",)
    clusters, instances = [f"${side}cluster" for side in sides], [f"${side}instance" for side in sides]
    assert "job" in variables and all(name[1:] in variables for name in clusters + instances)
    # The optional cluster: All is .*, which matches series without the label too.
    for name in clusters:
        assert variables[name[1:]]["includeAll"] and variables[name[1:]]["allValue"] == ".*"
    for panel in panels(model):
        for target in panel.get("targets", []):
            if "volprobe_" in target["expr"] or "target_op:" in target["expr"]:
                assert "$job" in target["expr"], target["expr"]
                assert any(name in target["expr"] for name in clusters), target["expr"]
                assert any(name in target["expr"] for name in instances), target["expr"]


def test_every_panel_says_what_it_shows(model):
    for panel in panels(model):
        assert len(panel.get("description", "")) >= 20, f"{model['title']}: {panel['title']} has no description"


@pytest.mark.parametrize("build", BUILDS, ids=BUILD_IDS)
def test_the_volume_dashboard_shows_each_disk_of_a_target_on_several(build):
    model = json.loads((build / "volprobe-volume.json").read_text())
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["disk"]["multi"] and variables["disk"]["includeAll"]
    assert "volprobe_target_disk_info" in str(variables["disk"]["query"])
    for panel in panels(model):
        for target in panel.get("targets", []):
            assert '"$disk"' not in target["expr"].replace('=~"$disk"', ""), "a list of disks needs =~"
            if "$disk" in target["expr"]:
                assert "{{device}}" in target["legendFormat"], "one series per disk"


@pytest.mark.parametrize("build", BUILDS, ids=BUILD_IDS)
def test_the_volume_dashboard_never_sums_volumes_of_different_hosts(build):
    model = json.loads((build / "volprobe-volume.json").read_text())
    variables = {v["name"]: v for v in model["templating"]["list"]}
    for name in ("instance", "target"):
        assert not variables[name].get("multi") and not variables[name].get("includeAll"), name
    for panel in panels(model):
        for target in panel.get("targets", []):
            if "volprobe_" in target["expr"] or "target_op:" in target["expr"]:
                assert 'instance=~"$instance"' in target["expr"], target["expr"]


@pytest.mark.parametrize("build", BUILDS, ids=BUILD_IDS)
def test_the_fleet_table_has_a_unit_per_column_and_links_each_volume_to_its_dashboard(build):
    fleet = json.loads((build / "volprobe-fleet.json").read_text())
    volume = json.loads((build / "volprobe-volume.json").read_text())
    (table,) = [p for p in panels(fleet) if p["type"] == "table"]
    overrides = {
        o["matcher"]["options"]: {q["id"]: q["value"] for q in o["properties"]}
        for o in table["fieldConfig"]["overrides"]
    }
    assert table["fieldConfig"]["defaults"]["unit"] == "s"  # the quantile columns
    assert {name: overrides[name]["unit"] for name in ("throttled", "errors", "warm-up")} == {
        "throttled": "bool_yes_no",
        "errors": "none",
        "warm-up": "percentunit",
    }
    (link,) = overrides["target"]["links"]
    assert link["url"].startswith(f"/d/{volume['uid']}/")
    assert (
        "var-instance=${__data.fields.instance}" in link["url"] and "var-target=${__data.fields.target}" in link["url"]
    )


@pytest.mark.parametrize("build", BUILDS, ids=BUILD_IDS)
def test_the_volume_dashboard_links_to_its_warm_up_and_migration_views(build):
    uids = {json.loads(p.read_text())["title"]: json.loads(p.read_text())["uid"] for p in DASHBOARDS}
    volume = json.loads((build / "volprobe-volume.json").read_text())
    urls = {link["title"]: link["url"] for link in volume["links"]}
    warmup = urls["Warm-up of this volume"]
    assert warmup.startswith(f"/d/{uids['volprobe / Warm-up']}/") and "${instance:queryparam}" in warmup
    # This volume becomes the baseline (its host and target); the candidate is picked on its own host.
    migration = urls["Compare with another volume (Migration)"]
    assert migration.startswith(f"/d/{uids['volprobe / Migration']}/")
    assert "var-baseline_instance=${instance:percentencode}" in migration
    assert "var-baseline=${target:percentencode}" in migration
    assert "${cluster:queryparam}" in warmup
    for url in urls.values():
        assert "${job:queryparam}" in url, url
    assert all(link["keepTime"] for link in volume["links"])


@pytest.mark.parametrize("build", BUILDS, ids=BUILD_IDS)
def test_the_migration_dashboard_pins_each_side_to_its_own_instance_and_target(build):
    """A migration compares hosts (an EBS node with an Azure one, maybe in two clusters): each side's series
    come from its own cluster, instance and target, and the shared target name of two hosts never merges them."""
    model = json.loads((build / "volprobe-migration.json").read_text())
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert "instance" not in variables and "cluster" not in variables
    for side in ("baseline", "candidate"):
        for name in (f"{side}_cluster", f"{side}_instance", side):
            assert not variables[name].get("multi"), name
        for name in (f"{side}_instance", side):
            assert not variables[name].get("includeAll"), name
        assert f'cluster=~"${side}_cluster"' in variables[f"{side}_instance"]["query"]
        assert f'cluster=~"${side}_cluster", job=~"$job", instance="${side}_instance"' in variables[side]["query"]
    for panel in panels(model):
        for target in panel["targets"]:
            for side in re.findall(r'target="\$(\w+)"', target["expr"]):
                pinned = f'cluster=~"${side}_cluster", job=~"$job", instance="${side}_instance", target="${side}"'
                assert pinned in target["expr"], target["expr"]
            sides = set(re.findall(r'instance="\$(\w+)_instance"', target["expr"]))
            assert sides and sides <= {"baseline", "candidate"}, target["expr"]


def test_rates_use_rate_interval(model):
    for panel in panels(model):
        for target in panel.get("targets", []):
            for match in RANGE_FUNCTIONS.finditer(target["expr"]):
                window = match.group(3)
                allowed = {"$__rate_interval"} | ({"$__range"} if target.get("instant") else set())
                assert window in allowed, f"{panel['title']}: {match.group(0)}"


def test_unique_panel_ids_refids_and_legends(model):
    ids = [p["id"] for p in panels(model)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    for panel in panels(model):
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert refs and all(refs) and len(refs) == len(set(refs)), panel["title"]
        if panel["type"] in ("timeseries", "barchart", "state-timeline"):
            assert panel["options"]["legend"]["showLegend"] is True, panel["title"]


def test_every_query_parses_with_promtool(model, tmp_path):
    rules_file = {"groups": [{"name": "dashboard", "rules": []}]}
    for panel in panels(model):
        for target in panel.get("targets", []):
            record = f"dashboard:query:{panel['id']}_{target['refId'].lower()}"
            rules_file["groups"][0]["rules"].append({"record": record, "expr": substitute(target["expr"])})
    for variable in model["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*), *\w+\)|query_result\((.*)\)", variable["query"])
            assert inner, variable["query"]
            rules_file["groups"][0]["rules"].append(
                {
                    "record": f"dashboard:variable:{variable['name']}",
                    "expr": substitute(inner.group(1) or inner.group(2)),
                }
            )
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules_file))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "$" not in path.read_text(), "every variable was substituted"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('regression_factor: "2"', "regression_factor"),
        ("latency_objective: {read: 5ms, write: [2ms]}", "latency_objective"),
        ("selector: 7", "selector"),
        ("- a list", "mixin"),
    ],
)
def test_a_mixin_value_of_the_wrong_type_exits_2_naming_the_key(tmp_path, text, key):
    config = tmp_path / "mixin.yml"
    config.write_text(text + "\n")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "volprobe.mixin", "--config", str(config), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and key in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not out.exists(), "nothing is written from a bad configuration"


@pytest.mark.parametrize("version", PROMETHEUS_VERSIONS)
def test_the_namespace_storageclass_and_pvc_variables_narrow_the_targets(version, tmp_path):
    """The dashboards' target selection (Scope.selected_targets), on promtool over the recorded join: a namespace,
    a storage class or a claim picked keeps only its targets; All (.*) keeps every target, a disk no claim is on
    too."""
    from volprobe.mixin.dashboards.variables import Scope

    selected_targets = Scope.of(mixin.DEFAULTS).selected_targets

    def info(target: str, pv: str) -> str:
        labels = ",".join(f'{k}=""' for k in metrics.TARGET_INFO.labels if k not in ("target", "device", "pv"))
        identity = f'target="{target}",device="{target}",pv="{pv}"'
        return f'volprobe_target_info{{job="volprobe",instance="node-1",{identity},{labels}}}'

    ksm = 'job="kube-state-metrics",instance="10.0.3.7:8080"'
    inputs = [
        (info("nvme1n1", "pvc-a"), "1x10"),
        (info("nvme2n1", "pvc-b"), "1x10"),
        (info("nvme0n1", ""), "1x10"),
        (f'kube_persistentvolume_claim_ref{{{ksm},persistentvolume="pvc-a",claim_namespace="shop",name="db"}}', "1x10"),
        (
            f'kube_persistentvolume_claim_ref{{{ksm},persistentvolume="pvc-b",claim_namespace="ops",name="logs"}}',
            "1x10",
        ),
        (f'kube_persistentvolume_info{{{ksm},persistentvolume="pvc-a",storageclass="gp3"}}', "1x10"),
        (f'kube_persistentvolume_info{{{ksm},persistentvolume="pvc-b",storageclass="io2"}}', "1x10"),
    ]
    cases = {
        (".*", ".*", ".*"): ["nvme0n1", "nvme1n1", "nvme2n1"],
        ("shop", ".*", ".*"): ["nvme1n1"],
        (".*", ".*", "logs"): ["nvme2n1"],
        (".*", "io2", ".*"): ["nvme2n1"],
        ("shop", "io2", ".*"): [],
    }
    tests = []
    for (namespace, storageclass, pvc), targets in cases.items():
        values = {**SUBSTITUTIONS, "$namespace": namespace, "$storageclass": storageclass, "$pvc": pvc}
        values["$instance"] = "node-1"
        expr = f"count by (target) ({substitute(selected_targets, values)})"
        samples = [{"labels": f'{{target="{t}"}}', "value": 1} for t in targets]
        tests.append({"expr": expr, "eval_time": "5m", "exp_samples": samples})
    document = {
        "rule_files": [str(REPO / "alerts" / "volprobe-rules.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in inputs],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "selected_test.yml"
    path.write_text(yaml.safe_dump(document))
    promtool_test_rules(version, path)
