"""Faults on lab volumes: a stalled device, I/O errors, a vanishing device. /metrics must stay responsive."""

from __future__ import annotations

import os
import time

import pytest
from lab import lab

from volprobe import probe, targets, timer
from volprobe.config import ProbeConfig
from volprobe.stats import RELATIVE_ERROR, ProbeStats

from .support.attacks import prepared
from .support.harness import (
    ENGINE_MOST_IDLE,
    MIB,
    engine_threads,
    probes_done,
    sample_value,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.root


# CI's short version; the full minute of issue 13: VOLPROBE_TEST_STALL_S=60 pytest -k stalled_device
STALL_S = float(os.environ.get("VOLPROBE_TEST_STALL_S", "15"))


@pytest.mark.slow
# Alone (.ci/run: after the others): it holds the healthy probe to every slot, which on 2 cores shared with the
# parallel suite CPU starvation alone can miss (CI run 22: one slot late by a whole interval in 15 s).
@pytest.mark.alone
def test_a_stalled_device_blocks_neither_metrics_nor_other_targets(tmp_path, lab_volume, make_loop, start_exporter):
    stalling = lab_volume(size=64 * MIB, read_latency=0.0005)
    healthy = make_loop(16 * MIB)
    config = write_config(
        tmp_path,
        f"""
defaults: {{window: 1m}}
targets:
  - {{name: stalling, device: {stalling.device}, probes: [{{op: read, interval: 100ms}}]}}
  - {{name: healthy, device: {healthy}, probes: [{{op: read, interval: 100ms}}]}}
""",
    )
    exporter = start_exporter("--config", config)
    pid = exporter.process.pid
    exporter.wait_for(lambda s: probes_done(s, "stalling") >= 5, what="probes on the stalling volume")
    # The probe engine: its leader and watcher, and up to two spares if a request outlived its grace already.
    idle_engine = engine_threads(pid)
    assert 2 <= idle_engine <= ENGINE_MOST_IDLE
    stall_started = time.monotonic()
    stalling.set(stall=True)
    samples = exporter.wait_for(
        lambda s: sample_value(s, "volprobe_probe_inflight_seconds", target="stalling", op="read") > 0.3,
        what="a request stalled",
    )
    healthy_before = probes_done(samples, "healthy")
    missed_before = sample_value(samples, "volprobe_probe_missed_total", target="healthy", op="read")
    slowest = 0.0
    while time.monotonic() - stall_started < STALL_S:  # scrapes every half second while a probe hangs
        start = time.monotonic()
        samples = exporter.metrics()
        slowest = max(slowest, time.monotonic() - start)
        # The in-flight age follows the stall: the hung probe was issued at most one slot after it began.
        age = sample_value(samples, "volprobe_probe_inflight_seconds", target="stalling", op="read")
        assert start - stall_started - 1.0 <= age <= time.monotonic() - stall_started, age
        # The engine's leader is stuck in that request: its watcher took over, and a spare or a new thread
        # watches. One thread more than idle at most, whatever the stall's length.
        assert engine_threads(pid) <= max(idle_engine, 3)
        time.sleep(0.5)
    assert slowest < 1.0, f"a scrape took {slowest:.2f}s while a device was stalled"
    # The other probe kept its schedule: no slot of it was late by a whole interval (none missed).
    assert sample_value(samples, "volprobe_probe_missed_total", target="healthy", op="read") == missed_before
    assert probes_done(samples, "healthy") > healthy_before + 0.8 * (STALL_S - 1) / 0.1, (
        "the healthy target kept its pace"
    )
    stalled_count = probes_done(samples, "stalling")
    stalling.set(stall=False)
    stalled_for = time.monotonic() - stall_started
    samples = exporter.wait_for(
        lambda s: probes_done(s, "stalling") > stalled_count, what="the stalled probe to finish"
    )
    assert sample_value(samples, "volprobe_probe_inflight_seconds", target="stalling", op="read") < 1
    # The thread that was stuck recorded its request and waits as a spare for the next stall, or ends.
    assert engine_threads(pid) <= ENGINE_MOST_IDLE

    # The stalled probe is recorded with its true latency: above 5 s, and no longer than the stall lasted (a loaded
    # machine stretches the stall beyond the scrapes' minute). The slots it held were missed.
    def observed_up_to(bound: float) -> float:
        return sum(
            v
            for labels, v in samples["volprobe_probe_latency_seconds_bucket"]
            if labels["target"] == "stalling" and float(labels["le"]) == bound
        )

    assert probes_done(samples, "stalling") - observed_up_to(5.0) == 1, "one probe took more than 5 s"
    # Its latency, exact to 0.78% (the recent p99.9 of fewer than 1000 probes is the slowest of them).
    slowest = max(
        v
        for labels, v in samples["volprobe_probe_latency_recent_seconds"]
        if labels["target"] == "stalling" and labels["quantile"] == "0.999" and v == v
    )
    assert 5.0 < slowest <= (stalled_for + 0.5) * (1 + RELATIVE_ERROR), (
        f"{slowest:.2f} s for a {stalled_for:.1f} s stall"
    )
    assert sample_value(samples, "volprobe_probe_missed_total", target="stalling") >= 0.8 * STALL_S / 0.1
    # No burst replays the missed slots: after the release, probes go on at their own pace (10/s).
    resumed, started = probes_done(samples, "stalling"), time.monotonic()
    exporter.wait_for(lambda s: probes_done(s, "stalling") >= resumed + 20, what="20 probes after the release")
    assert time.monotonic() - started >= (20 - 3) * 0.1, "20 probes at 10/s take about 2 s, not a burst"
    assert exporter.stop() == 0


def test_a_stalled_request_that_returns_when_nothing_else_is_probed_is_followed_by_the_next(lab_volume, make_loop):
    """The probe engine, in this process: a request stalls, the watcher takes over while another probe is due,
    that other probe stops, so the stalled one is the only run left, busy. When its request returns, its run goes
    on at its next slot: the thread that made the request wakes the leader, which had nothing to wait for."""
    if timer._timedio is None:
        pytest.skip("no C timer")
    stalling = lab_volume(size=16 * MIB, read_latency=0.0005)
    spec = ProbeConfig("read", 4096, interval=0.1, revisit=0.0, jitter=0.0)
    workers = {
        name: probe.ProbeWorker(spec, probe.IOTarget(path, os.O_RDONLY | os.O_DIRECT, 0, 16 * MIB), ProbeStats(60.0))
        for name, path in (("stalling", stalling.device), ("other", make_loop(16 * MIB)))
    }
    assert all(w.probe.engine for w in workers.values())
    for w in workers.values():
        w.start()
    stalled = workers["stalling"]
    try:
        wait_until(lambda: stalled.completed >= 3, what="probes before the stall")
        stalling.set(stall=True)
        wait_until(lambda: stalled.inflight_seconds() > 0.5, what="a stalled request")
        other = workers.pop("other")
        before = other.completed
        wait_until(lambda: other.completed > before + 2, what="the other probe going on meanwhile")
        other.stop()
        assert other.join(2.0)
        other.close()
        stalling.set(stall=False)
        done = stalled.completed
        wait_until(lambda: stalled.completed >= done + 5, timeout=5, what="the probe after its stall")
    finally:
        stalling.set(stall=False)
        for w in workers.values():
            w.stop()
            assert w.join(5.0)
            w.close()


def test_a_slow_request_back_while_two_others_hang_is_still_watched(lab_volume):
    """The probe engine, in this process, three probes due together (one interval, no jitter): two whose volumes
    stall for good, and one whose every read takes 20 ms, past the grace. Found in CI: the slow request was
    displaced, the next leader took one stalled request and the one after the other, finding the slow probe busy:
    with nothing else to watch it disarmed the watchdog, and when the slow request came back, its run (mid-batch,
    not listed again for 51 s) was due with no leader free and no watchdog armed. The probe stopped for the whole
    stall. The displaced thread now arms the watchdog for it: the slow probe goes on at its pace."""
    if timer._timedio is None:
        pytest.skip("no C timer")
    spec = ProbeConfig("read", 4096, interval=0.1, revisit=0.0, jitter=0.0)
    # The slow one started first: listed first, so served first of the three in each slot, which is how it came.
    volumes = {
        "slow": lab_volume(size=16 * MIB, read_latency=0.02),
        "stalling-1": lab_volume(size=16 * MIB, read_latency=0.0005),
        "stalling-2": lab_volume(size=16 * MIB, read_latency=0.0005),
    }
    workers = {
        name: probe.ProbeWorker(
            spec, probe.IOTarget(volume.device, os.O_RDONLY | os.O_DIRECT, 0, 16 * MIB), ProbeStats(60.0)
        )
        for name, volume in volumes.items()
    }
    assert all(w.probe.engine for w in workers.values())
    for w in workers.values():
        w.start()
    slow = workers["slow"]
    try:
        wait_until(lambda: all(w.completed >= 3 for w in workers.values()), what="probes before the stall")
        for name in ("stalling-1", "stalling-2"):
            volumes[name].set(stall=True)
        wait_until(
            lambda: all(workers[n].inflight_seconds() > 0.5 for n in ("stalling-1", "stalling-2")),
            what="both requests stalled",
        )
        # Its pace is 10 a second: 20 in 5 s leaves room for a loaded machine, none for a stop.
        before = slow.completed
        wait_until(lambda: slow.completed >= before + 20, timeout=5, what="the slow probe going on")
    finally:
        for name in ("stalling-1", "stalling-2"):
            volumes[name].set(stall=False)
        for w in workers.values():
            w.stop()
            assert w.join(5.0)
            w.close()


@pytest.mark.lab
def test_a_recheck_hung_on_a_mount_delays_no_other_probe(tmp_path, fuse_directory, lab_volume, monkeypatch):
    """The re-check of a held probe file (an fstat, HELD_RECHECK_S apart) on a FUSE mount whose getattr hangs,
    its writes still answered: the engine treats the fstat as a request, so it shows in flight, a watcher takes
    over, and a probe of another volume keeps its pace; released, the writes go on. Control first: with no
    re-check due, the same stall of getattr leaves the writes going (a write asks no getattr)."""
    if timer._timedio is None:
        pytest.skip("no C timer")
    fuse = fuse_directory()
    data = fuse.path / "data"
    data.mkdir()
    host, resolved = prepared(tmp_path, data, "[{op: write}]", "4MiB")
    target = resolved[0]
    io = targets.io_target(host, target, target.probes[0])
    os.close(target.fds.pop("write"))
    volume = lab_volume(size=16 * MIB, read_latency=0.0005)
    other = probe.ProbeWorker(
        ProbeConfig("read", 4096, interval=0.05, jitter=0.0),
        probe.IOTarget(volume.device, os.O_RDONLY | os.O_DIRECT, 0, 16 * MIB),
        ProbeStats(60.0),
    )
    monkeypatch.setattr(probe, "HELD_RECHECK_S", 3600.0)  # the control: none due
    writes = probe.ProbeWorker(ProbeConfig("write", 4096, interval=0.05, jitter=0.0), io, ProbeStats(60.0), seed=1)
    assert writes.probe.engine and other.probe.engine
    workers = (writes, other)
    for w in workers:
        w.start()
    try:
        wait_until(lambda: writes.completed >= 5 and other.completed >= 5, 10, "probes before the stall")
        fuse.stall("meta")
        written = writes.completed
        wait_until(lambda: writes.completed >= written + 20, 10, "writes with getattr stalled, no re-check due")
        fuse.release()
        writes.stop()
        assert writes.join(5.0)
        writes.close()
        # Again with a re-check every 0.3 s: the first one due after the stall hangs in getattr.
        monkeypatch.setattr(probe, "HELD_RECHECK_S", 0.3)
        writes = probe.ProbeWorker(ProbeConfig("write", 4096, interval=0.05, jitter=0.0), io, ProbeStats(60.0))
        workers = (writes, other)
        writes.start()
        wait_until(lambda: writes.completed >= 10, 10, "writes through re-checks")
        fuse.stall("meta")
        wait_until(lambda: writes.inflight_seconds() > 1.0, 10, "the re-check hung, shown in flight")
        stalled_at = writes.completed
        # Its pace is 20 a second: 40 in 8 s leaves room for a loaded machine, none for a stop.
        before = other.completed
        wait_until(lambda: other.completed >= before + 40, 8, "the other probe going on")
        assert writes.completed == stalled_at, "a write past a re-check that never answered"
        fuse.release()
        wait_until(lambda: writes.completed > stalled_at + 5, 10, "the writes after the release")
        assert writes.error_counts() == {} and other.error_counts() == {}
    finally:
        fuse.release()
        for w in workers:
            w.stop()
        stuck = [w.name for w in workers if not w.join(5.0)]
        for w in workers:
            w.close()
        targets.close(resolved)
    assert stuck == []


def test_io_errors_are_counted_by_errno_and_probing_recovers(tmp_path, lab_volume, start_exporter):
    volume = lab_volume(size=64 * MIB, read_latency=0.0005)
    config = write_config(
        tmp_path,
        f"""
defaults: {{window: 1m}}
targets: [{{name: flaky, device: {volume.device}, probes: [{{op: read, interval: 100ms}}]}}]
""",
    )
    exporter = start_exporter("--config", config)
    exporter.wait_for(lambda s: probes_done(s, "flaky") >= 3, what="first samples")
    volume.set(fail_reads=1.0)
    samples = exporter.wait_for(
        lambda s: (sample_value(s, "volprobe_probe_errors_total", target="flaky", errno="EIO") or 0) >= 3,
        what="EIO errors",
    )
    errors = sample_value(samples, "volprobe_probe_errors_total", target="flaky", errno="EIO")
    time.sleep(2)
    later = sample_value(exporter.metrics(), "volprobe_probe_errors_total", target="flaky", errno="EIO")
    assert later - errors < 10, "the worker backs off instead of hammering a failing device"
    before = probes_done(exporter.metrics(), "flaky")
    volume.set(fail_reads=0.0)
    exporter.wait_for(lambda s: probes_done(s, "flaky") > before + 3, timeout=45, what="recovery after the errors stop")
    assert exporter.process.poll() is None
    assert exporter.stop() == 0


def test_a_vanished_device_is_counted_not_fatal(tmp_path, lab_volume, start_exporter):
    volume = lab_volume(size=64 * MIB, read_latency=0.0005)
    config = write_config(
        tmp_path,
        f"""
targets: [{{name: gone, device: {volume.device}, probes: [{{op: read, interval: 100ms}}]}}]
""",
    )
    exporter = start_exporter("--config", config)
    exporter.wait_for(lambda s: probes_done(s, "gone") >= 3, what="first samples")
    lab.down(volume.name)
    samples = exporter.wait_for(
        lambda s: (sample_value(s, "volprobe_probe_failures_total", target="gone") or 0) > 0,
        what="errors from the vanished device",
    )
    errnos = {labels["errno"] for labels, v in samples["volprobe_probe_errors_total"] if v > 0}
    # Reads open the device per probe, so the detach completes at once: a detached loop device reads as
    # empty (SHORT); had a request been in flight, it would have failed (EIO, ENOTCONN).
    assert errnos & {"SHORT", "EIO", "ENXIO", "ENOTCONN", "ENODEV"}, errnos
    assert exporter.process.poll() is None
    assert exporter.stop() == 0


# Alone (.ci/run: after the others): with a core kept busy, beside the parallel run's lab-load tests (fio at a
# volume's cap, bursts that come and go) the probes' window saw the lab 23% slower than fio's windows just before
# and after it (more with more cores busy), in 3 runs of 4; by itself, with the same core busy, within 8% in 4 of 4.
@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.xdist_group("lab-latency")  # conftest.py
@pytest.mark.parametrize("latency", [0.002])
def test_probe_latency_on_a_slow_device_matches_fio_paced_at_the_same_rate(
    tmp_path, lab_volume, start_exporter, latency
):
    volume = lab_volume(size=64 * MIB, read_latency=latency)

    def fio_p50() -> float:
        job = lab.run_fio(
            volume.device, "--ioengine=sync", "--iodepth=1", "--rw=randread", "--bs=4k", "--rate_iops=20", runtime=5
        )
        return lab.fio_percentile(job, "read", 50)

    # fio before and after the exporter: beside the parallel run's other tests the lab's latency drifts between
    # one 5 s window and the next (fio 2.15 ms, then the probes 2.41 ms, in one CI run), so the reference
    # brackets the probes' window in time.
    before = fio_p50()
    config = write_config(
        tmp_path,
        f"""
defaults: {{window: 1m, jitter: 0}}
targets: [{{name: slow, device: {volume.device}, probes: [{{op: read, interval: 50ms}}]}}]
""",
    )
    exporter = start_exporter("--config", config)
    samples = exporter.wait_for(lambda s: probes_done(s, "slow") >= 100, what="100 probes")
    p50 = sample_value(samples, "volprobe_probe_latency_recent_seconds", target="slow", touch="first", quantile="0.5")
    assert exporter.stop() == 0
    after = fio_p50()
    assert 0.9 * min(before, after) < p50 < 1.1 * max(before, after), (p50, before, after)
    os.sync()
