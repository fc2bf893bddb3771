"""The plateau rule on constructed windows (each case states what its numbers model); the real thing is
checked on lab volumes in test_throttle.py."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from volprobe import detectors
from volprobe.detectors import Second

KIB = 1024


def window(ops: list[float], size: int, inflight: float, await_s: float, direction: str = "read") -> list[Second]:
    seconds = []
    for value in ops:
        other = "write" if direction == "read" else "read"
        seconds.append(
            Second(
                ops={direction: value, other: 0.0, "total": value},
                bytes={direction: value * size, other: 0.0, "total": value * size},
                inflight={direction: inflight, other: 0.0, "total": inflight},
                await_s={direction: await_s, other: float("nan"), "total": await_s},
            )
        )
    return seconds


def noisy(level: float, n: int = 60, spread: float = 0.01, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


@pytest.mark.parametrize("cap", [150, 500, 1000])
def test_iops_cap_under_parallel_load_is_a_plateau(cap):
    # 16 requests in flight queue behind the cap: await = 16 / cap, far above a 1 ms unloaded latency.
    plateau = detectors.evaluate(window(noisy(cap), 4 * KIB, 16, 16 / cap), "read", unloaded_s=0.001)
    assert plateau is not None and plateau.limit == "iops"
    assert abs(plateau.ceiling_ops - cap) <= 0.03 * cap


def test_bandwidth_cap_with_large_requests_is_a_bandwidth_plateau():
    rate = 20 * 1024 * KIB
    ops = noisy(rate / (64 * KIB))
    plateau = detectors.evaluate(window(ops, 64 * KIB, 16, 16 / 320), "read", unloaded_s=0.001)
    assert plateau is not None and plateau.limit == "bandwidth"
    assert abs(plateau.ceiling_bytes - rate) <= 0.03 * rate


def test_mixed_request_sizes_the_flatter_signal_decides():
    rng = random.Random(3)
    sizes = [rng.choice([4 * KIB, 16 * KIB, 64 * KIB]) for _ in range(60)]
    seconds = window(noisy(500, spread=0.005), 4 * KIB, 16, 0.032)
    for second, size in zip(seconds, sizes, strict=True):  # IOPS pinned at 500, bytes follow the sizes
        second.bytes["read"] = second.bytes["total"] = second.ops["read"] * size
    plateau = detectors.evaluate(seconds, "read", unloaded_s=0.001)
    assert plateau is not None and plateau.limit == "iops"


def test_a_cap_flat_to_a_request_a_second_is_judged_by_its_request_size():
    """A 300 IOPS cap of 4 KiB reads, flat to a request a second, where a few seconds also count 8 requests of
    512 bytes: both signals are flat to under a percent, and the one a few thousandths flatter must not decide
    (a CI run called such a cap a bandwidth cap). Small requests: IOPS."""
    seconds = window(noisy(300, n=45, spread=0.002), 4 * KIB, 8, 8 / 300)
    for second in seconds[2:5]:
        for direction in ("read", "total"):
            second.ops[direction] += 8
            second.bytes[direction] += 8 * 512
    plateau = detectors.evaluate(seconds, "read", unloaded_s=0.001)
    assert plateau is not None and plateau.limit == "iops"


def test_a_configured_limit_that_matches_names_the_limit():
    seconds = window(noisy(320), 64 * KIB, 16, 0.05)
    assert detectors.evaluate(seconds, "read", 0.001, limit_ops=320).limit == "iops"


def test_single_threaded_qd1_on_a_slow_device_is_not_a_plateau():
    # ~500 IOPS, flat, at 2 ms: the latency bound of one request at a time. Never more than one in flight.
    assert detectors.evaluate(window(noisy(495), 8 * KIB, 0.99, 0.002), "write", unloaded_s=0.002) is None


def test_threads_at_qd1_on_an_unthrottled_device_are_not_a_plateau():
    # 4 threads keep 4 in flight and run flat at 2000 IOPS, but each request takes the unloaded 2 ms.
    assert detectors.evaluate(window(noisy(2000), 4 * KIB, 4, 0.002), "read", unloaded_s=0.0019) is None


def test_idle_device_is_not_a_plateau():
    assert detectors.evaluate(window([0.0] * 60, 4 * KIB, 0, float("nan")), "read", 0.001) is None
    assert detectors.evaluate(window(noisy(1.0), 4 * KIB, 0.001, 0.001), "read", 0.001) is None  # probes only


def test_bursty_load_is_not_a_plateau():
    rng = random.Random(5)
    bursty = [rng.choice([0, 50, 300, 1200, 2500]) * 1.0 for _ in range(60)]
    assert detectors.evaluate(window(bursty, 4 * KIB, 8, 0.02), "read", unloaded_s=0.001) is None


def test_too_few_seconds_or_no_unloaded_latency_yet():
    seconds = window(noisy(500), 4 * KIB, 16, 0.032)
    assert detectors.evaluate(seconds[: detectors.MIN_SAMPLES - 1], "read", 0.001) is None
    assert detectors.evaluate(seconds, "read", unloaded_s=None) is None


def test_plateau_must_cover_most_of_the_window():
    # 20 s of load at the cap after 40 s idle: not yet most of the window.
    ops = [0.0] * 40 + noisy(500, n=20)
    assert detectors.evaluate(window(ops, 4 * KIB, 16, 0.032), "read", 0.001) is None


def test_rates_from_diskstats_readings():
    from volprobe.diskstats import DiskStats

    before = DiskStats(8, 0, "sda", 100, 0, 800, 100, 50, 0, 800, 500, 0, 0, 600)
    after = DiskStats(8, 0, "sda", 600, 0, 4800, 8100, 50, 0, 800, 500, 16, 1000, 8600)
    second = detectors.second_between(before, after, 1.0)
    assert second.ops["read"] == 500 and second.bytes["read"] == 4000 * 512
    assert second.inflight["read"] == 8.0  # 8000 ms of requests in one second: 8 in flight on average
    assert second.await_s["read"] == 0.016
    assert detectors.second_between(after, before, 1.0) is None  # a counter reset


# -- the sampler's cost: idle windows are not judged, and do not ask the exporter every second ------------------


def _levels(rng: random.Random, n: int) -> list[float]:
    """Rates shaped as disks see them: idle, probes only, steady, bursty, flat at a level, around the threshold."""
    shape = rng.choice(["idle", "probes", "steady", "bursty", "flat", "threshold"])
    if shape == "idle":
        return [0.0] * n
    if shape == "probes":
        return [rng.choice([1.0, 2.0]) for _ in range(n)]
    if shape == "bursty":
        return [rng.choice([0.0, 0.0, 0.0, 400.0]) for _ in range(n)]
    if shape == "threshold":  # at and around rule 2's level, within rule 3's tolerance of it
        return [detectors.MIN_OPS * rng.uniform(0.94, 1.06) for _ in range(n)]
    level = rng.choice([9.6, 10.0, 50.0, 500.0])
    return noisy(level, n, spread=0.03 if shape == "flat" else 0.5, seed=rng.randrange(1 << 30))


def test_a_window_that_cannot_hold_a_plateau_is_known_by_its_counts():
    """Window.may_hold_plateau is never False where candidate() finds a flat, queued window (it would hide a
    plateau), and it is False for the idle and probe-only windows that are most disks' (or it saves nothing)."""
    rng = random.Random(28)
    skipped = found = 0
    for _ in range(3000):
        n = rng.randrange(1, 80)
        size = rng.choice([512, 4 * KIB, 64 * KIB, 1024 * KIB])
        seconds = window(_levels(rng, n), size, rng.choice([0.5, 2.0, 16.0]), 0.002, rng.choice(["read", "write"]))
        held = detectors.Window(60)
        for second in seconds:
            held.append(second)
        if rng.random() < 0.1:
            held.clear()
        # The sampler keeps the seconds too idle for any band as QUIET, without their rates (second_between()).
        quieted = [detectors.QUIET if quiet(s) else s for s in held]
        for direction in detectors.DIRECTIONS:
            judged = detectors.candidate(list(held), direction)
            may = held.may_hold_plateau(direction)
            assert may or judged is None, (direction, [s.ops[direction] for s in held])
            found += judged is not None
            skipped += not may
            assert detectors.evaluate(quieted, direction, 0.001) == detectors.evaluate(list(held), direction, 0.001)
    assert found > 100 and skipped > 1000  # both kinds of window were met


def quiet(second: Second) -> bool:
    return second.ops["total"] < detectors.BUSY_OPS and second.bytes["total"] < detectors.BUSY_BYTES


def test_a_second_too_idle_for_any_band_is_kept_as_quiet():
    from volprobe.diskstats import DiskStats

    def quiet_or_rates(before: DiskStats, after: DiskStats, elapsed: float) -> Second | None:
        return detectors.second_between(before, after, elapsed, quiet_if_idle=True)

    def reading(reads: int, sectors: int, read_ms: int = 0) -> DiskStats:
        return DiskStats(8, 0, "sda", reads, 0, sectors, read_ms, 0, 0, 0, 0, 0, 0, 0)

    start = reading(100, 800)
    assert quiet_or_rates(start, reading(102, 816), 1.0) is detectors.QUIET  # two probes
    assert quiet_or_rates(start, reading(109, 872), 1.0) is detectors.QUIET
    busy = quiet_or_rates(start, reading(110, 880), 1.0)  # 10 ops/s: may be on a band at 10
    assert busy is not detectors.QUIET and busy.ops["read"] == 10.0
    assert quiet_or_rates(start, reading(101, 800 + 2048), 1.0) is not detectors.QUIET  # 1 MiB in a second
    assert quiet_or_rates(start, reading(99, 800), 1.0) is None  # a counter reset is a reset, not quiet
    assert quiet_or_rates(start, reading(101, 808, read_ms=-1), 1.0) is None


def _diskstats_line(name: str, reads: int, read_ms: int, inflight: int = 0) -> str:
    """A line as Linux 5.5+ prints it (20 fields), for a disk with these reads done."""
    return f" 259       0 {name} {reads} 0 {reads * 8} {read_ms} 0 0 0 0 {inflight} {read_ms} {read_ms} 0 0 0 0 0 0\n"


def _sampler(
    proc_root: Path, disks: set[str], unloaded_latency: Callable[[str, str], float | None]
) -> detectors.ThrottleDetector:
    """A detector of `disks` sampling proc_root/diskstats at 1 s over 60 s, no limits, no probes of its own."""
    return detectors.ThrottleDetector(
        devices=lambda: disks,
        unloaded_latency=unloaded_latency,
        limits=lambda _disk: (None, None),
        on_change=lambda _disk, _throttled: None,
        probe_completions=lambda _disk: 0,
        proc_root=proc_root,
        sample_interval=1.0,
        window=60.0,
    )


def test_the_sampler_asks_for_an_idle_disks_inputs_only_now_and_then(tmp_path):
    """An idle disk's unloaded latency and limits are asked for at its first sample and every INPUTS_EVERY_S;
    a disk whose window may hold a plateau is asked at every sample, and its plateau is found as before."""
    asked: dict[str, int] = {"idle": 0, "busy": 0}

    def unloaded_latency(disk: str, direction: str) -> float | None:
        if direction == "total":
            asked[disk] += 1
        return 0.001

    detector = _sampler(tmp_path, {"idle", "busy"}, unloaded_latency)
    samples = 40
    for second in range(samples):
        idle_reads = second + 1  # a probe a second
        busy_reads, busy_ms = 500 * (second + 1), 500 * 16 * (second + 1)  # 500 IOPS, 16 in flight: a cap
        (tmp_path / "diskstats").write_text(
            _diskstats_line("idle", idle_reads, idle_reads) + _diskstats_line("busy", busy_reads, busy_ms, 16)
        )
        detector.sample(1000.0 + second)
    assert asked["idle"] == math.ceil(samples / detectors.INPUTS_EVERY_S)  # at 0 s, 30 s, ...
    assert asked["busy"] > samples - detectors.MIN_SAMPLES  # from when the window could hold one, every sample
    assert detector.is_throttled("busy") and not detector.is_throttled("idle")
    assert detector.snapshot()["idle"].unloaded == {d: 0.001 for d in detectors.DIRECTIONS}


def test_an_idle_disk_is_read_every_few_seconds_and_a_cap_is_flagged_as_soon_as_it_is_seen(tmp_path):
    """Two probes a second leave a disk idle for certain over four seconds (8 requests, under rule 2's level in
    any one second): the sampler reads it every four, and keeps the same QUIET seconds that reads every second
    keep. A cap that starts between two reads is seen at the next one; from then on the sampler reads every
    second, and flags the cap at most IDLE_STRIDE_MAX - 1 seconds after a sampler that never stopped doing so."""
    cap_from, end = 60, 150

    def line_at(second: int) -> str:
        probes = 2 * min(second, cap_from)
        capped = max(0, second - cap_from)
        reads, read_ms = probes + 500 * capped, probes + 500 * 16 * capped  # 500 IOPS with 16 in flight
        return _diskstats_line("d", reads, read_ms, 16 if capped else 0)

    def detector(root: Path) -> detectors.ThrottleDetector:
        root.mkdir()
        return _sampler(root, {"d"}, lambda _disk, _direction: 0.001)

    every_second, strided = detector(tmp_path / "every"), detector(tmp_path / "strided")
    reads = {"every": 0, "strided": 0}
    flagged: dict[str, int] = {}
    next_read = 0
    for second in range(end):
        (tmp_path / "every" / "diskstats").write_text(line_at(second))
        every_second.sample(float(second))
        reads["every"] += 1
        if second == next_read:
            (tmp_path / "strided" / "diskstats").write_text(line_at(second))
            strided.sample(float(second))
            reads["strided"] += 1
            next_read = second + strided.stride
            if strided.is_throttled("d"):
                assert strided.stride == 1, "a throttled disk is read every second"
            if second < cap_from:  # the same QUIET seconds as reads every second keep
                assert list(strided._states["d"].window) == list(every_second._states["d"].window)
        for name, one in (("every", every_second), ("strided", strided)):
            if one.is_throttled("d"):
                flagged.setdefault(name, second)
        if second == cap_from - 1:
            assert strided.stride == 4  # 4 x 2 requests < 9.5 <= 5 x 2
            assert reads["strided"] <= reads["every"] / 3
    assert "every" in flagged and "strided" in flagged
    assert 0 <= flagged["strided"] - flagged["every"] <= detectors.IDLE_STRIDE_MAX - 1


def test_a_disk_busy_between_two_reads_brings_the_sampler_back_to_every_second():
    from volprobe.diskstats import DiskStats

    def reading(reads: int, sectors: int) -> DiskStats:
        return DiskStats(8, 0, "sda", reads, 0, sectors, 0, 0, 0, 0, 0, 0, 0, 0)

    start = reading(100, 800)
    assert detectors.idle_between(start, reading(109, 872), 1.0) is True  # 9 requests in four seconds
    assert detectors.idle_between(start, reading(110, 880), 1.0) is False  # 10 may all have come in one
    assert detectors.idle_between(start, reading(101, 800 + 2048), 1.0) is False  # 1 MiB may have, too
    assert detectors.idle_between(start, reading(99, 800), 1.0) is None  # a counter reset
    assert detectors.idle_stride(start, reading(102, 816), 1.0, 1.0) == 4
    assert detectors.idle_stride(start, reading(100, 800), 1.0, 1.0) == detectors.IDLE_STRIDE_MAX
    assert detectors.idle_stride(start, reading(105, 840), 1.0, 1.0) == 1
