"""/proc/diskstats of the probed devices and the disks beneath them (or of every device: `diskstats: all`)."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import diskstats, metrics
from . import Sources, register


@register("diskstats", "/proc/diskstats of probed devices, named as node_exporter's node_disk_*")
class DiskstatsCollector:
    def __init__(self, sources: Sources) -> None:
        self.exporter = sources.exporter
        self.proc_root = sources.proc_root

    def collect(self) -> list[Metric]:
        wanted = None if self.exporter.config.diskstats == "all" else self.exporter.probed_devices()
        stats = diskstats.read(self.proc_root, wanted)
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
