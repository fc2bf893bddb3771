"""Fixtures over the shared harness (support/harness.py): real block devices (loop, zram), filesystems on them, lab
volumes, a running exporter and a running Prometheus; and the markers that say which tests need what.

Markers (declared in pyproject.toml): `root` for every test that makes block devices or mounts (added here to
each test using a device fixture, and explicitly on the others; skipped when not run as root), `lab` for those
on lab volumes, `slow` for those over ten seconds. `pytest -m "not root"` runs the rest, as any user.

Under pytest-xdist (`.ci/run`: -n 4 --dist loadgroup) tests run side by side, each with its own loop device
numbers (lab.loops_of_this_worker), directories, ports and processes. `xdist_group(NAME)` runs a group one test
after another on one worker: "lab-load" (tests that drive lab volumes to their caps with fio: the throttle
detector's, the lab's own cap checks) and "lab-latency" (tests that hold measured latency to a few percent or
to alert thresholds: end to end, compare's history, fidelity against fio) would each disturb their own kind
on 2 cores; "loop300" shares a discovery range; "compare-backfilled" shares one backfilled Prometheus;
"kube-apiserver" and "cluster" share one API server, and one single-node cluster (support/cluster.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

# The lab's fixtures: lab_volume(**settings) -> Volume, the session-wide clean-up of killed runs' volumes, and
# each xdist worker's own range of loop device numbers.
from lab.fuselab import fuse_directory  # noqa: F401 - fixture
from lab.lab import clean_stale_test_volumes, lab_volume, latency_tests_first, loops_of_this_worker  # noqa: F401 - fixtures

from volprobe import timer

from .support import harness
from .support.harness import MIB, RunningExporter, RunningPrometheus

# Fixtures that make block devices or mount filesystems: a test using one needs root.
ROOT_FIXTURES = frozenset({"make_loop", "mount_fs", "zram_device", "lab_volume", "fuse_directory"})
LAB_FIXTURES = frozenset({"lab_volume", "fuse_directory"})


# A wrapper: what comes before the yield runs before -m deselects (the markers added here count), what comes after
# runs once every other plugin has modified the items (xdist's own group renaming included).
@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Generator[None, None, None]:
    not_root = pytest.mark.skip(reason="needs root to make block devices; CI runs the suite as root")
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & ROOT_FIXTURES and item.get_closest_marker("root") is None:
            item.add_marker(pytest.mark.root)
        if fixtures & LAB_FIXTURES and item.get_closest_marker("lab") is None:
            item.add_marker(pytest.mark.lab)
        if item.get_closest_marker("root") is not None and os.geteuid() != 0:
            item.add_marker(not_root)
    yield
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # xdist hands tests out in this order as workers come free: the long ones first, so none starts last.
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
        if config.getvalue("loadgroup"):
            name_groups(items)


def name_groups(items: list[pytest.Item]) -> None:
    """Rename each test marked xdist_group(NAME) `nodeid@NAME`, which is how --dist loadgroup sends a group to
    one worker. pytest-xdist 3.8 does it through `item._nodeid`, which pytest 9 no longer reads (a node's id is
    `item._id`): without this, loadgroup silently groups nothing. A no-op where xdist's own renaming works."""
    for item in items:
        groups = sorted(
            {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
        )
        suffix = "@" + "_".join(groups)
        if groups and not item.nodeid.endswith(suffix):
            item._id = type(item._id).parse(item.nodeid + suffix)


@pytest.fixture(scope="session")
def exporter_toolkit(tmp_path_factory) -> Path:
    """The reference web-config implementation, built once per run, by the first xdist worker that needs it
    (tests/support/toolkit.py)."""
    from .support import toolkit

    directory = harness.shared_directory(tmp_path_factory, "exporter-toolkit")
    with harness.locked(directory / "build.lock"):
        binary = directory / toolkit.BINARY
        return binary if binary.exists() else toolkit.build(directory)


@pytest.fixture(params=["c", "c-thread", "python"])
def loop_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The timer a ProbeWorker made in the test gets: the C timer through the probe engine, the C timer in the
    probe's own thread (as a probe that keeps nothing open runs it), and the Python timer."""
    if request.param.startswith("c") and timer._timedio is None:
        pytest.skip(f"the C timer is not in use (${timer.TEST_TIMER_ENV})")
    if request.param == "c-thread":
        monkeypatch.setattr(timer, "_ENGINE", False)
    if request.param == "python":
        monkeypatch.setattr(timer, "_timedio", None)
    return str(request.param)


@pytest.fixture
def make_loop(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """make_loop(size=64MiB, direct_io=True, name=...) -> /dev/loopN over a sparse file in tmp_path."""
    with contextlib.ExitStack() as stack:
        count = 0

        def make(size: int = 64 * MIB, direct_io: bool = True, name: str = "disk") -> str:
            nonlocal count
            backing = tmp_path / f"{name}-{count}.img"
            count += 1
            return stack.enter_context(harness.loop_device(backing, size, direct_io=direct_io))

        yield make


@pytest.fixture
def mount_fs(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """mount_fs(device, fstype="ext4") -> mount point of a fresh filesystem on the device."""
    with contextlib.ExitStack() as stack:
        count = 0

        def mount(device: str, fstype: str = "ext4") -> str:
            nonlocal count
            point = tmp_path / f"mnt{count}"
            count += 1
            return stack.enter_context(harness.mounted_fs(device, point, fstype))

        yield mount


@pytest.fixture
def zram_device() -> Iterator[str]:
    """A fresh 256 MiB zram device (RAM-backed: microsecond latency)."""
    with harness.zram(256 * MIB) as device:
        yield device


@pytest.fixture
def start_exporter(tmp_path: Path) -> Iterator[Callable[..., RunningExporter]]:
    """start_exporter(*args) runs `volprobe *args` on a free loopback port until /-/ready answers."""
    running: list[RunningExporter] = []

    def start(
        *args: str,
        ready_timeout: float = 30.0,
        tls: bool = False,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> RunningExporter:
        log_path = tmp_path / f"exporter-{len(running)}.log"
        exporter = harness.start_volprobe(
            *args, log_path=log_path, ready_timeout=ready_timeout, tls=tls, env=env, prefix=prefix
        )
        running.append(exporter)
        return exporter

    yield start
    for exporter in running:
        exporter.kill()


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[..., RunningPrometheus]]:
    """start_prometheus(config_text, version="2") runs Prometheus (Debian's 2.42, or the 3.x .ci/run builds) on a
    free loopback port until it is ready."""
    running: list[RunningPrometheus] = []

    def start(config_text: str, version: str = "2") -> RunningPrometheus:
        server = harness.start_prometheus(config_text, tmp_path / f"prometheus-{len(running)}", version=version)
        running.append(server)
        return server

    yield start
    for server in running:
        server.stop()
