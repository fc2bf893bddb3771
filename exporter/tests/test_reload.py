"""SIGHUP reloads, and devices that come and go at run time (discovery)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from .support.harness import (
    ENGINE_MOST_IDLE,
    MIB,
    engine_threads,
    free_loop,
    probes_done,
    run,
    sample_value,
    threads,
    wait_until,
)

pytestmark = pytest.mark.root


def targets(samples) -> set[str]:
    return {labels["target"] for labels, _ in samples.get("volprobe_target_info", [])}


def test_sighup_keeps_unchanged_targets_and_drops_removed_ones(tmp_path, make_loop, start_exporter):
    a, b, c = make_loop(16 * MIB, name="a"), make_loop(16 * MIB, name="b"), make_loop(16 * MIB, name="c")
    config = tmp_path / "volprobe.yml"
    config.write_text(f"""
targets:
  - {{name: kept, device: {a}, probes: [{{op: read, interval: 50ms}}]}}
  - {{name: dropped, device: {b}, probes: [{{op: read, interval: 50ms}}]}}
""")
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(lambda s: probes_done(s, "kept") >= 60 and probes_done(s, "dropped") >= 1, what="samples")
    # The kept target moves to another place in the file: same configuration, so the same probe.
    config.write_text(f"""
targets:
  - {{name: added, device: {c}, probes: [{{op: read, interval: 50ms}}]}}
  - {{name: kept, device: {a}, probes: [{{op: read, interval: 50ms}}]}}
""")
    started = time.monotonic()
    before = probes_done(exporter.metrics(), "kept")
    exporter.process.send_signal(signal.SIGHUP)
    after = exporter.wait_for(lambda s: "added" in targets(s) and probes_done(s, "added") >= 1, what="the added target")
    elapsed = time.monotonic() - started
    assert "dropped" not in targets(after)
    assert not any(labels["target"] == "dropped" for labels, _ in after["volprobe_probe_latency_seconds_count"])
    # One probe every 50 ms makes at most elapsed/50ms + 2 probes in `elapsed` (jitter can bring two closer;
    # missed slots are skipped, never replayed). A histogram reset by the reload would hold no more than that:
    # fewer than before, so the count not falling below `before` shows the kept probe kept its histogram,
    # and its growth staying within that bound shows one probe (not the old and a new one) feeds it.
    most = elapsed / 0.05 + 2
    assert most < before, f"the reload took {elapsed:.1f} s: too long to tell a kept histogram from a regrown one"
    kept = probes_done(after, "kept")
    assert before <= kept <= before + most, f"kept target: {before} probes before the reload, {kept} after"
    assert "configuration reloaded: 1 kept, 1 added, 1 removed" in exporter.log()
    assert exporter.stop() == 0


def test_a_bad_new_config_is_rejected_and_the_old_one_kept(tmp_path, make_loop, start_exporter):
    a = make_loop(16 * MIB)
    config = tmp_path / "volprobe.yml"
    config.write_text(f"targets: [{{name: a, device: {a}, probes: [{{op: read, interval: 50ms}}]}}]\n")
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(lambda s: probes_done(s, "a") >= 5, what="samples")
    config.write_text(f"targets: [{{name: a, device: {a}, probes: [{{op: read, intervall: 50ms}}]}}]\n")
    exporter.process.send_signal(signal.SIGHUP)
    wait_until(lambda: "rejected" in exporter.log(), what="the rejection", every=0.1)
    assert "targets[0].probes[0].intervall: unknown key" in exporter.log()
    before = probes_done(exporter.metrics(), "a")
    exporter.wait_for(lambda s: probes_done(s, "a") > before + 5, what="the running configuration to keep probing")
    assert exporter.process.poll() is None
    assert exporter.stop() == 0


def test_discovery_follows_devices_attached_and_detached(tmp_path, start_exporter):
    # The device that comes, by the name it will take: discovery follows it alone, not the devices of tests
    # running beside this one.
    loop = free_loop()
    name = os.path.basename(loop)
    config = tmp_path / "volprobe.yml"
    config.write_text(f"""
defaults: {{window: 1m}}
discovery:
  include: ['{name}']
  rescan_interval: 2s
  probes: [{{op: read, interval: 100ms}}]
""")
    exporter = start_exporter("--config", str(config))
    time.sleep(1)
    baseline_threads = threads(exporter.process.pid)
    backing = tmp_path / "hotplug.img"
    with open(backing, "wb") as f:
        f.truncate(32 * MIB)
    attached = time.monotonic()
    run("losetup", "--direct-io=on", loop, str(backing))
    try:
        exporter.wait_for(lambda s: probes_done(s, name) >= 1, timeout=15, what=f"probes of the new {name}")
        assert time.monotonic() - attached < 10, "a new device is probed within 10 s"
        assert threads(exporter.process.pid) > baseline_threads
    finally:
        run("losetup", "--detach", loop)
    detached = time.monotonic()
    samples = exporter.wait_for(lambda s: name not in targets(s), timeout=15, what=f"{name} to be dropped")
    assert time.monotonic() - detached < 10
    assert not any(
        labels.get("device") == name for labels, _ in samples.get("volprobe_probe_latency_seconds_count", [])
    )
    wait_until(lambda: threads(exporter.process.pid) <= baseline_threads, 5, "no thread left behind", every=0.2)
    assert engine_threads(exporter.process.pid) <= ENGINE_MOST_IDLE
    assert threads(exporter.process.pid) == baseline_threads, "no thread left behind"
    assert sample_value(samples, "volprobe_scrape_collector_success", collector="probe") == 1
    assert exporter.process.poll() is None
    assert exporter.stop() == 0


def test_a_reload_rejected_half_way_leaves_everything_as_it_was(tmp_path, make_loop, start_exporter):
    """The new file resolves (every check passes) but a new raw-write target cannot be opened: another process
    holds it with O_EXCL. Nothing the running configuration set may have changed: the kept target's limits and
    warm-up, the restarting target's probes and counters (no restart), and the reload is reported failed."""
    kept, moved, busy = make_loop(64 * MIB, name="kept"), make_loop(16 * MIB, name="moved"), make_loop(16 * MIB)
    config = tmp_path / "volprobe.yml"
    before_text = f"""
state_directory: {tmp_path}
targets:
  - {{name: kept, device: {kept}, limits: {{iops: 500}}, warmup: {{rate: 256KiB, block_size: 64KiB}},
     probes: [{{op: read, interval: 50ms}}]}}
  - {{name: moved, device: {moved}, probes: [{{op: read, interval: 50ms}}]}}
"""
    config.write_text(before_text)
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(
        lambda s: (
            probes_done(s, "moved") >= 5 and (sample_value(s, "volprobe_warmup_done_bytes", target="kept") or 0) > 0
        ),
        what="probes and the warm-up",
    )
    holder = os.open(busy, os.O_RDONLY | os.O_EXCL)  # resolve() finds it blank and unclaimed; the open fails
    try:
        config.write_text(f"""
state_directory: {tmp_path}
targets:
  - {{name: kept, device: {kept}, limits: {{iops: 3000}}, warmup: {{rate: 512KiB, block_size: 64KiB}},
     probes: [{{op: read, interval: 50ms}}]}}
  - {{name: moved, device: {moved}, probes: [{{op: read, interval: 20ms}}]}}
  - {{name: new, device: {busy}, allow_raw_writes: true, probes: [{{op: write, interval: 50ms}}]}}
""")
        before = exporter.metrics()
        exporter.process.send_signal(signal.SIGHUP)
        after = exporter.wait_for(
            lambda s: sample_value(s, "volprobe_config_last_reload_successful") == 0, what="the rejected reload"
        )
    finally:
        os.close(holder)
    assert re.search(r"targets\[2\]\.probes\[0\]: cannot open .*(busy|Device or resource busy)", exporter.log())
    assert sample_value(after, "volprobe_limit_ops_per_second", target="kept", device=os.path.basename(kept)) == 500
    assert sample_value(after, "volprobe_probe_interval_seconds", target="moved", op="read") == 0.05
    assert probes_done(after, "moved") >= probes_done(before, "moved"), "the counters of a target that stayed went back"
    assert "new" not in targets(after)
    # The kept target's warm-up goes on at its old rate; a warm-up stopped for the new settings would stand still.
    done = sample_value(after, "volprobe_warmup_done_bytes", target="kept")
    exporter.wait_for(
        lambda s: sample_value(s, "volprobe_warmup_done_bytes", target="kept") > done, what="the warm-up to go on"
    )
    assert "stopped probing moved" not in exporter.log()
    assert exporter.stop() == 0
