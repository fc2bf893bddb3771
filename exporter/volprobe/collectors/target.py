"""Identity of each target and its device: the labels every other series is joined to."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..discovery import choose_kubernetes_volume, kubernetes_volume
from ..view import RuntimeView
from .registry import register


@register("target", "identity of targets and their devices")
class TargetCollector:
    def __init__(self, view: RuntimeView) -> None:
        self.view = view
        # Each target's (pv, pod_uid) from kubelet's mounts at the last scrape: kept while it still holds.
        self._kubelet: dict[str, tuple[str, str]] = {}

    def collect(self) -> list[Metric]:
        info = metrics.TARGET_INFO.family()
        disks = metrics.TARGET_DISK_INFO.family()
        size = metrics.DEVICE_SIZE.family()
        seen: set[str] = set()
        chosen: dict[str, tuple[str, str]] = {}
        targets = self.view.target_readings()
        # A device (one discovery found, say) that pods mount: kubelet's mounts of it say which.
        named = {t.name: kubernetes_volume(t.path, t.mount.mount_point if t.mount else "") for t in targets}
        unnamed = [t.device for t in targets if not named[t.name][0] and t.device is not None]
        kubelet = self.view.kubernetes_volumes(unnamed) if unnamed else {}
        drivers = self.view.pod_volume_drivers()
        for target in targets:
            d = target.device
            mountpoint = target.mount.mount_point if target.mount else ""
            fstype = target.mount.fstype if target.mount else ""
            pv, pod = named[target.name]
            if d is not None and not pv:
                previous = self._kubelet.get(target.name, ("", ""))
                pv, pod = chosen[target.name] = choose_kubernetes_volume(kubelet.get(d.name, set()), previous)
            # Without a device (NFS, CephFS, SMB, FUSE) there is no identity, disk or size: its fstype (nfs4,
            # ceph, cifs, fuse.sshfs, ...), as /proc/self/mountinfo gives it, says what it is.
            identity = [d.kind, d.serial, d.model, d.vendor, d.wwn, d.volume_id] if d is not None else [""] * 6
            name = d.name if d is not None else ""
            driver = drivers.get((pv, pod), "") if pv else ""
            info.add_metric(
                [
                    target.name,
                    name,
                    target.path,
                    *identity,
                    mountpoint,
                    fstype,
                    ",".join(target.disks),
                    pv,
                    pod,
                    driver,
                ],
                1,
            )
            for disk in target.disks:
                disks.add_metric([target.name, name, disk], 1)
            if d is not None and d.name not in seen:
                seen.add(d.name)
                size.add_metric([d.name], d.size_bytes)
        self._kubelet = chosen
        responsive, answered = metrics.MOUNT_RESPONSIVE.family(), metrics.MOUNT_LAST_RESPONSE_TIME.family()
        durations = metrics.MOUNT_CHECK_SECONDS.family()
        bounds = [*(repr(b) for b in metrics.MOUNT_CHECK_BUCKETS), "+Inf"]
        for mount in self.view.mount_readings():
            responsive.add_metric([mount.target, mount.device], 1.0 if mount.responsive else 0.0)
            answered.add_metric([mount.target, mount.device], mount.last_response_time)
            counts = mount.check_counts or (0,) * len(bounds)
            durations.add_metric(
                [mount.target, mount.device], list(zip(bounds, counts, strict=True)), mount.check_seconds
            )
        return [info, disks, size, responsive, answered, durations]
