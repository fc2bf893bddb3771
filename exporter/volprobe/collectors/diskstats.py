"""/proc/diskstats of the probed devices and the disks beneath them (or of every device: `diskstats: all`)."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..view import RuntimeView
from .registry import register


@register("diskstats", "/proc/diskstats of probed devices, named as node_exporter's node_disk_*")
class DiskstatsCollector:
    def __init__(self, view: RuntimeView) -> None:
        self.view = view

    def collect(self) -> list[Metric]:
        stats = self.view.disk_stats()
        names = sorted(stats)
        families = []
        for disk in metrics.DISK_METRICS:
            family = disk.spec.family()
            for name in names:
                value = getattr(stats[name], disk.field)
                if value is not None:
                    family.add_metric([name], value * disk.scale)
            if family.samples:
                families.append(family)
        return families
