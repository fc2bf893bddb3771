"""`volprobe compare` against a real Prometheus (Debian 2.42) holding days of history, backfilled with
`promtool tsdb create-blocks-from openmetrics`.

Two histories: one generated (per minute, the counters an exporter would expose for a probe whose latency is
lognormal around a median that wanders from day to day), for exact ratios and many days; and one recorded from
the real exporter probing lab volumes, retimed over days (test_history_recorded_from_lab_volumes_then_live),
which also compares live from the Prometheus that scraped it.
"""

from __future__ import annotations

import base64
import bisect
import itertools
import json
import math
import random
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request

import bcrypt
import pytest

from volprobe.compare.verdict import EXIT_STATUS
from volprobe.mixin import MixinConfig
from volprobe.mixin.rules import bucket_rate, daily_quantile, long_window_rules, recording_rules
from volprobe.stats import DEFAULT_BUCKETS

from .support.harness import MIB, REPO, Samples, run, volprobe_command, wait_until
from .support.harness import start_prometheus as start_backfilled
from .support.pki import make_pki
from .support.verdicts import verdicts_consistent_with

DAY = 86400
STEP = 300  # seconds between the generated samples (a probe every second in between)
END = (int(time.time()) // 3600 - 2) * 3600  # two whole hours ago: inside the head of no running server


def series_text(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))


def history(
    sides: dict[str, tuple[float, dict[str, str]]], days: int, seed: int, warming: dict[str, list[float]] | None = None
) -> str:
    """OpenMetrics text: for each side (median seconds, spec labels), a write probe every second for `days`;
    `warming`: per side, how many times slower first touches are than repeats, day by day (1 by default)."""
    rng = random.Random(seed)
    bounds = [*DEFAULT_BUCKETS, math.inf]
    families: dict[str, list[str]] = {"bucket": [], "count": [], "info": [], "failures": [], "recent": []}
    start = END - days * DAY
    for target, (median, spec) in sides.items():
        labels = {
            "job": "volprobe",
            "instance": "node:10130",
            "target": target,
            "device": f"{target}dev",
            "op": "write",
        }
        counts_by_bucket = [0] * len(bounds)
        rows: dict[int, list[str]] = {i: [] for i in range(len(bounds))}
        counts, infos, failures = [], [], []
        day_median = median
        for t in range(start, END + 1, STEP):
            if (t - start) % DAY == 0:
                day_median = median * math.exp(rng.gauss(0, 0.03))
            for _ in range(STEP):
                counts_by_bucket[bisect.bisect_left(bounds, day_median * math.exp(rng.gauss(0, 0.3)))] += 1
            cumulative = list(itertools.accumulate(counts_by_bucket))
            for i, bound in enumerate(bounds):
                le = "+Inf" if math.isinf(bound) else repr(bound)
                rows[i].append(
                    f"volprobe_probe_latency_seconds_bucket{{{series_text({**labels, 'le': le})}}} {cumulative[i]} {t}"
                )
            counts.append(f"volprobe_probe_latency_seconds_count{{{series_text(labels)}}} {cumulative[-1]} {t}")
            infos.append(f"volprobe_probe_info{{{series_text({**labels, **spec})}}} 1 {t}")
            penalty = (warming or {}).get(target, [1.0] * days)[min(days - 1, (t - start) // DAY)]
            for touch, value in (("first", day_median * penalty), ("repeat", day_median)):
                recent = series_text({**labels, "quantile": "0.5", "touch": touch})
                families["recent"].append(f"volprobe_probe_latency_recent_seconds{{{recent}}} {value} {t}")
            failures.append(f"volprobe_probe_failures_total{{{series_text(labels)}}} 0 {t}")
        for i in rows:
            families["bucket"] += rows[i]
        families["count"] += counts
        families["info"] += infos
        families["failures"] += failures
    return "\n".join(
        [
            "# TYPE volprobe_probe_latency_seconds histogram",
            *families["bucket"],
            *families["count"],
            "# TYPE volprobe_probe_info gauge",
            *families["info"],
            "# TYPE volprobe_probe_failures counter",
            *families["failures"],
            "# TYPE volprobe_probe_latency_recent_seconds gauge",
            *sorted(families["recent"], key=lambda line: line.split(" ")[0]),
            "# EOF",
            "",
        ]
    )


SPEC = {"block_size_bytes": "8192", "interval": "1s", "sync": "true"}


# The tests on the backfilled server run on one xdist worker: each worker would otherwise make the history again.
ONE_SERVER = pytest.mark.xdist_group("compare-backfilled")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("compare-prometheus")
    sides = {
        "aws": (0.0010, SPEC),
        "azure": (0.0014, SPEC),  # 1.4x slower
        "aws-twin": (0.0010, SPEC),
        "hdd": (0.0010, {**SPEC, "block_size_bytes": "4096"}),  # another spec
        "cold": (0.0010, SPEC),  # restored from a snapshot: first touches 3x slower on the first two days
    }
    source = directory / "history.om"
    source.write_text(history(sides, days=4, seed=1, warming={"cold": [3.0, 3.0, 1.0, 1.0]}))
    run("promtool", "tsdb", "create-blocks-from", "openmetrics", str(source), str(directory / "data"))
    # The blocks as promtool made them, for a second server on the same history: a copy of the running server's
    # directory raced its compactions (blocks deleted mid-copy, three times running on a busy machine).
    shutil.copytree(directory / "data", directory / "backfilled")
    server = start_backfilled("global: {scrape_interval: 1m}\nscrape_configs: []\n", directory)
    server.blocks = directory / "backfilled"
    yield server
    server.stop()


def compare(prometheus, *args: str) -> subprocess.CompletedProcess:
    url = f"http://127.0.0.1:{prometheus.port}"
    command = volprobe_command("compare", "--prometheus", url, "--end", str(END), "--format", "json", *args)
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@ONE_SERVER
def test_a_candidate_40_percent_slower_is_worse(prometheus):
    result = compare(prometheus, "--baseline", 'target="aws"', "--candidate", 'target="azure"', "--since", "4d")
    report = json.loads(result.stdout)
    assert result.returncode == 1 and report["verdict"] == "worse", result.stdout + result.stderr
    assert report["histograms"] == "classic"  # a backfill from OpenMetrics text holds no native histograms
    p50 = report["quantiles"][0]
    assert p50["ratio"] == pytest.approx(1.4, rel=0.05)
    assert report["periods"] == 4 and report["probes"]["baseline"] == pytest.approx(4 * DAY, rel=0.01)


@ONE_SERVER
def test_native_histograms_asked_for_where_there_are_none_is_an_error_naming_the_side(prometheus):
    args = ["--baseline", 'target="aws"', "--candidate", 'target="azure"', "--since", "4d", "--histograms", "native"]
    result = compare(prometheus, *args)
    assert result.returncode == 2 and 'baseline {target="aws"}: no native histogram' in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@ONE_SERVER
def test_equal_sides_are_equivalent(prometheus):
    result = compare(prometheus, "--baseline", 'target="aws"', "--candidate", 'target="aws-twin"', "--since", "4d")
    report = json.loads(result.stdout)
    p50, p90 = report["quantiles"][:2]
    assert p50["verdict"] == p90["verdict"] == "equivalent", result.stdout
    assert result.returncode in (0, 3)  # p99.9 over four days may still be inconclusive


@ONE_SERVER
def test_the_text_and_markdown_reports_carry_the_verdict(prometheus):
    for fmt in ("text", "markdown"):
        command = volprobe_command(
            "compare", "--prometheus", f"http://127.0.0.1:{prometheus.port}", "--end", str(END),
            "--baseline", 'target="aws"', "--candidate", 'target="azure"', "--since", "4d", "--format", fmt,
        )  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, result.stderr
        assert "worse" in result.stdout and "p50" in result.stdout and "p99.9" in result.stdout, result.stdout


@ONE_SERVER
def test_one_period_is_inconclusive(prometheus):
    result = compare(prometheus, "--baseline", 'target="aws"', "--candidate", 'target="azure"', "--since", "1d")
    report = json.loads(result.stdout)
    assert result.returncode == 3 and report["verdict"] == "inconclusive"
    assert "more periods" in report["quantiles"][0]["reason"]


@ONE_SERVER
def test_different_specs_are_refused_naming_both(prometheus):
    result = compare(prometheus, "--baseline", 'target="aws"', "--candidate", 'target="hdd"', "--since", "4d")
    assert result.returncode == 2
    assert "write 8192 bytes" in result.stderr and "write 4096 bytes" in result.stderr
    allowed = compare(
        prometheus,
        "--baseline",
        'target="aws"',
        "--candidate",
        'target="hdd"',
        "--since",
        "4d",
        "--allow-different-specs",
    )
    assert allowed.returncode in (0, 1, 3) and "different specs" in json.loads(allowed.stdout)["warnings"][0]


@ONE_SERVER
def test_a_side_still_warming_up_is_warned_about(prometheus):
    result = compare(prometheus, "--baseline", 'target="aws"', "--candidate", 'target="cold"', "--since", "4d")
    warnings = json.loads(result.stdout)["warnings"]
    assert any("candidate" in w and "3.0x slower" in w and "2 of 4 periods" in w for w in warnings), warnings
    assert not any(w.startswith("baseline") and "warming" in w for w in warnings)


@ONE_SERVER
def test_the_html_report_is_one_self_contained_file_never_written_over(prometheus, tmp_path):
    report = tmp_path / "report.html"
    args = ["--baseline", 'target="aws"', "--candidate", 'target="azure"', "--since", "4d", "--format", "html"]
    result = compare(prometheus, *args, "--output", str(report))
    assert result.returncode == 1, result.stderr
    page = report.read_text()
    assert "worse" in page and page.count("<svg") == 3, "quantiles over time, distributions, ratios"
    assert "<script" not in page and not re.search(r'(src|href)="(https?:|//)', page), "nothing loaded from elsewhere"
    assert "p99.9" in page and "baseline p50" in page  # the table and the plots' legends
    again = compare(prometheus, *args, "--output", str(report))
    assert again.returncode == 2 and "--force" in again.stderr and report.read_text() == page
    report.write_text("an older report")
    forced = compare(prometheus, *args, "--output", str(report), "--force")
    assert forced.returncode == 1 and report.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"], "no temporary file left behind"


@ONE_SERVER
def test_html_without_the_report_extra_says_how_to_get_it(prometheus):
    url = f"http://127.0.0.1:{prometheus.port}"
    code = "import sys; sys.modules['matplotlib'] = None; from volprobe.cli import main; sys.exit(main())"
    command = [sys.executable, "-c", code, "compare", "--prometheus", url, "--end", str(END), "--since", "4d"]
    command += ["--baseline", 'target="aws"', "--candidate", 'target="azure"', "--format", "html"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "pip install 'volprobe[report]'" in result.stderr, result.stderr


@ONE_SERVER
def test_the_migration_dashboard_and_the_report_agree(prometheus):
    """On the same history: the dashboard's daily quantiles (the recording rules it plots, evaluated at each
    period's end) lie in the bucket the report gives for that period, and its distribution panel puts each
    side's median in the report's bucket too. (The estimates inside a bucket differ on purpose: Prometheus
    interpolates linearly, the report geometrically, and the report prints the bucket.)"""
    report = json.loads(
        compare(prometheus, "--baseline", 'target="aws"', "--candidate", 'target="azure"', "--since", "4d").stdout
    )
    config = MixinConfig(rate_window="10m")  # two of the history's 5-minute samples in each rate()
    rules = {rule["record"]: rule["expr"] for rule in recording_rules(config) + long_window_rules(config)}
    # The daily rules read the recorded bucket rates, which a backfilled server has not recorded: the same
    # expression as a subquery stands in for them (a rule evaluated every 5 minutes of the day).
    rates = bucket_rate(config)
    for name, expr in rules.items():
        rules[name] = expr.replace(f"{rates}[{config.daily_window}]", f"({rules[rates]})[{config.daily_window}:5m]")
    dashboard = json.loads((REPO / "dashboards" / "volprobe-migration.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for quantile, key in (("p50", "p50"), ("p99", "p99"), ("p999", "p99.9")):
        name = daily_quantile(config, quantile)
        assert any(name in q for q in queries), f"the Migration dashboard plots {name}"
        for period in report["per_period"]:
            found = prometheus.api("query", query=rules[name], time=str(period["end"]))["result"]
            daily = {item["metric"]["target"]: float(item["value"][1]) for item in found}
            for side, target in (("baseline", "aws"), ("candidate", "azure")):
                low, high = period[key][side]["bucket"]
                assert low <= daily[target] <= high, (name, period["end"], side, daily[target], low, high)
    cdf = next(q for q in queries if "$__range" in q and '"$baseline"' in q)
    whole = {r["quantile"]: r for r in report["quantiles"]}
    for side, target in (("baseline", "aws"), ("candidate", "azure")):
        expr = cdf.replace("$baseline_cluster", ".*").replace("$job", "volprobe")
        expr = expr.replace("$baseline_instance", "node:10130")
        expr = expr.replace("$op", "write")
        expr = expr.replace("$__range", f"{4 * DAY}s").replace("$baseline", target)
        fractions = {
            float(i["metric"]["le"]): float(i["value"][1])
            for i in prometheus.api("query", query=expr, time=str(END))["result"]
        }
        low, high = whole[0.5][side]["bucket"]
        assert fractions[high] >= 0.5 > fractions.get(low, 0.0), (side, low, high, fractions)
        # The same target name on another host is another volume: the side's instance is honoured.
        elsewhere = expr.replace('instance="node:10130"', 'instance="elsewhere:10130"')
        assert elsewhere != expr and prometheus.api("query", query=elsewhere, time=str(END))["result"] == []


@ONE_SERVER
def test_a_server_behind_tls_and_basic_auth(prometheus, tmp_path):
    """The same history served by a Prometheus with --web.config.file (TLS, basic auth), as a Thanos or Mimir
    front would be: --ca-file, --username and --password-file reach it; without them it is an error (2)."""
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki)
    password = "compare-secret"
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=6)).decode()
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config: {{cert_file: {pki}/server.crt, key_file: {pki}/server.key}}\n"
        f"basic_auth_users: {{sre: '{hashed}'}}\n"
    )
    (tmp_path / "password").write_text(password + "\n")
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    authorization = "Basic " + base64.b64encode(f"sre:{password}".encode()).decode()

    def ready(port: int) -> None:
        request = urllib.request.Request(f"https://127.0.0.1:{port}/-/ready", headers={"Authorization": authorization})
        urllib.request.urlopen(request, timeout=1, context=context).read()

    # A second server on a copy of the backfilled data (the first keeps serving the other tests).
    data = tmp_path / "secured" / "data"
    shutil.copytree(prometheus.blocks, data)
    secured = start_backfilled(
        "global: {scrape_interval: 1m}\nscrape_configs: []\n", tmp_path / "secured", web_config=web, ready=ready
    )
    try:
        url = f"https://127.0.0.1:{secured.port}"
        sides = ["--baseline", 'target="aws"', "--candidate", 'target="azure"', "--since", "4d", "--end", str(END)]
        base = ["compare", "--prometheus", url, *sides, "--format", "json"]
        auth = ["--ca-file", str(pki / "ca.crt"), "--username", "sre", "--password-file", str(tmp_path / "password")]
        result = subprocess.run(volprobe_command(*base, *auth), capture_output=True, text=True, timeout=120)
        assert result.returncode == 1 and json.loads(result.stdout)["verdict"] == "worse", result.stderr
        unauthenticated = subprocess.run(
            volprobe_command(*base, "--ca-file", str(pki / "ca.crt")), capture_output=True, text=True, timeout=120
        )
        assert unauthenticated.returncode == 2 and "401" in unauthenticated.stderr, unauthenticated.stderr
        untrusted = subprocess.run(volprobe_command(*base), capture_output=True, text=True, timeout=120)
        assert untrusted.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr, untrusted.stderr
    finally:
        secured.stop()


def test_an_unreachable_server_is_an_error(tmp_path):
    command = volprobe_command(
        "compare", "--prometheus", "http://127.0.0.1:9", "--baseline", 'target="a"', "--candidate", 'target="b"'
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "127.0.0.1:9" in result.stderr


LIVE_PERIODS = 3  # the fewest a verdict is given on (verdict.MIN_PERIODS)
LIVE_PERIOD_S = 20
TOLERANCE = 0.10  # compare's default
OTHER_PROBES = 0.03  # test_compare_native's: how far the exact median of the exporter's window may lie from the span's


def verdict_of(interval: list[float]) -> str:
    """The verdict compare's own bootstrap interval of a ratio gives, at the default tolerance."""
    low, high = interval
    if low > 1 + TOLERANCE:
        return "worse"
    if high < 1 - TOLERANCE:
        return "better"
    return "equivalent" if low >= 1 - TOLERANCE and high <= 1 + TOLERANCE else "inconclusive"


RECORDED = (
    "volprobe_probe_latency_seconds",
    "volprobe_probe_failures",
    "volprobe_probe_info",
    "volprobe_probe_latency_recent_seconds",
)


def test_a_verdict_is_consistent_with_the_exact_ratio_only_on_its_side_of_the_tolerance():
    assert verdicts_consistent_with(1.0, tolerance=0.10, slack=0.05) == {"inconclusive", "equivalent"}
    assert verdicts_consistent_with(1.12, tolerance=0.10, slack=0.05) == {"inconclusive", "equivalent", "worse"}
    assert verdicts_consistent_with(1.2, tolerance=0.10, slack=0.05) == {"inconclusive", "worse"}
    assert verdicts_consistent_with(0.8, tolerance=0.10, slack=0.05) == {"inconclusive", "better"}


def retimed_history(scrapes: list[Samples], days: int) -> str:
    """OpenMetrics text of the exporter's own expositions, recorded over minutes, laid out over `days`: scrape i
    at END - days + i * days / (n - 1). The counts and the labels are the exporter's; only the times are moved."""
    step = days * DAY / (len(scrapes) - 1)
    lines: dict[str, dict[str, list[str]]] = {}  # family -> series -> lines, in time order
    types = {}
    for i, samples in enumerate(scrapes):
        t = round(END - days * DAY + i * step)
        for name, found in samples.items():
            family = next((f for f in RECORDED if name == f or name.startswith(f + "_")), None)
            if family is None or name.endswith("_created"):
                continue
            types[family] = {
                "volprobe_probe_latency_seconds": "histogram",
                "volprobe_probe_latency_recent_seconds": "summary",
                "volprobe_probe_failures": "counter",
            }.get(family, "gauge")
            for labels, value in found:
                if math.isnan(value):  # a quantile without samples (no repeats with revisit 0)
                    continue
                series = f"{name}{{{series_text({**labels, 'job': 'volprobe', 'instance': 'node:10130'})}}}"
                lines.setdefault(family, {}).setdefault(series, []).append(f"{series} {value!r} {t}")
    text = []
    for family, by_series in lines.items():
        text.append(f"# TYPE {family} {types[family]}")
        for series_lines in by_series.values():
            text += series_lines
    return "\n".join([*text, "# EOF", ""])


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.lab
@pytest.mark.alone  # .ci/run: after the others
@pytest.mark.xdist_group("lab-latency")  # conftest.py
def test_history_recorded_from_lab_volumes_then_live(tmp_path, lab_volume, make_loop, start_exporter, start_prometheus):
    """The real exporter on three lab volumes (8 KiB writes of 1 ms, 1.4 ms and 1 ms again) and a loop device
    probed with another block size, for a minute, with a real Prometheus scraping it every second.

    Recorded: its expositions, laid out over four days (retimed_history) and backfilled into a second Prometheus
    with promtool: worse with the ratio the exporter itself measured (its exact recent medians) within 5%,
    the equal pair's median ratio what the probes saw within 5%, and each quantile's verdict the one compare's own
    interval gives, inconclusive on one period, the other spec refused.
    Live: three periods of 20 s: worse, and each side's median within 3% of the bucket the report gives for it.
    (The reference for the ratio is what the probes saw, not the lab's settings: uncalibrated, the lab adds its
    chain's overhead to both. Without O_DSYNC: through the lab's loop, FUSE and NBD a flush adds about a
    millisecond of its own.)"""
    # Uncalibrated: each volume's latency is the setting plus the same chain's own overhead. Calibrated, twins
    # came out 10% apart (each calibration measures the chain's overhead with its own noise).
    volumes = {
        "base": lab_volume(size=64 * MIB, write_latency=0.001, calibrate=False).device,
        "slow": lab_volume(size=64 * MIB, write_latency=0.0014, calibrate=False).device,
        "twin": lab_volume(size=64 * MIB, write_latency=0.001, calibrate=False).device,
    }
    # revisit 0: every write is a first touch, so the exporter's exact recent median (by touch) is of them all.
    probes = "interval: 20ms, sync: false, revisit: 0}], allow_raw_writes: true"
    # Buckets 4% apart around the volumes' latencies (at most 50 bounds): the report's ratio is only as exact as
    # the buckets, and a migration test deserves this resolution where the latency lies.
    fine = [f"{round(800 * 1.04**i)}us" for i in range(35)]
    buckets = ", ".join(["100us", "200us", "400us", *fine, "10ms", "100ms", "1s"])
    config = tmp_path / "volprobe.yml"
    config.write_text(
        f"defaults: {{buckets: [{buckets}]}}\n"
        "targets:\n"
        + "".join(
            f"  - {{name: {n}, device: {d}, probes: [{{op: write, block_size: 8KiB, {probes}}}\n"
            for n, d in volumes.items()
        )
        + f"  - {{name: small, device: {make_loop(64 * MIB)}, probes: [{{op: write, block_size: 4KiB, {probes}}}\n"
    )
    exporter = start_exporter("--config", str(config))
    prometheus = start_prometheus(f"""
global: {{scrape_interval: 1s}}
scrape_configs:
  - job_name: volprobe
    static_configs: [{{targets: ["127.0.0.1:{exporter.port}"]}}]
""")
    wait_until(lambda: prometheus.query("volprobe_probe_latency_seconds_count"), 30, "a scrape", every=0.5)
    started = time.time()
    scrapes = []
    while time.time() < started + LIVE_PERIODS * LIVE_PERIOD_S + 3:
        scrapes.append(exporter.metrics())
        time.sleep(1)
    samples = exporter.metrics()  # the exact medians of the same probes (the exporter's 5m window holds them all)
    exact_at = {
        (labels["target"], labels["quantile"]): v
        for labels, v in samples["volprobe_probe_latency_recent_seconds"]
        if labels["touch"] == "first"
    }
    exact = {target: v for (target, quantile), v in exact_at.items() if quantile == "0.5"}

    # Live, from the Prometheus that scraped it.
    url = f"http://127.0.0.1:{prometheus.port}"
    command = volprobe_command(
        "compare", "--prometheus", url, "--baseline", 'target="base"', "--candidate", 'target="slow"',
        "--start", str(started), "--end", str(started + LIVE_PERIODS * LIVE_PERIOD_S), "--period", f"{LIVE_PERIOD_S}s",
        "--format", "json",
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    report = json.loads(result.stdout)
    assert report["periods"] == LIVE_PERIODS, report
    p50 = report["quantiles"][0]
    assert p50["verdict"] == "worse", (p50, exact)
    assert result.returncode == 1 and report["verdict"] == "worse"
    for side, name in (("baseline", "base"), ("candidate", "slow")):
        # The exact medians also hold the probes of the seconds before the span and just after it (CI: the base's
        # lay 1.5% above the span's bucket), hence test_compare_native's allowance, not the buckets' own error.
        low, high = p50[side]["bucket"]
        assert low * (1 - OTHER_PROBES) <= exact[name] <= high * (1 + OTHER_PROBES), (p50, exact)

    # Recorded, laid out over four days, backfilled.
    directory = tmp_path / "backfilled"
    directory.mkdir()
    (directory / "history.om").write_text(retimed_history(scrapes, days=4))
    run("promtool", "tsdb", "create-blocks-from", "openmetrics", str(directory / "history.om"), str(directory / "data"))
    backfilled = start_backfilled("global: {scrape_interval: 1m}\nscrape_configs: []\n", directory)
    try:

        def recorded(baseline: str, candidate: str, *args: str) -> tuple[int, dict | str]:
            result = compare(
                backfilled, "--baseline", f'target="{baseline}"', "--candidate", f'target="{candidate}"', *args
            )
            return result.returncode, json.loads(result.stdout) if result.stdout else result.stderr

        status, worse = recorded("base", "slow", "--since", "4d")
        assert status == 1 and worse["verdict"] == "worse" and worse["periods"] == 4, worse
        p50 = worse["quantiles"][0]
        assert p50["ratio"] == pytest.approx(exact["slow"] / exact["base"], rel=0.05), (p50, exact)
        status, equal = recorded("base", "twin", "--since", "4d", "--quantiles", "0.5,0.9")
        # The twins are equal as the lab sets them; what the probes saw of them can still differ by 10% or more
        # (each volume's chain adds its own overhead, uncalibrated). The reference is what the probes saw.
        seen = [exact_at[("twin", q)] / exact_at[("base", q)] for q in ("0.5", "0.9")]
        assert equal["quantiles"][0]["ratio"] == pytest.approx(seen[0], rel=0.05), (equal, exact_at)
        assert status == EXIT_STATUS[equal["verdict"]], equal
        verdicts = [q["verdict"] for q in equal["quantiles"]]
        if all(abs(ratio - 1) <= 0.05 for ratio in seen):
            # Well inside the 10% tolerance, each quantile's verdict is the one its own interval gives. Over four
            # periods the interval's ends are about the farthest single period's ratio, and one period can reach
            # past 10% (CI: twins seen within 5%, the whole "inconclusive"), which compare must then say, as
            # test_compare_native asks of the live twins. (The median's ratio is checked above, within 5%.)
            for result in equal["quantiles"]:
                assert result["verdict"] == verdict_of(result["interval"]), (verdicts, equal, exact_at)
        for result, ratio in zip(equal["quantiles"], seen, strict=True):
            # In every case, no quantile's verdict contradicts what the probes saw, within the buckets' 5%.
            assert result["verdict"] in verdicts_consistent_with(ratio, tolerance=TOLERANCE, slack=0.05), (
                verdicts,
                equal,
                exact_at,
            )
        status, one_day = recorded("base", "slow", "--since", "1d")
        assert status == 3 and one_day["verdict"] == "inconclusive", one_day
        status, refused = recorded("base", "small", "--since", "4d")
        assert status == 2 and "write 8192 bytes" in refused and "write 4096 bytes" in refused, refused
    finally:
        backfilled.stop()
