"""Loads for the throttling tests (fio on a lab volume: steady, queue depth 1, bursts) and the detector's verdict
on a volume it judged not throttled."""

from __future__ import annotations

import random
import subprocess
import threading
import time
from pathlib import Path

from lab import lab

from volprobe import diskstats
from volprobe.detectors import FLAT_SHARE, FLAT_TOLERANCE, MIN_SAMPLES


def fio_load(device: str, *options: str, runtime: float) -> subprocess.Popen[bytes]:
    """fio on `device` with O_DIRECT for `runtime` seconds, in its own process group (stop it with stop_fio)."""
    return subprocess.Popen(
        [
            "fio",
            "--name=load",
            f"--filename={device}",
            "--direct=1",
            "--time_based",
            lab.fio_runtime(runtime),
            "--output=/dev/null",
            *options,
        ],
        start_new_session=True,  # fio forks its jobs: stop_fio() signals the whole group
    )


def qd1_writer(device: str, runtime: float) -> subprocess.Popen[bytes]:
    """The seed's job: one thread, queue depth 1, 8 KiB random O_DIRECT writes (latency-bound, never a cap)."""
    return fio_load(
        device,
        "--ioengine=sync",
        "--iodepth=1",
        "--rw=randwrite",
        "--bs=8k",
        "--offset=1M",
        "--size=60M",
        runtime=runtime,
    )


def run_bursts(
    device: str, stop: threading.Event, seed: int, depths: tuple[int, ...] = (4, 16, 32), rw: str = "randrw"
) -> None:
    """Bursts of 0.5 to 2.5 s of parallel I/O, 0.5 to 3 s apart, until `stop`: a load that touches a cap
    for a few seconds at a time, never long enough to be a plateau."""
    rng = random.Random(seed)
    while not stop.is_set():
        burst = fio_load(
            device,
            "--ioengine=libaio",
            f"--iodepth={rng.choice(depths)}",
            f"--rw={rw}",
            "--bs=4k",
            runtime=rng.uniform(0.5, 2.5),
        )
        burst.wait()
        stop.wait(rng.uniform(0.5, 3))


# What the detector exports for a device it judged not throttled: every limit and direction at 0.
NOT_THROTTLED = {(limit, direction): 0.0 for limit in ("iops", "bandwidth") for direction in ("read", "write", "total")}


def device_of(volume: lab.Volume) -> str:
    """The kernel name of a lab volume's device (loop7), as the detector labels it."""
    return Path(volume.device).name


class DiskRates:
    """A disk's reads (`unit` "ops") or bytes read ("bytes") a second, from /proc/diskstats once a second, apart
    from the exporter (a scrape's counters are read at some point within the scrape, which a loaded machine delays
    by a varying amount): in `rates`, until stop()."""

    def __init__(self, device: str, unit: str = "ops") -> None:
        self.device, self.unit = device, unit
        self.rates: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _read(self) -> float:
        stats = diskstats.read(names=[self.device])[self.device]
        return stats.reads_completed if self.unit == "ops" else stats.bytes_read

    def _sample(self) -> None:
        previous, at = self._read(), time.monotonic()
        while not self._stop.wait(max(0.0, at + 1 - time.monotonic())):
            value = self._read()
            now = time.monotonic()
            self.rates.append((value - previous) / (now - at))
            previous, at = value, now
            self.seen(now)

    def seen(self, now: float) -> None:
        """Called after each new rate."""

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class PlateauEvidence(DiskRates):
    """When a disk's reads first showed a plateau at `level` (ops or bytes a second, the lab's cap) by the
    detector's counts: at least MIN_SAMPLES seconds in its window, FLAT_SHARE of them within FLAT_TOLERANCE of
    the level (the detector takes its level from the seconds themselves; the lab serves its cap to 0.1%).
    Read here from /proc/diskstats once a second, apart from the exporter. On a machine loaded by other tests,
    the lab serves its cap unevenly and the plateau's evidence comes late: a deadline for detection runs from
    whichever is later, the start or this."""

    def __init__(self, device: str, level: float, unit: str, window_s: float) -> None:
        self.level, self.window_s = level, window_s
        self.evident_at: float | None = None  # time.monotonic()
        super().__init__(device, unit)

    def seen(self, now: float) -> None:
        window = self.rates[-round(self.window_s) :]
        flat = sum(abs(rate - self.level) <= FLAT_TOLERANCE * self.level for rate in window)
        if self.evident_at is None and len(window) >= MIN_SAMPLES and flat >= FLAT_SHARE * len(window):
            self.evident_at = now
