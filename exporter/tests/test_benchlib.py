"""The statistics bench/fidelity reads its commit rows with (bench/benchlib.py), on distributions whose answer is
known: a wrong interval there would let a benchmark claim a bar it did not meet, or miss one it did."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import benchlib  # bench/benchlib.py: bench/ is on the path (pyproject.toml's pytest `pythonpath`)
import pytest

ROUNDS = 40
PER_ROUND = 600  # requests a round: 8 s at 100/s, less the 2 s ramp


def rounds_of(scale: float, seed: int) -> list[dict[float, float]]:
    """Rounds of lognormal latencies around 1 ms times `scale`, each round's level drifting by up to 10% (as a
    VM's disk does), rounded to 1 us as fio's bins are."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(ROUNDS):
        drift = rng.uniform(0.9, 1.1)
        counts: dict[float, float] = {}
        for _ in range(PER_ROUND):
            value = round(scale * drift * rng.lognormvariate(-6.9, 0.4), 6)
            counts[value] = counts.get(value, 0) + 1
        rounds.append(counts)
    return rounds


def test_the_sum_of_two_independent_draws_weighs_every_pair():
    summed = benchlib.sum_distribution({0.001: 1, 0.002: 1}, {0.01: 1, 0.02: 3}, total=8)
    assert summed == pytest.approx({0.011: 1, 0.012: 1, 0.021: 3, 0.022: 3})
    assert benchlib.pooled_quantile([summed], 0.5) == 0.021


def test_the_grid_keeps_a_quantile_within_its_width():
    rounds = rounds_of(1.0, seed=1)
    exact = benchlib.pooled_quantile(rounds, 0.99)
    gridded = benchlib.grid_quantile([benchlib.on_grid(c) for c in rounds], 0.99)
    assert gridded == pytest.approx(exact, rel=benchlib.GRID_WIDTH)


def test_one_process_against_itself_lies_within_its_interval_and_a_20_percent_bias_outside():
    ours, refs = rounds_of(1.0, seed=2), rounds_of(1.0, seed=3)
    low, high = benchlib.ratio_interval(ours, refs, 0.99, resamples=200)
    assert low < 1 < high
    assert high - low < 0.2  # 40 rounds pin a p99 to within a few percent here
    low, high = benchlib.ratio_interval(rounds_of(1.2, seed=2), refs, 0.99, resamples=200)
    assert 1.05 < low < 1.2 < high


def test_halves_of_one_side_alternate_the_order_and_compare_like_with_like():
    same = rounds_of(1.0, seed=4)
    assert benchlib.halves_ratio(same, 0.5) == pytest.approx(1.0, abs=0.03)
    # Rounds 2, 3, 6, 7, ... twice as slow: the ratio is that of the two halves, whichever side ran first.
    slowed = [{v * (2 if (i // 2) % 2 else 1): n for v, n in c.items()} for i, c in enumerate(same)]
    assert benchlib.halves_ratio(slowed, 0.5) == pytest.approx(0.5, rel=0.03)
    # An odd last round is left out: it would give one half a round of one order more.
    assert benchlib.halves_ratio(slowed[:5], 0.5) == benchlib.halves_ratio(slowed[:4], 0.5)
    with pytest.raises(ValueError, match="four rounds"):
        benchlib.halves_ratio(same[:3], 0.5)


def test_a_fractional_total_a_hair_off_keeps_the_nearest_rank():
    # 0.1 + 0.2 + 0.7 sums to a hair above 1.0 in floats: the median is still the second value.
    assert benchlib.pooled_quantile([{1.0: 0.1, 2.0: 0.4, 3.0: 0.5}], 0.5) == 2.0
    assert benchlib.pooled_quantile([{1.0: 0.1, 2.0: 0.2, 3.0: 0.7}], 0.3) == 2.0


def test_the_convolved_reference_understates_pairs_slow_together():
    """Writes and fdatasyncs slow together (a common drift) have a wider tail than fio's reference makes of their
    parts (independent_sum); parts independent in the first place keep their quantiles."""
    rng = random.Random(3)
    shared = [rng.lognormvariate(0, 0.5) for _ in range(4000)]
    together = benchlib.CommitPairs([round(1e5 * s) for s in shared], [round(1e6 * s) for s in shared])
    apart = benchlib.CommitPairs(
        [round(1e5 * rng.lognormvariate(0, 0.5)) for _ in range(4000)],
        [round(1e6 * rng.lognormvariate(0, 0.5)) for _ in range(4000)],
    )

    def p99_ratio(pairs: benchlib.CommitPairs) -> float:
        sums = Counter(w + s for w, s in zip(pairs.writes, pairs.syncs, strict=True))
        return benchlib.pooled_quantile([sums], 0.99) / benchlib.pooled_quantile(
            [benchlib.independent_sum(pairs)], 0.99
        )

    assert p99_ratio(together) > 1.01
    assert p99_ratio(apart) == pytest.approx(1.0, rel=0.05)


def test_a_process_cpu_time_holds_its_exited_threads_and_agrees_with_its_clock_ticks():
    burn = (
        "import sys, threading, time\n"
        "def burn():\n"
        "    start = time.thread_time()\n"
        "    while time.thread_time() - start < 0.3:\n"
        "        pass\n"
        "worker = threading.Thread(target=burn)\n"
        "worker.start()\n"
        "worker.join()\n"
        "print('burnt', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"  # the burning thread has exited
        exact = benchlib.process_cpu_seconds(child.pid)
        ticks = benchlib.harness.process_cpu_ticks(child.pid)
    finally:
        child.kill()
        child.communicate()
    assert exact >= 0.3, exact  # the exited thread's 0.3 s is in it
    assert abs(exact - ticks) <= 0.03, (exact, ticks)  # the same time, but to the tick
