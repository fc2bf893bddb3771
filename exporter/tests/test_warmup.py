"""Warm-up: every block read once, resumable after kill -9, rate-limited, safe; checked block by block."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest

from volprobe import safety, warmup

from .support.harness import MIB, run, sample_value, volprobe_command, write_config


def test_extents_track_a_low_water_mark_and_the_blocks_above_it():
    extents = warmup.Extents(10)
    for block in (0, 1, 3, 4, 7):
        extents.add(block)
    assert extents.mark == 2 and extents.above == {3, 4, 7}
    assert extents.to_list() == [[0, 2], [3, 5], [7, 8]]
    assert list(extents.pending()) == [2, 5, 6, 8, 9]
    extents.add(2)
    assert extents.mark == 5 and extents.above == {7}
    again = warmup.Extents.from_list(10, extents.to_list())
    assert again.to_list() == extents.to_list() and len(again) == 6


IDENTITY = warmup.Identity("vol-0abc", 64 * MIB, MIB, "read")


def test_state_round_trip(tmp_path):
    path = str(tmp_path / "state.json")
    extents = warmup.Extents(64)
    for block in (*range(10), 12):
        extents.add(block)
    warmup.save_state(path, IDENTITY, "read", extents)
    loaded, phase, warning = warmup.load_state(path, IDENTITY, 64)
    assert warning is None and phase == "read" and loaded.to_list() == [[0, 10], [12, 13]]


@pytest.mark.parametrize(
    ("content", "word"),
    [
        ("{not json", "corrupt"),
        (
            json.dumps(
                {
                    "version": 1,
                    "identity": {**IDENTITY.to_json(), "device": "vol-other"},
                    "phase": "read",
                    "done": [[0, 3]],
                }
            ),
            "belongs to",
        ),
        (
            json.dumps(
                {"version": 1, "identity": {**IDENTITY.to_json(), "size": 32 * MIB}, "phase": "read", "done": [[0, 3]]}
            ),
            "belongs to",
        ),
        (json.dumps({"version": 1, "identity": IDENTITY.to_json(), "phase": "read", "done": [[0, 999]]}), "corrupt"),
        (json.dumps({"version": 1, "identity": IDENTITY.to_json(), "phase": "read", "done": "all"}), "corrupt"),
        (json.dumps(["something", "else"]), "not a volprobe"),
    ],
    ids=["garbage", "other device", "other size", "out of range", "bad extents", "foreign file"],
)
def test_corrupt_or_foreign_state_starts_over_with_a_warning(tmp_path, content, word):
    path = tmp_path / "state.json"
    path.write_text(content)
    extents, phase, warning = warmup.load_state(str(path), IDENTITY, 64)
    assert len(extents) == 0 and phase == "" and word in warning


def test_rate_limiter_holds_the_rate():
    import threading

    limiter = warmup.RateLimiter(8 * MIB)
    stop = threading.Event()
    start = time.monotonic()
    for _ in range(16):
        limiter.take(MIB, stop)
    elapsed = time.monotonic() - start
    assert 1.8 <= elapsed <= 2.3  # the 16th MiB may start at 15/8 s, less the 0.05 s burst


@pytest.mark.root
def test_warmup_cli_reads_every_block(lab_volume, tmp_path):
    volume = lab_volume(size=32 * MIB, read_latency=0.0005)
    result = subprocess.run(
        volprobe_command("warmup", volume.device, "--jobs", "4", "-q"), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "warm: 32MiB" in result.stdout
    coverage = volume.read_coverage()
    assert all(count >= 64 * 1024 for count in coverage), "every 64 KiB of the device was read"


@pytest.mark.root
def test_warmup_resumes_after_kill_9_with_no_gap_and_one_interval_reread(lab_volume, tmp_path):
    rate, interval, jobs, block = 16 * MIB, 1.0, 4, MIB
    volume = lab_volume(size=96 * MIB, read_latency=0.0005)
    state = tmp_path / "warmup.json"
    args = [
        "warmup",
        volume.device,
        "--rate",
        "16MiB",
        "--jobs",
        str(jobs),
        "--block-size",
        "1MiB",
        "--state",
        str(state),
        "--checkpoint-interval",
        "1s",
        "-q",
    ]
    first = subprocess.Popen(volprobe_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def done_so_far() -> int:
        """Bytes done by the last checkpoint (written atomically), 0 before the first."""
        try:
            saved = json.loads(state.read_text())
        except FileNotFoundError:
            return 0
        return sum(end - start for start, end in saved["done"]) * block

    # Killed once a checkpoint holds some of the work, as soon as it shows: at 16 MiB/s the 96 MiB take 6 s, and
    # the first checkpoint comes 1 s into them. Not after a fixed time: with a core kept busy, 3.5 s after the start
    # there was no checkpoint yet (the interpreter's start and imports are CPU work).
    deadline = time.monotonic() + 60
    while done_so_far() == 0 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    done_before = done_so_far()
    assert 0 < done_before < 96 * MIB
    second = subprocess.run(volprobe_command(*args), capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "resumed at" in second.stdout
    assert json.loads(state.read_text())["phase"] == "done"
    coverage = volume.read_coverage()
    unit = 64 * 1024
    assert all(count >= unit for count in coverage), "no gaps: every block read at least once"
    reread = sum(count - unit for count in coverage if count > unit)
    # What was read twice: at most one checkpoint interval's worth, plus the requests in flight at the kill.
    assert reread <= rate * interval + jobs * block, reread
    # And a finished job is not redone.
    third = subprocess.run(volprobe_command(*args), capture_output=True, text=True, timeout=60)
    assert third.returncode == 0 and volume.read_coverage() == coverage


@pytest.mark.root
def test_write_mode_is_refused_on_a_device_with_a_filesystem(make_loop):
    loop = make_loop(32 * MIB)
    run("mkfs.ext4", "-q", "-F", loop)
    result = subprocess.run(volprobe_command("warmup", loop, "--write", "-q"), capture_output=True, text=True)
    assert result.returncode == 2 and "refusing raw writes" in result.stderr and "ext4" in result.stderr


@pytest.mark.root
def test_write_mode_allocates_a_lazy_volume_then_reads_it(lab_volume):
    volume = lab_volume(size=32 * MIB, alloc_unit=MIB, lazy=True, first_write_latency=0.005)
    # The first and last MiB hold bytes of their own (no signature among them): a write warm-up never writes
    # there, as raw write probes never do, so they must come out exactly as they went in.
    guard = random.Random(7).randbytes(MIB)
    assert safety.scan_signatures(guard, guard, 32 * MIB) == []
    fd = os.open(volume.device, os.O_WRONLY)
    try:
        os.pwrite(fd, guard, 0)
        os.pwrite(fd, guard, 31 * MIB)
        os.fsync(fd)
    finally:
        os.close(fd)
    result = subprocess.run(
        volprobe_command("warmup", volume.device, "--write", "-q"), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert volume.fresh_stats()["allocated_ratio"] == 1.0  # the 30 MiB between, written by the warm-up
    assert all(count >= 64 * 1024 for count in volume.read_coverage())
    with open(volume.device, "rb") as f:
        assert f.read(MIB) == guard
        f.seek(31 * MIB)
        assert f.read(MIB) == guard


@pytest.mark.root
def test_write_warmup_and_write_probes_on_one_device_are_refused_naming_the_key(tmp_path, make_loop):
    loop = make_loop(32 * MIB)
    config = write_config(
        tmp_path,
        f"targets: [{{device: {loop}, allow_raw_writes: true, probes: [{{op: write}}], warmup: {{mode: write}}}}]\n",
    )
    result = subprocess.run(volprobe_command("check-config", config), capture_output=True, text=True)
    assert result.returncode == 2 and "targets[0].warmup.mode" in result.stderr, result.stderr


@pytest.mark.root
def test_resident_warmup_exports_progress_to_done(tmp_path, lab_volume, start_exporter):
    volume = lab_volume(size=32 * MIB, read_latency=0.0005)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    config = tmp_path / "volprobe.yml"
    config.write_text(f"""
state_directory: {state_dir}
targets:
  - name: restored
    device: {volume.device}
    warmup: {{mode: read, rate: 8MiB, jobs: 2}}
""")
    exporter = start_exporter("--config", str(config))
    samples = exporter.wait_for(
        lambda s: (
            0 < (sample_value(s, "volprobe_warmup_progress_ratio", target="restored") or 0) < 0.9
            and sample_value(s, "volprobe_warmup_eta_seconds", target="restored") is not None
        ),
        what="warm-up under way, with an ETA",
    )
    assert sample_value(samples, "volprobe_warmup_state", target="restored", state="running") == 1
    assert sample_value(samples, "volprobe_warmup_size_bytes", target="restored") == 32 * MIB
    assert sample_value(samples, "volprobe_warmup_eta_seconds", target="restored") > 0
    samples = exporter.wait_for(
        lambda s: sample_value(s, "volprobe_warmup_state", target="restored", state="done") == 1,
        timeout=30,
        what="warm-up done",
    )
    assert sample_value(samples, "volprobe_warmup_done_bytes", target="restored") == 32 * MIB
    # The checkpoint is the warm-up section of the volume's state, keyed by the volume (a loop device has no
    # serial: the file it shows), not by the target's name.
    (state,) = state_dir.glob("volume-backing_file_*.json")
    assert json.loads(state.read_text())["identity"]["key"] == f"backing_file:{volume.backing}"
    assert json.loads(state.read_text())["sections"]["warmup"]["phase"] == "done"
    assert exporter.stop() == 0
    assert json.loads(state.read_text())["sections"]["warmup"]["phase"] == "done"


@pytest.mark.root
def test_a_checkpoint_of_an_earlier_version_is_carried_over(tmp_path, lab_volume, start_exporter):
    volume = lab_volume(size=16 * MIB)
    loop = volume.device
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    # Half done, as an earlier version left it: a file named after the target.
    identity = warmup.Identity(os.path.realpath(loop), 16 * MIB, MIB, "read")
    half = warmup.Extents(16)
    half.mark = 8
    warmup.save_state(str(state_dir / "warmup-old.json"), identity, "read", half)
    config = tmp_path / "volprobe.yml"
    config.write_text(
        f"state_directory: {state_dir}\n"
        f"targets: [{{name: old, device: {loop}, probes: [{{op: read, interval: 2m}}], warmup: {{jobs: 1}}}}]\n"
    )
    before = volume.read_coverage()
    exporter = start_exporter("--config", str(config))
    samples = exporter.wait_for(
        lambda s: sample_value(s, "volprobe_warmup_state", target="old", state="done") == 1, what="warm-up done"
    )
    assert sample_value(samples, "volprobe_warmup_done_bytes", target="old") == 16 * MIB
    read = [after - earlier for after, earlier in zip(volume.read_coverage(), before, strict=True)]
    half = len(read) // 2
    # The second half was read whole, the first (done before the upgrade) not again: one 4 KiB probe at most.
    assert all(count >= 64 * 1024 for count in read[half:]) and sum(read[:half]) <= 4096
    assert not (state_dir / "warmup-old.json").exists() and (state_dir / "warmup-old.json.migrated").exists()
    (path,) = state_dir.glob("volume-backing_file_*.json")
    state = json.loads(path.read_text())
    assert state["sections"]["warmup"]["phase"] == "done"
    assert exporter.stop() == 0
