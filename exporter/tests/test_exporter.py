"""The exporter end to end on real block devices: loop devices, ext4, O_DIRECT probes, /metrics, promtool."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest

from volprobe import probefile
from volprobe.config import PROBE_FILE_NAME

from .support.harness import (
    MIB,
    attach_loop,
    descriptors_on,
    probes_done,
    run,
    sample_value,
    sha256_of,
    volprobe_command,
    write_config,
)

HISTOGRAM_ERROR = 1 / 128  # the recent quantiles' stated bound (their HELP: <=0.78% relative error)

pytestmark = pytest.mark.root


def tree_snapshot(root: str, skip: str) -> dict[str, str]:
    """Every file and directory under root (but `skip`) with its content hash, mode and mtime."""
    result = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if name == skip:
                continue
            st = os.lstat(path)
            digest = sha256_of(path) if os.path.isfile(path) else ""
            result[os.path.relpath(path, root)] = f"{st.st_mode:o} {st.st_size} {st.st_mtime_ns} {digest}"
    return result


RECENT_COUNT = "volprobe_probe_latency_recent_seconds_count"  # by touch: first and repeat


def quantile_bucket(samples, q: float, **labels: str) -> tuple[float, float]:
    """(lower, upper] bounds of the histogram bucket holding the nearest-rank q-quantile of a probe's samples."""
    buckets = sorted(
        (float(found["le"]), value)
        for found, value in samples["volprobe_probe_latency_seconds_bucket"]
        if all(found.get(k) == v for k, v in labels.items())
    )
    rank = max(1, math.ceil(q * sample_value(samples, "volprobe_probe_latency_seconds_count", **labels)))
    lower = 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            return lower, upper
        lower = upper
    raise AssertionError(f"no bucket reaches rank {rank}: {buckets}")


def test_read_and_write_probes_on_a_device_and_a_directory(tmp_path, make_loop, mount_fs, start_exporter):
    raw = make_loop(64 * MIB, name="raw")
    data = mount_fs(make_loop(128 * MIB, name="fs"))
    Path(data, "precious.db").write_bytes(os.urandom(MIB))
    before = tree_snapshot(data, PROBE_FILE_NAME)
    config = write_config(
        tmp_path,
        f"""
defaults: {{window: 1m}}
targets:
  - name: raw
    device: {raw}
    allow_raw_writes: true
    probes:
      - {{op: read, block_size: 4KiB, interval: 50ms, revisit: 0}}
      - {{op: write, block_size: 8KiB, interval: 50ms}}
  - name: pgdata
    directory: {data}
    probe_file_size: 16MiB
    probes:
      - {{op: write, block_size: 8KiB, interval: 50ms}}
      - {{op: read, block_size: 4KiB, interval: 50ms}}
""",
    )
    exporter = start_exporter("--config", config)
    samples = exporter.wait_for(
        lambda s: all(probes_done(s, t, op) >= 20 for t in ("raw", "pgdata") for op in ("read", "write")),
        what="20 samples of each probe",
    )
    # The contract: labels, touch split (on the recent summary: its counts add up to the histogram's), quantiles.
    by_touch = {
        touch: sample_value(samples, RECENT_COUNT, target="pgdata", op="write", touch=touch)
        for touch in ("first", "repeat")
    }
    assert by_touch["first"] and by_touch["repeat"], "default revisit sends some probes to offsets probed before"
    total = sample_value(samples, "volprobe_probe_latency_seconds_count", target="pgdata", op="write")
    assert total == by_touch["first"] + by_touch["repeat"]
    assert not any("touch" in labels for labels, _ in samples["volprobe_probe_latency_seconds_bucket"])
    # The recent p50 against the same probe's histogram in the same scrape (the 1m window still holds every
    # sample, and with revisit 0 every one is a first touch): it lies in the bucket where the cumulative count
    # passes half the samples, within the stated error.
    raw_read = {"target": "raw", "op": "read"}
    assert sample_value(samples, RECENT_COUNT, touch="repeat", **raw_read) == 0
    p50 = sample_value(samples, "volprobe_probe_latency_recent_seconds", quantile="0.5", touch="first", **raw_read)
    low, high = quantile_bucket(samples, 0.5, **raw_read)
    assert low * (1 - HISTOGRAM_ERROR) <= p50 <= high * (1 + HISTOGRAM_ERROR), (p50, low, high)
    info = next(labels for labels, _ in samples["volprobe_target_info"] if labels["target"] == "pgdata")
    assert info["mountpoint"] == data and info["fstype"] == "ext4" and info["kind"] == "loop"
    assert info["path"] == data
    raw_dev = os.path.basename(raw)
    assert sample_value(samples, "volprobe_disk_writes_completed_total", device=raw_dev) >= 20
    # Error counters exist at 0 from the start (so the first error is an increase), and stayed there.
    assert sample_value(samples, "volprobe_probe_errors_total", target="raw", errno="EIO") == 0
    assert sample_value(samples, "volprobe_probe_failures_total", target="raw", op="write") == 0
    # promtool lints the exposition.
    text = exporter.get()
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert exporter.stop() == 0
    # The probe file is the only thing written in the filesystem, and it kept its size and header.
    assert tree_snapshot(data, PROBE_FILE_NAME) == before
    probe_path = os.path.join(data, PROBE_FILE_NAME)
    assert os.path.getsize(probe_path) == 16 * MIB
    assert probefile.read_header(probe_path)["size"] == 16 * MIB
    # Raw write probes never touch the first and last MiB, where signatures live.
    with open(raw, "rb") as f:
        assert f.read(MIB) == bytes(MIB)
        f.seek(63 * MIB)
        assert f.read(MIB) == bytes(MIB)


def test_reads_keep_their_descriptor_only_beside_a_raw_write(tmp_path, make_loop, start_exporter):
    rw, ro = make_loop(16 * MIB, name="rw"), make_loop(16 * MIB, name="ro")
    read = "{op: read, block_size: 4KiB, interval: 200ms}"
    text = f"""
targets:
  - {{name: rw, device: {rw}, allow_raw_writes: true, probes: [{read}, {{op: write, interval: 200ms}}]}}
  - {{name: ro, device: {ro}, probes: [{read}]}}
"""
    config = write_config(tmp_path, text)
    exporter = start_exporter("--config", config)
    exporter.wait_for(
        lambda s: probes_done(s, "rw", "read") >= 3 and probes_done(s, "ro", "read") >= 3, what="3 reads of each"
    )
    pid = exporter.process.pid
    # The write's descriptor and the read's, held between probes; a lone read opens for each request only (one
    # may be in flight at a look: 1 of 3 looks at 0 suffices).
    assert descriptors_on(rw, pid) == 2
    assert min(descriptors_on(ro, pid) for _ in range(3)) == 0
    # A reload without the write: the read lets go of the device too.
    exporter.reload(Path(config), text.replace(", {op: write, interval: 200ms}", ""))
    deadline = time.monotonic() + 10
    while descriptors_on(rw, pid) != 0:
        assert time.monotonic() < deadline, "the read still holds the device without a write beside it"
        time.sleep(0.05)
    exporter.wait_for(lambda s: probes_done(s, "rw", "read") >= 3, what="reads after the reload")
    assert exporter.stop() == 0


def test_raw_writes_refused_on_ext4_and_its_bytes_unchanged(tmp_path, make_loop):
    loop = make_loop(64 * MIB)
    run("mkfs.ext4", "-q", "-F", loop)
    before = sha256_of(loop)
    config = write_config(
        tmp_path,
        f"""
targets:
  - name: victim
    device: {loop}
    allow_raw_writes: true
    probes: [{{op: write, block_size: 8KiB, interval: 10ms}}]
""",
    )
    result = subprocess.run(
        volprobe_command("--config", config, "--web.listen-address", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "targets[0].allow_raw_writes: refusing raw writes" in result.stderr
    assert "ext4" in result.stderr
    assert sha256_of(loop) == before


def test_foreign_file_named_like_the_probe_file_is_never_touched(tmp_path, make_loop, mount_fs):
    data = mount_fs(make_loop(64 * MIB))
    foreign = Path(data, PROBE_FILE_NAME)
    foreign.write_bytes(b"somebody else's data" * 1000)
    digest = hashlib.sha256(foreign.read_bytes()).hexdigest()
    config = write_config(tmp_path, f"targets: [{{directory: {data}, probe_file_size: 4MiB}}]")
    result = subprocess.run(volprobe_command("check-config", config), capture_output=True, text=True)
    assert result.returncode == 2 and "not a volprobe probe file" in result.stderr
    result = subprocess.run(
        volprobe_command("--config", config, "--web.listen-address", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert hashlib.sha256(foreign.read_bytes()).hexdigest() == digest


def test_block_size_must_fit_the_logical_block_size(tmp_path):
    backing = tmp_path / "4k.img"
    backing.write_bytes(b"")
    os.truncate(backing, 16 * MIB)
    loop = attach_loop(["--sector-size", "4096"], backing)
    try:
        config = write_config(tmp_path, f"targets: [{{device: {loop}, probes: [{{op: read, block_size: 512}}]}}]")
        result = subprocess.run(volprobe_command("check-config", config), capture_output=True, text=True)
        assert result.returncode == 2
        assert "targets[0].probes[0].block_size: 512 is not a multiple of the device's logical block size 4096" in (
            result.stderr
        )
    finally:
        run("losetup", "--detach", loop)


def test_sigterm_stops_promptly_with_exit_0(make_loop, start_exporter):
    loop = make_loop(16 * MIB)
    exporter = start_exporter("--target", loop)
    exporter.wait_for(lambda s: probes_done(s, os.path.basename(loop), "read") >= 1, what="a first probe")
    started = time.monotonic()
    assert exporter.stop(timeout=10) == 0
    assert time.monotonic() - started < 6


def test_ping_a_device_and_a_directory(make_loop, mount_fs):
    loop = make_loop(16 * MIB)
    result = subprocess.run(volprobe_command("ping", loop, "-c", "5", "-i", "10ms"), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert sum(" <<< " in line and "request=" in line for line in lines) == 5
    assert any(line.startswith("min/avg/max/mdev = ") for line in lines)
    assert any(line.startswith("p50/p99 = ") for line in lines)
    data = mount_fs(make_loop(64 * MIB, name="fs"))
    result = subprocess.run(
        volprobe_command("ping", data, "--op", "write", "-c", "3", "-i", "10ms", "--probe-file-size", "4MiB"),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert sum(" >>> " in line for line in result.stdout.splitlines()) == 3
    assert os.path.getsize(os.path.join(data, PROBE_FILE_NAME)) == 4 * MIB
    refused = subprocess.run(volprobe_command("ping", loop, "--write", "-c", "1"), capture_output=True, text=True)
    assert refused.returncode == 2 and "--allow-raw-writes" in refused.stderr


@pytest.mark.parametrize("fstype", ["tmpfs"])
def test_directory_without_a_block_device_is_refused(tmp_path, fstype):
    point = tmp_path / "ram"
    point.mkdir()
    run("mount", "-t", fstype, "none", str(point))
    try:
        config = write_config(tmp_path, f"targets: [{{directory: {point}}}]")
        result = subprocess.run(volprobe_command("check-config", config), capture_output=True, text=True)
        assert result.returncode == 2 and "targets[0].directory" in result.stderr and "tmpfs" in result.stderr
    finally:
        run("umount", str(point))


def test_a_kubelet_volume_path_gives_the_persistent_volume_and_pod(tmp_path, make_loop, start_exporter):
    pod, pv = "0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11", "pvc-8d1c2a4e-1b2f-4d3e-8f9a-0c1d2e3f4a5b"
    point = tmp_path / "var/lib/kubelet/pods" / pod / "volumes/kubernetes.io~csi" / pv / "mount"
    point.mkdir(parents=True)
    # The kubelet's record that it is that PersistentVolume's (an inline volume's directory name is its pod's).
    record = {"driverName": "ebs.csi.aws.com", "specVolID": pv, "volumeLifecycleMode": "Persistent"}
    (point.parent / "vol_data.json").write_text(json.dumps(record))
    loop = make_loop(64 * MIB)
    run("mkfs.ext4", "-q", "-F", loop)
    run("mount", loop, str(point))
    try:
        config = write_config(tmp_path, f"targets: [{{name: pgdata, directory: {point}, probe_file_size: 4MiB}}]")
        exporter = start_exporter("--config", config)
        info = next(labels for labels, _ in exporter.metrics()["volprobe_target_info"] if labels["target"] == "pgdata")
        assert info["pv"] == pv and info["pod_uid"] == pod and info["mountpoint"] == str(point)
        assert exporter.stop() == 0
    finally:
        run("umount", str(point))


@pytest.mark.root
def test_a_directory_whose_device_cannot_be_opened_reads_its_probe_file(tmp_path, make_loop, mount_fs, start_exporter):
    """As in a container that does not expose the disk (its device cgroup denies it: EPERM), `--target DIR` is
    probed all the same: writes to the probe file, and reads from it, said in volprobe_probe_info{source}."""
    device = make_loop(128 * MIB)
    data = mount_fs(device)
    cgroup = Path("/sys/fs/cgroup/devices") / f"volprobe-test-{os.getpid()}-{tmp_path.name}"
    cgroup.mkdir()
    try:
        rdev = os.stat(device).st_rdev
        (cgroup / "devices.deny").write_text(f"b {os.major(rdev)}:{os.minor(rdev)} rwm\n")
        in_cgroup = ("sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup))
        denied = subprocess.run([*in_cgroup, "dd", f"if={device}", "of=/dev/null", "count=1"], capture_output=True)
        assert denied.returncode != 0 and b"Operation not permitted" in denied.stderr  # as a container's cgroup
        exporter = start_exporter("--target", data, prefix=in_cgroup)
        samples = exporter.wait_for(
            lambda s: (
                probes_done(s, os.path.basename(device), "read") >= 3
                and probes_done(s, os.path.basename(device), "write") >= 3
            ),
            what="reads and writes",
        )
        sources = {labels["op"]: labels["source"] for labels, _ in samples["volprobe_probe_info"]}
        assert sources == {"read": "probe_file", "write": "probe_file"}, sources
        assert exporter.log().count("its read probes read the probe file") == 1
        assert exporter.stop() == 0
    finally:
        with contextlib.suppress(OSError):
            cgroup.rmdir()
