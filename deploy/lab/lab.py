#!/usr/bin/env python3
"""The volume lab: emulated cloud volumes as real kernel block devices, for volprobe's tests and demo.

Each volume is nbdkit (volume_plugin.py: latency, throttling, lazy allocation, errors, stalls) -> nbdfuse
(a FUSE file) -> `losetup --direct-io=on` (a real /dev/loopN that O_DIRECT, fio, mkfs and mount work on).

    lab.py up NAME [--size 256MiB] [--read-latency 2ms] [--write-latency 5ms] [--jitter 0.2ms]
                   [--tail-fraction 0.02 --tail-latency 8ms]
                   [--iops-limit N] [--bandwidth-limit 50MiB] [--lazy --first-write-latency 20ms]
    lab.py set NAME [same options] [--stall|--no-stall] [--fail-reads RATE] [--fail-writes RATE]
    lab.py down NAME | --all
    lab.py status

State lives in /run/volprobe-lab/NAME; `up` first tears down a stale volume of the same name, so a test
that was killed leaves nothing behind for long. Importable: up(), down(), Volume, and the pytest fixture
lab_volume.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LAB_ROOT = Path(os.environ.get("VOLPROBE_LAB_ROOT", "/run/volprobe-lab"))
PLUGIN = Path(__file__).resolve().parent / "volume_plugin.py"
CALIBRATION_LATENCY = 0.001
MIB = 1024 * 1024
TRACE_UNIT = 64 * 1024  # the granularity of Volume.read_coverage()
CONNECTIONS = 16  # nbdfuse -> nbdkit

_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": MIB, "mib": MIB, "g": 1024**3, "gib": 1024**3}


def parse_duration(text: str) -> float:
    for unit in sorted(_DURATION_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * _DURATION_UNITS[unit]
    raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 2ms, 500us)")


def parse_size(text: str) -> int:
    text = text.strip().lower().removesuffix("/s")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :]
    if not number or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 256MiB)")
    return int(float(number) * _SIZE_UNITS[unit])


LOOP_SPAN = 256  # how many numbers from `first` free_loop looks through


def default_first_loop() -> int:
    """$VOLPROBE_TEST_FIRST_LOOP, read at each attach (the test suite sets it per worker); 0: the lowest free,
    as losetup --find."""
    return int(os.environ.get("VOLPROBE_TEST_FIRST_LOOP") or "0")


def free_loop(first: int = 0) -> str:
    """The loop device the next attach should take: the lowest free, or with `first` (default
    $VOLPROBE_TEST_FIRST_LOOP) the first free from that number (clear of the numbers something else running
    here is about to attach)."""
    first = first or default_first_loop()
    if not first:
        return _run("losetup", "--find").stdout.strip()
    for number in range(first, first + LOOP_SPAN):
        if not Path(f"/sys/block/loop{number}/loop").exists():  # not bound
            return f"/dev/loop{number}"
    raise RuntimeError(f"no free loop device from /dev/loop{first}")


def attach_loop(options: list[str], backing: str | Path, first: int = 0) -> str:
    """Attach `backing` to a free loop device (see free_loop) and return it; retried if another attach took the
    device in between."""
    first = first or default_first_loop()
    if not first:
        return _run("losetup", "--find", "--show", *options, str(backing)).stdout.strip()
    for _ in range(10):
        device = free_loop(first)
        if _run("losetup", *options, device, str(backing), check=False).returncode == 0:
            return device
    raise RuntimeError(f"could not attach {backing} to a loop device from /dev/loop{first}")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def _alive(pid: int, name: str) -> bool:
    try:
        return name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _kill(pid: int, name: str, grace: float = 3.0) -> None:
    if not _alive(pid, name):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pid, name):
        time.sleep(0.05)
    if _alive(pid, name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(pid, name):
            time.sleep(0.05)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


@dataclass
class Volume:
    name: str

    @property
    def dir(self) -> Path:
        return LAB_ROOT / self.name

    @property
    def state(self) -> dict:
        return json.loads((self.dir / "state.json").read_text())

    @property
    def device(self) -> str:
        return self.state["device"]

    @property
    def backing(self) -> Path:
        return self.dir / "mnt" / "disk"

    def settings(self) -> dict:
        return json.loads((self.dir / "control.json").read_text())

    def stats(self) -> dict:
        try:
            return json.loads((self.dir / "stats.json").read_text())
        except (OSError, ValueError):
            return {}

    def fresh_stats(self) -> dict:
        """Counters as of now: the plugin writes them every 0.2 s, and acknowledges a settings change with them."""
        self.set()
        return self.stats()

    def read_coverage(self) -> list[int]:
        """Bytes read so far from each 64 KiB of the device (since it was made), for coverage checks."""
        import array

        counts = array.array("I")
        counts.frombytes((self.dir / "reads.bin").read_bytes())
        return counts.tolist()

    def requests(self) -> list[tuple[str, int, int]]:
        """Every request served while `trace` was set: ("r" or "w", offset, length), in order."""
        try:
            text = (self.dir / "requests.log").read_text()
        except FileNotFoundError:
            return []
        return [(op, int(offset), int(length)) for op, offset, length in (line.split() for line in text.splitlines())]

    def detach(self) -> None:
        """Detach the volume's loop device, as a cloud volume is detached from the instance (its data stays)."""
        state = self.state
        _run("losetup", "--detach", state["device"])
        state["device"] = ""
        (self.dir / "state.json").write_text(json.dumps(state))

    def attach(self, first_loop: int = 0) -> str:
        """Attach it again, to the first free loop device (from `first_loop`): maybe another kernel name."""
        state = self.state
        state["device"] = attach_loop(["--direct-io=on"], self.backing, first_loop)
        (self.dir / "state.json").write_text(json.dumps(state))
        return state["device"]

    def set(self, wait: bool = True, **changes: object) -> dict:
        """Change live settings (seconds, bytes/s, ratios); returns the new settings once the device applies them."""
        current = self.settings()
        unknown = set(changes) - set(current)
        if unknown:
            raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
        current.update(changes)
        check_settings(current)
        current["generation"] = current.get("generation", 0) + 1
        tmp = self.dir / "control.json.tmp"
        tmp.write_text(json.dumps(current, indent=1))
        os.replace(tmp, self.dir / "control.json")
        if wait:
            deadline = time.monotonic() + 5
            while self.stats().get("generation") != current["generation"]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: the device did not apply the settings")
                time.sleep(0.02)
        return current


DEFAULTS = {
    "read_latency": 0.0,
    "write_latency": 0.0,
    "jitter": 0.0,
    "tail_fraction": 0.0,
    "tail_latency": 0.0,
    "iops_limit": 0.0,
    "bandwidth_limit": 0.0,
    "burst": 0.02,
    "lazy": False,
    "first_write_latency": 0.02,
    "zero_read_latency": 0.00005,
    "fail_reads": 0.0,
    "fail_writes": 0.0,
    "stall": False,
    "overhead_read": 0.0,
    "overhead_write": 0.0,
    "generation": 1,
    "reset_allocation": 0,
    "trace": False,
}


def check_settings(settings: dict) -> None:
    """Refuse settings the model would apply silently wrong: a rate outside [0, 1] (never or always), a tail
    without its latency (its requests would take no time at all: faster, not slower)."""
    for key in ("tail_fraction", "fail_reads", "fail_writes"):
        if not 0 <= settings.get(key, 0) <= 1:  # .get: a volume made before tails has no such key
            raise ValueError(f"{key}: {settings[key]!r} is not a fraction between 0 and 1")
    if settings.get("tail_fraction") and not settings["tail_latency"] > 0:
        raise ValueError("tail_fraction needs a tail_latency above 0 (the tail's requests take it instead)")


def _calibrate(volume: Volume, samples: int = 60, rounds: int = 6) -> tuple[float, float]:
    """The chain's own qd1 overhead per op: measured latency at a known 1 ms, minus 1 ms.

    Reads and writes run in rounds of their own, as fio's qd1 jobs issue them (a read right after a write is
    slower), taking turns after a warm-up (the first requests to a new device are slow). This machine's
    latency has phases: most of the time it sits at one level, now and then it runs 0.1-0.4 ms slower for
    a second or so. The lowest round's median is the usual level: a median of rounds, or of all samples,
    that met a slow phase made volumes up to 0.4 ms faster than configured.
    """
    volume.set(read_latency=CALIBRATION_LATENCY, write_latency=CALIBRATION_LATENCY, lazy=False)
    size = volume.state["size"]
    fd = os.open(volume.device, os.O_RDWR | os.O_DIRECT)
    import mmap

    buffer = mmap.mmap(-1, 4096)
    rng = random.Random(0)

    def median_latency(op: str) -> float:
        call, argument = (os.pwrite, buffer) if op == "write" else (os.preadv, [buffer])
        values = []
        for _ in range(samples):
            offset = rng.randrange(size // 4096) * 4096
            t0 = time.perf_counter()
            call(fd, argument, offset)  # writes put zeros over zeros: the content does not change
            values.append(time.perf_counter() - t0)
        return statistics.median(values[samples // 4 :])

    medians: dict[str, list[float]] = {"read": [], "write": []}
    try:
        for op in medians:
            median_latency(op)  # warm-up
        for _ in range(rounds):
            for op in medians:
                medians[op].append(median_latency(op))
    finally:
        os.close(fd)
    return tuple(max(0.0, min(medians[op]) - CALIBRATION_LATENCY) for op in ("read", "write"))  # type: ignore[return-value]


def up(
    name: str,
    size: int = 256 * MIB,
    alloc_unit: int = MIB,
    calibrate: bool = True,
    first_loop: int = 0,
    **settings: object,
) -> Volume:
    """Create a volume (tearing down a stale one of that name first) and return it."""
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"{name!r}: use letters, digits, '-' and '_'")
    volume = Volume(name)
    unknown = set(settings) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    check_settings({**DEFAULTS, **settings})  # before anything is torn down or started
    if volume.dir.exists():
        down(name)
    (volume.dir / "mnt").mkdir(parents=True)
    control = dict(DEFAULTS)  # the model's settings apply after calibration, which must see a plain device
    (volume.dir / "control.json").write_text(json.dumps(control, indent=1))
    state = {"name": name, "size": size, "alloc_unit": alloc_unit, "created": time.time()}
    (volume.dir / "state.json").write_text(json.dumps(state))
    try:
        _spawn(
            volume.dir / "nbdkit.log",
            "nbdkit",
            "-f",
            "--unix",
            str(volume.dir / "nbd.sock"),
            "--pidfile",
            str(volume.dir / "nbdkit.pid"),
            "--threads",
            "64",
            "python",
            str(PLUGIN),
            f"state={volume.dir}",
            f"size={size}",
            f"alloc_unit={alloc_unit}",
        )
        state["nbdkit_pid"] = _wait_for_pid(volume.dir / "nbdkit.pid", "nbdkit", volume.dir / "nbdkit.log")
        _spawn(
            volume.dir / "nbdfuse.log",
            "nbdfuse",
            "-P",
            str(volume.dir / "nbdfuse.pid"),
            # One connection per request in flight, up to 16: with nbdfuse's default of 4, an uncapped volume
            # stops scaling at about 4 parallel requests, which looks like a cap to anything watching it.
            "--connections",
            str(CONNECTIONS),
            str(volume.backing),
            "--unix",
            str(volume.dir / "nbd.sock"),
        )
        state["nbdfuse_pid"] = _wait_for_pid(volume.dir / "nbdfuse.pid", "nbdfuse", volume.dir / "nbdfuse.log")
        state["device"] = attach_loop(["--direct-io=on"], volume.backing, first_loop)
        (volume.dir / "state.json").write_text(json.dumps(state))
        overhead_read, overhead_write = _calibrate(volume) if calibrate else (0.0, 0.0)
        state.update(overhead_read=overhead_read, overhead_write=overhead_write)
        (volume.dir / "state.json").write_text(json.dumps(state))
        final = {**DEFAULTS, **settings, "overhead_read": overhead_read, "overhead_write": overhead_write}
        final.pop("generation")
        volume.set(**{**final, "reset_allocation": 1})
    except BaseException:
        down(name)
        raise
    return volume


SERVER_NICE = -10  # a volume's latency is its settings', not the host's load: its servers run before other work
SERVER_EXITED = "lab: server exited with status"  # the last line of a server's log once it has exited


def _spawn(log: Path, *command: str) -> None:
    """Start a server in a session of its own, not a child of this (possibly short-lived) process, with a shell
    as its parent for its whole life; the shell adds SERVER_EXITED and the server's status to its log.

    The shell is there because of nbdkit: it sets PR_SET_PDEATHSIG (SIGTERM) early in its start-up, even without
    --exit-with-parent (1.32.5, seen with strace), so its parent must outlive it. With `setsid --fork` alone
    the parent is setsid, which exits at once; on a busy machine that exit came after nbdkit (started at nice
    -10) had set the signal, and the kernel then ended nbdkit with SIGTERM before it wrote a line or its pidfile
    (3 to 12 of 60 starts on this 2-core VM with its cores busy; none of 260 with the shell)."""
    shell = f'"$@"; echo "{SERVER_EXITED} $?"'  # a command after "$@": the shell does not exec the server
    with open(log, "w") as out:
        subprocess.run(
            ["setsid", "--fork", "nice", "-n", str(SERVER_NICE), "sh", "-c", shell, "sh", *command],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
        )


def _wait_for_pid(pidfile: Path, what: str, log: Path, timeout: float = 60.0) -> int:
    """The server's pid once it has written its pidfile. A server that exits is reported at once (its status
    is in its log); the timeout is only for one that neither starts nor exits, and is generous: a start on a
    busy machine (a python interpreter and the plugin to load) takes what the machine gives it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text())
            if _alive(pid, what):
                return pid
        with contextlib.suppress(OSError):
            if SERVER_EXITED in log.read_text():
                raise RuntimeError(f"{what} exited while starting: {log.read_text()[-2000:]}")
        time.sleep(0.02)
    raise RuntimeError(
        f"{what} did not start within {timeout:.0f}s: {log.read_text()[-2000:]}\n{_processes_of(pidfile.parent)}"
    )


def _pids_of(directory: Path) -> dict[int, str]:
    """The processes (other than this one) whose command line names the volume's directory."""
    here = str(directory)

    def names_it(arg: str) -> bool:  # the directory itself or a path in it, alone or as `key=value`
        path = arg.split("=", 1)[1] if "=" in arg else arg
        return path == here or path.startswith(here + "/")

    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if int(proc.name) != os.getpid() and any(names_it(arg) for arg in args):
                found[int(proc.name)] = " ".join(args).strip()
    return found


def _kill_processes_of(directory: Path) -> None:
    for pid in _pids_of(directory):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for name in ("nbdkit.pid", "nbd.sock"):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()


def _processes_of(directory: Path) -> str:
    """What the processes serving a volume are doing (for a start-up that timed out)."""
    lines = []
    for pid, cmdline in _pids_of(directory).items():
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0]
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            lines.append(f"pid {pid} state {state} wchan {wchan}: {cmdline}")
    return "\n".join(lines) or f"no process of {directory} is running"


def down(name: str) -> None:
    """Tear a volume down: release stalls, detach loop devices, unmount FUSE, stop processes, remove state."""
    volume = Volume(name)
    if not volume.dir.exists():
        return
    try:
        state = volume.state
    except (OSError, ValueError):
        state = {}
    if (volume.dir / "control.json").exists() and (volume.dir / "stats.json").exists():
        with contextlib.suppress(Exception):
            volume.set(
                stall=False,
                fail_reads=0.0,
                fail_writes=0.0,
                iops_limit=0.0,
                bandwidth_limit=0.0,
                read_latency=0.0,
                write_latency=0.0,
                lazy=False,
                wait=_alive(state.get("nbdkit_pid", 0), "nbdkit"),
            )
    if _mounted(volume.dir / "mnt"):
        for line in _run(
            "losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE", check=False
        ).stdout.splitlines():
            parts = line.split(None, 1)
            if len(parts) == 2 and parts[1].strip().startswith(str(volume.backing)):
                _run("losetup", "--detach", parts[0], check=False)
        if _run("fusermount3", "-u", str(volume.dir / "mnt"), check=False).returncode != 0:
            _run("fusermount3", "-u", "-z", str(volume.dir / "mnt"), check=False)
    _kill(state.get("nbdfuse_pid", 0), "nbdfuse")
    _kill(state.get("nbdkit_pid", 0), "nbdkit")
    for pidfile, name_part in (("nbdfuse.pid", "nbdfuse"), ("nbdkit.pid", "nbdkit")):
        with contextlib.suppress(OSError, ValueError):
            _kill(int((volume.dir / pidfile).read_text()), name_part)
    if _mounted(volume.dir / "mnt"):
        _run("umount", "-l", str(volume.dir / "mnt"), check=False)
    _kill_processes_of(volume.dir)  # a server that never wrote its pidfile
    shutil.rmtree(volume.dir, ignore_errors=True)


def names(prefix: str = "") -> list[str]:
    if not LAB_ROOT.is_dir():
        return []
    return sorted(p.name for p in LAB_ROOT.iterdir() if p.is_dir() and p.name.startswith(prefix))


def down_all(prefix: str = "") -> None:
    for name in names(prefix):
        down(name)


# -- fio, the reference every lab claim is checked against ----------------------------------------------------


def fio_runtime(seconds: float) -> str:
    """fio's --runtime option; in milliseconds, as fio truncates fractional seconds (0.7 s would not run)."""
    return f"--runtime={round(seconds * 1000)}ms"


def run_fio(device: str, *options: str, runtime: float = 5.0) -> dict:
    """Run one fio job on a device; returns fio's JSON for the job (group_reporting)."""
    command = [
        "fio",
        "--name=lab",
        f"--filename={device}",
        "--direct=1",
        "--time_based",
        fio_runtime(runtime),
        "--group_reporting",
        "--output-format=json",
        *options,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout[result.stdout.index("{") :])["jobs"][0]


def fio_percentile(job: dict, op: str, percentile: float) -> float:
    """A completion-latency percentile of a fio job, in seconds."""
    return job[op]["clat_ns"]["percentile"][f"{percentile:.6f}"] / 1e9


# -- pytest fixture -------------------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # the CLI runs without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture
    def lab_volume(request):
        """lab_volume(size=..., read_latency=0.002, ...) -> Volume; torn down after the test, pass or fail."""
        made: list[str] = []
        prefix = f"pytest-{os.getpid()}"

        def make(**kwargs) -> Volume:
            name = f"{prefix}-{len(made)}"
            made.append(name)
            return up(name, **kwargs)

        yield make
        for name in made:
            down(name)

    _FIRST_LOOP_GIVEN = os.environ.get("VOLPROBE_TEST_FIRST_LOOP")

    @pytest.fixture(scope="session", autouse=True)
    def loops_of_this_worker() -> Iterator[None]:
        """Under pytest-xdist each worker attaches its loop devices from a range of its own: from
        $VOLPROBE_TEST_FIRST_LOOP (1024 if unset) plus LOOP_SPAN per worker. `losetup --find` would give one
        worker a number another has just detached and is about to attach again, or one a test's discovery
        follows; the kernel also hands out any unbound number it has, however high."""
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        if worker.startswith("gw"):
            first = int(_FIRST_LOOP_GIVEN or "1024") + LOOP_SPAN * int(worker.removeprefix("gw"))
            os.environ["VOLPROBE_TEST_FIRST_LOOP"] = str(first)
        yield

    @pytest.fixture(autouse=True)
    def latency_tests_first(request: pytest.FixtureRequest) -> Iterator[None]:
        """A test of the "lab-latency" xdist group runs at nice -10, and so does everything it starts (the
        exporter, Prometheus, fio, the lab's servers): it holds measured latency to alert thresholds, and on
        2 cores the other workers' tests (fio at a volume's cap, other interpreters' runs) would otherwise add
        their CPU queueing to what it measures. The other tests only wait a little longer."""
        group = request.node.get_closest_marker("xdist_group")
        if group is None or group.args[:1] != ("lab-latency",) or os.geteuid() != 0:
            yield
            return
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, -10)  # this thread: the one that starts the test's processes
        try:
            yield
        finally:
            os.setpriority(os.PRIO_PROCESS, 0, before)

    @pytest.fixture(scope="session", autouse=True)
    def clean_stale_test_volumes():
        """Volumes of earlier, killed test runs are torn down by name before any test starts; those of a test
        run still going (its pid is in the name) are left alone."""
        for name in names(prefix="pytest-"):
            pid = name.split("-")[1]
            if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
                down(name)
        yield


# -- command line ------------------------------------------------------------------------------------------


def _add_settings(parser: argparse.ArgumentParser, live: bool) -> None:
    parser.add_argument("--read-latency", type=parse_duration)
    parser.add_argument("--write-latency", type=parse_duration)
    parser.add_argument("--jitter", type=parse_duration, help="uniform +- jitter added to each latency")
    parser.add_argument(
        "--tail-fraction", type=float, metavar="RATE", help="fraction of reads and writes taking --tail-latency"
    )
    parser.add_argument(
        "--tail-latency", type=parse_duration, help="the tail's latency, instead of (not added to) the op's"
    )
    parser.add_argument("--iops-limit", type=float, help="device-wide IOPS cap (0 removes it)")
    parser.add_argument("--bandwidth-limit", type=parse_size, help="device-wide bytes/s cap (0 removes it)")
    parser.add_argument("--burst", type=parse_duration, help="token bucket burst, as time at the cap (default 20ms)")
    parser.add_argument(
        "--lazy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lazy allocation: first writes are slow, never-written blocks read as zeros",
    )
    parser.add_argument("--first-write-latency", type=parse_duration)
    if live:
        parser.add_argument(
            "--stall", action=argparse.BooleanOptionalAction, default=None, help="hold every request until --no-stall"
        )
        parser.add_argument("--fail-reads", type=float, metavar="RATE", help="fraction of reads failing with EIO")
        parser.add_argument("--fail-writes", type=float, metavar="RATE", help="fraction of writes failing with EIO")


def _settings_from(args: argparse.Namespace) -> dict:
    keys = [
        "read_latency",
        "write_latency",
        "jitter",
        "tail_fraction",
        "tail_latency",
        "iops_limit",
        "bandwidth_limit",
        "burst",
        "lazy",
        "first_write_latency",
        "stall",
        "fail_reads",
        "fail_writes",
    ]
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="create a volume; prints its block device as the last line")
    p_up.add_argument("name")
    p_up.add_argument("--size", type=parse_size, default=256 * MIB)
    p_up.add_argument("--alloc-unit", type=parse_size, default=MIB, help="lazy allocation granularity")
    _add_settings(p_up, live=False)
    p_set = sub.add_parser("set", help="change a live volume")
    p_set.add_argument("name")
    _add_settings(p_set, live=True)
    p_down = sub.add_parser("down", help="tear a volume down")
    p_down.add_argument("name", nargs="?")
    p_down.add_argument("--all", action="store_true")
    sub.add_parser("status", help="volumes, devices, settings and I/O counts")
    args = parser.parse_args(argv)
    if os.geteuid() != 0 and args.command != "status":
        print("lab.py: needs root (loop devices, FUSE)", file=sys.stderr)
        return 1
    if args.command == "up":
        try:
            volume = up(args.name, size=args.size, alloc_unit=args.alloc_unit, **_settings_from(args))
        except ValueError as e:  # refused before anything was made or torn down
            parser.error(str(e))
        state = volume.state
        print(
            f"{args.name}: {units_text(volume.settings())}; chain overhead read "
            f"{state['overhead_read'] * 1e3:.3f}ms write {state['overhead_write'] * 1e3:.3f}ms (compensated)"
        )
        print(volume.device)
    elif args.command == "set":
        volume = Volume(args.name)
        if not volume.dir.exists():
            print(f"lab.py: no volume {args.name}", file=sys.stderr)
            return 1
        try:
            print(f"{args.name}: {units_text(volume.set(**_settings_from(args)))}")
        except ValueError as e:  # refused: the device keeps its settings
            parser.error(str(e))
    elif args.command == "down":
        if args.all:
            down_all()
        elif args.name:
            down(args.name)
        else:
            parser.error("down needs NAME or --all")
    else:
        for name in names():
            volume = Volume(name)
            try:
                device, stats = volume.device, volume.stats()
                print(f"{name}  {device}  {units_text(volume.settings())}")
                print(
                    f"    reads {stats.get('reads', 0)} writes {stats.get('writes', 0)} errors "
                    f"{stats.get('errors', 0)} stalled {stats.get('stalled', 0)} allocated "
                    f"{stats.get('allocated_ratio', 0):.0%}"
                )
            except (OSError, ValueError, KeyError):
                print(f"{name}  (incomplete: tear down with `lab.py down {name}`)")
    return 0


def units_text(settings: dict) -> str:
    parts = [f"read {settings['read_latency'] * 1e3:g}ms", f"write {settings['write_latency'] * 1e3:g}ms"]
    if settings["jitter"]:
        parts.append(f"jitter {settings['jitter'] * 1e3:g}ms")
    if settings.get("tail_fraction"):  # a volume made before tails had no such key
        parts.append(f"tail {settings['tail_fraction'] * 100:g}% at {settings['tail_latency'] * 1e3:g}ms")
    if settings["iops_limit"]:
        parts.append(f"{settings['iops_limit']:g} IOPS cap")
    if settings["bandwidth_limit"]:
        parts.append(f"{settings['bandwidth_limit'] / MIB:g} MiB/s cap")
    if settings["lazy"]:
        parts.append(f"lazy (first write {settings['first_write_latency'] * 1e3:g}ms)")
    if settings["stall"]:
        parts.append("STALLED")
    if settings["fail_reads"] or settings["fail_writes"]:
        parts.append(f"EIO reads {settings['fail_reads']:g} writes {settings['fail_writes']:g}")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
