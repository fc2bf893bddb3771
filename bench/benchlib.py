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
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "deploy" / "lab"))
import lab  # noqa: E402

MIB = 1024 * 1024
BENCHMARKS = REPO / "BENCHMARKS.md"


def run(*cmd: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- devices --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def zram(size: int = 256 * MIB) -> Iterator[str]:
    """A zram device filled with random data (outside the first and last MiB, which stay blank)."""
    number = Path("/sys/class/zram-control/hot_add").read_text().strip()
    device = f"/dev/zram{number}"
    try:
        Path(f"/sys/block/zram{number}/disksize").write_text(str(size))
        fill(device, size)
        yield device
    finally:
        with contextlib.suppress(OSError):
            Path(f"/sys/block/zram{number}/reset").write_text("1")
        with contextlib.suppress(OSError):
            Path("/sys/class/zram-control/hot_remove").write_text(number)


@contextlib.contextmanager
def loop_on_ext4_file(size: int = 256 * MIB, directory: str = "/var/tmp") -> Iterator[str]:
    """A loop device (direct I/O) over a fully written file on the host's ext4 root filesystem."""
    with tempfile.NamedTemporaryFile(dir=directory, prefix="volprobe-bench-", suffix=".img") as backing:
        with open(backing.name, "wb") as f:
            f.truncate(size)
        device = run("losetup", "--find", "--show", "--direct-io=on", backing.name).stdout.strip()
        try:
            fill(device, size)
            yield device
        finally:
            run("losetup", "--detach", device)


@contextlib.contextmanager
def lab_volume(name: str, **settings) -> Iterator[str]:
    volume = lab.up(name, **settings)
    try:
        fill(volume.device, settings.get("size", 256 * MIB))
        yield volume.device
    finally:
        lab.down(name)


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


class Exporter:
    """The real `volprobe` process on a loopback port."""

    def __init__(self, config_text: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="volprobe-bench-"))
        (self.dir / "volprobe.yml").write_text(config_text)
        self.port = free_port()
        self.log = open(self.dir / "log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "volprobe",
                "--config",
                str(self.dir / "volprobe.yml"),
                "--web.listen-address",
                f"127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError((self.dir / "log").read_text())
            with contextlib.suppress(OSError):
                self.get("/-/ready")
                break
            if time.monotonic() > deadline:
                raise RuntimeError("exporter not ready")
            time.sleep(0.1)

    def get(self, path: str = "/metrics") -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
            return response.read().decode()

    def samples(self) -> dict[tuple[str, frozenset], float]:
        from prometheus_client.parser import text_string_to_metric_families

        result = {}
        for family in text_string_to_metric_families(self.get()):
            for sample in family.samples:
                result[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return result

    def value(self, name: str, **labels: str) -> float:
        total = 0.0
        for (sample, found), value in self.samples().items():
            if sample == name and all((k, v) in found for k, v in labels.items()):
                total += value
        return total

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> tuple[int, int]:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024
        return rss, peak

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)
        self.log.close()


# -- BENCHMARKS.md ---------------------------------------------------------------------------------------


def machine() -> str:
    cpu = ""
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, Python {platform.python_version()}"


def write_section(name: str, body: str) -> None:
    """Replace (or append) the `<!-- bench:NAME -->` section of BENCHMARKS.md."""
    command = "bench/" + name + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
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
