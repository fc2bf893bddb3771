"""podman as the tests run it on these machines (/work/shared/containers.md): a private containers.conf, since
the host's hard limits are below podman's defaults and its hybrid cgroups are refused by crun."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
"""


def containers_conf(directory: Path) -> Path:
    """CONTAINERS_CONF written into `directory`: the file every podman() call of a test is given."""
    conf = directory / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return conf


def podman(
    conf: Path, *args: str, check: bool = True, timeout: float = 300, input: str | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    result = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout, input=input)
    if check and result.returncode != 0:
        pytest.fail(f"podman {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def needs(*tools: str) -> pytest.MarkDecorator:
    """Skip, naming them, when any of these programs is not on the PATH (.ci/run installs them all)."""
    missing = [tool for tool in tools if not shutil.which(tool)]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {' '.join(missing)} (.ci/run installs them)")


@contextlib.contextmanager
def as_udev_would(device: str) -> Iterator[str]:
    """The loop node as udev makes disks (root:disk 0660): there is no udev here, and a container sees the
    host's node and mode. Restored afterwards."""
    before = os.stat(device)
    os.chown(device, 0, 6)
    os.chmod(device, 0o660)
    try:
        yield device
    finally:
        os.chown(device, before.st_uid, before.st_gid)
        os.chmod(device, before.st_mode & 0o7777)
