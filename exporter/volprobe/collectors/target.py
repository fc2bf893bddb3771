"""Identity of each target and its device: the labels every other series is joined to."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..discovery import choose_kubernetes_volume, kubernetes_volume
from . import Sources, register


@register("target", "identity of targets and their devices")
class TargetCollector:
    def __init__(self, sources: Sources) -> None:
        self.exporter = sources.exporter
        # Each target's (pv, pod_uid) from kubelet's mounts at the last scrape: kept while it still holds.
        self._kubelet: dict[str, tuple[str, str]] = {}

    def collect(self) -> list[Metric]:
        info = metrics.TARGET_INFO.family()
        disks = metrics.TARGET_DISK_INFO.family()
        size = metrics.DEVICE_SIZE.family()
        seen: set[str] = set()
        host = self.exporter.host
        kubelet_mounts = None
        chosen: dict[str, tuple[str, str]] = {}
        for target in self.exporter.probes.targets():
            d = target.device
            mountpoint = target.mount.mount_point if target.mount else ""
            pv, pod = kubernetes_volume(target.path, mountpoint)
            if not pv:  # a device (one discovery found, say) that pods mount: kubelet's mounts of it say which
                if kubelet_mounts is None:
                    kubelet_mounts = host.kubelet_mounts()
                found = host.kubernetes_volumes(d, kubelet_mounts)
                previous = self._kubelet.get(target.name, ("", ""))
                pv, pod = chosen[target.name] = choose_kubernetes_volume(found, previous)
            fstype = target.mount.fstype if target.mount else ""
            identity = [d.kind, d.serial, d.model, d.vendor, d.wwn, d.volume_id, mountpoint, fstype]
            info.add_metric([target.name, d.name, target.path, *identity, ",".join(target.disks), pv, pod], 1)
            for disk in target.disks:
                disks.add_metric([target.name, d.name, disk], 1)
            if d.name not in seen:
                seen.add(d.name)
                size.add_metric([d.name], d.size_bytes)
        self._kubelet = chosen
        return [info, disks, size]
