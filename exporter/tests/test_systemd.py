"""The systemd units: `systemd-analyze verify` clean, and `systemd-analyze security` exposure at most 2.5."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .support.harness import REPO

UNITS = REPO / "systemd"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with the system's own units (for the dependencies verify follows) and the paths the units use:
    verify checks that ExecStart binaries exist, and volprobe is not installed system-wide here."""
    shutil.copytree("/lib/systemd/system", tmp_path / "lib/systemd/system", symlinks=True)
    for binary in ("usr/local/bin/volprobe", "bin/sh"):
        path = tmp_path / binary
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    (tmp_path / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS.glob("*.service"):
        shutil.copy(unit, tmp_path / "etc/systemd/system" / unit.name)
    return tmp_path


@pytest.mark.parametrize("unit", ["volprobe.service", "volprobe-warmup@dev-nvme1n1.service"])
def test_systemd_analyze_verify_is_clean(root, unit):
    result = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", f"/etc/systemd/system/{unit}"], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


@pytest.mark.parametrize("unit", ["volprobe.service", "volprobe-warmup@.service"])
def test_security_exposure_at_most_2_5(tmp_path, unit):
    path = tmp_path / unit.replace("@.", "@dev-nvme1n1.")
    shutil.copy(UNITS / unit, path)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(path)], capture_output=True, text=True
    )
    exposure = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout).group(1))
    assert exposure <= 2.5, result.stdout


def test_the_provider_stats_drop_in_keeps_the_exposure_at_most_2_5(tmp_path):
    """The opt-in drop-in for AWS NVMe statistics (CAP_SYS_ADMIN): the unit with it still scores <= 2.5."""
    path = tmp_path / "volprobe.service"
    drop_in = (UNITS / "volprobe.service.d" / "provider-stats.conf.example").read_text()
    settings = dict(line.split("=", 1) for line in drop_in.splitlines() if "=" in line and not line.startswith("#"))
    assert settings == {"CapabilityBoundingSet": "CAP_SYS_ADMIN", "AmbientCapabilities": "CAP_SYS_ADMIN"}
    text = (UNITS / "volprobe.service").read_text()
    for key, value in settings.items():  # as systemd applies the drop-in: the later assignment wins
        text = text.replace(f"\n{key}=\n", f"\n{key}={value}\n")
    path.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(path)], capture_output=True, text=True
    )
    assert "CapabilityBoundingSet=~CAP_SYS_ADMIN" in result.stdout  # the capability is really granted here
    exposure = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout).group(1))
    assert exposure <= 2.5, result.stdout


def test_probes_never_run_at_the_idle_io_class():
    text = (UNITS / "volprobe.service").read_text()
    assert "IOSchedulingClass=best-effort" in text and "IOSchedulingClass=idle" not in text
    for directive in (
        "DynamicUser=yes",
        "SupplementaryGroups=disk",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=\n",
        "DeviceAllow=block-* r",
        "SystemCallFilter=@system-service",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "ExecReload=/bin/sh -c 'kill -HUP \"$MAINPID\"'",
        "Restart=on-failure",
        "StateDirectory=volprobe",
        "ConfigurationDirectory=volprobe",
        "PrivateTmp=yes",
        "ProtectHome=yes",
        "MemoryMax=",
    ):
        assert directive in text, directive


def test_extra_flags_come_from_the_environment_file_as_debians_node_exporter_takes_them(root):
    """EnvironmentFile=-/etc/default/volprobe (optional: the leading '-'), its ARGS= appended to ExecStart, split
    into words: what systemd resolves the command line to, with and without the file."""
    text = (UNITS / "volprobe.service").read_text()
    assert "\nEnvironmentFile=-/etc/default/volprobe\n" in text
    (exec_start,) = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    assert exec_start.endswith(" $ARGS"), exec_start
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    (root / "etc/default").mkdir(parents=True)
    (root / "etc/default/volprobe").write_text('ARGS="--log.format json --web.max-requests 5"\n')
    result = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", "/etc/systemd/system/volprobe.service"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
