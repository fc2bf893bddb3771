"""The one test harness, shared by the tests and the benchmarks: commands, free ports, block devices, the real
exporter and a real Prometheus, and reading an exposition.

Plain functions and context managers: exporter/tests/conftest.py wraps them in fixtures, the tests import them
as `from .support.harness import ...`, and bench/benchlib.py as `from tests.support import harness` (with
`exporter` and `deploy` on the path, as pyproject.toml's pytest `pythonpath` puts them). The device context
managers need root; everything else does not.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
from lab import lab
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "exporter" / "tests" / "fixtures"
MIB = 1024 * 1024

Samples = dict[str, list[tuple[dict[str, str], float]]]


# -- commands -------------------------------------------------------------------------------------------


def run(*cmd: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; raises CalledProcessError on a non-zero exit, output captured as text."""
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def descriptors_on(path: str, pid: int | str = "self") -> int:
    """How many of the process's descriptors are open on `path` (its real path) now."""
    real, count = os.path.realpath(path), 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed while we looked
            count += os.path.realpath(f"/proc/{pid}/fd/{fd}") == real
    return count


# The probe engine's threads (_timedio.c): its leader and watcher, one more for each request stalled past its grace,
# and up to two spares kept from earlier stalls (MAX_PARKED). Started at the first probe, never ended.
ENGINE_THREAD = "vp probes"
ENGINE_MOST_IDLE = 4  # leader, watcher and two spares, with no request stalled


def thread_names(pid: int) -> list[str]:
    """The names (comm) of a process's threads; those that ended while being listed are left out."""
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            names.append((task / "comm").read_text().strip())
    return names


def threads(pid: int) -> int:
    """A process's threads but the probe engine's, whose number depends on past stalls, not on what runs now."""
    return sum(name != ENGINE_THREAD for name in thread_names(pid))


def engine_threads(pid: int) -> int:
    return thread_names(pid).count(ENGINE_THREAD)


def thread_stacks(pid: int) -> str:
    """Each thread of a process as the kernel sees it now: name, state, and (as root) its kernel stack. For the
    message of a failed assertion that some probe went on: says where a thread that should have was waiting."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda t: int(t.name)):
        with contextlib.suppress(OSError):  # the thread ended while we looked
            state = next(line for line in (task / "status").read_text().splitlines() if line.startswith("State:"))
            try:
                stack = " < ".join(frame.split()[-1] for frame in (task / "stack").read_text().splitlines()[:8])
            except PermissionError:
                stack = "(its stack: root only)"
            lines.append(f"{task.name} {(task / 'comm').read_text().strip()!r} {state.split()[1]}: {stack}")
    return "\n".join(lines)


def probe_report(samples: Samples, target: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A target's probe series that tell why its probes did not go on: errors, failures, missed slots, the
    request in flight and its interval."""
    names = ("errors_total", "failures_total", "missed_total", "inflight_seconds", "interval_seconds")
    return {
        name: [(labels, v) for labels, v in samples.get(f"volprobe_probe_{name}", []) if labels["target"] == target]
        for name in names
    }


class OpenFiles:
    """This process's descriptors open on one filesystem, told by the file each one opens (its device and inode),
    never by its name: a file opened through a private copy of a mount (volprobe.privatemount) is named from the
    copy's root ("/.volprobe-probe"), not from where the test made it. Those open when it was made are not counted, nor
    those on the files `besides` (what the code under test keeps open by design)."""

    def __init__(self, path: Path, besides: Iterable[Path] = ()) -> None:
        self.device = path.stat().st_dev
        self.besides = {(p.stat().st_dev, p.stat().st_ino) for p in besides}
        self.before = self._open()

    def _open(self) -> dict[str, tuple[int, int]]:
        found = {}
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile, or the listing's own descriptor
                opened = os.stat(f"/proc/self/fd/{fd}")
                if opened.st_dev == self.device:
                    found[fd] = (opened.st_dev, opened.st_ino)
        return found

    def new(self) -> list[str]:
        """The descriptors on the filesystem now that were not open (on that file) before."""
        return sorted(
            fd for fd, file in self._open().items() if self.before.get(fd) != file and file not in self.besides
        )


def wait_until(condition: Callable[[], object], timeout: float = 10.0, what: str = "", every: float = 0.005) -> float:
    """Poll `condition` every `every` seconds until it holds; the monotonic time it was first seen to hold."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        time.sleep(every)
    return time.monotonic()


def volprobe_command(*args: str) -> list[str]:
    """The command line of `volprobe ARGS` with this interpreter (the venv the tests run in)."""
    return [sys.executable, "-m", "volprobe", *args]


def write_config(directory: Path, text: str, name: str = "volprobe.yml") -> str:
    """Write a configuration file into `directory` and return its path."""
    path = Path(directory) / name
    path.write_text(text)
    return str(path)


def sha256_of(path: str, length: int | None = None) -> str:
    """SHA-256 of a file or device, or of its first `length` bytes."""
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


def stop_fio(process: subprocess.Popen[bytes]) -> None:
    """Stop a fio run started with start_new_session=True: SIGTERM to its process group. fio forks its jobs;
    killing the parent alone would leave them running, loading later tests, until their device goes away."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)


# -- set-up shared by the workers of a run (pytest-xdist) ------------------------------------------------


def shared_directory(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """`name` under this run's base temporary directory, which its xdist workers share (each worker's own is
    popen-gwN in it): for set-up done once per run, under `locked`. A run without workers has its own."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    directory = base / name
    directory.mkdir(exist_ok=True)
    return directory


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (made if missing): set-up that two workers must not do at once."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


# -- block devices (root) ------------------------------------------------------------------------------


def attach_loop(options: list[str], backing: str | Path) -> str:
    """Attach `backing` to a free loop device (the lowest, or from $VOLPROBE_TEST_FIRST_LOOP: lab.free_loop)."""
    return lab.attach_loop(options, backing)


def free_loop() -> str:
    """The name the next attach would take, for tests that attach a device by name later."""
    return lab.free_loop()


@contextlib.contextmanager
def loop_device(
    backing: str | Path, size: int = 64 * MIB, direct_io: bool = True, sector_size: int | None = None
) -> Iterator[str]:
    """/dev/loopN over `backing`, made (or cut) to a sparse file of `size` bytes; detached on exit."""
    with open(backing, "r+b" if Path(backing).exists() else "wb") as f:
        f.truncate(size)
    options = ["--direct-io=on" if direct_io else "--direct-io=off"]
    if sector_size:
        options += ["--sector-size", str(sector_size)]
    device = attach_loop(options, backing)
    try:
        yield device
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            run("losetup", "--detach", device)


@contextlib.contextmanager
def zram(size: int = 256 * MIB) -> Iterator[str]:
    """A fresh, blank zram device (RAM-backed: microsecond latency); reset and removed on exit."""
    number = Path("/sys/class/zram-control/hot_add").read_text().strip()
    try:
        Path(f"/sys/block/zram{number}/disksize").write_text(str(size))
        yield f"/dev/zram{number}"
    finally:
        with contextlib.suppress(OSError):
            Path(f"/sys/block/zram{number}/reset").write_text("1")
        with contextlib.suppress(OSError):
            Path("/sys/class/zram-control/hot_remove").write_text(number)


@contextlib.contextmanager
def mounted_fs(device: str, point: str | Path, fstype: str = "ext4") -> Iterator[str]:
    """A fresh `fstype` filesystem made on `device` and mounted on `point` (created); unmounted on exit."""
    run(f"mkfs.{fstype}", *(["-q", "-F"] if fstype.startswith("ext") else ["-f"]), device)
    Path(point).mkdir(parents=True, exist_ok=True)
    run("mount", device, str(point))
    try:
        yield str(point)
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            run("umount", str(point))


@contextlib.contextmanager
def lab_device(name: str, **settings: Any) -> Iterator[lab.Volume]:
    """A lab volume (deploy/lab: nbdkit -> nbdfuse -> loop) by name, torn down on exit."""
    volume = lab.up(name, **settings)
    try:
        yield volume
    finally:
        lab.down(name)


# -- the exposition ---------------------------------------------------------------------------------------


def parse_metrics(text: str) -> Samples:
    """{sample name: [(labels, value)]} of an exposition text."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def probes_done(samples: Samples, target: str, op: str = "read") -> float:
    """Probes a target's `op` completed, all touches together (the latency histogram's count)."""
    return sum(
        v
        for labels, v in samples.get("volprobe_probe_latency_seconds_count", [])
        if labels["target"] == target and labels["op"] == op
    )


def recent_probes(samples: Samples, target: str, touch: str, op: str | None = None) -> float:
    """Probes of a target's `op` (or of all its ops) with `touch` ("first" or "repeat") in the recent window (the
    recent-latency summary's count)."""
    return sum(
        v
        for labels, v in samples.get("volprobe_probe_latency_recent_seconds_count", [])
        if labels["target"] == target and labels["touch"] == touch and op in (None, labels["op"])
    )


def sample_value(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the first sample `name` whose labels include `labels`, or None."""
    for found, value in samples.get(name, []):
        if all(found.get(k) == v for k, v in labels.items()):
            return value
    return None


# -- the exporter ----------------------------------------------------------------------------------------


def process_cpu_clock(pid: int) -> int:
    """The clock id of a process's CPU time, as clock_getcpuclockid(3) makes it on Linux: the time all its threads
    have run, those that exited included, in nanoseconds (the scheduler's sum_exec_runtime)."""
    return (~pid << 3) | 2  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def process_cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, its exited threads included: its CPU-time clock (exact), or where that cannot
    be read, process_cpu_ticks()."""
    with contextlib.suppress(OSError):
        return time.clock_gettime(process_cpu_clock(pid))
    return process_cpu_ticks(pid)


def process_cpu_ticks(pid: int) -> float:
    """User + system CPU time of a process from /proc/PID/stat, in seconds: whole clock ticks, up to 10 ms off."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class RunningExporter:
    """A `volprobe` process serving on a loopback port."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    log_file: IO[str] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str = "/metrics", timeout: float = 5.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            body: bytes = response.read()
            return body.decode()

    def metrics(self) -> Samples:
        return parse_metrics(self.get())

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples `name` whose labels include `labels` (0 if none)."""
        return sum(
            value for found, value in self.metrics().get(name, []) if all(found.get(k) == v for k, v in labels.items())
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, predicate: Callable[[Samples], bool], timeout: float = 30.0, what: str = "condition") -> Samples:
        deadline = time.monotonic() + timeout
        samples: Samples = {}
        while time.monotonic() < deadline:
            samples = self.metrics()
            if predicate(samples):
                return samples
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; log:\n{self.log()[-3000:]}")

    def reload(self, config: Path, text: str) -> None:
        """Write `text` to the config file, send SIGHUP and wait until the log says it was applied."""
        reloads, rejections = self.log().count("configuration reloaded"), self.log().count("rejected")
        config.write_text(text)
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while self.log().count("configuration reloaded") == reloads:
            assert self.log().count("rejected") == rejections, self.log()[-2000:]
            assert time.monotonic() < deadline, f"no reload in the log:\n{self.log()[-2000:]}"
            time.sleep(0.05)

    def cpu_seconds(self) -> float:
        """CPU time of the process so far (process_cpu_seconds)."""
        return process_cpu_seconds(self.process.pid)

    def rss_bytes(self) -> tuple[int, int]:
        """(resident memory now, peak resident memory) of the process."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        rss, peak = (int(re.findall(rf"{key}:\s+(\d+) kB", status)[0]) * 1024 for key in ("VmRSS", "VmHWM"))
        return rss, peak

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, and the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            self.close_log()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.close_log()

    def close_log(self) -> None:
        if self.log_file is not None and self.process.poll() is not None:
            self.log_file.close()


def start_volprobe(
    *args: str,
    log_path: Path,
    ready_timeout: float = 30.0,
    tls: bool = False,
    env: dict[str, str] | None = None,
    prefix: tuple[str, ...] = (),
) -> RunningExporter:
    """Run `volprobe ARGS` on a free loopback port (output to `log_path`) until /-/ready answers; with tls,
    until the port accepts connections (readiness over plain HTTP is not possible). `env` adds to the
    environment; `prefix` runs the command under another (setpriv, say). A port taken by another process between
    free_port() and the exporter's bind (the suite runs on four workers) is given up for another, twice at most."""
    for attempt in range(3):
        exporter = _start_volprobe(args, log_path, ready_timeout, tls, env, prefix, retry_taken_port=attempt < 2)
        if exporter is not None:
            return exporter
    raise AssertionError("unreachable: the last attempt returns or raises")


def _start_volprobe(
    args: tuple[str, ...],
    log_path: Path,
    ready_timeout: float,
    tls: bool,
    env: dict[str, str] | None,
    prefix: tuple[str, ...],
    retry_taken_port: bool,
) -> RunningExporter | None:
    """start_volprobe's one attempt: None if the exporter exited because its port was taken in the meantime
    and `retry_taken_port`."""
    port = free_port()
    log_file = open(log_path, "w")  # noqa: SIM115 - closed by stop() or kill()
    process = subprocess.Popen(
        [*prefix, *volprobe_command("--web.listen-address", f"127.0.0.1:{port}", *args)],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    exporter = RunningExporter(process, port, Path(log_path), log_file)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            exporter.close_log()
            if retry_taken_port and f"cannot listen on 127.0.0.1:{port}: Address already in use" in exporter.log():
                return None
            raise AssertionError(f"exporter exited with {process.returncode}:\n{exporter.log()}")
        with contextlib.suppress(OSError):
            if tls:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            else:
                exporter.get("/-/ready", timeout=1)
            return exporter
        time.sleep(0.1)
    exporter.kill()
    raise AssertionError(f"exporter not ready:\n{exporter.log()}")


# -- Prometheus ------------------------------------------------------------------------------------------


@dataclass
class RunningPrometheus:
    """Debian's `prometheus` serving on a loopback port."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


# Prometheus 2.42 is Debian's; 3.x is built from Go's module proxy by .ci/run into a cache outside the checkout.
PROMETHEUS_3 = Path(os.environ.get("VOLPROBE_PROMETHEUS_3", "/var/cache/volprobe-ci/prometheus-v0.316.0"))
PROMETHEUS_VERSIONS = ("2", "3")


def prometheus_built(version: str) -> bool:
    """Whether Prometheus `version` can be run here (2 is Debian's; 3 only where .ci/run built it)."""
    return version == "2" or os.access(PROMETHEUS_3 / "prometheus", os.X_OK)


def prometheus_tool(name: str, version: str = "2") -> str:
    """The `prometheus` or `promtool` command of Prometheus `version` ("2" or "3"); skips the test when 3 was not
    built (.ci/run always builds it)."""
    if version == "2":
        return name
    tool = PROMETHEUS_3 / name
    if not os.access(tool, os.X_OK):
        pytest.skip(f"Prometheus 3 is not built at {PROMETHEUS_3} (.ci/run builds it)")
    return str(tool)


def start_prometheus(
    config_text: str,
    directory: Path,
    ready_timeout: float = 60.0,
    web_config: Path | None = None,
    ready: Callable[[int], None] | None = None,
    args: tuple[str, ...] = (),
    version: str = "2",
) -> RunningPrometheus:
    """Run prometheus with `config_text` and its data in `directory`/data (made here, or backfilled before) until
    /-/ready answers (`ready(port)` raises until it does, for a server behind `web_config`'s TLS or auth); `args`
    adds to its command line."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "prometheus.yml").write_text(config_text)
    port = free_port()
    log_path = directory / "log"
    extra = [f"--web.config.file={web_config}"] if web_config else []
    with open(log_path, "w") as log_file:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [
                prometheus_tool("prometheus", version),
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                *extra,
                *args,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    server = RunningPrometheus(process, port, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{log_path.read_text()}")
        with contextlib.suppress(OSError):
            if ready is not None:
                ready(port)
            else:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1).read()
            return server
        time.sleep(0.2)
    server.stop()
    raise AssertionError(f"prometheus not ready:\n{log_path.read_text()}")


def start_with_kept_target(
    tmp_path: Path, start_exporter: Callable[..., RunningExporter]
) -> tuple[RunningExporter, Path, str]:
    """An exporter on a configuration file with one directory target, `kept` (a write every 50 ms), once it has
    probed: the running configuration a refused reload must keep. (exporter, the file, its good text.)"""
    (tmp_path / "data").mkdir()
    good = f"targets: [{{name: kept, directory: {tmp_path / 'data'}, probe_file_size: 1MiB, "
    good += "probes: [{op: write, block_size: 4KiB, interval: 50ms}]}]\n"
    path = tmp_path / "volprobe.yml"
    path.write_text(good)
    exporter = start_exporter("--config", str(path))
    exporter.wait_for(lambda s: probes_done(s, "kept", "write") >= 1, what="the first probes")
    return exporter, path, good
