"""Data safety (issue 13, short form of the hour-long run): write probes on a filesystem that holds other files
change nothing but the probe file, across a kill -9 and a restart; the filesystem checks clean after."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from .support.harness import MIB, run, sha256_of, write_config

pytestmark = [pytest.mark.root, pytest.mark.slow]


def checksums(directory: str) -> dict[str, str]:
    return {
        os.path.relpath(os.path.join(root, name), directory): sha256_of(os.path.join(root, name))
        for root, _, names in os.walk(directory)
        for name in names
        if not name.startswith(".volprobe-probe")
    }


@pytest.mark.slow
def test_write_probes_touch_nothing_but_their_probe_file(tmp_path, make_loop, start_exporter):
    device = make_loop(128 * MIB)
    data = tmp_path / "data"
    data.mkdir()
    run("mkfs.ext4", "-q", "-F", device)
    run("mount", device, str(data))
    try:
        (data / "db").mkdir()
        for i in range(24):  # files of many sizes, some a few blocks, some spanning many extents
            (data / "db" / f"file{i}").write_bytes(os.urandom((i * 37 + 1) * 4096 + i))
        os.symlink("db/file1", data / "link")
        before = checksums(str(data))
        config = write_config(
            tmp_path,
            f"targets: [{{name: data, directory: {data}, probe_file_size: 8MiB, "
            f"probes: [{{op: write, interval: 5ms}}, {{op: read, interval: 5ms}}]}}]\n",
        )
        written = 0
        for stop in (signal.SIGKILL, signal.SIGTERM):
            exporter = start_exporter("--config", config)
            samples = exporter.wait_for(
                lambda s: (
                    sum(v for labels, v in s.get("volprobe_probe_latency_seconds_count", []) if labels["op"] == "write")
                    >= 1000
                ),
                timeout=60,
                what="a thousand writes",
            )
            written += sum(
                v for labels, v in samples["volprobe_probe_latency_seconds_count"] if labels["op"] == "write"
            )
            exporter.process.send_signal(stop)
            exporter.process.wait(15)
        assert written >= 2000
        run("umount", str(data))  # drop every cached page: what follows reads the device
        run("e2fsck", "-f", "-n", device)  # read-only check: exits non-zero on any inconsistency
        run("mount", device, str(data))
        assert checksums(str(data)) == before
        assert sorted(os.listdir(data)) == sorted(["db", "link", "lost+found", ".volprobe-probe"])
        assert os.path.getsize(data / ".volprobe-probe") == 8 * MIB
    finally:
        subprocess.run(["umount", str(data)], capture_output=True)  # already unmounted if a step failed between
