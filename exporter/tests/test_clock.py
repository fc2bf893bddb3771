"""The wall clock stepped under a running exporter, as NTP steps it (issue 13): probes keep their pace, nothing
goes negative, state written in the clock's "future" is still resumed.

A small LD_PRELOAD shim (clockstep/clockstep.c) steps CLOCK_REALTIME of the exporter's process alone; the
machine's clock is left as it is. As with NTP, the monotonic clock (which schedules and times the probes) and
sleeps are not touched; libfaketime cannot be used for this, as it shifts absolute monotonic sleeps too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from .support.harness import MIB, Samples, probes_done, run, sample_value

pytestmark = pytest.mark.root

SHIM = Path(__file__).parent / "clockstep" / "clockstep.c"
INTERVAL = 0.05


@pytest.fixture
def clock_shim(tmp_path) -> Path:
    library = tmp_path / "clockstep.so"
    run("cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(SHIM), "-ldl")
    return library


def step(offset: Path, seconds: int) -> None:
    """Set the exporter's clock offset, atomically (the shim reads the file at every wall-clock read)."""
    staged = offset.with_suffix(".new")
    staged.write_text(f"{seconds}\n")
    os.replace(staged, offset)


def probes(samples: Samples, op: str) -> float:
    return probes_done(samples, "t", op)


def missed(samples) -> float:
    return sum(v for labels, v in samples.get("volprobe_probe_missed_total", []) if labels["target"] == "t")


# It holds the probes' pacing to 5% missed slots at 50 ms: the other workers' CPU would add its own misses.
@pytest.mark.alone
def test_the_wall_clock_stepped_back_and_forward(tmp_path, make_loop, start_exporter, clock_shim):
    loop = make_loop(64 * MIB)
    states = tmp_path / "state"
    states.mkdir()
    config = tmp_path / "volprobe.yml"
    text = (
        f"state_directory: {states}\n"
        f"targets: [{{name: t, device: {loop}, allow_raw_writes: true, "
        f"probes: [{{op: read, interval: {INTERVAL}s}}, {{op: write, interval: {INTERVAL}s}}]}}]\n"
    )
    config.write_text(text)
    offset = tmp_path / "offset"
    step(offset, 0)
    env = {"LD_PRELOAD": str(clock_shim), "CLOCKSTEP_FILE": str(offset)}
    exporter = start_exporter("--config", str(config), env=env)
    exporter.wait_for(lambda s: probes(s, "write") >= 20, what="probes")

    for seconds in (-3600, 3600):  # back an hour, then an hour ahead of the real time
        before, started = exporter.metrics(), time.monotonic()
        step(offset, seconds)
        exporter.reload(config, text)  # stamps volprobe_config_last_reload_success_timestamp_seconds
        stamped = sample_value(exporter.metrics(), "volprobe_config_last_reload_success_timestamp_seconds")
        assert abs(stamped - (time.time() + seconds)) < 30, "the exporter's wall clock did not move"
        time.sleep(3)
        after, elapsed = exporter.metrics(), time.monotonic() - started
        for op in ("read", "write"):
            done = probes(after, op) - probes(before, op)
            assert 0.5 * elapsed / INTERVAL <= done <= elapsed / INTERVAL + 5, f"{op}: {done} probes in {elapsed:.1f}s"
        assert missed(after) - missed(before) <= 0.05 * 2 * elapsed / INTERVAL, "slots missed on a clock step"
        for labels, age in after["volprobe_probe_inflight_seconds"]:
            assert 0 <= age < 1, (labels, age)
        [(_, age)] = after["volprobe_state_age_seconds"]
        created = json.loads(next(states.glob("*.json")).read_text())["created"]
        # An hour back, the volume was first remembered "in the future": the age reads 0, never negative.
        expected = max(0.0, time.time() + seconds - created)
        assert age == pytest.approx(expected, abs=15), (age, expected)
        assert sample_value(after, "volprobe_scrape_collector_success", collector="throttle") == 1

    # Stopped with the clock an hour ahead (the state says it was saved then), started with it an hour behind:
    # the state is resumed, not taken for corrupt, and its age is not negative.
    created = json.loads(next(states.glob("*.json")).read_text())["created"]
    assert exporter.stop() == 0
    step(offset, -3600)
    again = start_exporter("--config", str(config), env=env)
    samples = again.wait_for(lambda s: probes(s, "write") >= 5, what="probes after the restart")
    assert sample_value(samples, "volprobe_state_status", status="ok") == 1, samples["volprobe_state_status"]
    [(_, age)] = samples["volprobe_state_age_seconds"]
    assert age == 0  # remembered since before "now": clamped, not negative
    assert json.loads(next(states.glob("*.json")).read_text())["created"] == created, "the state was started afresh"
    assert not list(states.glob("*.corrupt-*")) and not list(states.glob("*.foreign-*"))
    assert again.stop() == 0
