"""End to end on native histograms: the dashboards and the rules built with `histograms: native`, on Prometheus
3.16 scraping the real exporter with scrape_native_histograms (the classic series kept too). Every latency panel
has data, and the quantiles the dashboards and the recording rules give are the exporter's own exact ones
(volprobe_probe_latency_recent_seconds) to within 2%: issue 30's "the mixin, both ways".

The same probes on both sides, not merely the same minutes: the exporter's window (300 s) holds every probe
since the probe started, and Prometheus's rate over a range reaching back before that start counts every one of
them too, because the start is a restart. Before it, the target has a read and a write probe of 1 MiB at 100 s
(one probe each, done at once); a reload makes them probes of the default sizes at 10 ms, new probes from zero,
whose first scrape lacks the 1 MiB probe's bucket: Prometheus sees a counter reset, and counts from zero too. Then
the exporter is stopped (SIGSTOP): its probes, and what Prometheus last scraped of them, stay as they are while
the rules' windows fill with that one state, so that the recorded daily quantiles are those of the very probes
the exporter counted.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from volprobe import mixin
from volprobe.mixin import dashboards, rules

from .support.dashboards import panels, reads_filesystem_probes, substitute
from .support.harness import RunningPrometheus, probes_done, wait_until
from .support.rules import TEST_SIZED

pytestmark = pytest.mark.slow

# The rules' windows: the rate's (rate_window, 2m here) reaches back before the probes' start for the whole test;
# the "daily" one (5s) holds only evaluations made once the exporter is stopped.
NATIVE = {**TEST_SIZED, "histograms": "native", "rate_window": "2m", "daily_window": "5s", "long_interval": "1s"}
LATENCY = r"\bvolprobe_probe_latency_seconds\b"  # the native histogram, raw or in a recorded name
QUANTILES = {"p50": "0.5", "p99": "0.99", "p999": "0.999"}
OPS = ("read", "write")
TOLERANCE = 0.02  # issue 30: "within 2%"


def target(device: str, probe: str) -> str:
    """The one target, a read and a write probe with `probe`'s settings: every probe a first touch."""
    probes = ", ".join(f"{{op: {op}, revisit: 0, {probe}}}" for op in OPS)
    return f"targets: [{{name: fast, device: {device}, allow_raw_writes: true, probes: [{probes}]}}]\n"


def at(prometheus: RunningPrometheus, expr: str, when: float | None = None) -> list[dict[str, Any]]:
    """An instant query, at `when` (a Unix time) or now."""
    params = {"query": expr} | ({"time": f"{when:.3f}"} if when is not None else {})
    result: list[dict[str, Any]] = prometheus.api("query", **params)["result"]
    return result


def value(result: list[dict[str, Any]]) -> float:
    (sample,) = result
    return float(sample["value"][1])


def test_native_dashboards_and_rules_give_the_exporters_exact_quantiles(
    tmp_path: Path, zram_device: str, start_exporter, start_prometheus
) -> None:
    config = tmp_path / "volprobe.yml"
    config.write_text(target(zram_device, "block_size: 1MiB, interval: 100s, jitter: 0"))
    exporter = start_exporter("--config", str(config))
    rules_path = tmp_path / "native-rules.yml"
    rules_path.write_text(rules.render(mixin.from_mapping(NATIVE)))
    prometheus = start_prometheus(
        f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [{rules_path}]
scrape_configs:
  - job_name: volprobe
    scrape_native_histograms: true
    always_scrape_classic_histograms: true
    static_configs: [{{targets: ["127.0.0.1:{exporter.port}"]}}]
""",
        "3",
    )
    wait_until(
        lambda: len(at(prometheus, 'count_over_time(volprobe_probe_latency_seconds{target="fast"}[1m]) >= 2')) == 2,
        30,
        "two scrapes of the probe before its restart",
        every=0.25,
    )
    exporter.reload(config, target(zram_device, "interval: 10ms"))
    exporter.wait_for(
        lambda s: min(probes_done(s, "fast", op) for op in OPS) >= 1500, timeout=45, what="1500 probes of each op"
    )
    time.sleep(1.5)  # one more scrape after them
    os.kill(exporter.process.pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: at(prometheus, 'up{job="volprobe"} == 0'), 15, "a scrape of the stopped exporter", every=0.25
        )
        # The last scrape was in by the failed one after it: 7 s on, the daily window's 5 s of evaluations all
        # read it, and rate() extrapolates it alike (by half an interval, once 1.1 interval has passed).
        time.sleep(7)
        check(prometheus, exporter.port, zram_device)
    finally:
        os.kill(exporter.process.pid, signal.SIGCONT)
    assert exporter.stop() == 0


def check(prometheus: RunningPrometheus, port: int, device: str) -> None:
    c = mixin.from_mapping(NATIVE)
    # The exporter's exact quantiles in the last scrape Prometheus took (a range keeps them past the stop).
    exact: dict[tuple[str, str], float] = {}
    scraped_at = 0.0
    for op, (name, q) in itertools.product(OPS, QUANTILES.items()):
        recent = f'volprobe_probe_latency_recent_seconds{{target="fast", op="{op}", touch="first", quantile="{q}"}}'
        (samples,) = at(prometheus, recent + "[2m]")
        scraped_at, exact[(op, name)] = samples["values"][-1][0], float(samples["values"][-1][1])
    for op in OPS:
        count = value(at(prometheus, f'histogram_count(volprobe_probe_latency_seconds{{op="{op}"}})', scraped_at))
        window = value(at(prometheus, f'sum(volprobe_probe_latency_recent_seconds_count{{op="{op}"}})', scraped_at))
        assert count == window >= 1000, (op, count, window, "every probe since the restart, in the exporter's window")
        # The restart is a counter reset to Prometheus: rate() counts from zero, not from the 1 MiB probe's count.
        resets = value(at(prometheus, f'resets(volprobe_probe_latency_seconds{{op="{op}"}}[2m])', scraped_at))
        assert resets >= 1, (op, resets)

    found: dict[tuple[str, str, str], float] = {}
    for op in OPS:
        values = {
            **{f"${side}_cluster": ".*" for side in ("baseline", "candidate")},
            **{f"${side}_instance": f"127.0.0.1:{port}" for side in ("baseline", "candidate")},
            "$cluster": ".*",
            "$job": "volprobe",
            "$instance": f"127.0.0.1:{port}",
            "$target": "fast",
            "$baseline": "fast",
            "$candidate": "fast",
            "$device": Path(device).name,
            "$disk": Path(device).name,
            "$op": op,
            "$namespace": ".*",
            "$storageclass": ".*",
            "$pvc": ".*",
            "$__rate_interval": "2m",  # reaching back before the restart: every probe the exporter's window holds
            "$__range": "2m",
            "$__interval": "1s",
            "${datasource}": "prometheus",
        }
        queries = dashboard_queries(c, values)
        # Every query on the probes' latency (the native histogram, raw or recorded) has data, but those of the
        # filesystem probes this target does not have (test_e2e_fsops.py); none reads a classic series of it.
        latency = {
            key: expr for key, expr in queries.items() if re.search(LATENCY, expr) and not reads_filesystem_probes(expr)
        }
        assert len(latency) >= 20, sorted(latency)
        assert not [expr for expr in queries.values() if re.search(LATENCY + "_(bucket|count|sum)", expr)]
        empty = [key for key, expr in latency.items() if not at(prometheus, expr, scraped_at)]
        assert empty == [], f"native queries without data: {empty}"

        # The quantiles: from the raw native histograms at the last scrape, and the recorded ones now, made of
        # that scrape alone.
        for ref, name in zip("ABC", QUANTILES, strict=True):
            per_op = at(prometheus, queries[(VOLUME, "Percentiles per op", ref)], scraped_at)
            found[("Volume, percentiles per op", op, name)] = value([s for s in per_op if s["metric"]["op"] == op])
            daily = queries[(MIGRATION, f"Daily {name}: baseline vs candidate", "A")]
            found[("Migration, daily", op, name)] = value(at(prometheus, daily))
            recorded = f'{rules.quantile(c, name)}{{target="fast", op="{op}"}}'
            found[("recording rule", op, name)] = value(at(prometheus, recorded))
            ratio = value(at(prometheus, queries[(MIGRATION, "Candidate / baseline, daily", ref)]))
            assert ratio == pytest.approx(1.0), (op, name, ratio)  # one target on both sides
        fleet = queries[(FLEET, f"{op.capitalize()} p99 by volume", "A")]
        found[("Fleet, p99 by volume", op, "p99")] = value(at(prometheus, fleet, scraped_at))

        classic = dashboard_queries(mixin.from_mapping({**NATIVE, "histograms": "classic"}), values)
        check_overlay(
            prometheus, op, queries[(MIGRATION, OVERLAY, "A")], classic[(MIGRATION, OVERLAY, "A")], scraped_at
        )
    off = {key: (got, exact[key[1:]]) for key, got in found.items() if abs(got / exact[key[1:]] - 1) > TOLERANCE}
    assert off == {}, f"(native, exact) more than 2% apart: {off}; exact: {exact}"


def dashboard_queries(c: mixin.MixinConfig, values: dict[str, str]) -> dict[tuple[str, str, str], str]:
    """(dashboard file, panel title, refId) -> its query, with the variables given `values`."""
    built = {name: json.loads(text) for name, text in dashboards.render_all(c).items()}
    return {
        (name, panel["title"], target["refId"]): substitute(target["expr"], values)
        for name, model in built.items()
        for panel in panels(model)
        for target in panel.get("targets", [])
    }


def check_overlay(prometheus: RunningPrometheus, op: str, native: str, classic: str, when: float) -> None:
    """The Migration overlay's shares under each bound, from the native histogram (histogram_fraction) and from
    the classic buckets of the same scrapes: the same bounds, and the same shares but for the probes within a
    native bucket or so of a bound, where the fraction interpolates (3% either side covers a bucket at schema 5)."""
    shares = {}
    for build, expr in (("native", native), ("classic", classic)):
        shares[build] = {s["metric"]["le"]: float(s["value"][1]) for s in at(prometheus, expr, when)}
    assert set(shares["native"]) == set(shares["classic"]) and len(shares["native"]) >= 20, (op, shares)
    histogram = f'sum(increase(volprobe_probe_latency_seconds{{target="fast", op="{op}"}}[2m]))'
    apart = {}
    for le, share in shares["native"].items():
        if le == "+Inf":
            continue
        bound = float(le)
        near = value(at(prometheus, f"histogram_fraction({bound / 1.03!r}, {bound * 1.03!r}, {histogram})", when))
        if abs(share - shares["classic"][le]) > near + 0.002:
            apart[le] = (share, shares["classic"][le], near)
    assert apart == {}, f"{op}: (native, classic, share near the bound): {apart}"


VOLUME, FLEET, MIGRATION = "volprobe-volume.json", "volprobe-fleet.json", "volprobe-migration.json"
OVERLAY = "Cumulative latency distribution over the range: baseline vs candidate"
