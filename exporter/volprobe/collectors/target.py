"""Identity of each target and its device: the labels every other series is joined to."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..discovery import kubernetes_volume
from . import Sources, register


@register("target", "identity of targets and their devices")
class TargetCollector:
    def __init__(self, sources: Sources) -> None:
        self.exporter = sources.exporter

    def collect(self) -> list[Metric]:
        info = metrics.TARGET_INFO.family()
        disks = metrics.TARGET_DISK_INFO.family()
        size = metrics.DEVICE_SIZE.family()
        seen: set[str] = set()
        for target in self.exporter.probes.targets():
            d = target.device
            mountpoint = target.mount.mount_point if target.mount else ""
            pv, pod = kubernetes_volume(target.path, mountpoint)
            fstype = target.mount.fstype if target.mount else ""
            identity = [d.kind, d.serial, d.model, d.vendor, d.wwn, d.volume_id, mountpoint, fstype]
            info.add_metric([target.name, d.name, target.path, *identity, ",".join(target.disks), pv, pod], 1)
            for disk in target.disks:
                disks.add_metric([target.name, d.name, disk], 1)
            if d.name not in seen:
                seen.add(d.name)
                size.add_metric([d.name], d.size_bytes)
        return [info, disks, size]
