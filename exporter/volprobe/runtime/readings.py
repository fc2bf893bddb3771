"""The running exporter's state as the collectors' readings (volprobe.view): each function takes a snapshot of
one part, under that part's own short lock, and copies it into immutable data."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..discovery import BlockDevice, Host
from ..state import StateStore
from ..view import DiskThrottle, ProbeReading, ProviderDevice, TargetReading, VolumeReading, WarmupReading
from .probes import ProbeSet
from .provider import ProviderStats, verdicts
from .throttle import ThrottleWatch
from .warmups import WarmupManager


def probe_readings(probes: ProbeSet) -> list[ProbeReading]:
    now = time.perf_counter_ns()
    readings = []
    for running in probes.running():
        worker = running.worker
        touches, steps = worker.drained(now)  # the latencies recorded since the last scrape, into the histograms
        readings.append(
            ProbeReading(
                identity=running,
                target=running.target.name,
                device=running.target.device_name,
                spec=running.spec,
                source=running.source,
                buckets=running.stats.buckets,
                touches=touches,
                missed=worker.missed,
                errors=worker.error_counts(),
                inflight_seconds=worker.inflight_seconds(now),
                slowdown=worker.slowdown,
                zero_reads=worker.zero_reads,
                steps=steps,
            )
        )
    return readings


def target_readings(probes: ProbeSet) -> list[TargetReading]:
    return [TargetReading(t.name, t.path, t.device, t.mount, tuple(t.disks), t.config.limits) for t in probes.targets()]


def kubernetes_volumes(host: Host, devices: Sequence[BlockDevice]) -> dict[str, set[tuple[str, str]]]:
    """kubelet's mounts read once for all the devices. Only the mounts at a kubelet volume's path can name one,
    so the others are left out first: on a node of many pods each device is matched against a few mounts, not
    hundreds, and on a host without kubelet no device is looked at (nor its partitions read from sysfs)."""
    if not devices:
        return {}
    mounts = host.kubelet_mounts()
    if not mounts:
        return {}
    return {device.name: host.kubernetes_volumes(device, mounts) for device in devices}


def throttle_readings(throttle: ThrottleWatch) -> dict[str, DiskThrottle] | None:
    detector = throttle.detector
    if detector is None:
        return None
    return {
        name: DiskThrottle(
            plateaus=state.plateaus,
            throttled_seconds=state.throttled_seconds,
            checks=state.checks,
            unloaded=state.unloaded,
            probe_share=detector.probe_share(name),
        )
        for name, state in detector.snapshot().items()  # copies already
    }


def provider_readings(provider: ProviderStats) -> dict[str, ProviderDevice]:
    now = time.monotonic()
    return {
        name: ProviderDevice(device.kind, device.fresh(now), device.latest, verdicts(device, now))
        for name, device in provider.snapshot().items()
    }


def warmup_readings(warmups: WarmupManager) -> list[WarmupReading]:
    readings = []
    for target, job in warmups.jobs():
        progress = job.progress
        readings.append(
            WarmupReading(
                target.name,
                target.device_name,
                progress.total_bytes,
                progress.done_bytes,
                progress.ratio,
                progress.eta(),
                progress.state,
            )
        )
    return readings


def volume_readings(store: StateStore) -> dict[str, VolumeReading]:
    return {key: VolumeReading(v.device, v.status, v.age_seconds) for key, v in store.volumes().items()}
