"""The throttling plateau detector on lab volumes under real load: what it must flag, and what it must not."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from .support.harness import MIB, Samples, recent_probes, sample_value, stop_fio
from .support.throttle import NOT_THROTTLED, device_of, fio_load, qd1_writer, run_bursts

# Each test loads devices for over a minute; one at a time with the other lab load tests (conftest.py).
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.xdist_group("lab-load")]


def probes_ready(samples: Samples, names: list[str], count: int = 12) -> bool:
    return all(recent_probes(samples, name, "first") >= count for name in names)


def start(tmp_path: Path, start_exporter, volumes: dict[str, object]):
    lines = ["defaults: {interval: 200ms, window: 1m}", "targets:"]
    for name, volume in volumes.items():
        lines.append(f"  - {{name: {name}, device: {volume.device}, probes: [{{op: read}}]}}")
    config = tmp_path / "volprobe.yml"
    config.write_text("\n".join(lines) + "\n")
    exporter = start_exporter("--config", str(config))
    # The unloaded latency comes from the probes: let them see each volume idle first.
    exporter.wait_for(lambda s: probes_ready(s, list(volumes)), what="probes on the idle volumes")
    return exporter


def test_caps_are_flagged_within_60s_with_their_ceiling(tmp_path, lab_volume, start_exporter):
    caps = {
        "iops150": (lab_volume(size=64 * MIB, read_latency=0.001, iops_limit=150), "iops", 150),
        "iops500": (lab_volume(size=64 * MIB, read_latency=0.001, iops_limit=500), "iops", 500),
        "iops1000": (lab_volume(size=64 * MIB, read_latency=0.001, iops_limit=1000), "iops", 1000),
        "bw20": (lab_volume(size=64 * MIB, read_latency=0.0005, bandwidth_limit=20 * MIB), "bandwidth", 20 * MIB),
    }
    exporter = start(tmp_path, start_exporter, {name: v for name, (v, _, _) in caps.items()})
    loads = [
        fio_load(
            v.device,
            "--ioengine=libaio",
            "--iodepth=16",
            "--rw=randread",
            f"--bs={'64k' if limit == 'bandwidth' else '4k'}",
            runtime=75,
        )
        for v, limit, _ in caps.values()
    ]
    started = time.monotonic()
    flagged: dict[str, float] = {}
    # Probes back off on a throttled disk (10x their interval), and are a small share of its I/O. That holds while
    # the verdict does: once a plateau is judged over (the load can ease on a busy machine), the interval is the
    # configured one again. So each volume's back-off is read in a scrape that also shows its cap flagged.
    backed_off: dict[str, float] = {}
    seen: dict[str, list[tuple[float, float, float]]] = {name: [] for name in caps}  # (active, interval, share)
    try:
        while (len(flagged) < len(caps) or len(backed_off) < len(caps)) and time.monotonic() - started < 70:
            samples = exporter.metrics()
            for name, (volume, limit, cap) in caps.items():
                dev = device_of(volume)
                active = sample_value(samples, "volprobe_throttle_active", device=dev, limit=limit, dir="read")
                if active == 1 and name not in flagged:
                    flagged[name] = time.monotonic() - started
                    metric = "ops" if limit == "iops" else "bytes"
                    ceiling = sample_value(
                        samples, f"volprobe_throttle_ceiling_{metric}_per_second", device=dev, dir="read"
                    )
                    assert abs(ceiling - cap) <= 0.03 * cap, (name, ceiling, cap)
                    other = "bandwidth" if limit == "iops" else "iops"
                    assert sample_value(samples, "volprobe_throttle_active", device=dev, limit=other, dir="read") == 0
                if name in flagged and name not in backed_off:
                    interval = sample_value(samples, "volprobe_probe_interval_seconds", target=name)
                    share = sample_value(samples, "volprobe_probe_share_ratio", device=dev)
                    seen[name].append((active, interval, share))
                    if active == 1 and interval == 2.0 and share < 0.05:
                        backed_off[name] = time.monotonic() - started
            time.sleep(1)
        assert set(flagged) == set(caps), f"flagged after {flagged}; log:\n{exporter.log()[-2000:]}"
        assert max(flagged.values()) <= 60
        assert set(backed_off) == set(caps), {name: seen[name][-5:] for name in set(caps) - set(backed_off)}
        samples = exporter.metrics()
        for volume, limit, _ in caps.values():
            dev = device_of(volume)
            assert sample_value(samples, "volprobe_throttle_seconds_total", device=dev, dir="read", limit=limit) > 0
    finally:
        for load in loads:
            stop_fio(load)
    assert exporter.stop() == 0


def test_idle_bursty_and_latency_bound_qd1_are_not_flagged(tmp_path, lab_volume, start_exporter):
    volumes = {
        "idle": lab_volume(size=64 * MIB, read_latency=0.001),
        "bursty": lab_volume(size=64 * MIB, read_latency=0.001, write_latency=0.001),
        "qd1": lab_volume(size=64 * MIB, read_latency=0.002, write_latency=0.002),
    }
    exporter = start(tmp_path, start_exporter, volumes)
    # The seed's job: one thread, queue depth 1, 8 KiB random writes on a 2 ms device: ~500 IOPS, flat.
    qd1 = qd1_writer(volumes["qd1"].device, runtime=55)
    stop = threading.Event()
    burster = threading.Thread(target=run_bursts, args=(volumes["bursty"].device, stop, 7))
    burster.start()
    try:
        deadline = time.monotonic() + 50
        seen_qd1 = []
        judged_since: dict[str, float] = {}  # volume -> when the detector's verdicts on it were first exported
        while time.monotonic() < deadline:
            samples = exporter.metrics()
            active = [(labels, v) for labels, v in samples.get("volprobe_throttle_active", []) if v == 1]
            assert active == [], f"false plateau: {active}"
            for name, volume in volumes.items():
                verdict = {
                    (labels["limit"], labels["dir"]): v
                    for labels, v in samples.get("volprobe_throttle_active", [])
                    if labels["device"] == device_of(volume)
                }
                if verdict == NOT_THROTTLED:
                    judged_since.setdefault(name, time.monotonic())
                else:
                    assert name not in judged_since, f"the detector's verdicts on {name} went away: {verdict}"
            dev = device_of(volumes["qd1"])
            writes = sample_value(samples, "volprobe_disk_writes_completed_total", device=dev)
            busy = sample_value(samples, "volprobe_disk_write_time_seconds_total", device=dev)
            seen_qd1.append((time.monotonic(), writes, busy))
            time.sleep(2)
        (t0, w0, b0), (t1, w1, b1) = seen_qd1[5], seen_qd1[-1]
        # The premise: one write always in flight (write-seconds per second ~1), at the device's own pace. On a
        # loaded CI machine the emulation chain's CPU time slows a "2 ms" write to ~3 ms, hence the wide range.
        rate, depth = (w1 - w0) / (t1 - t0), (b1 - b0) / (t1 - t0)
        assert 250 < rate < 600 and 0.75 < depth < 1.1, f"the qd1 load ran at {rate:.0f} IOPS, depth {depth:.2f}"
        # "Never flagged" means something only if the detector judged these devices all along: a 0 for every
        # limit and direction of each, from the first seconds on (>= 35 s: a detector needs 15 s of window to
        # flag anything), not missing series; none spent a second on a plateau between two scrapes either; and
        # it read the loaded device's diskstats: the probes were a small share of that device's I/O.
        assert set(judged_since) == set(volumes), f"no verdicts on {set(volumes) - set(judged_since)}"
        assert all(deadline - since >= 35 for since in judged_since.values()), judged_since
        for volume in volumes.values():
            seconds = [
                v
                for labels, v in samples.get("volprobe_throttle_seconds_total", [])
                if labels["device"] == device_of(volume)
            ]
            assert len(seconds) == len(NOT_THROTTLED) and sum(seconds) == 0, (device_of(volume), seconds)
        assert sample_value(samples, "volprobe_probe_share_ratio", device=device_of(volumes["qd1"])) < 0.2
    finally:
        stop.set()
        burster.join()
        stop_fio(qd1)
    assert exporter.stop() == 0
