"""A directory target's read source, its held directory and a reload (the review of 14b936f): reads whose device
cannot be opened get their probe file, at a start and at a reload, and a reload prepares on a copy of the running
target; a directory being opened on a hung mount never holds up another thread's release(); a reload while a
held directory is unmounted (an fsck) leaves that target pending and applies the rest."""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
from pathlib import Path

import pytest

from volprobe import probefile, targets
from volprobe.config import PROBE_FILE_NAME, ConfigError, load
from volprobe.discovery import Host

from .support.harness import MIB, run, write_config

SIZE = 4 * MIB


def _without_device(target: targets.ResolvedTarget, tmp_path: Path) -> None:
    """As in a container that does not expose the disk: its device node is not there (ENOENT)."""
    assert target.device is not None
    target.device = dataclasses.replace(target.device, devnode=str(tmp_path / "no-such-device"))


def _read_one_block(host: Host, target: targets.ResolvedTarget, op: str = "read") -> str:
    """Open the probe's I/O as its worker would and read one block; the path it read."""
    probe = next(p for p in target.probes if p.op == op)
    io = targets.io_target(host, target, probe)
    fd = io.open()
    buffer = mmap.mmap(-1, probe.block_size)
    try:
        assert os.preadv(fd, [buffer], probefile.HEADER_BYTES) == probe.block_size
    finally:
        buffer.close()
        os.close(fd)
    return io.path


@pytest.mark.root
def test_a_read_only_directory_whose_device_cannot_be_opened_gets_its_probe_file(tmp_path, make_loop, mount_fs):
    """Only a read probe, and the device cannot be opened: the reads go to the probe file, which prepare() must
    then make and pin (14b936f decided whether to make it before choosing where the reads go)."""
    data = mount_fs(make_loop(64 * MIB))
    text = f"targets: [{{name: d, directory: {data}, probe_file_size: 4MiB, probes: [{{op: read}}]}}]\n"
    host = Host()
    resolved = targets.resolve(load(write_config(tmp_path, text)), host)
    (target,) = resolved
    _without_device(target, tmp_path)
    try:
        targets.prepare(host, resolved)
        assert target.reads_probe_file
        assert PROBE_FILE_NAME in target.file_pins
        assert _read_one_block(host, target) == os.path.join(data, PROBE_FILE_NAME)
    finally:
        targets.close(resolved)


@pytest.mark.root
def test_a_reload_prepares_its_read_probe_on_a_copy_of_the_running_target(tmp_path, make_loop, mount_fs):
    """A running target with a commit probe alone (no probe file) gets a read probe, its device now out of reach:
    the probe file is made for it, but the running target takes the new read source only at commit(); a reload
    rolled back leaves it reading the device as before."""
    data = mount_fs(make_loop(64 * MIB))
    text = f"targets: [{{name: d, directory: {data}, probe_file_size: 4MiB, probes: [{{op: commit}}]}}]\n"
    host = Host()
    resolved = targets.resolve(load(write_config(tmp_path, text)), host)
    (running,) = resolved
    try:
        targets.prepare(host, resolved)
        assert not running.reads_probe_file and PROBE_FILE_NAME not in running.file_pins
        reloaded = load(write_config(tmp_path, text.replace("[{op: commit}]", "[{op: commit}, {op: read}]")))
        (read,) = [p for p in reloaded.targets[0].probes if p.op == "read"]
        _without_device(running, tmp_path)

        rolled_back = targets.prepare_probes(host, running, [read])
        assert rolled_back.trial.reads_probe_file and PROBE_FILE_NAME in rolled_back.trial.file_pins
        rolled_back.close()  # another part of the reload failed
        assert not running.reads_probe_file and PROBE_FILE_NAME not in running.file_pins

        prepared = targets.prepare_probes(host, running, [read])
        assert not running.reads_probe_file
        prepared.commit()
        assert running.reads_probe_file and PROBE_FILE_NAME in running.file_pins
        running.config = reloaded.targets[0]
        assert _read_one_block(host, running) == os.path.join(data, PROBE_FILE_NAME)
    finally:
        targets.close(resolved)


@pytest.mark.root
@pytest.mark.lab
def test_a_directory_opened_on_a_hung_mount_holds_up_no_other_thread(fuse_directory):
    """One thread opens the let-go directory on a mount that hangs; another lets go of it meanwhile (a probe on
    EROFS, a stop): that returns at once instead of waiting on the hung thread's lock."""
    lab = fuse_directory()
    directory = probefile.ProbeDirectory(str(lab.path))  # resolved, then let go
    opened: list[object] = []
    opener = threading.Thread(target=lambda: opened.append(directory.open()), daemon=True)
    releaser = threading.Thread(target=directory.release, daemon=True)
    lab.stall()
    try:
        opener.start()
        for _ in range(200):
            if lab.status()["stalled"]:
                break
            threading.Event().wait(0.02)
        assert lab.status()["stalled"], "the open did not reach the mount"
        releaser.start()
        releaser.join(2.0)
        blocked = releaser.is_alive()
    finally:
        lab.release()
        opener.join(10)
        releaser.join(10)
    assert not blocked, "release() waited for a directory being opened on a hung mount"
    assert len(opened) == 1 and isinstance(opened[0], int)
    assert os.path.samefile(f"/proc/self/fd/{opened[0]}", lab.path)
    directory.release()
    assert not [n for n in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{n}") == str(lab.path)]


@pytest.mark.root
def test_a_reload_while_a_held_directory_is_unmounted_leaves_it_pending(tmp_path, make_loop, mount_fs):
    """A running target let go of its directory and the filesystem was unmounted for an fsck: the reload is not
    refused; that target is pending on the very directory it held (its empty mount point is not it), the other
    resolves; once the filesystem is mounted back, the same directory is recognised."""
    loop = make_loop(64 * MIB)
    data, other = mount_fs(loop), mount_fs(make_loop(64 * MIB))
    text = (
        "targets:\n"
        f"  - {{name: d, directory: {data}, probe_file_size: 4MiB, probes: [{{op: write}}]}}\n"
        f"  - {{name: e, directory: {other}, probe_file_size: 4MiB, probes: [{{op: write}}]}}\n"
    )
    config = load(write_config(tmp_path, text))
    host = Host()
    held = probefile.ProbeDirectory(data)  # as the running target holds it, let go (EROFS)
    run("umount", data)
    try:
        resolved = targets.resolve(config, host, held={data: held})
    except ConfigError as err:
        pytest.fail(f"the reload was refused: {err.problems}")
    finally:
        run("mount", loop, data)
    try:
        by_name = {t.name: t for t in resolved}
        assert by_name["d"].pending and f"{held.path} is no longer the directory" in by_name["d"].pending
        assert by_name["d"].probe_dir is not None and by_name["d"].probe_dir.identity == held.identity
        assert not by_name["e"].pending
    finally:
        targets.close(resolved)
    # Mounted back: the directory it held answers again, and is the one resolved.
    again = targets.resolve(config, host, held={data: by_name["d"].probe_dir})
    try:
        assert not any(t.pending for t in again)
    finally:
        targets.close(again)
