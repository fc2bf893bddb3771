"""A directory target is resolved once, then known by the directory volprobe holds (issue 41, part B): its probe
threads share that descriptor safely, the mount check asks it rather than the name, and a reload recognises it
rather than resolving the name again."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from volprobe import probefile

from .support.harness import MIB, probes_done, sample_value, write_config


def test_a_probe_that_lets_go_never_closes_the_directory_under_another(tmp_path, monkeypatch):
    """One probe thread lets go of the shared directory (EROFS, say) while another is opening its probe file in
    it; the number is reused at once by an open elsewhere. The other thread's open must still be in the target's
    directory, not in whatever the number now leads to."""
    data, decoy = tmp_path / "data", tmp_path / "decoy"
    data.mkdir()
    decoy.mkdir()
    directory = probefile.ProbeDirectory(str(data))
    size = probefile.HEADER_BYTES + MIB
    pin = probefile.ensure(directory, ".volprobe-probe", size)
    (decoy / ".volprobe-probe").write_bytes((data / ".volprobe-probe").read_bytes())  # same header, another file
    real_open, reused = probefile.open_no_link, []

    def let_go_meanwhile(name: str, flags: int, dir_fd: int | None = None, path: str = "") -> int:
        if dir_fd is not None and not reused:
            directory.release()  # another probe thread lets go, now
            reused.append(os.open(decoy, os.O_RDONLY | os.O_DIRECTORY))  # the lowest free number: maybe dir_fd
        return real_open(name, flags, dir_fd, path)

    monkeypatch.setattr(probefile, "open_no_link", let_go_meanwhile)
    try:
        fd = directory.open_file(".volprobe-probe", os.O_RDWR, size, pin)
    finally:
        for number in reused:
            os.close(number)
    try:
        assert os.fstat(fd).st_ino == os.stat(data / ".volprobe-probe").st_ino
    finally:
        os.close(fd)
    # The directory let go of was closed once its last user was done: nothing of it is left open.
    assert not [n for n in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{n}") == str(data)]


@pytest.mark.root
def test_the_mount_check_asks_the_directory_held_not_its_name(tmp_path, make_loop, mount_fs, start_exporter):
    """The configured path is swapped for a dangling symlink after start: the directory volprobe holds still
    answers, and the mount check says so (asking the name would say 0: ENOENT)."""
    data = Path(mount_fs(make_loop(64 * MIB))) / "data"
    data.mkdir()
    text = (
        "mount_check: {interval: 200ms, timeout: 2s}\n"
        f"targets: [{{name: d, directory: {data}, probe_file_size: 8MiB, probes: [{{op: write, interval: 50ms}}]}}]\n"
    )
    exporter = start_exporter("--config", write_config(tmp_path, text))
    exporter.wait_for(lambda s: sample_value(s, "volprobe_mount_responsive", target="d") == 1, what="the first answer")
    os.rename(data, data.with_name("data.moved"))
    os.symlink(data.with_name("nowhere"), data)
    swapped = time.time()
    samples = exporter.wait_for(
        lambda s: (
            sample_value(s, "volprobe_mount_responsive", target="d") == 0
            or sample_value(s, "volprobe_mount_last_response_timestamp_seconds", target="d") > swapped
        ),
        what="a mount check after the swap",
    )
    assert sample_value(samples, "volprobe_mount_responsive", target="d") == 1, exporter.log()[-2000:]
    assert "mount check of" not in exporter.log()
    assert exporter.stop() == 0


@pytest.mark.root
def test_a_reload_recognises_the_directory_held_and_never_follows_the_name(
    tmp_path, make_loop, mount_fs, start_exporter
):
    """After start, the configured path is made a symlink to a directory of another filesystem. A reload (one
    probe changed) keeps the target on the directory it resolved at start: nothing is written to the other
    filesystem, and the unchanged probe's count goes on."""
    data = Path(mount_fs(make_loop(64 * MIB))) / "data"
    other = Path(mount_fs(make_loop(64 * MIB))) / "other"
    data.mkdir()
    other.mkdir()
    probes = "[{op: write, interval: 50ms}, {op: commit, interval: 50ms}]"
    text = f"targets: [{{name: d, directory: {data}, probe_file_size: 8MiB, probes: {probes}}}]\n"
    config = Path(write_config(tmp_path, text))
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(lambda s: probes_done(s, "d", "write") >= 20, what="the probes")
    moved = data.with_name("data.moved")
    os.rename(data, moved)
    os.symlink(other, data)
    before = exporter.metrics()
    exporter.reload(config, text.replace("{op: commit, interval: 50ms}", "{op: commit, interval: 40ms}"))
    after = exporter.wait_for(lambda s: probes_done(s, "d", "commit") >= 5, what="the restarted commit probe")
    assert sorted(os.listdir(other)) == [], "a reload followed the name to another filesystem"
    assert probes_done(after, "d", "write") >= probes_done(before, "d", "write"), "the write probe restarted"
    assert ".volprobe-commit" in os.listdir(moved)
    assert "stopped probing d (" not in exporter.log().replace(f"stopped probing d ({data}) with commit", "")
    assert exporter.stop() == 0
