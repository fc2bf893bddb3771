"""Faults of the filesystem and device under a target (issue 13): the exporter keeps serving, counts them,
recovers, and loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from .support.harness import MIB, probes_done, run, sample_value, volprobe_command, wait_until, write_config

pytestmark = pytest.mark.root


def failures(samples, target: str, op: str) -> float:
    return sample_value(samples, "volprobe_probe_failures_total", target=target, op=op) or 0


def test_a_filesystem_gone_read_only_fails_writes_until_repaired(tmp_path, make_loop, start_exporter):
    """An ext4 error remounts the filesystem read-only under the running probes (errors=remount-ro): writes
    fail with EROFS and are counted, reads go on, the probe file is let go so the operator can unmount and
    fsck, and probing resumes once the filesystem is back."""
    device = make_loop(64 * MIB)
    data = tmp_path / "data"
    data.mkdir()
    run("mkfs.ext4", "-q", "-F", device)
    run("mount", "-o", "errors=remount-ro", device, str(data))
    try:
        config = write_config(
            tmp_path,
            f"targets: [{{name: data, directory: {data}, probe_file_size: 4MiB, "
            f"probes: [{{op: write, interval: 50ms}}, {{op: read, interval: 50ms}}]}}]\n",
        )
        exporter = start_exporter("--config", config)
        exporter.wait_for(lambda s: probes_done(s, "data", "write") >= 10, what="writes")
        (Path("/sys/fs/ext4") / os.path.basename(device) / "trigger_fs_error").write_text("volprobe test")
        samples = exporter.wait_for(lambda s: failures(s, "data", "write") >= 1, what="failed writes")
        errnos = {labels["errno"] for labels, v in samples["volprobe_probe_errors_total"] if v > 0}
        assert errnos == {"EROFS"}, errnos
        reads = probes_done(samples, "data", "read")
        exporter.wait_for(lambda s: probes_done(s, "data", "read") > reads + 5, what="reads to go on")
        run("umount", str(data))  # possible only because volprobe let go of the probe file
        run("e2fsck", "-f", "-y", device)
        run("mount", "-o", "errors=remount-ro", device, str(data))
        written = probes_done(exporter.metrics(), "data", "write")
        # The back-off is at most 30 s; then writes go to the same probe file again.
        exporter.wait_for(lambda s: probes_done(s, "data", "write") > written, timeout=45, what="writes to resume")
        assert exporter.stop() == 0
    finally:
        subprocess.run(["umount", str(data)], capture_output=True)


def test_a_device_detached_and_attached_again_under_its_name_is_probed_again(tmp_path, make_loop, start_exporter):
    loop = make_loop(16 * MIB)
    backing = run("losetup", "--noheadings", "--output", "BACK-FILE", loop).stdout.strip()
    config = write_config(tmp_path, f"targets: [{{name: a, device: {loop}, probes: [{{op: read, interval: 50ms}}]}}]\n")
    exporter = start_exporter("--config", config)
    exporter.wait_for(lambda s: probes_done(s, "a", "read") >= 10, what="reads")
    run("losetup", "--detach", loop)
    try:
        exporter.wait_for(lambda s: failures(s, "a", "read") >= 1, what="failures of the detached device")
    finally:
        run("losetup", "--direct-io=on", loop, backing)  # the same name again
    done = probes_done(exporter.metrics(), "a", "read")
    samples = exporter.wait_for(lambda s: probes_done(s, "a", "read") >= done + 5, timeout=40, what="reads to resume")
    assert sample_value(samples, "volprobe_target_info", target="a") == 1
    assert exporter.stop() == 0


def test_sigterm_while_the_probe_file_is_made_leaves_no_probe_file(tmp_path, make_loop, mount_fs):
    data = mount_fs(make_loop(1024 * MIB))
    config = write_config(tmp_path, f"targets: [{{name: data, directory: {data}, probe_file_size: 768MiB}}]\n")
    process = subprocess.Popen(
        volprobe_command("--config", config, "--web.listen-address", "127.0.0.1:0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Kill it while it writes the 768 MiB of random data (a temporary file until complete).
    wait_until(lambda: any(".tmp." in name for name in os.listdir(data)), 30, "the temporary file", every=0.01)
    process.send_signal(signal.SIGTERM)
    process.wait(30)
    assert ".volprobe-probe" not in os.listdir(data), "a half-made probe file under the real name"
    leftovers = [name for name in os.listdir(data) if name.startswith(".volprobe-probe.tmp.")]
    assert leftovers, "the SIGTERM came before the temporary file was made: nothing left over to clear"
    # The next start clears the leftover and makes a whole, valid file.
    checked = subprocess.run(volprobe_command("check-config", config), capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    again = subprocess.Popen(
        volprobe_command("--config", config, "--web.listen-address", "127.0.0.1:0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while ".volprobe-probe" not in os.listdir(data) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.getsize(os.path.join(data, ".volprobe-probe")) == 768 * MIB
        assert not [name for name in os.listdir(data) if name in leftovers]
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(30)


def test_a_reload_onto_a_full_filesystem_is_rejected_and_the_rest_keeps_serving(
    tmp_path, make_loop, mount_fs, start_exporter
):
    loop, small = make_loop(16 * MIB), mount_fs(make_loop(32 * MIB))
    with open(os.path.join(small, "filler"), "wb") as f:  # leaves far less than a probe file free
        f.write(os.urandom(24 * MIB))
    good = f"targets:\n  - {{name: a, device: {loop}, probes: [{{op: read, interval: 50ms}}]}}\n"
    config = tmp_path / "volprobe.yml"
    config.write_text(good)
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(lambda s: probes_done(s, "a", "read") >= 5, what="reads")
    config.write_text(good + f"  - {{name: full, directory: {small}, probe_file_size: 16MiB}}\n")
    exporter.process.send_signal(signal.SIGHUP)
    samples = exporter.wait_for(
        lambda s: sample_value(s, "volprobe_config_last_reload_successful") == 0, what="the rejected reload"
    )
    assert "targets[1].directory: cannot prepare the probe file" in exporter.log()
    assert "bytes free; the probe file needs" in exporter.log()
    assert not os.path.exists(os.path.join(small, ".volprobe-probe"))
    done = probes_done(samples, "a", "read")
    exporter.wait_for(lambda s: probes_done(s, "a", "read") > done + 5, what="the running target to keep probing")
    assert exporter.stop() == 0


def fill_when_created(directory: str, problems: list[BaseException], stop_after: float = 60.0) -> None:
    """As soon as a probe file's temporary appears in `directory`, take all the space left (what a log or a
    database growing at the same moment would do): the creation, past its free-space check, meets ENOSPC.
    Runs in a thread: what goes wrong is kept in `problems` for the test to see."""
    try:
        _fill_when_created(directory, stop_after)
    except BaseException as err:  # handed to the test thread
        problems.append(err)


def _fill_when_created(directory: str, stop_after: float) -> None:
    deadline = time.monotonic() + stop_after
    while not any(".tmp." in name for name in os.listdir(directory)):
        assert time.monotonic() < deadline, "no probe file creation started"
        time.sleep(0.001)
    with open(os.path.join(directory, "grower"), "wb") as f:
        vfs = os.statvfs(directory)
        size = vfs.f_bavail * vfs.f_frsize
        while size > 0:
            try:
                os.posix_fallocate(f.fileno(), 0, size)
                break
            except OSError:
                size -= MIB
        chunk = b"\1" * 4096
        try:
            while True:  # whatever fallocate left
                f.write(chunk)
                f.flush()
        except OSError:
            pass


def test_enospc_in_the_middle_of_making_a_probe_file_is_rejected_cleanly_then_recovers(
    tmp_path, make_loop, mount_fs, start_exporter
):
    """ENOSPC after the free-space check, half-way through the probe file: the reload is rejected naming the
    key, the half-made file is removed, no other file is touched, the running target keeps probing; once
    space is freed, the next reload makes a whole probe file and write probes run."""
    loop, data = make_loop(16 * MIB), mount_fs(make_loop(256 * MIB))
    precious = os.path.join(data, "precious.db")
    Path(precious).write_bytes(os.urandom(4 * MIB))
    digest = run("sha256sum", precious).stdout.split()[0]
    good = f"targets:\n  - {{name: a, device: {loop}, probes: [{{op: read, interval: 50ms}}]}}\n"
    grown = good + f"  - {{name: grown, directory: {data}, probe_file_size: 160MiB}}\n"
    config = tmp_path / "volprobe.yml"
    config.write_text(good)
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(lambda s: probes_done(s, "a", "read") >= 5, what="reads")

    problems: list[BaseException] = []
    filler = threading.Thread(target=fill_when_created, args=(data, problems))
    filler.start()
    config.write_text(grown)
    exporter.process.send_signal(signal.SIGHUP)
    samples = exporter.wait_for(
        lambda s: sample_value(s, "volprobe_config_last_reload_successful") == 0, what="the rejected reload"
    )
    filler.join(60)
    assert not filler.is_alive() and not problems, problems
    assert "targets[1].directory: cannot prepare the probe file: [Errno 28] No space left on device" in exporter.log()
    assert not [name for name in os.listdir(data) if name.startswith(".volprobe-probe")], os.listdir(data)
    done = probes_done(samples, "a", "read")
    exporter.wait_for(lambda s: probes_done(s, "a", "read") > done + 5, what="the running target to keep probing")

    os.unlink(os.path.join(data, "grower"))
    exporter.reload(config, grown)
    exporter.wait_for(lambda s: probes_done(s, "grown", "write") >= 5, timeout=60, what="write probes in the new file")
    assert os.path.getsize(os.path.join(data, ".volprobe-probe")) == 160 * MIB
    assert sample_value(exporter.metrics(), "volprobe_config_last_reload_successful") == 1
    assert exporter.stop() == 0
    assert run("sha256sum", precious).stdout.split()[0] == digest
