"""The plateau rule on constructed windows (each case states what its numbers model); the real thing is
checked on lab volumes in test_throttle.py."""

from __future__ import annotations

import random

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
