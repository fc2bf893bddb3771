"""Attacks on what volprobe writes (issue 24): whoever owns a probe directory, or can repoint a device link, swaps
names under it; every write must go through a descriptor judged after it was opened, at every (re)open.

The victims are real files and devices, checksummed before and after."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import subprocess
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from volprobe import probe, probefile, targets, timer
from volprobe.config import PROBE_FILE_NAME, ProbeConfig, load
from volprobe.discovery import Host
from volprobe.safety import Refused
from volprobe.stats import ProbeStats

from .support.attacks import ATTACKER, SWAPS, prepared
from .support.harness import MIB, probes_done, run, sample_value, sha256_of, wait_until, write_config

pytestmark = pytest.mark.root


def errors(samples, target: str, name: str) -> float:
    return sample_value(samples, "volprobe_probe_errors_total", target=target, op="write", errno=name) or 0


def victim_file(directory: Path, size: int = 8 * MIB) -> tuple[Path, str]:
    victim = directory / "victim.db"
    victim.write_bytes(os.urandom(size))
    os.sync()
    return victim, sha256_of(str(victim))


def test_a_probe_file_swapped_for_a_symlink_across_an_fsck_is_never_written_through(
    tmp_path, make_loop, start_exporter
):
    """The filesystem goes read-only under the probes (errors=remount-ro); volprobe lets go; the operator runs
    fsck and mounts it again; meanwhile the directory's owner has replaced the probe file by a symlink to
    another file of the same filesystem. The reopen refuses it: that file comes out byte for byte as it was."""
    device = make_loop(64 * MIB)
    mount = tmp_path / "fs"
    mount.mkdir()
    run("mkfs.ext4", "-q", "-F", device)
    run("mount", "-o", "errors=remount-ro", device, str(mount))
    exporter = None
    try:
        data = mount / "pg"
        data.mkdir()
        os.chown(data, ATTACKER, ATTACKER)
        victim, before = victim_file(mount)
        config = write_config(
            tmp_path,
            f"targets: [{{name: data, directory: {data}, probe_file_size: 8MiB, "
            f"probes: [{{op: write, interval: 20ms, block_size: 64KiB}}]}}]\n",
        )
        exporter = start_exporter("--config", config)
        exporter.wait_for(lambda s: probes_done(s, "data", "write") >= 10, what="writes")
        (Path("/sys/fs/ext4") / os.path.basename(device) / "trigger_fs_error").write_text("volprobe test")
        exporter.wait_for(lambda s: errors(s, "data", "EROFS") >= 1, what="EROFS")
        run("umount", str(mount))  # possible only because volprobe let go of the file and the directory
        fsck = subprocess.run(["e2fsck", "-f", "-y", device], capture_output=True, text=True)
        assert fsck.returncode in (0, 1), fsck.stdout + fsck.stderr  # 1: errors were corrected
        run("mount", "-o", "errors=remount-ro", device, str(mount))
        os.unlink(data / PROBE_FILE_NAME)
        os.symlink(victim, data / PROBE_FILE_NAME)
        written = probes_done(exporter.metrics(), "data", "write")
        # The reopen comes within the back-off (at most 30 s): refused, or (the attack) written through.
        samples = exporter.wait_for(
            lambda s: errors(s, "data", "REFUSED") >= 1 or probes_done(s, "data", "write") > written,
            timeout=45,
            what="the reopen",
        )
        assert sha256_of(str(victim)) == before, "the probe wrote through the symlink into another file"
        assert probes_done(samples, "data", "write") == written
        assert "is a symbolic link; refusing to follow it" in exporter.log()
        assert exporter.stop() == 0
        assert sha256_of(str(victim)) == before
    finally:
        if exporter is not None:
            exporter.kill()  # it may hold the filesystem (a failed run): let go before unmounting
        subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.fixture
def directory_target(tmp_path, make_loop, mount_fs):
    """A prepared directory target with a write probe in an attacker-owned directory of a real ext4, and a
    victim file on the same filesystem. Yields (resolved target, its write IOTarget, data dir, victim)."""
    mount = Path(mount_fs(make_loop(64 * MIB)))
    data = mount / "pg"
    data.mkdir()
    os.chown(data, ATTACKER, ATTACKER)
    victim, _ = victim_file(mount, MIB)
    host, resolved = prepared(tmp_path, data, "[{op: write}]", "4MiB")
    target = resolved[0]
    io = targets.io_target(host, target, target.probes[0])
    os.close(target.fds.pop("write"))
    try:
        yield target, io, data, victim
    finally:
        targets.close(resolved)


@pytest.mark.parametrize("swap", SWAPS, ids=list(SWAPS))
def test_a_swap_in_the_probe_directory_is_refused_at_reopen(directory_target, swap):
    """What a reopen (after EROFS, ENOENT...) meets when the names changed while volprobe had let go."""
    _, io, data, victim = directory_target
    before = sha256_of(str(victim))
    fd = io.open()  # the file checked at start: accepted
    os.close(fd)
    io.let_go()  # as after EROFS: the directory is let go too
    SWAPS[swap](data, victim)
    with pytest.raises(Refused):
        os.close(io.open())
    assert sha256_of(str(victim)) == before


def test_a_hard_link_made_while_the_file_is_held_stops_the_writes(directory_target):
    _, io, data, _ = directory_target
    fd = io.open()
    try:
        io.verify(fd)
        os.link(data / PROBE_FILE_NAME, data / "grab")
        with pytest.raises(Refused, match="2 links"):
            io.verify(fd)
    finally:
        os.close(fd)


def running_writes(io: probe.IOTarget) -> probe.ProbeWorker:
    """A write probe every 20 ms on io. The C timer's batches (BATCH_S, at most MAX_BATCH probes) last about 10 s,
    the Python timer's one probe: either way only the timer's own re-check (HELD_RECHECK_S) looks at the held
    descriptor between its opening and a change."""
    spec = ProbeConfig("write", 4096, interval=0.02, jitter=0.0)
    w = probe.ProbeWorker(spec, io, ProbeStats(60.0), name="t", seed=1)
    assert w._batch_size() * 0.02 >= 10 or w.timer.max_batch == 1
    w.start()
    wait_until(lambda: w.completed >= 5, 10, "writes")
    return w


def stopped(w: probe.ProbeWorker) -> None:
    w.stop()
    assert w.join(5.0)
    w.close()


def test_a_hard_link_made_while_the_probe_runs_stops_its_writes_within_the_recheck(
    directory_target, loop_kind, monkeypatch
):
    """Mid-batch: the timer compares the held descriptor with what the worker checked (its pin) before a write
    once HELD_RECHECK_S passed, and ends the run on the change; the worker's full check refuses it."""
    monkeypatch.setattr(probe, "HELD_RECHECK_S", 0.2)
    _, io, data, _ = directory_target
    w = running_writes(io)
    try:
        linked = time.monotonic()
        os.link(data / PROBE_FILE_NAME, data / "grab")
        refused = wait_until(lambda: w.error_counts().get("REFUSED", 0) >= 1, 10, "the refusal")
        written = w.completed
        assert refused - linked < 3, "the batch, not the re-check, found the link"
        wait_until(lambda: w.error_counts()["REFUSED"] >= 2, 10, "the reopen")  # the next open refuses it too
        assert w.completed == written, "a write after the refusal"
        assert w.error_counts().keys() == {"REFUSED"}
    finally:
        stopped(w)


def test_a_change_the_checks_accept_costs_a_recheck_not_an_error(directory_target, loop_kind, monkeypatch):
    """A new mode and group on the probe file end the run at the re-check (the pin moved); checked again and
    accepted, it is pinned anew and the writes go on, without an error."""
    monkeypatch.setattr(probe, "HELD_RECHECK_S", 0.2)
    _, io, data, _ = directory_target
    w = running_writes(io)
    try:
        os.chmod(data / PROBE_FILE_NAME, 0o640)
        os.chown(data / PROBE_FILE_NAME, -1, ATTACKER)
        changed = w.completed
        wait_until(lambda: w.completed >= changed + 50, 10, "writes")  # 1 s of writes: several re-checks
        assert w.error_counts() == {}
    finally:
        stopped(w)


def test_a_link_undone_during_the_check_and_made_again_is_seen_at_the_recheck(directory_target, loop_kind, monkeypatch):
    """The race a pin taken before the check leaves open: linked when pinned, unlinked while checked (the check
    passes), linked again after. The worker makes sure the descriptor held still during its check, so what the
    timer compares with is the state the check judged, and the link made again ends the next run unwritten."""
    monkeypatch.setattr(probe, "HELD_RECHECK_S", 0.2)
    _, io, data, _ = directory_target
    grab = data / "grab"
    verify = io.verify
    assert verify is not None

    def undone_during_the_check(fd: int) -> None:
        if grab.exists():
            grab.unlink()
        verify(fd)

    spec = ProbeConfig("write", 4096, interval=0.02, jitter=0.0)
    w = probe.ProbeWorker(spec, dataclasses.replace(io, verify=undone_during_the_check), ProbeStats(60.0), seed=1)
    try:
        w.probe.open_checked()  # opened, checked and pinned with one link
        os.link(data / PROBE_FILE_NAME, grab)
        w.probe.changed()
        w.probe.open_checked()  # pinned with two links, checked with one
        os.link(data / PROBE_FILE_NAME, grab)
        time.sleep(0.25)  # the re-check is due
        w.timer.schedule(time.perf_counter_ns(), 1)
        done, ended, _ = w.probe.run(probe.Picks([(0, "first")]))
        assert (done, ended) == (0, timer.Status.CHANGED), "written with two links: the pin was the refused state"
        assert w.completed == 0
    finally:
        w.close()


def test_leftovers_that_are_fifos_or_symlinks_are_neither_opened_nor_removed(tmp_path, make_loop, mount_fs):
    """Names like a crashed creation's temporary file (`.volprobe-probe.tmp.<dead pid>.x`): a FIFO must not hang
    the start, a symlink must not be followed; only a real leftover of ours is cleared."""
    data = Path(mount_fs(make_loop(64 * MIB))) / "pg"
    data.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    fifo = data / f"{PROBE_FILE_NAME}.tmp.{dead.pid}.fifo"
    os.mkfifo(fifo)
    elsewhere = tmp_path / "elsewhere.fifo"
    os.mkfifo(elsewhere)
    link = data / f"{PROBE_FILE_NAME}.tmp.{dead.pid}.link"
    os.symlink(elsewhere, link)
    ours = data / f"{PROBE_FILE_NAME}.tmp.{dead.pid}.ours"
    ours.write_bytes((probefile.MAGIC + b'{"size": 1}').ljust(probefile.HEADER_BYTES, b"\0"))
    config = load(
        write_config(
            tmp_path, f"targets: [{{name: d, directory: {data}, probe_file_size: 4MiB, probes: [{{op: write}}]}}]\n"
        )
    )
    host = Host()
    outcome: list[object] = []

    def start() -> None:
        try:
            resolved = targets.resolve(config, host)
            targets.prepare(host, resolved)
            targets.close(resolved)
            outcome.append("ok")
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(30)
    hung = thread.is_alive()
    if hung:  # free the old code's blocked open before failing
        for path in (fifo, elsewhere):
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
    assert not hung, "a FIFO among the leftovers hung the start"
    assert outcome == ["ok"], outcome
    assert fifo.exists() and link.is_symlink() and elsewhere.exists()
    assert not ours.exists(), "a real leftover of ours is cleared"
    assert (data / PROBE_FILE_NAME).stat().st_size == 4 * MIB


def test_a_leftover_is_told_from_a_creation_under_way_by_its_lock_not_by_the_pid_in_its_name(tmp_path):
    """The PID in a temporary's name is only a hint: it can be reused by an unrelated process, or belong to
    another container's PID namespace. A creation under way holds a lock on its file that the kernel drops when
    the creator dies; that alone tells a leftover."""
    data = tmp_path / "data"
    data.mkdir()
    header = (probefile.MAGIC + b'{"size": 1}').ljust(probefile.HEADER_BYTES, b"\0")
    dead = subprocess.Popen(["true"])
    dead.wait()
    under_way = data / f"{PROBE_FILE_NAME}.tmp.{dead.pid}.busy"  # its creator lives on, elsewhere
    under_way.write_bytes(header)
    reused = data / f"{PROBE_FILE_NAME}.tmp.1.left"  # PID 1 lives, but made nothing here
    reused.write_bytes(header)
    emptied = data / f"{PROBE_FILE_NAME}.tmp.1.empty"  # its creator died before writing the header
    emptied.touch()
    foreign = data / f"{PROBE_FILE_NAME}.tmp.1.foreign"  # not empty, no header of ours: not ours
    foreign.write_bytes(b"someone else's data")
    creator = os.open(under_way, os.O_RDONLY)
    try:
        fcntl.flock(creator, fcntl.LOCK_EX)  # a separate open file: the cleaner's own flock conflicts with it
        removed = probefile.clear_leftover_temporaries(probefile.ProbeDirectory(str(data)), PROBE_FILE_NAME)
    finally:
        os.close(creator)
    assert sorted(removed) == sorted([reused.name, emptied.name])
    assert under_way.exists() and foreign.exists() and not reused.exists() and not emptied.exists()
    # Once its creator is gone, it is a leftover like any other.
    removed = probefile.clear_leftover_temporaries(probefile.ProbeDirectory(str(data)), PROBE_FILE_NAME)
    assert removed == [under_way.name] and not under_way.exists()


@pytest.fixture
def raw_target(tmp_path, make_loop):
    """A blank loop device A opted in for raw writes through a by-id-style link, and a device B with ext4."""
    blank, formatted = make_loop(32 * MIB, name="blank"), make_loop(32 * MIB, name="formatted")
    run("mkfs.ext4", "-q", "-F", formatted)
    by_id = tmp_path / "by-id"
    by_id.mkdir()
    link = by_id / "nvme-Amazon_Elastic_Block_Store_vol0123"
    os.symlink(blank, link)
    config = load(
        write_config(
            tmp_path,
            f"targets: [{{name: raw, device: {link}, allow_raw_writes: true, probes: [{{op: write}}]}}]\n",
        )
    )
    host = Host()
    resolved = targets.resolve(config, host)
    targets.prepare(host, resolved)
    target = resolved[0]
    os.close(target.fds.pop("write"))
    try:
        yield targets.io_target(host, target, target.probes[0]), link, blank, formatted
    finally:
        targets.close(resolved)


def test_a_device_link_repointed_at_a_formatted_device_is_refused_at_reopen(raw_target):
    io, link, _, formatted = raw_target
    before = sha256_of(formatted)
    os.close(io.open())  # the blank device the target was resolved to: accepted
    os.unlink(link)
    os.symlink(formatted, link)  # the volume re-attached elsewhere; the link follows another one
    with pytest.raises(Refused) as refused:
        os.close(io.open())
    assert "not the volume it was resolved to" in str(refused.value)
    assert sha256_of(formatted) == before


def test_a_device_link_repointed_at_another_blank_device_is_refused_at_reopen(raw_target, make_loop):
    io, link, _, _ = raw_target
    other = make_loop(32 * MIB, name="other")
    before = sha256_of(other)
    os.unlink(link)
    os.symlink(other, link)
    with pytest.raises(Refused, match="not the volume it was resolved to"):
        os.close(io.open())
    assert sha256_of(other) == before


def test_a_device_that_changes_size_stops_its_writes(raw_target):
    io, _, blank, _ = raw_target
    fd = io.open()
    try:
        io.verify(fd)
        backing = run("losetup", "--noheadings", "--output", "BACK-FILE", blank).stdout.strip()
        os.truncate(backing, 16 * MIB)
        run("losetup", "--set-capacity", blank)
        with pytest.raises(Refused, match="changed size"):
            io.verify(fd)
    finally:
        os.close(fd)
    with pytest.raises(Refused, match="changed size"):  # and a reopen refuses it too
        os.close(io.open())


def test_the_leftover_sweep_of_a_directory_of_200000_names_is_lazy_and_bounded(tmp_path, caplog):
    """A probe directory someone filled with 200,000 names (a tmpfs of this test's own): the sweep for leftover
    temporaries reads it lazily, so its memory does not grow with the directory (listing it whole took 13 MiB),
    and stops after probefile.SWEEP_LIMIT names, saying so."""
    data = tmp_path / "data"
    data.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=400k", "volprobe-sweep", str(data))
    try:
        fd = os.open(data, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for index in range(200_000):
                os.mknod(f"name-{index:06d}", dir_fd=fd)
        finally:
            os.close(fd)
        directory = probefile.ProbeDirectory(str(data))
        tracemalloc.start()
        try:
            with caplog.at_level(logging.INFO, logger="volprobe.probefile"):
                removed = probefile.clear_leftover_temporaries(directory, PROBE_FILE_NAME)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            directory.release()
        assert removed == []
        assert peak < 1 * MIB, f"the sweep took {peak / MIB:.1f} MiB"
        assert f"among its first {probefile.SWEEP_LIMIT} names only" in caplog.text
    finally:
        run("umount", str(data))
