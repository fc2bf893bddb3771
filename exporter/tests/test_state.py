"""What volprobe remembers per volume: first touch across restarts (SIGTERM and kill -9), a state directory
that is corrupt or unwritable (issue 16, part 2), and state files that are hostile (issue 24)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import resource
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from volprobe import state, warmup
from volprobe.discovery import BlockDevice, Host
from volprobe.probe import OffsetPicker

from .support.harness import MIB, recent_probes, run, sample_value

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
            lambda s: recent_probes(s, "reads", "first") >= 100 and recent_probes(s, "writes", "first") >= 100,
            what="100 first touches",
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
            assert len(new) >= recent_probes(samples, name, "first") >= 100, f"{name} after a {stop}"
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
        samples = exporter.wait_for(lambda s: recent_probes(s, "a", "first") >= 20, what="probes")
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
        count = recent_probes(samples, "a", "first")
        exporter.wait_for(lambda s: recent_probes(s, "a", "first") > count, what="probing to go on")
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


# -- hostile state files (issue 24): set aside as corrupt, and the volume or warm-up starts afresh ---------------

# Every kind of file the state directory holds, all read by state.read_state_file: a volume's state, a warm-up's
# own checkpoint (`volprobe warmup --state FILE`), and the checkpoint file of an earlier version.
KINDS = ("volume", "checkpoint", "legacy")
CREATED = 1_700_000_000


def state_file(directory: Path, kind: str) -> Path:
    if kind == "volume":
        return directory / state.VolumeIdentity.of(LOOP).file_name()
    return directory / ("warmup.json" if kind == "checkpoint" else warmup.legacy_state_file("old"))


def warmup_identity(nblocks: int) -> warmup.Identity:
    return warmup.Identity("vol-0abc", nblocks * MIB, MIB, "read")


def valid_document(kind: str, nblocks: int = 64) -> str:
    """A state volprobe resumes (test_valid_states_of_every_kind_are_resumed), for tests to spoil one way each."""
    if kind == "volume":
        identity = state.VolumeIdentity.of(LOOP).to_json()
        sections = {"probes": {"read": {"key": 7, "next": 25, "used": 25, "gaps": [[3, 5]]}}}
        return json.dumps(
            {"version": 1, "identity": identity, "created": CREATED, "saved": CREATED, "sections": sections}
        )
    identity = warmup_identity(nblocks).to_json()
    return json.dumps({"version": 1, "identity": identity, "phase": "read", "done": [[0, 3]], "saved": CREATED})


def resume(directory: Path, kind: str, nblocks: int = 64) -> bool:
    """Start on the state file of `kind` as volprobe does, then save to it (which must work, whatever the file
    held): True if what it held was resumed, False if it was refused and the start was afresh."""
    if kind == "volume":
        volume = state.VolumeState(str(directory), state.VolumeIdentity.of(LOOP))
        found = volume.status
        cursor = state.ProbeCursor(volume, "read", key=99, reserve=10)
        assert cursor.reserve(cursor.start + 1) and volume.put("unloaded", {}), volume.problem
        assert found in ("ok", "corrupt") and (cursor.key == 7) == (found == "ok")
        return found == "ok"
    path = str(state_file(directory, kind))
    if kind == "checkpoint":
        checkpoint: warmup.Checkpoint = warmup.FileCheckpoint(path)
    else:
        volume = state.StateStore(str(directory)).volume(LOOP)
        checkpoint = state.SectionCheckpoint(volume, "warmup", warmup.FileCheckpoint(path))
    extents, phase, warning = warmup.load_state(checkpoint, warmup_identity(nblocks), nblocks)
    warmup.save_state(checkpoint, warmup_identity(nblocks), phase or "read", extents)
    assert (warning is None) == bool(phase) and (warning is None or "corrupt" in warning), warning
    return warning is None


def set_aside(directory: Path, kind: str) -> Path:
    """The one file a refused state was set aside as."""
    [aside] = directory.glob(state_file(directory, kind).name + ".corrupt-*")
    return aside


@pytest.mark.parametrize("kind", KINDS)
def test_valid_states_of_every_kind_are_resumed(tmp_path, kind):
    state_file(tmp_path, kind).write_text(valid_document(kind))
    assert resume(tmp_path, kind)
    assert not list(tmp_path.glob("*.corrupt-*"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("levels", [100_000, 40])
def test_deeply_nested_json_is_set_aside(tmp_path, kind, levels):
    """100000 levels blew the parser's recursion (a RecursionError stopped the start). 40, in a state it would
    resume otherwise, would make every later copy of the state recurse that deep, in a probe's thread."""
    if levels > 1000:
        text = "[" * levels
    else:
        document = json.loads(valid_document(kind))
        (document["sections"] if kind == "volume" else document)["deep"] = json.loads("[" * levels + "]" * levels)
        text = json.dumps(document)
    state_file(tmp_path, kind).write_text(text)
    assert not resume(tmp_path, kind)
    assert set_aside(tmp_path, kind).read_text() == text


@pytest.mark.parametrize("created", ["1e400", "-1e400", "NaN", "Infinity", "1e300", "-5", "true", '"1700000000"'])
def test_a_creation_time_that_is_no_sane_time_is_set_aside(tmp_path, created):
    """1e400 is inf: it was taken, and every later write raised OverflowError (int(created)) in its thread."""
    text = valid_document("volume").replace(f'"created": {CREATED}', f'"created": {created}')
    assert created in text
    state_file(tmp_path, "volume").write_text(text)
    assert not resume(tmp_path, "volume")  # which writes the state twice
    assert set_aside(tmp_path, "volume").read_text() == text


@pytest.mark.parametrize(
    "entry",
    [
        {"key": 7, "next": 2**70},
        {"key": 7, "next": 2**63},
        {"key": -1, "next": 5},
        {"key": 7.5, "next": 5},
        {"key": True, "next": 5},
        {"key": 7, "next": 5, "used": "4"},
        {"key": 7, "next": 5, "gaps": [[0, 1]] * 33},
        {"key": 7, "next": 5, "gaps": [[0, 1.5]]},
        {"key": 7, "next": 5, "gaps": {"0": 1}},
    ],
)
def test_a_probe_cursor_out_of_range_is_set_aside(tmp_path, entry):
    """Its key and positions are read back as ints, and written again, by the probe's thread."""
    document = json.loads(valid_document("volume"))
    document["sections"]["probes"]["read"] = entry
    state_file(tmp_path, "volume").write_text(json.dumps(document))
    assert not resume(tmp_path, "volume")
    assert set_aside(tmp_path, "volume")


def test_probe_cursors_as_every_version_wrote_them_are_resumed(tmp_path):
    """The first versions wrote only the key and the next position."""
    document = json.loads(valid_document("volume"))
    document["sections"]["probes"] = {"read": {"key": 7, "next": 25}, "write": {"key": 2**64 - 1, "next": 0}}
    state_file(tmp_path, "volume").write_text(json.dumps(document))
    assert resume(tmp_path, "volume")


@pytest.mark.parametrize("kind", KINDS)
def test_a_huge_state_file_is_refused_without_reading_it(tmp_path, kind):
    """A state it would resume, padded with 100 MiB of blanks: refused on its size, before it is read."""
    path = state_file(tmp_path, kind)
    with path.open("w") as f:
        f.write(valid_document(kind))
        for _ in range(100):
            f.write(" " * MIB)
    started = time.monotonic()
    assert not resume(tmp_path, kind)
    assert time.monotonic() - started < 2
    assert set_aside(tmp_path, kind).stat().st_size > 100 * MIB


def in_a_process_of_its_own(test: Callable[[], None], timeout: float = 10) -> None:
    """Run `test` in a forked process allowed `timeout` seconds and 1 GiB more memory than this one: a
    regression fails this test, instead of hanging the run or exhausting the machine."""

    def child() -> None:
        limit = psutil.Process().memory_info().vms + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        test()

    process = multiprocessing.get_context("fork").Process(target=child)
    started = time.monotonic()
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail(f"still running after {timeout} s")
    assert process.exitcode == 0, f"failed after {time.monotonic() - started:.1f} s (exit code {process.exitcode})"


@pytest.mark.parametrize("kind", ["checkpoint", "legacy"])
def test_a_checkpoint_claiming_too_many_blocks_above_its_mark_is_refused_fast(tmp_path, kind):
    """[[1, 10**12]] was expanded into a set of 10**12 blocks; now more than MAX_ABOVE is corrupt."""
    nblocks = 2 * 10**12
    document = json.loads(valid_document(kind, nblocks))
    state_file(tmp_path, kind).write_text(json.dumps({**document, "done": [[1, 10**12]]}))

    def refused_within_a_second() -> None:
        started = time.monotonic()
        assert not resume(tmp_path, kind, nblocks)
        assert time.monotonic() - started < 1

    in_a_process_of_its_own(refused_within_a_second)
    assert json.loads(set_aside(tmp_path, kind).read_text())["done"] == [[1, 10**12]]
    # MAX_ABOVE blocks above the mark (a worker stuck while the others went on): still a checkpoint.
    half = warmup.Extents.MAX_ABOVE // 2
    done = [[0, 10], [11, 11 + half], [12 + half, 12 + 2 * half]]
    state_file(tmp_path, kind).write_text(json.dumps({**document, "done": done}))
    assert resume(tmp_path, kind, nblocks)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fifo_named_like_the_state_file_does_not_hang_the_start(tmp_path, kind):
    """open() waited for a writer that never comes."""
    path = state_file(tmp_path, kind)
    os.mkfifo(path)
    outcome: list[bool] = []
    reader = threading.Thread(target=lambda: outcome.append(resume(tmp_path, kind)), daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "blocked on the FIFO"
    assert outcome == [False]
    assert stat.S_ISFIFO(set_aside(tmp_path, kind).lstat().st_mode), "the FIFO itself is set aside"


@pytest.mark.parametrize("kind", KINDS)
def test_a_symlink_named_like_the_state_file_is_not_followed_nor_written_through(tmp_path, kind):
    """The link leads to a state volprobe would resume: were it followed, it would be."""
    other = tmp_path / "elsewhere" / "precious.json"
    other.parent.mkdir()
    other.write_text(valid_document(kind))
    checksum = hashlib.sha256(other.read_bytes()).hexdigest()
    path = state_file(tmp_path, kind)
    path.symlink_to(other)
    assert not resume(tmp_path, kind)  # which writes the state afterwards
    aside = set_aside(tmp_path, kind)
    assert aside.is_symlink() and os.readlink(aside) == str(other), "the link itself is set aside"
    assert hashlib.sha256(other.read_bytes()).hexdigest() == checksum and other.stat().st_nlink == 1
    if kind != "legacy":  # (a legacy checkpoint's progress goes to the volume's state)
        assert path.is_file() and not path.is_symlink(), "the new state is a file of its own"


def test_write_atomically_sets_the_mode_through_its_descriptor_not_a_name(tmp_path, monkeypatch):
    """Should its temporary file's name be swapped for a link (by someone who can write the directory), the
    mode is not set on whatever the link leads to."""
    precious = tmp_path / "precious"
    precious.write_text("keep")
    precious.chmod(0o600)
    mkstemp = tempfile.mkstemp

    def swapped(*args, **kwargs):
        fd, name = mkstemp(*args, **kwargs)
        os.unlink(name)
        os.symlink(precious, name)
        return fd, name

    monkeypatch.setattr(state.tempfile, "mkstemp", swapped)
    state.write_atomically(str(tmp_path / "report.txt"), "report", mode=0o644)
    assert stat.S_IMODE(precious.stat().st_mode) == 0o600 and precious.read_text() == "keep"
