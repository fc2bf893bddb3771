"""Shared by the benchmarks: devices, fio as the reference, the real exporter, and BENCHMARKS.md sections.

Every figure a benchmark writes is measured in the same run as its reference, on the same device.
"""

from __future__ import annotations

import compileall
import contextlib
import functools
import json
import math
import os
import platform
import random
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[1]
# The test harness (commands, devices, the exporter) is tests.support.harness; the lab is lab.lab: the roots that
# pyproject.toml's pytest `pythonpath` names, put on the path here as pytest puts them there.
sys.path[:0] = [str(REPO / "exporter"), str(REPO / "deploy")]
from lab import lab  # noqa: E402 - also used by the bench scripts
from tests.support import harness  # noqa: E402
from tests.support.families import PROMETHEUS_PROTOBUF_ACCEPT  # noqa: E402
from tests.support.harness import MIB, RunningExporter, loop_device, run  # noqa: E402 - also used by the scripts

process_cpu_seconds = harness.process_cpu_seconds  # the scripts' reading of a process's CPU, as the harness's

BENCHMARKS = REPO / "BENCHMARKS.md"
# What a Prometheus 3.16 scrape asks for (its default scrape protocols): OpenMetrics first, and gzip.
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.7,"
    "application/openmetrics-text;version=0.0.1;q=0.6,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "text/plain;version=0.0.4;q=0.4,*/*;q=0.3",
    "Accept-Encoding": "gzip",
}
# What it asks for with `scrape_native_histograms: true`: the protobuf exposition first.
PROMETHEUS_NATIVE_HEADERS = {"Accept": PROMETHEUS_PROTOBUF_ACCEPT, "Accept-Encoding": "gzip"}


# -- devices --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def zram(size: int = 256 * MIB) -> Iterator[str]:
    """A zram device filled with random data (outside the first and last MiB, which stay blank)."""
    with harness.zram(size) as device:
        fill(device, size)
        yield device


@contextlib.contextmanager
def loop_on_ext4_file(size: int = 256 * MIB, directory: str = "/var/tmp") -> Iterator[str]:
    """A loop device (direct I/O) over a fully written file on the host's ext4 root filesystem."""
    with (
        tempfile.NamedTemporaryFile(dir=directory, prefix="volprobe-bench-", suffix=".img") as backing,
        loop_device(backing.name, size) as device,
    ):
        fill(device, size)
        yield device


@contextlib.contextmanager
def lab_volume(name: str, **settings) -> Iterator[str]:
    """A lab volume filled with random data (outside the first and last MiB)."""
    with harness.lab_device(name, **settings) as volume:
        fill(volume.device, settings.get("size", 256 * MIB))
        yield volume.device


def fill(device: str, size: int) -> None:
    """Write random data over all but the first and last MiB, so reads hit data, not holes."""
    run(
        "fio",
        "--name=fill",
        f"--filename={device}",
        "--direct=1",
        "--rw=write",
        "--bs=1M",
        "--ioengine=libaio",
        "--iodepth=8",
        "--offset=1M",
        f"--size={size - 2 * MIB}",
        "--refill_buffers",
    )


# -- fio, the reference ----------------------------------------------------------------------------------


@dataclass
class Latency:
    p50: float
    p99: float
    samples: int
    cpu_per_io: float = 0.0  # seconds of whole-process CPU per request
    # The distribution behind p50 and p99, where a run gives it ({seconds: requests}): rounds pool it.
    counts: Mapping[float, float] = field(default_factory=dict)


Value = TypeVar("Value", int, float)  # what a distribution counts: seconds, or a bin's index


def pooled_quantile(distributions: Sequence[Mapping[Value, float]], q: float) -> Value:
    """The nearest-rank q-quantile of several distributions ({value: count}) taken together: values in seconds,
    or indexes of bins (grid_quantile)."""
    merged: dict[Value, float] = {}
    for counts in distributions:
        for value, count in counts.items():
            merged[value] = merged.get(value, 0) + count
    # Nearest rank: the first value whose cumulative count reaches q of the total. Counts may be fractions (a
    # convolved distribution's) whose float sum is a hair off the whole total: compared with that much room.
    total = sum(merged.values())
    rank, seen = q * total * (1 - 1e-9), 0.0
    for value in sorted(merged):
        seen += merged[value]
        if seen >= rank:
            return value
    raise ValueError("no samples to take a quantile of")


# Log-spaced bins this wide, on which rounds' distributions are resampled: a quantile read from them is off by at
# most half of it, far below the noise that the resampling measures.
GRID_WIDTH = 0.002


def on_grid(counts: Mapping[float, float]) -> dict[int, float]:
    """A distribution ({seconds: requests}) on the log grid ({bin index: requests})."""
    step = math.log1p(GRID_WIDTH)
    binned: dict[int, float] = {}
    for value, count in counts.items():
        if value > 0 and count > 0:
            index = math.floor(math.log(value) / step)
            binned[index] = binned.get(index, 0.0) + count
    return binned


def grid_quantile(rounds: Sequence[Mapping[int, float]], q: float) -> float:
    """The nearest-rank q-quantile (seconds, the bin's middle) of several rounds on the grid taken together."""
    return float((1 + GRID_WIDTH) ** (pooled_quantile(rounds, q) + 0.5))


def ratio_interval(
    ours: Sequence[Mapping[float, float]],
    refs: Sequence[Mapping[float, float]],
    q: float,
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 27,
) -> tuple[float, float]:
    """A bootstrap interval of the ratio of the two sides' pooled q-quantiles (ours / refs), resampling rounds
    with replacement, each round's pair together: the rounds are the independent units (a device's drift and
    its tail events cluster within a round), and a pair shares its round's drift."""
    if len(ours) != len(refs) or not ours:
        raise ValueError("one distribution per round on each side")
    ours_grid, refs_grid = [on_grid(c) for c in ours], [on_grid(c) for c in refs]
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(len(ours)) for _ in ours]
        ours_q = grid_quantile([ours_grid[i] for i in picks], q)
        ratios.append(ours_q / grid_quantile([refs_grid[i] for i in picks], q))
    ratios.sort()
    below = round((1 - level) / 2 * resamples)  # resamples left out at either end
    return ratios[below], ratios[resamples - 1 - below]


def halves_ratio(rounds: Sequence[Mapping[float, float]], q: float) -> float:
    """One side against itself: the pooled q-quantile of rounds 0, 1, 4, 5, ... over that of rounds 2, 3, 6,
    7, ... (each half holds as many rounds of either order, fio first or second; an odd last round is left
    out). How far a side's own quantile moves between two halves of one run: one draw of it, on half the
    rounds, so wider than the whole run's own spread."""
    paired = rounds[: len(rounds) // 2 * 2]
    first = [counts for i, counts in enumerate(paired) if (i // 2) % 2 == 0]
    second = [counts for i, counts in enumerate(paired) if (i // 2) % 2 == 1]
    if not first or not second:
        raise ValueError("halves need at least four rounds")
    return pooled_quantile(first, q) / pooled_quantile(second, q)


def fio_paced(device: str, op: str, block_size: int, rate: float, runtime: float, size: int) -> Latency:
    """fio at queue depth 1 (ioengine=sync, direct=1), paced at `rate` like volprobe (0: back to back), away
    from the first and last MiB (volprobe's raw-write guards)."""
    rw = "randread" if op == "read" else "randwrite"
    options = [
        "--name=ref",
        f"--filename={device}",
        "--direct=1",
        "--ioengine=sync",
        "--iodepth=1",
        f"--rw={rw}",
        f"--bs={block_size}",
        *([f"--rate_iops={rate:g}"] if rate else []),
        "--time_based",
        lab.fio_runtime(runtime),
        "--offset=1M",
        f"--size={size - 2 * MIB}",
        "--output-format=json",
        "--refill_buffers",
    ]
    if op == "write":
        options.append("--sync=dsync")
    job = json.loads(run("fio", *options).stdout)["jobs"][0]
    percentiles = job[op]["clat_ns"]["percentile"]
    ios = job[op]["total_ios"]
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000
    return Latency(percentiles["50.000000"] / 1e9, percentiles["99.000000"] / 1e9, ios, cpu / max(1, ios))


def fio_commit(directory: str, block_size: int, rate: float, runtime: float, size: int, ramp: float = 0.5) -> Latency:
    """etcd's fio recipe (`--rw=write --ioengine=sync --fdatasync=1 --bs=2300`) paced at `rate`, in a fresh file
    of `directory` (fio preallocates it, as volprobe's commit log and etcd's WAL are). A commit there is two
    syscalls, which fio times apart and logs no pairs of: the commit's distribution is taken as that of the sum
    of a write and an fdatasync drawn independently from fio's two distributions (its JSON's bins), and its
    quantiles are read from that. Not fdatasync's quantile plus the write's mean: that leaves out the write's
    own tail (through FUSE the write goes to the daemon); nor the sum of the two p99s, which overstates the p99
    of sums drawn independently. Independence is an assumption: a write and its fdatasync that are slow
    together (a device's drift within a round) would put fio's p99 a little higher than this."""
    path = os.path.join(directory, "fio-commit")
    options = [
        "--name=etcd",
        f"--filename={path}",
        "--rw=write",
        "--ioengine=sync",
        "--fdatasync=1",
        f"--bs={block_size}",
        f"--size={size}",
        f"--rate_iops={rate:g}",
        "--time_based",
        f"--ramp_time={round(ramp * 1000)}ms",  # its first commits left out (bench/fidelity: COMMIT_RAMP_S)
        lab.fio_runtime(runtime),
        "--output-format=json+",  # with "bins": the write's and fdatasync's whole distributions
        "--refill_buffers",
    ]
    try:
        job = json.loads(run("fio", *options).stdout)["jobs"][0]
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    ios = job["write"]["total_ios"]
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000
    # fio's bins are its log-linear buckets (volprobe's scheme), each by the value it stands for (ns).
    writes, syncs = (
        bins_in_seconds(job[ddir][key]["bins"]) for ddir, key in (("write", "clat_ns"), ("sync", "lat_ns"))
    )
    counts = sum_distribution(writes, syncs, ios)
    return Latency(pooled_quantile([counts], 0.5), pooled_quantile([counts], 0.99), ios, cpu / max(1, ios), counts)


@dataclass
class CommitPairs:
    """One paced run of etcd's recipe timed here: each commit's write and fdatasync (ns), in order."""

    writes: list[int]
    syncs: list[int]


def commit_pairs(directory: str, block_size: int, rate: float, runtime: float, size: int, ramp: float) -> CommitPairs:
    """etcd's recipe as fio runs it (a buffered write of `block_size` at the next offset of a preallocated file of
    `directory`, then fdatasync, paced at `rate`), each syscall timed apart, the first `ramp` seconds left out:
    what fio times, with each write kept beside its own fdatasync, which fio's output does not keep."""
    path = os.path.join(directory, "pairs-commit")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
        data = random.randbytes(block_size)
        clock, step = time.perf_counter_ns, round(1e9 / rate)
        start = due = clock()
        kept, end = start + round(ramp * 1e9), start + round((ramp + runtime) * 1e9)
        offset = 0
        pairs = CommitPairs([], [])
        while due < end:
            wait = due - clock()
            if wait > 0:
                time.sleep(wait / 1e9)
            before = clock()
            os.pwrite(fd, data, offset)
            written = clock()
            os.fdatasync(fd)
            synced = clock()
            if before >= kept:
                pairs.writes.append(written - before)
                pairs.syncs.append(synced - written)
            offset = offset + block_size if offset + 2 * block_size <= size else 0
            due += step
        return pairs
    finally:
        os.close(fd)
        os.unlink(path)


def independent_sum(pairs: CommitPairs) -> dict[float, float]:
    """The distribution fio's commit reference takes for these commits (sum_distribution: a write and an fdatasync
    drawn independently), from their own parts, each to 1 us (ns)."""
    writes, syncs = (Counter(round(ns, -3) for ns in part) for part in (pairs.writes, pairs.syncs))
    return sum_distribution(writes, syncs, len(pairs.writes))


def bins_in_seconds(bins: dict[str, int]) -> dict[float, int]:
    return {int(ns) / 1e9: count for ns, count in bins.items()}


def sum_distribution(a: Mapping[float, float], b: Mapping[float, float], total: int) -> dict[float, float]:
    """The distribution of x + y, x drawn from `a` and y from `b` independently ({value: count} each), scaled to
    `total` requests; its values are rounded to 1 ns, so that sums which differ only in the last float bits
    count as one value."""
    weight = total / (sum(a.values()) * sum(b.values()))
    summed: dict[float, float] = {}
    for x, m in a.items():
        for y, n in b.items():
            value = round(x + y, 9)
            summed[value] = summed.get(value, 0.0) + m * n * weight
    return summed


# -- the exporter ---------------------------------------------------------------------------------------


@functools.cache
def byte_compile() -> None:
    """volprobe's byte code, compiled once per benchmark into the package's own __pycache__ (which git ignores),
    so that the exporter runs as the .deb and the image run it. Without it (PYTHONDONTWRITEBYTECODE set, as on
    these machines, and an editable install), every start compiles the package from source, and its heap keeps
    about 1 MiB more of resident memory than production's."""
    if not compileall.compile_dir(REPO / "exporter" / "volprobe", quiet=1):
        raise RuntimeError("volprobe's sources did not compile")


def start_exporter(
    config_text: str, directory: Path | None = None, env: dict[str, str] | None = None
) -> RunningExporter:
    """The real `volprobe` process on a loopback port, from byte code compiled beforehand (byte_compile), with this
    configuration (and `env` added to the environment); its files (configuration, log) in `directory`, or a fresh
    temporary one. RunningExporter: get(), value(name, **labels), cpu_seconds(), rss_bytes(), stop()."""
    byte_compile()
    directory = directory or Path(tempfile.mkdtemp(prefix="volprobe-bench-"))
    config = harness.write_config(directory, config_text)
    return harness.start_volprobe("--config", config, log_path=directory / "log", env=env)


# -- CPU and memory of processes, from /proc ---------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A live thread: its name (comm, cut to 15 bytes) and its CPU time so far, in seconds."""

    comm: str
    cpu: float


def tasks(pid: int) -> dict[int, Task]:
    """The live threads of a process by thread id, their CPU time from /proc/PID/task/*/schedstat (nanoseconds on
    the CPU, exact). Threads that have exited are not there: their time is only in process_cpu_seconds()."""
    found: dict[int, Task] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # the thread exited meanwhile
            nanoseconds = int((task / "schedstat").read_text().split()[0])
            found[int(task.name)] = Task((task / "comm").read_text().rstrip("\n"), nanoseconds / 1e9)
    return found


def task_deltas(before: dict[int, Task], after: dict[int, Task]) -> dict[int, Task]:
    """The threads alive at `after`, with the CPU time they used since `before` (all of it if born since)."""
    return {tid: Task(task.comm, task.cpu - (before[tid].cpu if tid in before else 0.0)) for tid, task in after.items()}


def process_tree(pid: int) -> list[int]:
    """A process and its descendants (fio's job processes, say), by scanning /proc for parents."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(children.get(current, []))
    return tree


def tree_cpu_seconds(pids: list[int]) -> dict[int, float]:
    """CPU time of each of these processes, the sum of its live threads' schedstat (processes gone: left out)."""
    found: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            found[pid] = sum(task.cpu for task in tasks(pid).values())
    return found


@dataclass(frozen=True)
class Memory:
    """Resident memory of a process (or the sum over several), in bytes, and its threads."""

    rss: int  # VmRSS
    peak: int  # VmHWM, the peak VmRSS
    pss: int  # Pss of /proc/PID/smaps_rollup: shared pages divided among the processes sharing them
    threads: int

    def __add__(self, other: Memory) -> Memory:
        return Memory(self.rss + other.rss, self.peak + other.peak, self.pss + other.pss, self.threads + other.threads)


def memory(pid: int) -> Memory:
    """VmRSS, VmHWM and Threads of /proc/PID/status, and Pss of /proc/PID/smaps_rollup."""
    status = Path(f"/proc/{pid}/status").read_text()
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()

    def kib(text: str, key: str) -> int:
        return int(re.findall(rf"^{key}:\s+(\d+) kB", text, re.M)[0]) * 1024

    threads = int(re.findall(r"^Threads:\s+(\d+)", status, re.M)[0])
    return Memory(kib(status, "VmRSS"), kib(status, "VmHWM"), kib(rollup, "Pss"), threads)


# -- BENCHMARKS.md ---------------------------------------------------------------------------------------


def machine() -> str:
    cpu = ""
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, Python {platform.python_version()}"


def write_section(name: str, body: str, section: str | None = None) -> None:
    """Replace (or append) the `<!-- bench:SECTION -->` section of BENCHMARKS.md (SECTION: NAME unless one
    script writes several, one per mode)."""
    command = "bench/" + name + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
    name = section or name
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    section = (
        f"<!-- bench:{name} -->\n## {name}\n\nMade by `sudo {command}` on {stamp}; {machine()}.\n\n"
        f"{body.strip()}\n<!-- /bench:{name} -->"
    )
    text = (
        BENCHMARKS.read_text()
        if BENCHMARKS.exists()
        else (
            "# Benchmarks\n\nEvery figure here is written by a script in `bench/`, with the command that made it; "
            "each compares volprobe with a reference (fio) measured in the same run on the same device.\n"
        )
    )
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    BENCHMARKS.write_text(text)
