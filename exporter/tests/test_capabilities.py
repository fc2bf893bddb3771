"""Features a hardened unit or a container can take away: each is exported (volprobe_capability_available)
and logged once when missing, and volprobe falls back rather than stopping."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from volprobe.capabilities import Capabilities

from .support.harness import run, sample_value, write_config

SHIM = Path(__file__).parent / "noioprio" / "noioprio.c"


@pytest.fixture
def no_targets(tmp_path) -> str:
    return write_config(tmp_path, "targets: []\n")


def test_idle_io_priority_is_checked_at_start_and_exported(start_exporter, no_targets):
    exporter = start_exporter("--config", no_targets)
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_capability_available", capability="idle_io_priority") == 1
    assert "unavailable" not in exporter.log()


def test_a_denied_ioprio_set_is_logged_once_and_exported(start_exporter, no_targets, tmp_path):
    shim = tmp_path / "noioprio.so"
    run("cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(SHIM), "-ldl")
    exporter = start_exporter("--config", no_targets, env={"LD_PRELOAD": str(shim)})
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_capability_available", capability="idle_io_priority") == 0
    exporter.get("/metrics")
    assert exporter.stop() == 0
    log = exporter.log()
    assert log.count("idle_io_priority unavailable") == 1 and "normal priority" in log, log


def test_discovery_without_udev_falls_back_to_rescans_and_says_so(start_exporter, tmp_path):
    # This machine has no udevd (/run/udev): the monitor cannot be had; discovery rescans sysfs instead.
    config = write_config(tmp_path, "discovery: {include: ['^volprobe-none-such$'], rescan_interval: 1s}\n")
    exporter = start_exporter("--config", config)
    samples = exporter.wait_for(
        lambda s: sample_value(s, "volprobe_capability_available", capability="udev_monitor") is not None,
        what="the udev monitor's capability",
    )
    assert sample_value(samples, "volprobe_capability_available", capability="udev_monitor") == 0
    assert exporter.stop() == 0
    assert exporter.log().count("udev_monitor unavailable") == 1


def test_a_missing_capability_is_logged_once_until_it_was_had_again(caplog):
    found, other = Capabilities(), Capabilities()
    with caplog.at_level(logging.WARNING, logger="volprobe.capabilities"):
        found.record("udev_monitor", False, "no netlink")
        found.record("udev_monitor", False, "no netlink")
        assert [r.getMessage() for r in caplog.records] == ["udev_monitor unavailable: no netlink"]
        found.record("udev_monitor", True)
        found.record("udev_monitor", False, "gone")
    assert [r.getMessage() for r in caplog.records][1:] == ["udev_monitor unavailable: gone"]
    assert found.known() == {"udev_monitor": False}
    assert other.known() == {}  # each exporter's own: nothing is shared through the module
