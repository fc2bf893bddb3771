"""Churn (issue 13, short form): a hundred SIGHUPs and attach/detach cycles under discovery leave threads,
file descriptors and series where they started."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .support.harness import (
    ENGINE_MOST_IDLE,
    MIB,
    Samples,
    engine_threads,
    free_loop,
    probes_done,
    run,
    sample_value,
    threads,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# Values the throttle detector learns from a disk's own traffic (any process's): a series appears once learned,
# whatever the reloads do.
LEARNED = {"volprobe_throttle_unloaded_latency_seconds", "volprobe_probe_share_ratio"}


def series(exporter, devices: set[str]) -> set[tuple[str, frozenset]]:
    """The series of volprobe's own families (values aside) on `devices` or on none; process_* and build info
    vary by nature, and the devices of other tests running on the machine are not this test's to count."""
    return {
        (name, frozenset(labels.items()))
        for name, samples in exporter.metrics().items()
        if name.startswith("volprobe_") and "scrape_collector_duration" not in name and name not in LEARNED
        for labels, _ in samples
        if labels.get("device", next(iter(devices))) in devices
    }


def steady(pid: int, window: float = 1.0) -> tuple[int, int]:
    """The fewest threads and descriptors seen over a window: reads open and close a descriptor per probe and
    a scrape holds a socket for a moment, so one sample may count those; a leak stays in every sample."""
    deadline = time.monotonic() + window
    low = (threads(pid), fds(pid))
    while time.monotonic() < deadline:
        time.sleep(0.01)
        low = (min(low[0], threads(pid)), min(low[1], fds(pid)))
    return low


def settle(exporter, baseline: tuple[int, int], timeout: float = 20) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    pid = exporter.process.pid
    now = steady(pid)
    while now != baseline and time.monotonic() < deadline:
        now = steady(pid)
    return now


def test_a_hundred_reloads_and_attach_detach_cycles_leave_nothing_behind(tmp_path, make_loop, start_exporter):
    explicit = [make_loop(16 * MIB, name=f"e{i}") for i in range(4)]
    found = [os.path.basename(make_loop(16 * MIB, name=f"d{i}")) for i in range(4)]
    # The device that comes and goes: the next free loop number, attached and detached by name.
    backing = tmp_path / "hotplug.img"
    backing.write_bytes(b"")
    os.truncate(backing, 16 * MIB)
    hotplug = free_loop()
    pattern = "|".join([*found, os.path.basename(hotplug)])
    targets = "".join(
        f"  - {{name: e{i}, device: {loop}, probes: [{{op: read, interval: 100ms}}]}}\n"
        for i, loop in enumerate(explicit)
    )
    base = f"targets:\n{targets}discovery:\n  include: ['{pattern}']\n  rescan_interval: 1s\n"
    base += "  probes: [{op: read, interval: 100ms}]\n"
    variant = base.replace("  rescan_interval: 1s\n", "  rescan_interval: 1s\n  exclude: ['nothing\\d+']\n")
    config = tmp_path / "volprobe.yml"
    config.write_text(base)
    exporter = start_exporter("--config", str(config))
    targets = {*found, *(f"e{i}" for i in range(len(explicit)))}
    devices = {*found, *map(os.path.basename, explicit), os.path.basename(hotplug)}
    # The baseline once every target's probe thread runs: each has probed a few times.
    exporter.wait_for(lambda s: all(probes_done(s, target) >= 3 for target in targets), what="every target probed")
    pid = exporter.process.pid
    baseline = steady(pid)
    expected = series(exporter, devices)

    staged = tmp_path / "volprobe.yml.new"
    for i in range(100):  # 100 SIGHUPs in about 10 s, alternating two equivalent configurations
        # Replaced atomically, as configuration management does: a reload never reads half a file.
        staged.write_text(variant if i % 2 == 0 else base)
        os.replace(staged, config)
        last_signal = time.time()  # before the signal: its reload may be over before the pacing sleep is
        exporter.process.send_signal(signal.SIGHUP)
        time.sleep(0.1)  # pacing the signals, not waiting for anything

    def reloads_done(samples: Samples) -> bool:
        # A reload finished after the last signal (its stamp is the exporter's wall clock, last_signal this
        # process's), and none is under way: SIGHUPs that arrive during a reload make one more, not one each.
        log = exporter.log()
        stamp = sample_value(samples, "volprobe_config_last_reload_success_timestamp_seconds")
        return stamp >= last_signal and log.count("SIGHUP: reloading") == log.count("configuration reloaded")

    exporter.wait_for(reloads_done, what="the reloads after the last SIGHUP")
    assert exporter.log().count("configuration reloaded") >= 10
    assert settle(exporter, baseline) == baseline, "threads or descriptors left by the reloads"
    assert series(exporter, devices) == expected
    assert "stopped probing" not in exporter.log(), exporter.log()[-2000:]

    for _ in range(6):  # attach, wait until probed, detach, wait until dropped (bench/soak does 50)
        run("losetup", "--direct-io=on", hotplug, str(backing))
        try:
            exporter.wait_for(
                lambda s: any(
                    labels["target"] == os.path.basename(hotplug) for labels, _ in s.get("volprobe_target_info", [])
                ),
                timeout=15,
                what="the attached device",
            )
        finally:
            run("losetup", "--detach", hotplug)
        exporter.wait_for(
            lambda s: (
                not any(
                    labels["target"] == os.path.basename(hotplug) for labels, _ in s.get("volprobe_target_info", [])
                )
            ),
            timeout=15,
            what="the detached device to go",
        )
    assert settle(exporter, baseline) == baseline, "threads or descriptors left by attach/detach cycles"
    assert engine_threads(exporter.process.pid) <= ENGINE_MOST_IDLE
    assert series(exporter, devices) == expected
    assert exporter.process.poll() is None
    assert exporter.stop() == 0
