"""What the collectors read of the running exporter: a narrow, typed view (RuntimeView) returning plain,
immutable snapshots taken when asked. runtime.Exporter implements it; tests give the collectors a fixed one
(exporter/tests/support/fakeview.py) and compare the whole exposition with a golden file.

Nothing here refers to the runtime's classes: a collector sees readings, never a worker, a detector or a job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from .config import Limits, ProbeConfig
from .detectors import Plateau
from .discovery import BlockDevice, Mount
from .diskstats import DiskStats
from .nvme import Stats as NvmeStats
from .stats import LatencySnapshot


@dataclass(frozen=True, slots=True)
class BuildInfo:
    version: str
    python_version: str
    timer: str  # the probe timer: c or python


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    successful: bool  # the last reload
    success_time: float  # Unix time of the last successful load (start-up or reload)


class ProbeReading(NamedTuple):
    """One running probe's counters and latency, as of the scrape (a tuple: one is made per probe per scrape,
    and a tuple is made in half the time of a frozen dataclass)."""

    identity: object  # the same object for the probe's life, and no other's: its rendered series are kept by it
    target: str
    device: str
    spec: ProbeConfig
    source: str  # what its requests go to: probe_file or device
    buckets: tuple[float, ...]  # the histogram's upper bounds, +Inf excluded
    touches: tuple[LatencySnapshot, ...]  # one per stats.TOUCHES, in that order
    missed: int
    errors: Mapping[str, int]  # errno name -> failures
    inflight_seconds: float  # age of the request in flight, 0 if none
    slowdown: float  # the back-off's factor on the interval
    zero_reads: int
    steps: tuple[int, ...] = ()  # nanoseconds in each step (ops.Op.steps) of the sequences in `touches`

    @property
    def labels(self) -> dict[str, str]:
        return {"target": self.target, "device": self.device, "op": self.spec.op}


@dataclass(frozen=True, slots=True)
class TargetReading:
    name: str
    path: str
    device: BlockDevice | None  # None: a directory on a filesystem without a block device (NFS, FUSE, ...)
    mount: Mount | None
    disks: tuple[str, ...]  # the whole disks beneath the device
    limits: Limits


@dataclass(frozen=True, slots=True)
class DiskThrottle:
    """The throttle detector's verdicts and counters for one whole disk."""

    plateaus: Mapping[str, Plateau]  # direction -> plateau
    throttled_seconds: Mapping[tuple[str, str], float]  # (limit, direction) -> seconds
    checks: Mapping[str, int]  # verdict -> active checks that ended so
    unloaded: Mapping[str, float | None]  # direction -> latency without load
    probe_share: float | None  # the probes' share of the disk's I/Os, None if unknown


@dataclass(frozen=True, slots=True)
class ProviderDevice:
    """The provider's own statistics of one AWS NVMe device."""

    kind: str  # ebs or instance_store
    fresh: bool  # the last read succeeded, lately
    latest: NvmeStats | None
    verdicts: Mapping[str, bool]  # limit -> throttled, for the limits that can be judged now


@dataclass(frozen=True, slots=True)
class WarmupReading:
    target: str
    device: str
    total_bytes: int
    done_bytes: int
    ratio: float
    eta_seconds: float | None
    state: str


@dataclass(frozen=True, slots=True)
class MountReading:
    """Whether a directory target's mount answers (runtime.mounts)."""

    target: str
    device: str
    responsive: bool
    last_response_time: float  # Unix time; 0 if it never answered
    # How long its checks took: cumulative counts at each of metrics.MOUNT_CHECK_BUCKETS, then of all; their sum.
    check_counts: tuple[int, ...] = ()
    check_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class VolumeReading:
    device: str  # the kernel name it was last seen under
    status: str
    age_seconds: float


class RuntimeView(Protocol):
    """The running exporter as the collectors see it. Every method returns a snapshot the caller may keep;
    none waits on a device."""

    def build_info(self) -> BuildInfo: ...

    def capabilities(self) -> Mapping[str, bool]: ...

    def kept_capabilities(self) -> str | None:
        """The capabilities the process kept at start (volprobe.privileges), as "CAP_SYS_ADMIN" or "none"; None
        where it dropped none (an exporter run in-process by tests)."""
        ...

    def thread_restarts(self) -> Mapping[str, int]: ...

    def config_reload(self) -> ReloadOutcome: ...

    def web_config_reload(self) -> ReloadOutcome | None:
        """None without a web config watcher (its metrics are then not exported)."""
        ...

    def histogram_by_touch(self) -> bool: ...

    def probe_readings(self) -> Sequence[ProbeReading]: ...

    def target_readings(self) -> Sequence[TargetReading]: ...

    def kubernetes_volumes(self, devices: Sequence[BlockDevice]) -> Mapping[str, set[tuple[str, str]]]:
        """{device name: {(pv, pod_uid)}} of kubelet's mounts of the devices."""
        ...

    def pod_volume_drivers(self) -> Mapping[tuple[str, str], str]:
        """{(pv, pod_uid): CSI driver or in-tree plugin} of the pod volumes mounted at the last rescan (kubernetes:),
        (pv, "") too for each pv; empty while pod volumes are not followed."""
        ...

    def disk_stats(self) -> Mapping[str, DiskStats]:
        """/proc/diskstats of the probed devices and the disks beneath them (of every device: diskstats: all)."""
        ...

    def throttle_readings(self) -> Mapping[str, DiskThrottle] | None:
        """Per whole disk; None when the detector is off."""
        ...

    def provider_readings(self) -> Mapping[str, ProviderDevice]: ...

    def warmup_readings(self) -> Sequence[WarmupReading]: ...

    def mount_readings(self) -> Sequence[MountReading]:
        """Directory targets' mount checks, as of their last answers: never a call into the filesystem."""
        ...

    def volume_readings(self) -> Mapping[str, VolumeReading]:
        """By volume key."""
        ...
