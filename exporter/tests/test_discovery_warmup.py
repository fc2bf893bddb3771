"""`discovery.warmup`: every new volume attached to the node is read once, whole, at a bounded rate, in the
idle I/O class; resumed after a restart, never repeated for a volume already warmed (whatever kernel name it
comes back under), `max_concurrent` at a time, and `failed` with the reason when its device vanishes.

Real lab volumes (nbdkit -> nbdfuse -> loop), attached while the exporter runs; each checked on the lab side,
64 KiB by 64 KiB (what the device served), not only through the exporter's metrics. The volumes attach from
/dev/loop300 on, and discovery follows only loop300-loop349, so no other device of the machine is read."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from lab import lab

from .support import harness
from .support.harness import MIB, probes_done, sample_value, threads, wait_until

FIRST_LOOP = 300
CHUNK = 64 * 1024  # the lab's coverage unit
# One after another on one xdist worker: each test's discovery follows the whole range, and would find the
# volumes of another test of this module running beside it (the other workers attach from /dev/loop1024 up).
pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.xdist_group("loop300")]


def config_text(state_dir: Path, rate: str = "8MiB", max_concurrent: int = 2) -> str:
    # Probes every 10 minutes: their 4 KiB reads must not blur the coverage a warm-up leaves.
    return f"""
state_directory: {state_dir}
discovery:
  include: ['loop3[0-4][0-9]']
  rescan_interval: 500ms
  probes: [{{op: read, interval: 10m}}]
  warmup: {{rate: {rate}, jobs: 2, max_concurrent: {max_concurrent}}}
"""


def start(tmp_path: Path, start_exporter, **settings):
    state_dir = tmp_path / "state"
    state_dir.mkdir(exist_ok=True)
    config = tmp_path / "volprobe.yml"
    config.write_text(config_text(state_dir, **settings))
    return start_exporter("--config", str(config))


def name_of(volume) -> str:
    return Path(volume.device).name


def state_of(samples, target: str) -> str | None:
    for labels, value in samples.get("volprobe_warmup_state", []):
        if labels.get("target") == target and value == 1:
            return labels["state"]
    return None


def blocks_read_twice(coverage: list[int], block: int = MIB) -> list[int]:
    """The warm-up blocks (1 MiB) read more than once: every 64 KiB of them served twice. The small reads of
    probes and of the safety check (signatures at a few offsets) do not make a whole block."""
    per = block // CHUNK
    return [
        b for b in range(len(coverage) // per) if all(count >= 2 * CHUNK for count in coverage[b * per : (b + 1) * per])
    ]


def test_a_volume_attached_at_run_time_is_warmed_whole_once_resumed_after_a_restart_and_not_again(
    tmp_path, lab_volume, start_exporter
):
    exporter = start(tmp_path, start_exporter)
    volume = lab_volume(size=48 * MIB, calibrate=False, first_loop=FIRST_LOOP)
    name = name_of(volume)
    exporter.wait_for(
        lambda s: 0.2 < (sample_value(s, "volprobe_warmup_progress_ratio", target=name) or 0) < 0.7,
        what=f"the warm-up of {name} under way",
    )
    # A restart mid-way (SIGTERM): the volume was there at start, and its state holds an unfinished warm-up.
    assert exporter.stop() == 0
    exporter = start(tmp_path, start_exporter)
    samples = exporter.wait_for(lambda s: state_of(s, name) == "done", timeout=40, what="warm-up done")
    assert sample_value(samples, "volprobe_warmup_progress_ratio", target=name) == 1
    coverage = volume.read_coverage()
    assert all(count >= CHUNK for count in coverage), "every 64 KiB of the volume read"
    assert blocks_read_twice(coverage) == [], "the restart re-read nothing"
    assert sum(coverage) - len(coverage) * CHUNK <= 512 * 1024, "beyond one pass, only small reads"
    # Detached and attached again, on another loop device: the same volume (its backing image), not read again.
    volume.detach()
    exporter.wait_for(lambda s: state_of(s, name) is None, what=f"{name} gone")
    before = volume.read_coverage()
    volume.attach(first_loop=FIRST_LOOP + 10)
    again = name_of(volume)
    assert again != name
    samples = exporter.wait_for(lambda s: state_of(s, again) == "done", what="the re-attached volume known as done")
    # Its warm-up job has ended, having decided from the state that there was nothing to read.
    wait_until(lambda: f"{again}: already done" in exporter.log(), what="the warm-up to end without reading", every=0.1)
    read = sum(volume.read_coverage()) - sum(before)
    assert read <= 256 * 1024, f"{read} bytes read from a volume already warmed (signature checks and probes only)"
    # Restarted again, the warmed volume is there at start: still shown done (a workload gated on its progress
    # must not wait for ever after an exporter restart), and still not read.
    assert exporter.stop() == 0
    before = volume.read_coverage()
    exporter = start(tmp_path, start_exporter)
    samples = exporter.wait_for(lambda s: state_of(s, again) == "done", what="a warmed volume shown done at start")
    assert sample_value(samples, "volprobe_warmup_progress_ratio", target=again) == 1
    read = sum(volume.read_coverage()) - sum(before)
    assert read <= 256 * 1024, f"{read} bytes read from a warmed volume after a restart"
    assert exporter.stop() == 0


def test_volumes_attached_at_once_are_warmed_max_concurrent_at_a_time(tmp_path, lab_volume, start_exporter):
    exporter = start(tmp_path, start_exporter, rate="4MiB", max_concurrent=1)
    volumes = [lab_volume(size=8 * MIB, calibrate=False, first_loop=FIRST_LOOP) for _ in range(3)]
    names = [name_of(v) for v in volumes]
    seen_queued, most_running = set(), 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        samples = exporter.metrics()
        states = {n: state_of(samples, n) for n in names}
        most_running = max(most_running, sum(1 for s in states.values() if s == "running"))
        seen_queued |= {n for n, s in states.items() if s == "queued"}
        if all(s == "done" for s in states.values()):
            break
        time.sleep(0.1)
    assert all(state_of(samples, n) == "done" for n in names), states
    assert most_running == 1
    assert seen_queued, "the later volumes wait their turn, shown as queued"
    for volume in volumes:
        assert all(count >= CHUNK for count in volume.read_coverage())
    assert exporter.stop() == 0


def test_a_volume_that_vanishes_mid_warmup_ends_failed_and_the_exporter_serves_on(tmp_path, lab_volume, start_exporter):
    exporter = start(tmp_path, start_exporter, rate="4MiB")
    volume = lab_volume(size=64 * MIB, calibrate=False, first_loop=FIRST_LOOP)
    name = name_of(volume)
    exporter.wait_for(lambda s: state_of(s, name) == "running", what="warm-up running")
    lab.down(volume.name)  # the volume goes: detached and its server gone, in the middle of the pass
    samples = exporter.wait_for(lambda s: state_of(s, name) == "failed", timeout=30, what="warm-up failed")
    assert 0 < sample_value(samples, "volprobe_warmup_progress_ratio", target=name) < 1
    assert f"warm-up of {name} failed" in exporter.log() or f"warm-up of /dev/{name} failed" in exporter.log()
    for _ in range(3):  # scrapes go on, and the failure stays visible
        assert state_of(exporter.metrics(), name) == "failed"
    assert exporter.stop() == 0


def test_a_reload_that_adds_discovery_warmup_with_policy_all_warms_the_volumes_already_followed(
    tmp_path, lab_volume, start_exporter
):
    """Discovery ran without warm-ups; a SIGHUP adds `warmup: {policy: all}`: the followed volume is warmed,
    its probes keep running (their histogram is not reset)."""
    volume = lab_volume(size=16 * MIB, calibrate=False, first_loop=FIRST_LOOP)
    name = name_of(volume)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    config = tmp_path / "volprobe.yml"
    without = config_text(state_dir).split("  warmup:")[0].replace("interval: 10m", "interval: 100ms")
    config.write_text(without)
    exporter = start_exporter("--config", str(config))
    samples = exporter.wait_for(lambda s: probes_done(s, name) >= 5, what="probes")
    assert state_of(samples, name) is None
    probes_before = probes_done(samples, name)
    exporter.reload(config, without + "  warmup: {rate: 16MiB, policy: all}\n")
    samples = exporter.wait_for(lambda s: state_of(s, name) == "done", what="the followed volume warmed")
    assert probes_done(samples, name) >= probes_before
    assert all(count >= CHUNK for count in volume.read_coverage())
    assert exporter.stop() == 0


def test_policy_new_leaves_a_volume_there_at_start_alone_across_a_reload_that_restarts_its_probes(
    tmp_path, lab_volume, start_exporter
):
    """Under policy "new", a volume that was there when volprobe started is not warmed, even when a reload
    (a new histogram window) restarts every discovered probe, which finds it again."""
    volume = lab_volume(size=16 * MIB, calibrate=False, first_loop=FIRST_LOOP)
    name = name_of(volume)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    config = tmp_path / "volprobe.yml"
    text = config_text(state_dir).replace("interval: 10m", "interval: 100ms")
    config.write_text(text)
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(lambda s: probes_done(s, name) >= 3, what="probes")
    before = sum(volume.read_coverage())
    exporter.reload(config, "defaults: {window: 2m}\n" + text)
    exporter.wait_for(
        lambda s: probes_done(s, name) >= 3,
        what="the probes restarted by the reload",
    )
    assert f"stopped probing {name}" in exporter.log() and exporter.log().count(f"discovered {name}") == 2
    # A warm-up would be queued when the volume is found again: by 15 more probes (1.5 s, three rescans) it shows.
    probed = probes_done(exporter.metrics(), name)
    samples = exporter.wait_for(
        lambda s: probes_done(s, name) >= probed + 15,
        what="15 more probes after the volume was found again",
    )
    assert state_of(samples, name) is None, "not warmed"
    assert sum(volume.read_coverage()) - before < MIB, "only probes and signature checks read it"
    assert exporter.stop() == 0


def test_two_dozen_volumes_attached_at_once_are_warmed_two_at_a_time_and_scrapes_stay_fast(tmp_path, start_exporter):
    """A node that gets 24 volumes at once (a StatefulSet rescheduled there): two warm-ups at a time, the rest
    queued, every volume read whole (the kernel's own count of sectors read), threads bounded by the limit, and
    no scrape held up by the queue. Plain loop devices: the lab's chain is too heavy for two dozen."""
    exporter = start(tmp_path, start_exporter, rate="8MiB", max_concurrent=2)
    baseline_threads = threads(exporter.process.pid)  # the probe engine's aside (harness.threads)
    size = 4 * MIB
    devices: dict[str, int] = {}
    try:
        devices = attach_plain_loops(tmp_path, 24, size)
        most_running, most_threads, slowest, seen_queued = 0, 0, 0.0, set()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            started = time.monotonic()
            samples = exporter.metrics()
            slowest = max(slowest, time.monotonic() - started)
            states = {d: state_of(samples, d) for d in devices}
            most_running = max(most_running, sum(1 for s in states.values() if s == "running"))
            seen_queued |= {d for d, s in states.items() if s == "queued"}
            most_threads = max(most_threads, threads(exporter.process.pid))
            if all(s == "done" for s in states.values()):
                break
            time.sleep(0.2)
        assert all(s == "done" for s in states.values()), f"{states}\n{exporter.log()[-4000:]}"
        assert most_running == 2 and len(seen_queued) >= 12, (most_running, len(seen_queued))
        for device, before in devices.items():  # as the kernel counts them: at least the whole volume
            assert bytes_read(device) - before >= size, device
        # The warm-ups' threads are the limit's (jobs: 2 each), not one per queued volume; 4 for the rest (the
        # new probes' workers come and go with the devices, and are at most a few at a time here).
        assert most_threads - baseline_threads <= 2 * 2 + 24 + 4, (baseline_threads, most_threads)
        assert slowest < 2.0, f"a scrape took {slowest:.2f} s while the queue drained"
    finally:
        detach(devices)
    assert exporter.stop() == 0


def bytes_read(device: str) -> int:
    """What the kernel counts read from the device so far (a loop device keeps its count across attachments)."""
    stat = Path(f"/sys/block/{device}/stat")
    return int(stat.read_text().split()[2]) * 512 if stat.exists() else 0


def attach_plain_loops(tmp_path: Path, count: int, size: int, skip: int = 10) -> dict[str, int]:
    """`count` plain loop devices over sparse files, at free numbers of discovery's range (after `skip`): each
    with what the kernel had counted read from it before."""
    free = [n for n in range(FIRST_LOOP + skip, FIRST_LOOP + 50) if not Path(f"/sys/block/loop{n}/loop").exists()]
    assert len(free) >= count, free
    devices = {}
    try:
        for number in free[:count]:
            backing = tmp_path / f"volume{number}.img"
            with open(backing, "wb") as f:
                f.truncate(size)
            before = bytes_read(f"loop{number}")
            harness.run("losetup", "--direct-io=on", f"/dev/loop{number}", str(backing))
            devices[f"loop{number}"] = before
    except BaseException:
        detach(devices)
        raise
    return devices


def detach(devices) -> None:
    for device in devices:
        harness.run("losetup", "--detach", f"/dev/{device}")


@pytest.mark.slow
def test_queued_warmups_survive_a_sigterm_and_a_kill_9(tmp_path, start_exporter):
    """Three volumes attached at once, one warmed at a time: the two queued have no checkpoint of their own yet,
    and after a restart they are volumes "there at start". Their state marks them queued, so the restarted
    exporter (policy new) still warms all three, each whole, none twice. The kill -9 comes in the first quarter
    of a fresh warm-up: what a kill -9 loses is what was read after the last checkpoint (up to 5 s of reading),
    read again after the restart; a SIGTERM loses nothing."""
    size = 8 * MIB
    exporter = start(tmp_path, start_exporter, rate="2MiB", max_concurrent=1)
    devices = attach_plain_loops(tmp_path, 3, size)

    def progress(samples, device: str) -> float:
        return sample_value(samples, "volprobe_warmup_progress_ratio", target=device) or 0.0

    try:
        for stop, most in (("kill -9", 0.25), ("SIGTERM", 0.99)):
            exporter.wait_for(
                lambda s, most=most: (
                    [progress(s, d) <= most for d in devices if state_of(s, d) == "running"] == [True]
                    and any(state_of(s, d) == "queued" for d in devices)
                    # every volume discovered first: one attached while no exporter runs is "there at start"
                    and all(state_of(s, d) in ("running", "queued", "done") for d in devices)
                ),
                timeout=20,
                what="one warm-up running, another queued, every volume discovered",
            )
            if stop == "SIGTERM":
                assert exporter.stop() == 0
            else:
                exporter.process.kill()
                exporter.process.wait(10)
            exporter = start(tmp_path, start_exporter, rate="2MiB", max_concurrent=1)
        exporter.wait_for(
            lambda s: all(state_of(s, d) == "done" for d in devices), timeout=40, what="every volume warmed"
        )
        # Whole; beyond one pass, at most the quarter a kill -9 lost, and the probes' and checks' few reads.
        for device, before in devices.items():
            read = bytes_read(device) - before
            assert size <= read < size + size // 4 + MIB, (device, read)
        assert exporter.stop() == 0
    finally:
        detach(devices)
