"""A fixed RuntimeView (volprobe.view) for collector tests, and golden_view(): a runtime that exports every
metric family volprobe has, with fixed values, for the golden exposition (test_golden.py).

The readings are built with the package's own code where it is pure (ProbeStats fed fixed latencies at fixed
times, diskstats.parse of a fixture line, nvme.Histogram), so the golden file shows what the real parts make.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from volprobe import diskstats, supervise
from volprobe.config import Limits, ProbeConfig
from volprobe.detectors import Plateau
from volprobe.discovery import BlockDevice, Mount
from volprobe.nvme import Histogram
from volprobe.nvme import Stats as NvmeStats
from volprobe.stats import TOUCHES, ProbeStats
from volprobe.view import (
    BuildInfo,
    DiskThrottle,
    MountReading,
    ProbeReading,
    ProviderDevice,
    ReloadOutcome,
    TargetReading,
    VolumeReading,
    WarmupReading,
)

Kubelet = Callable[[Sequence[BlockDevice]], Mapping[str, set[tuple[str, str]]]]


@dataclass
class FakeView:
    """A RuntimeView that returns what it was given. Defaults: nothing probed, nothing failed."""

    build: BuildInfo = field(default_factory=lambda: BuildInfo("0.0.0", "3.11.0", "c"))
    capability: Mapping[str, bool] = field(default_factory=dict)
    kept: str | None = None  # the capabilities kept at start; None: none dropped (an in-process exporter)
    restarts: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(supervise.THREADS, 0))
    reload: ReloadOutcome = field(default_factory=lambda: ReloadOutcome(True, 1700000000.0))
    web_reload: ReloadOutcome | None = None
    by_touch: bool = False
    probes: Sequence[ProbeReading] = ()
    targets: Sequence[TargetReading] = ()
    kubelet: Kubelet = lambda devices: {}
    disks: Mapping[str, diskstats.DiskStats] = field(default_factory=dict)
    throttle: Mapping[str, DiskThrottle] | None = None
    provider: Mapping[str, ProviderDevice] = field(default_factory=dict)
    warmups: Sequence[WarmupReading] = ()
    volumes: Mapping[str, VolumeReading] = field(default_factory=dict)
    mounts: Sequence[MountReading] = ()
    drivers: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def build_info(self) -> BuildInfo:
        return self.build

    def capabilities(self) -> Mapping[str, bool]:
        return self.capability

    def kept_capabilities(self) -> str | None:
        return self.kept

    def thread_restarts(self) -> Mapping[str, int]:
        return self.restarts

    def config_reload(self) -> ReloadOutcome:
        return self.reload

    def web_config_reload(self) -> ReloadOutcome | None:
        return self.web_reload

    def histogram_by_touch(self) -> bool:
        return self.by_touch

    def probe_readings(self) -> Sequence[ProbeReading]:
        return self.probes

    def target_readings(self) -> Sequence[TargetReading]:
        return self.targets

    def kubernetes_volumes(self, devices: Sequence[BlockDevice]) -> Mapping[str, set[tuple[str, str]]]:
        return self.kubelet(devices)

    def pod_volume_drivers(self) -> Mapping[tuple[str, str], str]:
        return self.drivers

    def disk_stats(self) -> Mapping[str, diskstats.DiskStats]:
        return self.disks

    def throttle_readings(self) -> Mapping[str, DiskThrottle] | None:
        return self.throttle

    def provider_readings(self) -> Mapping[str, ProviderDevice]:
        return self.provider

    def warmup_readings(self) -> Sequence[WarmupReading]:
        return self.warmups

    def volume_readings(self) -> Mapping[str, VolumeReading]:
        return self.volumes

    def mount_readings(self) -> Sequence[MountReading]:
        return self.mounts


def probe_reading(
    target: str,
    device: str,
    spec: ProbeConfig,
    identity: object | None = None,
    latencies_us: Sequence[int] = (),
    errors: Mapping[str, int] | None = None,
    missed: int = 0,
    inflight_seconds: float = 0.0,
    slowdown: float = 1.0,
    zero_reads: int = 0,
    source: str = "device",
    steps: tuple[int, ...] = (),
) -> ProbeReading:
    """A probe's reading from real statistics: each latency recorded one second after the last, first and
    repeat touches in turn, and read at a fixed time within the window."""
    stats = ProbeStats(60.0)
    for i, latency in enumerate(latencies_us):
        stats.record(latency * 1000, TOUCHES[i % 2], (i + 1) * 10**9)
    now = (len(latencies_us) + 1) * 10**9
    return ProbeReading(
        identity=object() if identity is None else identity,
        target=target,
        device=device,
        spec=spec,
        source=source,
        buckets=stats.buckets,
        touches=tuple(stats.snapshot(touch, now) for touch in TOUCHES),
        missed=missed,
        errors=dict(errors or {}),
        inflight_seconds=inflight_seconds,
        slowdown=slowdown,
        zero_reads=zero_reads,
        steps=steps,
    )


# -- the golden runtime --------------------------------------------------------------------------------------

DISK = BlockDevice(
    "nvme1n1",
    259,
    1,
    "disk",
    "/dev/nvme1n1",
    100 * 2**30,
    512,
    4096,
    serial="vol0123456789abcdef0",
    model="Amazon Elastic Block Store",
    vendor="",
    wwn="nvme.1d0f-766f6c",
    volume_id="vol-0123456789abcdef0",
)
LOCAL = BlockDevice(
    "nvme2n1", 259, 2, "disk", "/dev/nvme2n1", 1900 * 2**30, 512, 512, model="Amazon EC2 NVMe Instance Storage"
)
PART = BlockDevice("nvme2n1p1", 259, 3, "part", "/dev/nvme2n1p1", 1900 * 2**30 - 2**20, 512, 512, parent="nvme2n1")

# 20 fields: a 5.5+ kernel's, with the discard and flush counters.
DISKSTATS = """\
 259       1 nvme1n1 120 3 9600 250 80 5 20480 900 0 1100 1150 4 0 2048 7 11 13
 259       2 nvme2n1 300 0 2400 60 10 1 80 40 1 90 100 0 0 0 0 2 1
 259       3 nvme2n1p1 300 0 2400 60 10 1 80 40 1 90 100 0 0 0 0 2 1
"""


def _nvme_stats(kind: str, scale: int) -> NvmeStats:
    read = Histogram(((0.000128, 50 * scale), (0.000256, 30 * scale), (0.001, 5 * scale), (1e12, 1)))
    write = Histogram(((0.000128, 10 * scale), (0.000256, 20 * scale), (0.001, 3)))
    return NvmeStats(
        kind,
        read_ops=86 * scale,
        write_ops=33 * scale,
        read_bytes=86 * 4096 * scale,
        write_bytes=33 * 8192 * scale,
        read_seconds=0.0125 * scale,
        write_seconds=0.0075 * scale,
        ebs_iops_exceeded_seconds=2.5 if kind == "ebs" else 0.0,
        ebs_throughput_exceeded_seconds=0.0,
        ec2_iops_exceeded_seconds=0.0,
        ec2_throughput_exceeded_seconds=0.25,
        queue_length=1,
        read_latency=read,
        write_latency=write,
    )


def golden_view() -> FakeView:
    """Every family volprobe exports, each with at least one series: two targets (a raw device with read and
    write probes and limits; a directory on instance store, its writes to a probe file), a detector that sees a
    plateau, provider statistics of both devices, two warm-ups, remembered volumes, a web config; and a directory on
    NFS, without a block device, whose mount hangs."""
    read = ProbeConfig("read", interval=0.5)
    write = ProbeConfig("write", interval=2.0)
    file_write = ProbeConfig("write", block_size=4096, interval=1.0)
    commit, meta = ProbeConfig("commit", interval=1.0), ProbeConfig("metadata", interval=10.0)
    meta_steps = (90_000, 4_000, 1_100_000, 60_000, 900_000, 50_000)  # ns per step over its three sequences
    ebs, local = "ebs", "local"
    probes = [
        probe_reading(ebs, DISK.name, read, latencies_us=[180, 220, 250, 900, 210, 40000], zero_reads=3, missed=1),
        probe_reading(
            ebs, DISK.name, write, latencies_us=[600, 750, 1200], errors={"EIO": 2, "ENOSPC": 1}, slowdown=2.0
        ),
        probe_reading(local, PART.name, read, latencies_us=[80, 95, 70]),
        probe_reading(local, PART.name, file_write, latencies_us=[300, 310], inflight_seconds=1.5, source="probe_file"),
        probe_reading(local, PART.name, commit, latencies_us=[900, 1100, 1000], source="commit_log"),
        probe_reading(
            local, PART.name, meta, latencies_us=[700, 800, 704], source="metadata_directory", steps=meta_steps
        ),
        probe_reading("shared", "", file_write, latencies_us=[2100, 2500], inflight_seconds=12.0, source="probe_file"),
        probe_reading("shared", "", read, latencies_us=[900, 1100], source="probe_file"),
    ]
    pod = "8d3b3c52-1f4e-4d8a-9a57-6f1c2e0d4b21"
    mount = Mount(259, 3, f"/var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~csi/pvc-42/mount", "xfs", PART.devnode)
    targets = [
        TargetReading(ebs, DISK.devnode, DISK, None, (DISK.name,), Limits(iops=3000, bandwidth=125 * 2**20)),
        TargetReading(local, mount.mount_point, PART, mount, (LOCAL.name,), Limits()),
        TargetReading("shared", "/mnt/shared", None, Mount(0, 53, "/mnt/shared", "nfs4", "nas:/export"), (), Limits()),
    ]
    mounts = [
        MountReading(local, PART.name, True, 1700000090.0, (3, 9, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12), 0.0041),
        MountReading("shared", "", False, 1700000030.0),
    ]
    throttle = {
        DISK.name: DiskThrottle(
            plateaus={"read": Plateau("iops", 3000.0, 12288000.0, 1.0, 0.00033)},
            throttled_seconds={("iops", "read"): 42.0, ("bandwidth", "write"): 3.0},
            checks={"capped": 2, "inconclusive": 1},
            unloaded={"read": 0.0002, "write": None},
            probe_share=0.004,
        ),
        LOCAL.name: DiskThrottle(plateaus={}, throttled_seconds={}, checks={}, unloaded={}, probe_share=None),
    }
    provider = {
        DISK.name: ProviderDevice("ebs", True, _nvme_stats("ebs", 10), {"iops": True, "bandwidth": False}),
        LOCAL.name: ProviderDevice("instance_store", True, _nvme_stats("instance_store", 1), {"instance_iops": False}),
        "nvme3n1": ProviderDevice("ebs", False, None, {}),  # not read yet
    }
    warmups = [
        WarmupReading(ebs, DISK.name, DISK.size_bytes, DISK.size_bytes // 4, 0.25, 5400.0, "running"),
        WarmupReading(local, PART.name, PART.size_bytes, PART.size_bytes, 1.0, None, "done"),
    ]
    volumes = {
        "ebs:vol-0123456789abcdef0": VolumeReading(DISK.name, "ok", 3600.0),
        "wwn:nvme.1d0f-local": VolumeReading(LOCAL.name, "new", 12.5),
    }
    restarts = dict.fromkeys(supervise.THREADS, 0)
    restarts["provider"] = 1
    return FakeView(
        build=BuildInfo("1.2.3", "3.11.2", "c"),
        capability={"idle_io_priority": True, "udev_monitor": False, "nvme_admin": True},
        kept="CAP_SYS_ADMIN",
        restarts=restarts,
        reload=ReloadOutcome(False, 1700000000.0),
        web_reload=ReloadOutcome(True, 1700000100.5),
        probes=probes,
        targets=targets,
        kubelet=lambda devices: {d.name: {("pvc-77", "5678-ef01")} for d in devices if d.name == DISK.name},
        disks=diskstats.parse(DISKSTATS),
        throttle=throttle,
        provider=provider,
        warmups=warmups,
        volumes=volumes,
        mounts=mounts,
        drivers={("pvc-42", pod): "ebs.csi.aws.com", ("pvc-42", ""): "ebs.csi.aws.com"},
    )
