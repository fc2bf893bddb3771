"""The filesystem's own operations (issue 27): commit probes (a buffered write and fdatasync at the end of a log of
their own) and metadata probes (create, write, fsync, rename, fsync the directory, unlink in a directory of their
own), on a real ext4; what a hostile directory owner swaps under them; a kill -9 and a restart; a reload."""

from __future__ import annotations

import array
import itertools
import mmap
import os
import random
import shutil
import signal
import struct
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest

from volprobe import metadata, ops, probefile, targets, timer
from volprobe.config import PROBE_FILE_NAME, ConfigError, ProbeConfig, parse
from volprobe.probe import NoOffsets, ProbeIO, SequentialPicker
from volprobe.safety import Refused

from .support.attacks import SWAPS as PROBE_FILE_SWAPS
from .support.attacks import prepared, swap_directory_for_a_symlink, swap_directory_for_another
from .support.harness import MIB, probes_done, sample_value, sha256_of, volprobe_command, write_config

COMMIT_LOG, META = ops.COMMIT.file, ops.METADATA.file
ATTACKER = 1000  # the uid owning the target directory, as etcd's user owns /var/lib/etcd


# -- pure ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("probe", "key", "message"),
    [
        ({"op": "commit"}, "targets[0].probes[0].op", "commit probes need a directory target"),
        ({"op": "metadata"}, "targets[0].probes[0].op", "metadata probes need a directory target"),
    ],
)
def test_commit_and_metadata_probes_of_a_device_are_rejected_by_key(probe, key, message):
    with pytest.raises(ConfigError) as err:
        parse({"targets": [{"device": "/dev/vdz", "allow_raw_writes": True, "probes": [probe]}]})
    assert any(p.startswith(f"{key}: {message}") for p in err.value.problems), err.value.problems


def test_commit_and_metadata_probes_always_sync_and_are_never_discovered():
    with pytest.raises(ConfigError) as err:
        parse(
            {
                "targets": [{"directory": "/srv", "probes": [{"op": "commit", "sync": False}]}],
                "discovery": {"probes": [{"op": "metadata"}]},
            }
        )
    assert "targets[0].probes[0].sync: commit probes always sync (fdatasync, fsync): that is what they time" in (
        err.value.problems
    )
    assert "discovery.probes[0].op: discovered devices are only ever probed with reads" in err.value.problems


def test_a_config_of_a_commit_probe_on_a_device_exits_2_naming_the_key(tmp_path):
    config = write_config(tmp_path, "targets: [{device: /dev/null, probes: [{op: commit}]}]\n")
    result = subprocess.run([*volprobe_command("--config", config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "targets[0].probes[0].op: commit probes need a directory target" in result.stderr


def test_the_defaults_are_unchanged_and_the_new_ops_are_opt_in():
    config = parse({"targets": [{"directory": "/srv"}]})
    assert [p.op for p in config.targets[0].probes] == ["write", "read"]
    commit, meta = ProbeConfig("commit"), ProbeConfig("metadata")
    assert (commit.block_size, meta.block_size) == (2300, 4096)  # etcd's WAL record; a page
    assert commit.sync and meta.sync
    assert not commit.open_flags & (os.O_DIRECT | os.O_DSYNC), "a commit is buffered, synced by fdatasync"


def test_the_commit_log_is_sequential_and_wraps_and_resumes_where_it_stopped():
    class Cursor:
        key, start, gaps = 0, 5, []

        def reserve(self, needed: int) -> bool:
            return True

        def release(self, used: int) -> None:
            self.released = used

    picker = SequentialPicker(4, random.Random(1))
    assert [picker.next() for _ in range(6)] == [
        *((block, "first") for block in range(4)),
        (0, "repeat"),
        (1, "repeat"),
    ]
    cursor = Cursor()
    resumed = SequentialPicker(4, random.Random(1), cursor)
    assert resumed.next() == (1, "repeat")  # position 5 of a 4-block log
    resumed.close()
    assert cursor.released == 6  # the other 31 of the batch of 32 were picked but never handed out
    assert NoOffsets().next() == (0, "first")


def test_a_commit_record_is_stamped_in_every_sector_it_holds_whole():
    import mmap

    buffer = mmap.mmap(-1, 2300)
    data = timer.WriteData(buffer)
    data.stamp()
    stamp = struct.pack("<Q", data.counter)
    assert [bytes(buffer[at : at + 8]) for at in range(0, 2300 - 8, 512)] == [stamp] * 5


# -- on a real ext4 -----------------------------------------------------------------------------------------------


@pytest.fixture
def ext4(tmp_path, make_loop, mount_fs) -> Path:
    """A target directory owned by someone else on a fresh ext4 of a loop device."""
    data = Path(mount_fs(make_loop(64 * MIB))) / "etcd"
    data.mkdir()
    os.chown(data, ATTACKER, ATTACKER)
    return data


@pytest.mark.root
def test_the_commit_log_is_written_sequentially_and_wraps_on_ext4(tmp_path, ext4):
    records = 7
    size = probefile.HEADER_BYTES + records * 2300 + 100  # room for 7 records; the rest of the file is never touched
    host, resolved = prepared(tmp_path, ext4, "[{op: commit}]", str(size))
    try:
        target = resolved[0]
        io = targets.io_target(host, target, target.probes[0])
        probe = ProbeIO(target.probes[0], io, random.Random(3), target.fds.pop("commit"))
        header = (ext4 / COMMIT_LOG).read_bytes()[: probefile.HEADER_BYTES]
        # Preallocated whole before the first commit (a sparse log would hold the header's blocks alone).
        assert (ext4 / COMMIT_LOG).stat().st_blocks * 512 >= size
        outcomes = [probe.once() for _ in range(records + 3)]
        assert all(not o.error for o in outcomes), outcomes
        starts = [probefile.HEADER_BYTES + 2300 * (k % records) for k in range(records + 3)]
        assert [o.offset for o in outcomes] == starts
        assert [o.touch for o in outcomes] == ["first"] * records + ["repeat"] * 3
        content = (ext4 / COMMIT_LOG).read_bytes()
        assert len(content) == size and content[: probefile.HEADER_BYTES] == header
        # Each record carries its write's stamp: the log's records hold consecutive counters, the first three
        # rewritten by the last three writes after the wrap.
        stamps = [struct.unpack("<Q", content[at : at + 8])[0] for at in starts[:records]]
        assert [b - a for a, b in itertools.pairwise(stamps[3:])] == [1] * (records - 4)
        assert stamps[0] == stamps[records - 1] + 1 and stamps[:3] == [stamps[0], stamps[0] + 1, stamps[0] + 2]
        assert content[probefile.HEADER_BYTES + records * 2300 :] == b"\0" * 100  # preallocated, never written
        probe.close()
    finally:
        targets.close(resolved)


@pytest.mark.root
def test_commit_and_metadata_probes_count_up_on_ext4_and_metadata_leaves_nothing(tmp_path, ext4, start_exporter):
    config = write_config(
        tmp_path,
        f"targets: [{{name: etcd, directory: {ext4}, probe_file_size: 4MiB, "
        f"probes: [{{op: commit, interval: 20ms}}, {{op: metadata, interval: 20ms}}]}}]\n",
    )
    exporter = start_exporter("--config", config)
    samples = exporter.wait_for(
        lambda s: probes_done(s, "etcd", "commit") >= 20 and probes_done(s, "etcd", "metadata") >= 100,
        what="commit and metadata probes",
    )
    info = {labels["op"]: labels for labels, _ in samples["volprobe_probe_info"]}
    assert info["commit"]["source"] == "commit_log" and info["commit"]["block_size_bytes"] == "2300"
    assert info["metadata"]["source"] == "metadata_directory" and info["metadata"]["sync"] == "true"
    assert sum(v for labels, v in samples["volprobe_probe_failures_total"]) == 0
    assert exporter.stop() == 0
    # The steps cover the whole sequence: their sum is the latency's, but for what lies between the timer's clock
    # reads and the steps' (a preemption, on a loaded machine). One scrape's steps and histogram hold the same
    # sequences, so the steps never exceed the latency (but for the float sum's last bits).
    steps = {labels["step"]: v for labels, v in samples["volprobe_probe_metadata_step_seconds_total"]}
    assert list(steps) == list(ops.METADATA.steps)
    total = sample_value(samples, "volprobe_probe_latency_seconds_sum", target="etcd", op="metadata")
    assert total is not None and 0.8 * total <= sum(steps.values()) <= total * (1 + 1e-9)
    assert steps["fsync"] > 0 and steps["fsync_dir"] > 0
    assert sorted(os.listdir(ext4)) == [COMMIT_LOG, metadata.NAME]  # no probe file without a write probe
    assert os.listdir(ext4 / metadata.NAME) == [metadata.ID_NAME]
    assert (ext4 / metadata.NAME).stat().st_mode & 0o777 == 0o700


@pytest.mark.root
def test_ping_times_commits_and_metadata_sequences(ext4):
    for op, where in (("commit", "commit log"), ("metadata", "metadata directory")):
        result = subprocess.run(
            volprobe_command("ping", "--op", op, "-c", "3", "-i", "10ms", "--probe-file-size", "1MiB", str(ext4)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"({where}" in result.stdout and "3 requests completed" in result.stdout, result.stdout
    result = subprocess.run(volprobe_command("ping", "--op", "commit", "/dev/null"), capture_output=True, text=True)
    assert result.returncode == 2 and "needs a directory" in result.stderr


@pytest.mark.parametrize("kind", ["c", "python"])
def test_a_timers_metadata_steps_are_those_of_the_results_it_has_handed_over(tmp_path, monkeypatch, kind):
    """A scrape reads the histogram (what take() returned) and the step counters: sequences that end in between
    are in neither, so the steps never exceed the latencies (one CI run saw the stacked steps 11% over the mean)."""
    if kind == "python":
        monkeypatch.setattr(timer, "_timedio", None)
    elif timer._timedio is None:
        pytest.skip("the C timer is not built")
    buffer = mmap.mmap(-1, 4096)
    loop = timer.new(str(tmp_path), 0, buffer, array.array("q", [0]), ops.METADATA, 0.0, 1)
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        loop.schedule(time.perf_counter_ns(), 1_000_000)
        assert loop.run(array.array("q", [0] * 5), directory)[0] == 5
        assert loop.steps == (0,) * len(ops.METADATA.steps)  # nothing handed over yet
        latencies = [latency for _, latency, _, _ in loop.take()]
        assert len(latencies) == 5
        handed_over = loop.steps
        assert 0 < sum(handed_over) <= sum(latencies)
        assert loop.run(array.array("q", [0] * 3), directory)[0] == 3
        assert loop.steps == handed_over  # the 3 new sequences are not taken yet
        latencies += [latency for _, latency, _, _ in loop.take()]
        assert all(after > before for before, after in zip(handed_over, loop.steps, strict=True))
        assert sum(loop.steps) <= sum(latencies)
    finally:
        os.close(directory)
    assert os.listdir(tmp_path) == []  # each sequence unlinks what it made


# -- hostile names ------------------------------------------------------------------------------------------------


def _metadata_symlink(data: Path, victim: Path) -> None:
    shutil.rmtree(data / metadata.NAME)
    os.symlink(victim.parent, data / metadata.NAME)


def _metadata_another_directory(data: Path, victim: Path) -> None:
    shutil.rmtree(data / metadata.NAME)
    os.mkdir(data / metadata.NAME, 0o700)  # ours in every way (its inode number too, as ext4 reuses it) but its id


def _metadata_open_to_others(data: Path, victim: Path) -> None:
    os.chmod(data / metadata.NAME, 0o777)


def _metadata_foreign(data: Path, victim: Path) -> None:
    os.chown(data / metadata.NAME, ATTACKER, ATTACKER)


# The probe file's attacks (test_hostile_files.py) on the commit log, and on the metadata directory the ones
# that apply to a directory, then a directory's own.
SWAPS = {
    **{f"commit log: {title}": ("commit", partial(swap, name=COMMIT_LOG)) for title, swap in PROBE_FILE_SWAPS.items()},
    "metadata: directory swapped for a symlink": ("metadata", partial(swap_directory_for_a_symlink, name=META)),
    "metadata: directory swapped for another": ("metadata", partial(swap_directory_for_another, name=META)),
    "metadata: symlink to another directory": ("metadata", _metadata_symlink),
    "metadata: another directory": ("metadata", _metadata_another_directory),
    "metadata: writable by others": ("metadata", _metadata_open_to_others),
    "metadata: someone else's": ("metadata", _metadata_foreign),
}


@pytest.mark.root
@pytest.mark.parametrize("swap", SWAPS, ids=list(SWAPS))
def test_a_swap_of_the_commit_log_or_metadata_directory_is_refused_at_reopen(tmp_path, ext4, swap):
    """What a reopen (after EROFS, ENOENT...) meets when the names changed while volprobe had let go. The victim
    is a directory of someone else's with a file under the metadata sequence's own name."""
    victims = ext4.parent / "victims"
    victims.mkdir()
    victim = victims / timer.METADATA_RENAMED
    victim.write_bytes(os.urandom(MIB))
    before = sha256_of(str(victim))
    host, resolved = prepared(tmp_path, ext4, "[{op: commit}, {op: metadata}]")
    try:
        target = resolved[0]
        op, attack = SWAPS[swap]
        io = targets.io_target(host, target, next(p for p in target.probes if p.op == op))
        for fd in target.fds.values():
            os.close(fd)
        target.fds.clear()
        os.close(io.open())  # what was checked at start: accepted
        io.let_go()
        attack(ext4, victim)
        with pytest.raises(Refused):
            os.close(io.open())
        assert sha256_of(str(victim)) == before
        assert sorted(os.listdir(victims)) == [timer.METADATA_RENAMED]
    finally:
        targets.close(resolved)


@pytest.mark.root
def test_a_hard_link_to_the_held_commit_log_stops_its_writes(tmp_path, ext4):
    host, resolved = prepared(tmp_path, ext4, "[{op: commit}]")
    try:
        io = targets.io_target(host, resolved[0], resolved[0].probes[0])
        fd = resolved[0].fds.pop("commit")
        try:
            io.verify(fd)
            os.link(ext4 / COMMIT_LOG, ext4 / "grab")
            with pytest.raises(Refused, match="2 links"):
                io.verify(fd)
        finally:
            os.close(fd)
    finally:
        targets.close(resolved)


# -- the paths production takes -----------------------------------------------------------------------------------


@pytest.mark.root
def test_a_kill_9_mid_run_leaves_nothing_behind_after_a_restart_that_is_not_ours(tmp_path, ext4, start_exporter):
    """kill -9 while sequences run (every 2 ms), then the leftovers a kill can leave at each step of them and of
    the commit log's creation; a restart clears what is ours and nothing else: the directory's other files, and
    files named like ours but not ours, come out as they were."""
    theirs = {
        "member.wal": os.urandom(64 * 1024),
        f"{COMMIT_LOG}.tmp.1.theirs": b"not a volprobe file",  # a leftover's name, someone else's content
    }
    for name, content in theirs.items():
        (ext4 / name).write_bytes(content)
    before = {name: sha256_of(str(ext4 / name)) for name in theirs}
    config = write_config(
        tmp_path,
        f"targets: [{{name: etcd, directory: {ext4}, probe_file_size: 1MiB, "
        f"probes: [{{op: commit, interval: 2ms}}, {{op: metadata, interval: 2ms}}]}}]\n",
    )
    exporter = start_exporter("--config", config)
    exporter.wait_for(lambda s: probes_done(s, "etcd", "metadata") >= 50, what="sequences")
    exporter.process.send_signal(signal.SIGKILL)
    exporter.process.wait(10)
    exporter.close_log()
    # What a kill at another moment leaves: each name of the sequence; and, killed while the log was being made,
    # its temporary (our header, no longer locked) and no log yet.
    for name in metadata.OUR_NAMES:  # an earlier version's names, and this one's (a random suffix per sequence)
        (ext4 / metadata.NAME / name).write_bytes(os.urandom(4096))
        (ext4 / metadata.NAME / f"{name}.{os.urandom(8).hex()}").write_bytes(os.urandom(4096))
    (ext4 / metadata.NAME / f"{metadata.OUR_NAMES[0]}.theirs").write_bytes(b"not a name of ours: left alone")
    os.unlink(ext4 / COMMIT_LOG)
    (ext4 / f"{COMMIT_LOG}.tmp.1.ours").write_bytes(probefile.MAGIC + b'{"size": 1}')
    restarted = start_exporter("--config", config)
    restarted.wait_for(lambda s: probes_done(s, "etcd", "metadata") >= 10, what="sequences after the restart")
    assert restarted.stop() == 0
    assert sorted(os.listdir(ext4)) == sorted([COMMIT_LOG, metadata.NAME, *theirs])
    assert sorted(os.listdir(ext4 / metadata.NAME)) == [metadata.ID_NAME, f"{metadata.OUR_NAMES[0]}.theirs"]
    assert {name: sha256_of(str(ext4 / name)) for name in theirs} == before


@pytest.mark.root
def test_a_reload_adds_and_removes_commit_and_metadata_probes(tmp_path, ext4, start_exporter):
    config = tmp_path / "volprobe.yml"
    base = f"targets: [{{name: etcd, directory: {ext4}, probe_file_size: 1MiB, probes: [{{op: write, interval: 50ms}}"
    config.write_text(base + "]}]\n")
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(lambda s: probes_done(s, "etcd", "write") >= 3, what="writes")
    exporter.reload(config, base + ", {op: commit, interval: 20ms}, {op: metadata, interval: 20ms}]}]\n")
    samples = exporter.wait_for(
        lambda s: probes_done(s, "etcd", "commit") >= 5 and probes_done(s, "etcd", "metadata") >= 5,
        what="the added probes",
    )
    assert len(samples["volprobe_probe_metadata_step_seconds_total"]) == len(ops.METADATA.steps)
    exporter.reload(config, base + "]}]\n")
    samples = exporter.wait_for(
        lambda s: (
            probes_done(s, "etcd", "write") >= 1
            and "volprobe_probe_metadata_step_seconds_total" not in s
            and not any(labels["op"] in ("commit", "metadata") for labels, _ in s["volprobe_probe_info"])
        ),
        what="the removed probes' series to go",
    )
    assert exporter.stop() == 0
    assert os.listdir(ext4 / metadata.NAME) == [metadata.ID_NAME]  # the stopped sequences left nothing
    assert PROBE_FILE_NAME in os.listdir(ext4)


def test_the_timers_metadata_names_are_the_c_timers():
    source = (Path(timer.__file__).parent / "_timedio.c").read_text()
    assert f'#define METADATA_NEW "{timer.METADATA_NEW}"' in source
    assert f'#define METADATA_RENAMED "{timer.METADATA_RENAMED}"' in source
    assert metadata.OUR_NAMES == (timer.METADATA_NEW, timer.METADATA_RENAMED)
