"""Shared by the benchmarks: devices, fio as the reference, the real exporter, and BENCHMARKS.md sections.

Every figure a benchmark writes is measured in the same run as its reference, on the same device.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The test harness (commands, devices, the exporter) is tests.support.harness; the lab is lab.lab: the roots that
# pyproject.toml's pytest `pythonpath` names, put on the path here as pytest puts them there.
sys.path[:0] = [str(REPO / "exporter"), str(REPO / "deploy")]
from lab import lab  # noqa: E402 - also used by the bench scripts
from tests.support import harness  # noqa: E402
from tests.support.harness import MIB, RunningExporter, loop_device, run  # noqa: E402 - also used by the scripts

BENCHMARKS = REPO / "BENCHMARKS.md"


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


# -- the exporter ---------------------------------------------------------------------------------------


def start_exporter(config_text: str) -> RunningExporter:
    """The real `volprobe` process on a loopback port, with this configuration; its files in a fresh
    temporary directory. RunningExporter: get(), value(name, **labels), cpu_seconds(), rss_bytes(), stop()."""
    directory = Path(tempfile.mkdtemp(prefix="volprobe-bench-"))
    config = harness.write_config(directory, config_text)
    return harness.start_volprobe("--config", config, log_path=directory / "log")


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
