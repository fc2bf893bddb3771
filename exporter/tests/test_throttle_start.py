"""Throttling already under way when volprobe starts (issue 9, part 1): a restart or upgrade on a busy volume.

The probes never see such a disk unloaded, so the plateau's await cannot be compared with the disk's unloaded
service time; the detector settles it with an active check (a burst of reads: a capped disk's total stays
flat, an uncapped one's rises). These tests start the load first, then volprobe with an empty state directory.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time

import pytest

from .support.harness import MIB, sample_value, stop_fio
from .support.throttle import (
    NOT_THROTTLED,
    DiskRates,
    PlateauEvidence,
    device_of,
    fio_load,
    qd1_writer,
    run_bursts,
)

# One at a time with the other lab load tests (conftest.py).
pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.slow, pytest.mark.xdist_group("lab-load")]


WINDOW_S = 60  # config_for's window
# From a plateau's evidence in the disk's reads to its flag: the sampler's next second, an active check's burst
# and the second after it, and the scrapes that see it.
DETECTION_S = 10


def config_for(tmp_path, volumes: dict) -> str:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    lines = [f"state_directory: {state}", "defaults: {interval: 200ms, window: 1m}", "targets:"]
    for name, volume in volumes.items():
        lines.append(f"  - {{name: {name}, device: {volume.device}, probes: [{{op: read}}]}}")
    path = tmp_path / "volprobe.yml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def wait_flagged(exporter, caps: dict, started: float, timeout: float = 30) -> dict[str, float]:
    """Each cap's seconds from start to flagged, for the caps flagged by their deadline: `timeout` from start, or,
    on a machine loaded so that the lab serves its cap unevenly, DETECTION_S after the disk's own reads first
    showed the plateau if that came later (PlateauEvidence). A plateau that never shows keeps the bar at
    `timeout`; the wait for one lasts at most a window."""
    evidence = {
        name: PlateauEvidence(device_of(volume), cap, "ops" if limit == "iops" else "bytes", WINDOW_S)
        for name, (volume, limit, cap) in caps.items()
    }
    try:
        flagged = _wait_flagged(exporter, caps, started, timeout, evidence)
    finally:
        for seen in evidence.values():
            seen.stop()
    on_time = {name: at for name, at in flagged.items() if at <= deadline(timeout, evidence[name].evident_at, started)}
    for name, seen in evidence.items():
        if name not in on_time:
            shown = "never" if seen.evident_at is None else f"{seen.evident_at - started:.0f} s after start"
            rates = ", ".join(f"{rate:.0f}" for rate in seen.rates)
            print(f"{name}: flagged {flagged.get(name)}; its reads showed a plateau {shown}; per second: {rates}")
    return on_time


def deadline(timeout: float, evident_at: float | None, started: float) -> float:
    """Seconds from start by which a cap must be flagged, given when its plateau showed (None: never)."""
    return timeout if evident_at is None else max(timeout, evident_at - started + DETECTION_S)


def _wait_flagged(exporter, caps: dict, started: float, timeout: float, evidence: dict) -> dict[str, float]:
    def waiting(name: str) -> bool:
        # Until its deadline; while its plateau has not shown, as if it would show at the window's end.
        seen = evidence[name].evident_at
        return time.monotonic() - started < deadline(timeout, seen if seen is not None else started + WINDOW_S, started)

    flagged: dict[str, float] = {}
    while any(name not in flagged and waiting(name) for name in caps):
        samples = exporter.metrics()
        for name, (volume, limit, cap) in caps.items():
            dev = device_of(volume)
            if (
                name in flagged
                or sample_value(samples, "volprobe_throttle_active", device=dev, limit=limit, dir="read") != 1
            ):
                continue
            flagged[name] = time.monotonic() - started
            metric = "ops" if limit == "iops" else "bytes"
            ceiling = sample_value(samples, f"volprobe_throttle_ceiling_{metric}_per_second", device=dev, dir="read")
            assert abs(ceiling - cap) <= 0.03 * cap, (name, ceiling, cap)
        time.sleep(0.5)
    return flagged


# Alone (the suite's last phase): its load must run above the lab's caps. Beside the suite's four workers, the lab
# once served the iops volume's load at 282 ops/s under a 300 ops/s cap, and the burst's answer was, rightly,
# inconclusive (CI run 10, 2026-11-27).
@pytest.mark.alone
def test_a_cap_already_under_way_is_flagged_at_start_and_after_a_restart(tmp_path, lab_volume, start_exporter):
    """Within 30 s of start, or where the lab serves its cap unevenly under the suite's load, within DETECTION_S
    of the plateau showing in the disk's own reads (wait_flagged)."""
    caps = {
        "iops": (lab_volume(size=64 * MIB, read_latency=0.001, iops_limit=300), "iops", 300),
        "bw": (lab_volume(size=64 * MIB, read_latency=0.0005, bandwidth_limit=20 * MIB), "bandwidth", 20 * MIB),
    }
    # Eight parallel readers on each, started before volprobe (as in a restart on a busy database volume).
    loads = [
        fio_load(
            v.device,
            "--ioengine=psync",
            "--numjobs=8",
            "--rw=randread",
            f"--bs={'64k' if limit == 'bandwidth' else '4k'}",
            runtime=300,  # longer than two starts can wait (stopped after them)
        )
        for v, limit, _ in caps.values()
    ]
    try:
        time.sleep(3)
        config = config_for(tmp_path, {name: v for name, (v, _, _) in caps.items()})
        for restart in ("first start, empty state directory", "after kill -9"):
            started = time.monotonic()
            exporter = start_exporter("--config", config)
            flagged = wait_flagged(exporter, caps, started)
            assert set(flagged) == set(caps), f"{restart}: flagged {flagged}; log:\n{exporter.log()[-2500:]}"
            if restart.startswith("first"):
                # Never seen unloaded: the plateau was settled by an active check.
                samples = exporter.metrics()
                for volume, _, _ in caps.values():
                    dev = device_of(volume)
                    assert sample_value(samples, "volprobe_throttle_checks_total", device=dev, result="capped") >= 1
            exporter.process.send_signal(signal.SIGKILL)
            exporter.process.wait(10)
    finally:
        for load in loads:
            stop_fio(load)


# The steady demand of the first phase: STEADY_JOBS readers, each at STEADY_IOPS. Paced, the total is fio's clock's,
# not the emulation chain's: 2 readers free-running at queue depth 1 did 2 / (20 ms + the chain's CPU time) a second,
# which on a machine with a core kept busy swung between 69 and 124, so that no window was flat and no active check
# was asked for. Each paced request has 13 ms of its 33 ms slot to spare; 4 x 30 x 20 ms keeps 2.4 requests in
# flight, well over the detector's QUEUE_MIN: the flat, queued window a cap also gives, which only a check settles.
STEADY_JOBS, STEADY_IOPS = 4, 30


def steady_demand(device: str, runtime: float):
    return fio_load(
        device,
        "--ioengine=psync",
        f"--numjobs={STEADY_JOBS}",
        f"--rate_iops={STEADY_IOPS}",
        "--rw=randread",
        "--bs=4k",
        runtime=runtime,
    )


def test_steady_demand_bursts_and_qd1_under_way_at_start_are_not_flagged(tmp_path, lab_volume, start_exporter):
    volumes = {
        # 20 ms, uncapped: N qd1 readers give N x 50 IOPS, well within what the lab serves on two cores.
        "parallel": lab_volume(size=64 * MIB, read_latency=0.02),
        "bursty": lab_volume(size=64 * MIB, read_latency=0.001, iops_limit=300),
        "qd1": lab_volume(size=64 * MIB, read_latency=0.002, write_latency=0.002),
    }
    qd1 = qd1_writer(volumes["qd1"].device, runtime=120)
    stop = threading.Event()
    # Bursts that touch the cap for a few seconds at a time.
    burster = threading.Thread(target=run_bursts, args=(volumes["bursty"].device, stop, 11, (16,), "randread"))
    burster.start()
    phases = []  # (readers, IOPS the parallel volume served)
    parallel = None
    try:
        parallel = steady_demand(volumes["parallel"].device, runtime=90)
        time.sleep(3)
        exporter = start_exporter("--config", config_for(tmp_path, volumes))
        dev = device_of(volumes["parallel"])
        for jobs in ("steady", 8, 16):
            if jobs != "steady":
                parallel = fio_load(
                    volumes["parallel"].device,
                    "--ioengine=psync",
                    f"--numjobs={jobs}",
                    "--rw=randread",
                    "--bs=4k",
                    runtime=30,
                )
            reads = DiskRates(dev)
            try:
                started = time.monotonic()
                while True:
                    samples = exporter.metrics()
                    active = [(labels, v) for labels, v in samples.get("volprobe_throttle_active", []) if v == 1]
                    assert active == [], f"false plateau with {jobs} readers: {active}\n{exporter.log()[-2000:]}"
                    elapsed = time.monotonic() - started
                    # The first phase is the steady plateau the active check is for: it lasts until a check has
                    # settled it (a window needs MIN_SAMPLES seconds, most of them within 5% of its level), at most
                    # 60 s. The others last 18 s. A disk's verdicts are exported from the sampler's first reading on,
                    # which can follow the first scrape.
                    checked = any(
                        (sample_value(samples, "volprobe_throttle_checks_total", device=dev, result=result) or 0) >= 1
                        for result in ("uncapped", "inconclusive", "capped")
                    )
                    if elapsed >= 18 and (jobs != "steady" or checked or elapsed >= 60):
                        break
                    time.sleep(1)
            finally:
                reads.stop()
            stop_fio(parallel)
            # The phase's reads a second from its fifth second on, by their median, which leaves out the seconds
            # of an active check's burst (8 more readers for 2 s).
            phases.append((jobs, statistics.median(reads.rates[4:])))
            if jobs == "steady":
                steady = [round(rate) for rate in reads.rates]  # for a failure's message
        print(f"reads a second by phase: {phases}; on the steady plateau: {steady}")
        rates = [rate for _, rate in phases]
        # The premise: the volume's throughput grows with the number of readers (it is not capped): 8 free-running
        # readers do well over twice the steady demand (paced at 4 x 30 = 120 IOPS), and 16 more than 8; less than
        # linearly at 16, where the lab's FUSE hop holds about a dozen requests in flight.
        assert rates[0] * 2 < rates[1] and rates[1] * 1.15 < rates[2], phases
        assert abs(rates[0] - STEADY_JOBS * STEADY_IOPS) <= 0.1 * STEADY_JOBS * STEADY_IOPS, (phases, steady)
        samples = exporter.metrics()
        # The detector judged every volume (all verdicts exported, at 0), and it did check the steady plateaus.
        for name, volume in volumes.items():
            verdict = {
                (labels["limit"], labels["dir"]): v
                for labels, v in samples["volprobe_throttle_active"]
                if labels["device"] == device_of(volume)
            }
            assert verdict == NOT_THROTTLED, name
            seconds = [
                v for labels, v in samples["volprobe_throttle_seconds_total"] if labels["device"] == device_of(volume)
            ]
            assert seconds and max(seconds) == 0, name
        checks = {
            result: sample_value(samples, "volprobe_throttle_checks_total", device=dev, result=result)
            for result in ("uncapped", "inconclusive", "capped")
        }
        assert checks["uncapped"] >= 1, (
            f"{checks}; reads a second on the steady plateau: {steady}\n{exporter.log()[-3000:]}"
        )
        assert checks["capped"] == 0, f"{checks}\n{exporter.log()[-3000:]}"
        assert exporter.stop() == 0
    finally:
        stop.set()
        burster.join()
        stop_fio(qd1)
        if parallel is not None:
            stop_fio(parallel)
