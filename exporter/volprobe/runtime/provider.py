"""The provider's statistics of the probed NVMe devices (volprobe.nvme), read in a thread of their own: an admin
command to a hung controller waits for the kernel's admin timeout, and a scrape must never wait with it; each
device is read in a thread of its own, so one that hangs leaves the others read.

Only the whole disks under the targets whose model is an AWS one (EBS, instance store) are asked, every
POLL_INTERVAL_S (AWS: no more often than once a second). A disk is looked at only if its name is an NVMe
namespace's, and its model is read from sysfs once, and again only when the disk changes (Host.known_device):
on a host without AWS devices a poll reads nothing. A device without the page is remembered and not
asked again for an hour, and said once in the log; a refusal for want of CAP_SYS_ADMIN is logged once and
exported as volprobe_capability_available{capability="nvme_admin"} = 0; any other error is logged at most once
an hour per device (the EBS CSI driver logged one per device per scrape: its issue 2232).

Test hook: with $VOLPROBE_TEST_NVME_PAGES set to a directory, a disk whose name is a file there is read from
that file instead of the device, every second (no NVMe device can be made on a test machine).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Set
from dataclasses import dataclass, field, replace

from .. import nvme, supervise
from ..capabilities import NVME_ADMIN, Capabilities
from ..discovery import Host
from ..osthread import name_this_thread

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 5.0
RETRY_UNSUPPORTED_S = 3600.0
LOG_AGAIN_S = 3600.0
HISTORY_S = 120.0  # readings kept per device: the exceeded-time rates of the throttle verdict need 15 s
# How long a poll waits for one device's page before it goes on to the next: each read runs in a thread of its
# own, so an admin command that hangs (a wedged controller) holds that thread only, not the other devices.
READ_WAIT_S = 2.0
TEST_PAGES_ENV = "VOLPROBE_TEST_NVME_PAGES"


@dataclass
class DeviceReadings:
    """Readings of one device, newest last, as (monotonic time, stats)."""

    kind: str
    readings: list[tuple[float, nvme.Stats]] = field(default_factory=list)
    up: bool = True  # the last read succeeded
    max_age: float = 3 * POLL_INTERVAL_S  # older than this, the newest reading says nothing of now
    raw: nvme.Stats | None = None  # the last reading as the device gave it (its histogram counts wrap)

    @property
    def latest(self) -> nvme.Stats | None:
        return self.readings[-1][1] if self.readings else None

    def fresh(self, now: float | None = None) -> bool:
        """The last read succeeded, lately: a hung admin command or failing reads make it stale."""
        now = time.monotonic() if now is None else now
        return self.up and bool(self.readings) and now - self.readings[-1][0] <= self.max_age

    def exceeded_fraction(self, attribute: str, window: float, now: float | None = None) -> float | None:
        """The share of the last `window` seconds the provider counted as over a limit (`attribute` of Stats:
        ebs_iops_exceeded_seconds, ...); None without two readings that far apart, or without a fresh one."""
        if len(self.readings) < 2 or not self.fresh(now):
            return None
        now, newest = self.readings[-1]
        older = [(t, s) for t, s in self.readings if now - t >= window]
        then, oldest = older[-1] if older else self.readings[0]
        if now - then < window / 2:
            return None
        grown: float = getattr(newest, attribute) - getattr(oldest, attribute)
        return max(0.0, min(1.0, grown / (now - then)))


# The provider's throttle verdict: demand over a limit for most of the last 15 s (the detector needs 15 s of a
# plateau to flag one), per (scope, limit) and the Stats field that counts it.
VERDICT_WINDOW_S = 15.0
VERDICT_SHARE = 0.5
EXCEEDED = (
    ("volume", "iops", "ebs_iops_exceeded_seconds"),
    ("volume", "bandwidth", "ebs_throughput_exceeded_seconds"),
    ("instance", "iops", "ec2_iops_exceeded_seconds"),
    ("instance", "bandwidth", "ec2_throughput_exceeded_seconds"),
)


def verdicts(device: DeviceReadings, now: float | None = None) -> dict[str, bool]:
    """The provider's throttle verdict per limit (`iops`, `bandwidth` of the volume; `instance_iops`,
    `instance_bandwidth` of the instance); limits it cannot judge now (too few or stale readings) are absent.
    Instance store has no volume limits."""
    result = {}
    for scope, limit, attribute in EXCEEDED:
        if scope == "volume" and device.kind != "ebs":
            continue
        fraction = device.exceeded_fraction(attribute, VERDICT_WINDOW_S, now)
        if fraction is not None:
            result[limit if scope == "volume" else f"instance_{limit}"] = fraction >= VERDICT_SHARE
    return result


class ProviderStats:
    def __init__(
        self,
        host: Host,
        disks: Callable[[], Set[str]],
        on_verdict: Callable[[str, bool], None] = lambda _disk, _throttled: None,
        interval: float = POLL_INTERVAL_S,
        *,
        capabilities: Capabilities,
    ) -> None:
        self.host = host
        self.capabilities = capabilities  # whether the NVMe admin command is permitted
        self.disks = disks  # the whole disks under the running targets
        self.on_verdict = on_verdict  # (disk, throttled at some limit): the probes back off as for a plateau
        self._throttled: set[str] = set()
        self.interval = interval
        self.test_pages = os.environ.get(TEST_PAGES_ENV) or None
        if self.test_pages:
            self.interval = 1.0  # files, not devices: AWS's once a second is about the controllers
        self._devices: dict[str, DeviceReadings] = {}
        self._unsupported: dict[str, float] = {}  # device identity -> monotonic time it said it has no page
        self._logged: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reading: dict[str, tuple[threading.Thread, float]] = {}  # disk -> its read in flight, since when

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="provider stats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> dict[str, DeviceReadings]:
        with self._lock:
            return {
                name: DeviceReadings(d.kind, list(d.readings), d.up, d.max_age) for name, d in self._devices.items()
            }

    def _run(self) -> None:
        name_this_thread("vp provider")

        def polls() -> None:
            while not self._stop.is_set():
                self.poll()
                self._stop.wait(self.interval)

        # A bad poll (a device vanishing mid-read) is logged, counted and retried after a back-off.
        supervise.run("provider", polls, self._stop, "provider statistics poll")

    def poll(self) -> None:
        disks = self.disks()
        with self._lock:
            for gone in set(self._devices) - disks:
                del self._devices[gone]
        self._poll(disks)
        now = time.monotonic()
        for disk, device in self.snapshot().items():
            throttled = any(verdicts(device, now).values())
            if throttled != (disk in self._throttled):
                self._throttled ^= {disk}
                self.on_verdict(disk, throttled)
        for disk in self._throttled - disks:  # a disk no longer read (stopped, or unsupported now)
            self._throttled.discard(disk)
            self.on_verdict(disk, False)

    def _poll(self, disks: Set[str]) -> None:
        now = time.monotonic()
        for disk in sorted(disks):
            reader, since = self._reading.get(disk, (None, now))
            if reader is not None and reader.is_alive():  # its last read still hangs: not asked again meanwhile
                self._hung(disk, now - since)
                continue
            found = self._source(disk)
            if found is None:
                continue
            source, identity, kind = found
            if now - self._unsupported.get(identity, -RETRY_UNSUPPORTED_S) < RETRY_UNSUPPORTED_S:
                continue
            reader = threading.Thread(
                target=self._read, args=(disk, source, identity), name=f"vp nvme {disk}", daemon=True
            )
            self._reading[disk] = (reader, now)
            reader.start()
            reader.join(READ_WAIT_S)
            if reader.is_alive():
                self._hung(disk, time.monotonic() - now, kind)
        # A read that still hangs stays on record: the disk, back under a reload, is not asked a second time.
        for disk in set(self._reading) - disks:
            if not self._reading[disk][0].is_alive():
                del self._reading[disk]

    def _hung(self, disk: str, seconds: float, kind: str = "ebs") -> None:
        with self._lock:
            # Hung from its first read: exported down all the same (a reading, when one comes, sets the kind).
            readings = self._devices.setdefault(disk, DeviceReadings(kind, max_age=3 * self.interval))
            readings.up = False
        self._say(
            disk,
            "hung",
            logging.WARNING,
            f"provider statistics of {disk}: its log page read has not returned for {seconds:.0f} s "
            f"(the device hangs?); the other devices are read on",
        )

    def _source(self, disk: str) -> tuple[str, str, str] | None:
        """(the file or device node to read the page from, what identifies the device: a new volume under the
        same name is asked afresh, its kind as its model says), or None if the disk is not an AWS NVMe device."""
        if self.test_pages:
            page = os.path.join(self.test_pages, disk)
            try:
                found = os.stat(page)
            except FileNotFoundError:
                return None
            # A regular file, or a FIFO: a read that hangs until the test writes to it.
            usable = stat.S_ISREG(found.st_mode) or stat.S_ISFIFO(found.st_mode)
            return (page, f"{disk}:{found.st_ino}", "ebs") if usable else None
        if not nvme.NAMESPACE_NAME.fullmatch(disk):  # AWS's volumes are NVMe namespaces: others cost nothing
            return None
        device = self.host.known_device(disk)  # read again only when the disk changes
        if device is None or device.model not in nvme.MODELS:
            return None
        return device.devnode, f"{disk}:{device.serial}", nvme.MODELS[device.model]

    def _read(self, disk: str, source: str, identity: str) -> None:
        name_this_thread()
        now = time.monotonic()
        try:
            if self.test_pages:
                with open(source, "rb") as f:
                    page = f.read()
            else:
                page = nvme.read_log_page(source)
            now = time.monotonic()  # when the device answered: a slow answer is not stamped with its request
            stats = nvme.parse_log_page(page)
        except nvme.Unsupported as err:
            self._unsupported[identity] = now
            with self._lock:
                self._devices.pop(disk, None)
            self._say(disk, "unsupported", logging.INFO, f"no provider statistics for {disk}: {err}")
            return
        except nvme.NotPermitted as err:
            self.capabilities.record(NVME_ADMIN, False, f"{err}; provider statistics are not read")
            self._unsupported[identity] = now
            return
        except (OSError, ValueError) as err:
            with self._lock:
                if disk in self._devices:
                    self._devices[disk].up = False
            self._say(disk, "error", logging.WARNING, f"provider statistics of {disk} not read: {err}")
            return
        if not self.test_pages:
            self.capabilities.record(NVME_ADMIN, True)
        with self._lock:
            readings = self._devices.setdefault(disk, DeviceReadings(stats.kind, max_age=3 * self.interval))
            raw, latest, earlier_raw = stats, readings.latest, readings.raw
            stats = replace(
                stats,
                read_latency=stats.read_latency.unwrap(
                    latest.read_latency if latest else None, earlier_raw.read_latency if earlier_raw else None
                ),
                write_latency=stats.write_latency.unwrap(
                    latest.write_latency if latest else None, earlier_raw.write_latency if earlier_raw else None
                ),
            )
            readings.kind, readings.up, readings.raw = stats.kind, True, raw
            readings.readings.append((now, stats))
            while readings.readings and now - readings.readings[0][0] > HISTORY_S:
                readings.readings.pop(0)

    def _say(self, disk: str, what: str, level: int, message: str) -> None:
        """Log `message` at most once per LOG_AGAIN_S for this disk and kind of problem."""
        now = time.monotonic()
        last = self._logged.get((disk, what))
        if last is not None and now - last < LOG_AGAIN_S:
            return
        self._logged[(disk, what)] = now
        log.log(level, "%s", message)
