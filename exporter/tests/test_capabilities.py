"""Features a hardened unit or a container can take away: each is exported (volprobe_capability_available)
and logged once when missing, and volprobe falls back rather than stopping."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from volprobe.capabilities import Capabilities

from .support.harness import probes_done, run, sample_value, write_config

SHIM = Path(__file__).parent / "noioprio" / "noioprio.c"


@pytest.fixture
def no_targets(tmp_path) -> str:
    return write_config(tmp_path, "targets: []\n")


def test_idle_io_priority_is_checked_at_start_and_exported(start_exporter, no_targets):
    exporter = start_exporter("--config", no_targets)
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_capability_available", capability="idle_io_priority") == 1
    assert "unavailable" not in exporter.log()


def test_a_denied_ioprio_set_is_logged_once_and_exported(start_exporter, no_targets, tmp_path):
    shim = tmp_path / "noioprio.so"
    run("cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(SHIM), "-ldl")
    exporter = start_exporter("--config", no_targets, env={"LD_PRELOAD": str(shim)})
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_capability_available", capability="idle_io_priority") == 0
    exporter.get("/metrics")
    assert exporter.stop() == 0
    log = exporter.log()
    assert log.count("idle_io_priority unavailable") == 1 and "normal priority" in log, log


def test_discovery_without_udev_falls_back_to_rescans_and_says_so(start_exporter, tmp_path):
    # This machine has no udevd (/run/udev): the monitor cannot be had; discovery rescans sysfs instead.
    config = write_config(tmp_path, "discovery: {include: ['^volprobe-none-such$'], rescan_interval: 1s}\n")
    exporter = start_exporter("--config", config)
    samples = exporter.wait_for(
        lambda s: sample_value(s, "volprobe_capability_available", capability="udev_monitor") is not None,
        what="the udev monitor's capability",
    )
    assert sample_value(samples, "volprobe_capability_available", capability="udev_monitor") == 0
    assert exporter.stop() == 0
    assert exporter.log().count("udev_monitor unavailable") == 1


def test_a_missing_capability_is_logged_once_until_it_was_had_again(caplog):
    found, other = Capabilities(), Capabilities()
    with caplog.at_level(logging.WARNING, logger="volprobe.capabilities"):
        found.record("udev_monitor", False, "no netlink")
        found.record("udev_monitor", False, "no netlink")
        assert [r.getMessage() for r in caplog.records] == ["udev_monitor unavailable: no netlink"]
        found.record("udev_monitor", True)
        found.record("udev_monitor", False, "gone")
    assert [r.getMessage() for r in caplog.records][1:] == ["udev_monitor unavailable: gone"]
    assert found.known() == {"udev_monitor": False}
    assert other.known() == {}  # each exporter's own: nothing is shared through the module


# -- what volprobe keeps of a privileged container's capabilities (volprobe.privileges) ------------------------

SYS_ADMIN, DAC_OVERRIDE = 1 << 21, 1 << 1
# Each mode: what its configuration adds to a loop device's read probes, its flags, and what volprobe keeps.
MODES = {
    "default": ("", (), 0),
    "pod volume rules": ("kubernetes: {{kubelet_directory: {kubelet}, rules: [{{path: '/none/*'}}]}}\n", (), SYS_ADMIN),
    "nvme statistics": ("", ("--nvme.provider-statistics",), SYS_ADMIN),
    # In a directory another user owns (postgres's 0700 /var/lib/postgresql): root writes there only with it.
    "directory target": (
        "  - {{name: d, directory: {data}, probe_file_size: 1MiB, probes: [{{op: write, interval: 100ms}}]}}\n",
        (),
        DAC_OVERRIDE,
    ),
}


def privileges_of(pid: int) -> dict[str, dict[str, int]]:
    """Each thread's (by its id and name) capability sets and no_new_privs, from /proc/PID/task/*/status."""
    found = {}
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        try:
            status = (task / "status").read_text()
            name = (task / "comm").read_text().strip()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        keys = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
        found[f"{task.name} {name}"] = {key: int(fields[key], 16) for key in keys} | {
            "NoNewPrivs": int(fields["NoNewPrivs"])
        }
    return found


@pytest.mark.root
@pytest.mark.parametrize("mode", MODES)
def test_volprobe_keeps_only_the_capabilities_its_configuration_uses(start_exporter, tmp_path, make_loop, mode):
    # Started as root, with every capability (as a privileged container's process is): every thread of the
    # process, the probes', the C engine's, the HTTP servers' and the followers' included, has exactly the mode's
    # set left in every set, the bounding set included, nothing inheritable or ambient, and no_new_privs.
    section, flags, expected = MODES[mode]
    kubelet = tmp_path / "kubelet"
    kubelet.mkdir()
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chown(data, 12345, 12345)
    text = (
        f"targets:\n  - {{name: vol, device: {make_loop(16 * 1024 * 1024)}, probes: [{{op: read, interval: 100ms}}]}}\n"
    )
    if section.startswith("  -"):
        text += section.format(data=data)
    else:
        text += section.format(kubelet=kubelet)
    exporter = start_exporter("--config", write_config(tmp_path, text), *flags)
    writes = "directory" in mode
    exporter.wait_for(lambda s: probes_done(s, "vol") > 0 and (not writes or probes_done(s, "d", "write") > 0))
    threads = privileges_of(exporter.process.pid)
    assert len(threads) >= 5 and any("vp http" in name for name in threads), threads
    expected_sets = {"CapInh": 0, "CapPrm": expected, "CapEff": expected, "CapBnd": expected, "CapAmb": 0}
    assert {name: found for name, found in threads.items() if found != {**expected_sets, "NoNewPrivs": 1}} == {}
    kept = {0: "none", SYS_ADMIN: "CAP_SYS_ADMIN", DAC_OVERRIDE: "CAP_DAC_OVERRIDE"}[expected]
    assert exporter.value("volprobe_capabilities_kept_info", capabilities=kept) == 1
    assert f"keeping capabilities: {kept}" in exporter.log()
    if "rules" in mode:  # what it kept is what the rules use: private copies of the pod volumes' mounts
        assert exporter.value("volprobe_capability_available", capability="private_mount") == 1


@pytest.mark.root
def test_a_reload_that_adds_a_rule_says_it_cannot_have_sys_admin_back(start_exporter, tmp_path):
    kubelet = tmp_path / "kubelet"
    kubelet.mkdir()
    config = Path(write_config(tmp_path, f"targets: []\nkubernetes: {{kubelet_directory: {kubelet}}}\n"))
    exporter = start_exporter("--config", str(config))
    assert exporter.value("volprobe_capabilities_kept_info", capabilities="none") == 1
    exporter.reload(config, f"targets: []\nkubernetes: {{kubelet_directory: {kubelet}, rules: [{{path: '/x/*'}}]}}\n")
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_capability_available", capability="private_mount") == 0
    assert "SIGHUP: kubernetes.rules need CAP_SYS_ADMIN (private mount copies), dropped at start" in exporter.log()
    assert privileges_of(exporter.process.pid) and all(
        found["CapEff"] == found["CapBnd"] == 0 for found in privileges_of(exporter.process.pid).values()
    )
