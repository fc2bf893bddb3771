"""What volprobe remembers per volume: first touch across restarts (SIGTERM and kill -9), and a state directory
that is corrupt or unwritable (issue 16, part 2)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from volprobe import state
from volprobe.discovery import BlockDevice, Host
from volprobe.probe import OffsetPicker

from .harness import MIB, run, sample_value

LOOP = BlockDevice("loop3", 7, 3, "loop", "/dev/loop3", 64 * MIB, 512, 512)
EBS = BlockDevice("nvme1n1", 259, 0, "disk", "/dev/nvme1n1", 64 * MIB, 512, 512, serial="vol0abc", volume_id="vol-0abc")


def test_identity_prefers_the_most_stable_key():
    assert state.VolumeIdentity.of(EBS) == state.VolumeIdentity("volume_id:vol-0abc", "volume_id", 64 * MIB)
    loop = state.VolumeIdentity.of(LOOP)
    assert loop.key == f"name:loop3:{64 * MIB}" and not loop.stable
    image = state.VolumeIdentity.of(replace(LOOP, backing_file="/srv/images/db.img"))
    assert image.key == "backing_file:/srv/images/db.img" and image.stable


def test_fresh_offsets_resume_after_a_clean_stop_and_skip_a_reservation_after_a_crash(tmp_path):
    store = state.StateStore(str(tmp_path))
    cursor = state.ProbeCursor(store.volume(LOOP), "read:device:4096:0-1", key=7, reserve=10)
    picker = OffsetPicker(1000, revisit=0.0, rng=random.Random(1), cursor=cursor)
    first_run = [picker.next()[0] for _ in range(25)]
    picker.close()  # a clean stop: 25 used, whatever was reserved or picked ahead
    saved = json.loads((tmp_path / state.VolumeIdentity.of(LOOP).file_name()).read_text())
    assert saved["sections"]["probes"]["read:device:4096:0-1"] == {"key": 7, "next": 25, "used": 25, "gaps": []}

    crashed = state.ProbeCursor(state.StateStore(str(tmp_path)).volume(LOOP), "read:device:4096:0-1", 99, 10)
    assert (crashed.key, crashed.start, crashed.resumed) == (7, 25, True)  # the saved key, not the new one
    picker = OffsetPicker(1000, revisit=0.0, rng=random.Random(2), cursor=crashed)
    second_run = [picker.next()[0] for _ in range(3)]
    assert not set(first_run) & set(second_run)
    # No close(): a kill -9. The next start skips the rest of the reservation, never reuses a handed-out one.
    after_crash = state.ProbeCursor(state.StateStore(str(tmp_path)).volume(LOOP), "read:device:4096:0-1", 5, 10)
    assert after_crash.start >= 25 + 32  # a whole batch of 32 was picked, so reserved, ahead
    # Revisits skip the run reserved but (mostly) never used before the crash.
    [(gap_start, gap_end)] = after_crash.gaps
    assert 25 <= gap_start < gap_end == after_crash.start
    picker = OffsetPicker(1000, revisit=1.0, rng=random.Random(3), cursor=after_crash)
    never_used = {picker.permutation(i) for i in range(gap_start, gap_end)}
    revisits = [picker.next() for _ in range(500)]
    assert {touch for _, touch in revisits} == {"repeat"} and not {b for b, _ in revisits} & never_used


def test_a_corrupt_or_foreign_state_is_set_aside_not_overwritten(tmp_path):
    path = tmp_path / state.VolumeIdentity.of(LOOP).file_name()
    path.write_text("{not json")
    volume = state.VolumeState(str(tmp_path), state.VolumeIdentity.of(LOOP))
    assert volume.status == "corrupt" and not path.exists()
    [aside] = tmp_path.glob(path.name + ".corrupt-*")
    assert aside.read_text() == "{not json"
    assert volume.put("probes", {}) and volume.status == "corrupt", "what start-up found stays until a restart"
    foreign = json.loads(path.read_text())
    foreign["identity"]["size"] = 1
    path.write_text(json.dumps(foreign))
    assert state.VolumeState(str(tmp_path), state.VolumeIdentity.of(LOOP)).status == "foreign"
    assert list(tmp_path.glob(path.name + ".foreign-*"))


def test_set_aside_files_never_replace_one_another(tmp_path):
    """Three corrupt states found within a second (or after the clock stepped back) are all kept."""
    path = tmp_path / state.VolumeIdentity.of(LOOP).file_name()
    for n in range(3):
        path.write_text(f"{{corrupt {n}")
        assert state.VolumeState(str(tmp_path), state.VolumeIdentity.of(LOOP)).status == "corrupt"
    kept = sorted(p.read_text() for p in tmp_path.glob(path.name + ".corrupt-*"))
    assert kept == ["{corrupt 0", "{corrupt 1", "{corrupt 2"]


def test_an_unwritable_state_directory_keeps_the_run_going_with_the_same_key(tmp_path):
    missing = str(tmp_path / "gone")  # cannot be written: as a read-only or full filesystem
    cursor = state.ProbeCursor(state.StateStore(missing).volume(LOOP), "read", key=7, reserve=10)
    picker = OffsetPicker(1000, revisit=0.0, rng=random.Random(1), cursor=cursor)
    picked = [picker.next()[0] for _ in range(50)]
    assert cursor.volume.status == "unwritable" and cursor.reserved == 0
    # The same permutation, position after position: no block of this run is handed out as fresh twice.
    assert picked == [picker.permutation(i) for i in range(50)] and len(set(picked)) == 50


def test_partitions_of_one_disk_have_states_of_their_own():
    disk = EBS
    part = BlockDevice(
        "nvme1n1p2",
        259,
        2,
        "part",
        "/dev/nvme1n1p2",
        MIB,
        512,
        512,
        parent="nvme1n1",
        serial="vol0abc",
        volume_id="vol-0abc",
    )
    assert state.VolumeIdentity.of(part).key == "volume_id:vol-0abc:part2"
    assert state.VolumeIdentity.of(part).key != state.VolumeIdentity.of(disk).key


# -- end to end, on lab volumes that trace every request ------------------------------------------------------


def blocks(volume, op: str, block_size: int, since: int = 0) -> set[int]:
    return {offset // block_size for kind, offset, _ in volume.requests()[since:] if kind == op}


def first_count(samples, target: str) -> float:
    return sum(
        v
        for labels, v in samples.get("volprobe_probe_latency_recent_seconds_count", [])
        if labels["target"] == target and labels["touch"] == "first"
    )


@pytest.mark.root
@pytest.mark.lab
@pytest.mark.slow
def test_first_touch_is_first_on_the_volume_across_sigterm_and_kill_9(tmp_path, lab_volume, start_exporter):
    reads = lab_volume(size=4 * MIB, trace=True)  # 1024 blocks of 4 KiB
    writes = lab_volume(size=6 * MIB, trace=True)  # 1024 blocks of 4 KiB between the guard MiBs
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    config = tmp_path / "volprobe.yml"
    config.write_text(f"""
state_directory: {state_dir}
defaults: {{window: 1m}}
targets:
  - {{name: reads, device: {reads.device}, probes: [{{op: read, interval: 10ms}}]}}
  - name: writes
    device: {writes.device}
    allow_raw_writes: true
    probes: [{{op: write, block_size: 4KiB, interval: 10ms, sync: false}}]
""")
    checks = [("reads", reads, "r"), ("writes", writes, "w")]
    for stop in ("SIGTERM", "SIGKILL", "SIGTERM"):
        before = {name: blocks(volume, op, 4096) for name, volume, op in checks}
        marks = {name: len(volume.requests()) for name, volume, _ in checks}
        exporter = start_exporter("--config", str(config))
        samples = exporter.wait_for(
            lambda s: first_count(s, "reads") >= 100 and first_count(s, "writes") >= 100, what="100 first touches"
        )
        if stop == "SIGKILL":
            exporter.process.send_signal(signal.SIGKILL)
            exporter.process.wait(10)
        else:
            assert exporter.stop() == 0
        for name, volume, op in checks:
            new = blocks(volume, op, 4096, marks[name]) - before[name]
            # Every first-touch probe of this run hit a block no earlier run touched (more new blocks than
            # counted firsts: the scrape lags the trace, and after a kill -9 a repeat may land on a block whose
            # reservation was skipped).
            assert len(new) >= first_count(samples, name) >= 100, f"{name} after a {stop}"
        assert sample_value(samples, "volprobe_state_status", status="ok", device=os.path.basename(reads.device)) == 1
    saved = list(state_dir.glob("volume-*.json"))
    assert len(saved) == 2


@pytest.mark.root
def test_a_corrupt_then_unwritable_state_directory_leaves_the_exporter_serving(tmp_path, make_loop, start_exporter):
    loop = make_loop(16 * MIB)
    name = os.path.basename(loop)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=1m", "volprobe-test-state", str(state_dir))
    try:
        corrupt = state_dir / state.VolumeIdentity.of(Host().device(name)).file_name()
        corrupt.write_text("\x00garbage")
        config = tmp_path / "volprobe.yml"
        probes = "[{op: read, interval: 10ms}]"
        config.write_text(f"state_directory: {state_dir}\ntargets: [{{name: a, device: {loop}, probes: {probes}}}]\n")
        exporter = start_exporter("--config", str(config))
        samples = exporter.wait_for(lambda s: first_count(s, "a") >= 20, what="probes")
        assert "unreadable or corrupt" in exporter.log() and "moved to" in exporter.log()
        assert list(Path(state_dir).glob(corrupt.name + ".corrupt-*")), "the corrupt file is kept for a human"
        assert sample_value(samples, "volprobe_state_status", device=name, status="corrupt") == 1
        # The state directory's filesystem goes read-only under the running exporter.
        run("mount", "-o", "remount,ro", str(state_dir))
        samples = exporter.wait_for(
            lambda s: sample_value(s, "volprobe_state_status", device=name, status="unwritable") == 1,
            timeout=30,
            what="the state to be reported unwritable",
        )
        count = first_count(samples, "a")
        time.sleep(1)
        assert first_count(exporter.metrics(), "a") > count, "probing goes on"
        # Offsets are picked a batch (here 5 s of probes) ahead: the warning comes with the next batch.
        exporter.wait_for(
            lambda _: "fresh offsets cannot be reserved in the state directory" in exporter.log(),
            timeout=20,
            what="the warning that fresh offsets cannot be reserved",
        )
        assert exporter.stop() == 0
    finally:
        run("umount", str(state_dir))


def test_a_loop_state_of_an_earlier_version_is_carried_over_to_its_backing_file(tmp_path):
    """Loop devices were keyed on name and size; now on the file they show. The old file's sections carry
    over (probe cursors, warm-up), and the old file is kept as `.migrated-TIME`, never lost; a file that is
    not a state of that identity is left alone."""
    old = state.StateStore(str(tmp_path)).volume(LOOP)
    old.put("probes", {"read:device:4096:0-1": {"key": 7, "next": 25, "used": 25, "gaps": []}})
    earlier = tmp_path / state.VolumeIdentity.of(LOOP).file_name()
    image = replace(LOOP, backing_file="/srv/images/db.img")
    volume = state.StateStore(str(tmp_path)).volume(image)
    assert volume.status == "ok"
    assert volume.get("probes")["read:device:4096:0-1"]["next"] == 25
    assert not earlier.exists() and len(list(tmp_path.glob(earlier.name + ".migrated-*"))) == 1
    saved = json.loads((tmp_path / state.VolumeIdentity.of(image).file_name()).read_text())
    assert saved["identity"]["key"] == "backing_file:/srv/images/db.img"
    assert saved["sections"]["probes"]["read:device:4096:0-1"]["next"] == 25
    # Not a state at all (a list): left where it is, and the volume starts afresh.
    (tmp_path / state.VolumeIdentity.of(replace(LOOP, name="loop4")).file_name()).write_text("[]")
    other = replace(LOOP, name="loop4", backing_file="/srv/images/other.img")
    assert state.StateStore(str(tmp_path)).volume(other).status == "new"
