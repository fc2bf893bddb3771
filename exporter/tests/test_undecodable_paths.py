"""Paths are bytes (issue 41): a mount point or a mount's source holding a byte that is not UTF-8 stops no start,
reload, scrape or tool. /proc's mount tables are read as bytes and decoded as os.fsdecode does, so such a path stays
usable in os calls; label values, the landing page and the tools' output carry it as valid UTF-8.

Each test mounts its filesystem in a mount namespace of its own (unshare), around the one command that must see
it: the other tests running meanwhile never do, and the mount goes with that command."""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from volprobe import discovery

from .support.harness import MIB, probes_done, run, sample_value, volprobe_command, write_config

pytestmark = pytest.mark.root

ODD = b"vp\xff"  # not UTF-8: the byte os.fsdecode makes "\udcff"


def mounted_privately(device: str, point: bytes) -> tuple[str, ...]:
    """A command prefix: what follows runs in a mount namespace of its own, with `device` mounted on `point` and
    a `data` directory made in it."""
    script = 'mount "$1" "$2"; mkdir -p "$2/data"; shift 2; exec "$@"'
    return ("unshare", "--mount", "--propagation", "private", "sh", "-ec", script, "sh", device, os.fsdecode(point))


def test_parse_mountinfo_ends_lines_at_newlines_and_fields_at_spaces_only():
    """The kernel escapes a space, a tab, a newline and a backslash in a path, nothing else: a form feed, U+3000
    or a byte that is not UTF-8 stand in a mount point as they are."""
    table = b"".join(
        b"%d 1 8:%d / %s rw - ext4 /dev/sd%d rw\n" % (n, n, point, n)
        for n, point in enumerate([b"/mnt/a\x0cb", "/mnt/c\u3000d".encode(), b"/mnt/e\\040f", b"/mnt/" + ODD])
    )
    mounts = discovery.parse_mountinfo(os.fsdecode(table))
    assert [m.mount_point for m in mounts] == ["/mnt/a\x0cb", "/mnt/c\u3000d", "/mnt/e f", os.fsdecode(b"/mnt/" + ODD)]
    assert [m.source for m in mounts] == ["/dev/sd0", "/dev/sd1", "/dev/sd2", "/dev/sd3"]


def test_an_exporter_under_a_mount_point_that_is_not_utf8_starts_scrapes_and_reloads(
    tmp_path, make_loop, start_exporter
):
    """A directory target reached through a link into an ext4 mounted at `.../vp\\xff`: it starts, probes, is
    scraped in every format with its path and mount point as `vp\\xff` in the labels, and reloads."""
    device = make_loop(64 * MIB)
    run("mkfs.ext4", "-q", "-F", device)
    point = os.fsencode(tmp_path) + b"/" + ODD
    os.mkdir(point)
    os.symlink(os.fsdecode(point + b"/data"), tmp_path / "link")
    text = "targets: [{{name: odd, directory: {}, probe_file_size: 1MiB, probes: [{{op: write, interval: {}}}]}}]\n"
    config = Path(write_config(tmp_path, text.format(tmp_path / "link", "50ms")))
    exporter = start_exporter("--config", str(config), prefix=mounted_privately(device, point))
    samples = exporter.wait_for(lambda s: probes_done(s, "odd", "write") >= 3, what="probes")
    shown = f"{tmp_path}/vp\\xff"  # the byte, as the logs write it
    info = [labels for labels, _ in samples["volprobe_target_info"] if labels["target"] == "odd"]
    assert info and info[0]["mountpoint"] == shown
    protobuf = "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
    escaped = shown.replace("\\", "\\\\")  # a label value's backslash, in the text formats
    for accept, label in (("application/openmetrics-text; version=1.0.0", escaped), (protobuf, shown)):
        request = urllib.request.Request(exporter.url + "/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200 and label.encode() in response.read()
    assert "<td>odd</td>" in exporter.get("/")
    exporter.reload(config, text.format(tmp_path / "link", "40ms"))
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_config_last_reload_successful") == 1
    assert "Traceback" not in exporter.log()
    assert exporter.stop() == 0


def test_the_tools_see_a_mount_point_that_is_not_utf8(tmp_path, make_loop):
    """`volprobe check-config` judges a raw write target (whose safety checks read the mount table) and
    `volprobe devices` lists the mount, printing its mount point's bytes as they are."""
    mounted, blank = make_loop(32 * MIB, name="mounted"), make_loop(32 * MIB, name="blank")
    run("mkfs.ext4", "-q", "-F", mounted)
    point = os.fsencode(tmp_path) + b"/" + ODD
    os.mkdir(point)
    config = write_config(
        tmp_path, f"targets: [{{device: {blank}, allow_raw_writes: true, probes: [{{op: write, interval: 1s}}]}}]\n"
    )
    prefix = mounted_privately(mounted, point)
    checked = subprocess.run([*prefix, *volprobe_command("check-config", config)], capture_output=True, timeout=60)
    assert checked.returncode == 0 and b"OK, 1 target(s)" in checked.stdout, checked.stderr.decode(errors="replace")
    listed = subprocess.run([*prefix, *volprobe_command("devices")], capture_output=True, timeout=60)
    assert listed.returncode == 0, listed.stderr.decode(errors="replace")
    row = next(line for line in listed.stdout.splitlines() if line.startswith(os.path.basename(mounted).encode()))
    assert point in row and b"is mounted on " + point in row
