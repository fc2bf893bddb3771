"""Wires the throttle detector to the probes: which disks it watches, their unloaded service time (from the
probes, and remembered in each volume's state across restarts), their configured limits, active checks of
plateaus the probes cannot judge, and the probes' back-off while their disk is throttled."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .. import burst
from ..config import ThrottleConfig
from ..detectors import DIRECTIONS, CheckRequest, ThrottleDetector
from ..discovery import BlockDevice, Host
from ..state import StateStore, VolumeIdentity, VolumeState
from .probes import ProbeSet, RunningProbe

log = logging.getLogger(__name__)

REMEMBER_S = 7 * 86400  # a remembered unloaded latency older than this is not used
SAVE_EVERY_S = 60.0  # a lower unloaded latency is written at most this often per disk


class ThrottleWatch:
    """The throttle detector of the current configuration, and what it needs from the rest of the exporter."""

    def __init__(self, probes: ProbeSet, host: Host, store: Callable[[], StateStore]) -> None:
        self.probes = probes
        self.host = host
        self.store = store  # the exporter's current state store (a reload may replace it)
        self.config = ThrottleConfig(enabled=False)
        self.detector: ThrottleDetector | None = None
        self._lock = threading.Lock()
        self._devices: dict[str, BlockDevice] = {}  # disk -> its identity when last asked
        self._remembered: dict[tuple[str, str], tuple[float, int]] = {}  # (disk, direction) -> (seconds, unix time)
        self._saved_at: dict[str, float] = {}
        self._burst_requests: dict[str, int] = {}
        self._inferred: set[str] = set()  # disks on a plateau, by the detector
        self._provider: set[str] = set()  # disks throttled by the provider's own count (runtime.provider)

    def apply(self, config: ThrottleConfig) -> None:
        """Start the detector, or restart it if its settings changed."""
        if config == self.config and (self.detector is not None) == config.enabled:
            return
        self.stop()
        self.config = config
        if not config.enabled:
            return
        self.detector = ThrottleDetector(
            devices=self.devices,
            unloaded_latency=self.unloaded_latency,
            limits=self.limits,
            on_change=self.changed,
            probe_completions=self.probe_completions,
            proc_root=self.host.proc,
            sample_interval=config.sample_interval,
            window=config.window,
            request_check=self.check,
        )
        self.detector.start()

    def stop(self) -> None:
        if self.detector is not None:
            self.detector.stop()
            self.detector = None
        self._inferred.clear()  # a new detector judges afresh
        for running in self.probes.running():
            running.worker.set_slowdown(1.0)

    def devices(self) -> frozenset[str]:
        return self.probes.disks()

    # -- the unloaded service time ------------------------------------------------------------------------------

    def _device(self, disk: str) -> BlockDevice | None:
        """The disk's identity, read again when the disk changes (Host.known_device): a disk replaced under the
        same name gets its own remembered latency, not its predecessor's."""
        device = self.host.known_device(disk)
        if device is None:
            return None
        cached = self._devices.get(disk)
        if cached is not None and VolumeIdentity.of(cached) != VolumeIdentity.of(device):
            for key in [k for k in self._remembered if k[0] == disk]:
                del self._remembered[key]
            self._saved_at.pop(disk, None)
        self._devices[disk] = device
        return device

    def _volume(self, disk: str) -> VolumeState | None:
        device = self._device(disk)
        store = self.store()
        return store.volume(device) if device is not None and store.directory else None

    def _load(self, disk: str) -> None:
        """Read the disk's remembered unloaded latencies once."""
        volume = self._volume(disk)
        saved = volume.get("unloaded") if volume else None
        for direction in DIRECTIONS:
            entry = saved.get(direction) if isinstance(saved, dict) else None
            if not (isinstance(entry, dict) and isinstance(entry.get("seconds"), float)):
                continue
            if isinstance(entry.get("at"), int) and time.time() - entry["at"] < REMEMBER_S:
                self._remembered[(disk, direction)] = (entry["seconds"], entry["at"])
        self._saved_at.setdefault(disk, 0.0)

    def unloaded_latency(self, disk: str, direction: str) -> float | None:
        """The lowest latency the probes of this direction (any direction for "total") have seen, or remembered
        from earlier runs within REMEMBER_S (so a restart under load knows the disk's unloaded time)."""
        # A commit or metadata probe times a filesystem's work (journal, several requests), not one request.
        probes = [p for p in self.probes.on_disk(disk) if not p.spec.kind.buffered]
        chosen = [p for p in probes if p.spec.kind.direction == direction] or probes
        for probe in chosen:
            probe.worker.drain()
        floors = [f for f in (p.stats.floor() for p in chosen) if f is not None]
        measured = min(floors) if floors else None
        with self._lock:
            self._device(disk)  # forgets what was remembered of a replaced disk
            if disk not in self._saved_at:
                self._load(disk)
            remembered = self._remembered.get((disk, direction))
            if measured is not None and (remembered is None or measured < remembered[0]):
                self._remembered[(disk, direction)] = remembered = (measured, int(time.time()))
                if time.monotonic() - self._saved_at[disk] >= SAVE_EVERY_S:
                    self._save(disk)
        known = [v for v in (measured, remembered[0] if remembered else None) if v is not None]
        return min(known) if known else None

    def _save(self, disk: str) -> None:
        volume = self._volume(disk)
        self._saved_at[disk] = time.monotonic()
        if volume is None:
            return
        entries = {d: {"seconds": v, "at": at} for (name, d), (v, at) in self._remembered.items() if name == disk}
        volume.put("unloaded", entries)

    # -- limits, completions, back-off ---------------------------------------------------------------------------

    def limits(self, disk: str) -> tuple[float | None, float | None]:
        for target in self.probes.targets():
            limits = target.config.limits
            if disk in target.disks and (limits.iops or limits.bandwidth):
                return limits.iops, limits.bandwidth
        return None, None

    def probe_completions(self, disk: str) -> int:
        """volprobe's own I/O on the disk: its probes' and its active checks'."""
        with self._lock:
            bursts = self._burst_requests.get(disk, 0)
        return self.probes.completed_on(disk) + bursts

    def changed(self, disk: str, throttled: bool) -> None:
        """Probes back off while their disk is throttled, so volprobe never adds to the throttling it reports:
        on a plateau the detector found (here), or when the provider counts demand over a limit
        (provider_changed)."""
        (self._inferred.add if throttled else self._inferred.discard)(disk)
        self._slow_down(disk)

    def provider_changed(self, disk: str, throttled: bool) -> None:
        (self._provider.add if throttled else self._provider.discard)(disk)
        self._slow_down(disk)

    def _slow_down(self, disk: str) -> None:
        throttled = self.detector is not None and (disk in self._inferred or disk in self._provider)
        factor = self.config.backoff if throttled else 1.0
        for running in self.probes.on_disk(disk):
            running.worker.set_slowdown(factor)

    def back_off_new(self, new: list[RunningProbe]) -> None:
        """Probes started on a disk that is throttled already back off from their first request."""
        detector = self.detector
        if detector is None:
            return
        for running in new:
            if any(detector.is_throttled(disk) or disk in self._provider for disk in running.target.disks):
                running.worker.set_slowdown(self.config.backoff)

    # -- active checks -----------------------------------------------------------------------------------------

    def check(self, request: CheckRequest) -> None:
        """Run a burst of reads on the disk in its own thread (it blocks on I/O) and report the verdict."""
        threading.Thread(target=self._check, args=(request,), name=f"check {request.disk}", daemon=True).start()

    def _check(self, request: CheckRequest) -> None:
        verdict = "inconclusive"
        try:
            with self._lock:
                device = self._device(request.disk)
            if device is None:
                return
            size = burst.request_size(request.bytes_per_s / max(request.ops_per_s, 1e-9))
            size = max(size, device.logical_block_size)
            result = burst.run(device.devnode, device.size_bytes, size, request.disk, self.host.proc, request.stop)
            with self._lock:
                self._burst_requests[request.disk] = self._burst_requests.get(request.disk, 0) + result.requests
            verdict = burst.verdict(request.ops_per_s, request.bytes_per_s, result)
            log.info(
                "%s: burst of %d reads: the disk went from %.0f to %.0f ops/s, %.1f to %.1f MiB/s: %s",
                request.disk,
                result.requests,
                request.ops_per_s,
                result.ops_per_s,
                request.bytes_per_s / 2**20,
                result.bytes_per_s / 2**20,
                verdict,
            )
        except Exception:
            log.exception("active check of %s failed", request.disk)
        finally:
            request.report(request.disk, verdict)  # always: a check that never reports would block the next
