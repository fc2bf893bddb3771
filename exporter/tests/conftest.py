"""Shared fixtures: real block devices (loop, zram), filesystems on them, and a running exporter."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy" / "lab"))
from lab import clean_stale_test_volumes, lab_volume  # noqa: E402, F401 - fixtures shared with the lab's tests

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MIB = 1024 * 1024

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates block devices; CI runs the suite as root")


def run(*cmd: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)


def sha256_of(path: str, length: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = length
        while remaining is None or remaining > 0:
            chunk = f.read(MIB if remaining is None else min(MIB, remaining))
            if not chunk:
                break
            digest.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return digest.hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def make_loop(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """make_loop(size=64MiB, direct_io=True, name=...) -> /dev/loopN over a sparse file in tmp_path."""
    created: list[str] = []

    def make(size: int = 64 * MIB, direct_io: bool = True, name: str = "disk") -> str:
        backing = tmp_path / f"{name}-{len(created)}.img"
        with open(backing, "wb") as f:
            f.truncate(size)
        dio = "--direct-io=on" if direct_io else "--direct-io=off"
        device = run("losetup", "--find", "--show", dio, str(backing)).stdout.strip()
        created.append(device)
        return device

    yield make
    for device in created:
        with contextlib.suppress(subprocess.CalledProcessError):
            run("losetup", "--detach", device)


@pytest.fixture
def mount_fs(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """mount_fs(device, fstype="ext4") -> mount point of a fresh filesystem on the device."""
    mounted: list[str] = []

    def mount(device: str, fstype: str = "ext4") -> str:
        run(f"mkfs.{fstype}", *(["-q", "-F"] if fstype.startswith("ext") else ["-f"]), device)
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        run("mount", device, str(point))
        mounted.append(str(point))
        return str(point)

    yield mount
    for point in reversed(mounted):
        with contextlib.suppress(subprocess.CalledProcessError):
            run("umount", point)


@pytest.fixture
def zram_device() -> Iterator[str]:
    """A fresh 256 MiB zram device (RAM-backed: microsecond latency)."""
    control = Path("/sys/class/zram-control/hot_add")
    number = control.read_text().strip()
    name = f"zram{number}"
    Path(f"/sys/block/{name}/disksize").write_text(str(256 * MIB))
    yield f"/dev/{name}"
    with contextlib.suppress(OSError):
        Path(f"/sys/block/{name}/reset").write_text("1")
    with contextlib.suppress(OSError):
        Path("/sys/class/zram-control/hot_remove").write_text(number)


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """{sample name: [(labels, value)]} of an exposition text."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def sample_value(samples, name: str, **labels: str) -> float | None:
    for found, value in samples.get(name, []):
        if all(found.get(k) == v for k, v in labels.items()):
            return value
    return None


@dataclass
class RunningExporter:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str = "/metrics", timeout: float = 5.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return response.read().decode()

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        return parse_metrics(self.get())

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float = 30.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        samples: dict = {}
        while time.monotonic() < deadline:
            samples = self.metrics()
            if predicate(samples):
                return samples
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; log:\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def volprobe_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "volprobe", *args]


@pytest.fixture
def start_exporter(tmp_path: Path) -> Iterator[Callable[..., RunningExporter]]:
    """start_exporter(*args) runs `volprobe *args` on a free loopback port until /-/ready answers."""
    running: list[RunningExporter] = []

    def start(*args: str, ready_timeout: float = 30.0, tls: bool = False) -> RunningExporter:
        port = free_port()
        log_path = tmp_path / f"exporter-{len(running)}.log"
        log_file = open(log_path, "w")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            volprobe_command("--web.listen-address", f"127.0.0.1:{port}", *args),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        exporter = RunningExporter(process, port, log_path)
        running.append(exporter)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"exporter exited with {process.returncode}:\n{log_path.read_text()}")
            with contextlib.suppress(OSError):
                if tls:  # readiness over plain HTTP is not possible: wait for the listener
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                else:
                    exporter.get("/-/ready", timeout=1)
                return exporter
            time.sleep(0.1)
        raise AssertionError(f"exporter not ready:\n{log_path.read_text()}")

    yield start
    for exporter in running:
        if exporter.process.poll() is None:
            exporter.process.kill()
            exporter.process.wait(10)


def stop_fio(process: subprocess.Popen) -> None:
    """Stop a fio run: SIGTERM to its process group. fio forks its jobs; killing the parent alone would
    leave them running, loading later tests, until their device goes away."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


@dataclass
class RunningPrometheus:
    process: subprocess.Popen
    port: int
    log_path: Path

    def api(self, path: str, **params: str) -> object:
        import json
        import urllib.parse

        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[..., RunningPrometheus]]:
    """start_prometheus(config_text) runs Debian's prometheus on a free loopback port until it is ready."""
    running: list[RunningPrometheus] = []

    def start(config_text: str) -> RunningPrometheus:
        directory = tmp_path / f"prometheus-{len(running)}"
        directory.mkdir()
        (directory / "prometheus.yml").write_text(config_text)
        port = free_port()
        log_path = directory / "log"
        log_file = open(log_path, "w")  # noqa: SIM115 - the child keeps it
        process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        server = RunningPrometheus(process, port, log_path)
        running.append(server)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{log_path.read_text()}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1).read()
                return server
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready:\n{log_path.read_text()}")

    yield start
    for server in running:
        server.process.terminate()
        try:
            server.process.wait(20)
        except subprocess.TimeoutExpired:
            server.process.kill()
