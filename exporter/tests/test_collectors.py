"""Collectors are registered by name and switched with --collector.NAME / --no-collector.NAME."""

from __future__ import annotations

import subprocess

import pytest

from volprobe import collectors, metrics

from .harness import MIB, volprobe_command


def test_every_collector_is_registered_with_its_flag():
    assert list(collectors.REGISTRY) == ["diskstats", "probe", "state", "target", "throttle", "warmup"]
    result = subprocess.run(volprobe_command("--help"), capture_output=True, text=True, check=True)
    for name in collectors.REGISTRY:
        assert f"--collector.{name}, --no-collector.{name}" in result.stdout


def test_an_unknown_collector_flag_is_a_usage_error():
    result = subprocess.run(volprobe_command("--no-collector.nonesuch"), capture_output=True, text=True)
    assert result.returncode == 2 and "--no-collector.nonesuch" in result.stderr


@pytest.mark.root
def test_a_disabled_collector_is_neither_run_nor_reported(make_loop, start_exporter):
    loop = make_loop(16 * MIB)
    exporter = start_exporter("--target", loop, "--no-collector.diskstats")
    samples = exporter.wait_for(lambda s: "volprobe_probe_latency_seconds_count" in s, what="probes")
    exported = {name for name in samples if name.startswith("volprobe_")}
    assert not {d.spec.total for d in metrics.DISK_METRICS if d.spec.kind == "counter"} & exported
    assert metrics.DISK_IO_NOW.spec.name not in exported
    reported = {labels["collector"] for labels, _ in samples["volprobe_scrape_collector_success"]}
    assert reported == {"probe", "state", "target", "throttle", "warmup"}
    # Everything exported is declared once in volprobe.metrics.
    assert exported <= metrics.series_names()
    assert exporter.stop() == 0
