"""/proc/diskstats of the probed devices and the disks beneath them (or of every device: `diskstats: all`).

A device's series are rendered once, when it is first scraped, and kept while it is exported (as a probe's
are, in collectors/probe.py): a scrape only writes the values.
"""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..exposition import Series
from ..view import RuntimeView
from .registry import register


def device_series(device: str) -> tuple[Series, ...]:
    """One series per metrics.DISK_METRICS, in its order."""
    return tuple(disk.spec.series(disk.spec.series_names()[0], {"device": device}) for disk in metrics.DISK_METRICS)


@register("diskstats", "/proc/diskstats of probed devices, named as node_exporter's node_disk_*")
class DiskstatsCollector:
    def __init__(self, view: RuntimeView) -> None:
        self.view = view
        self._series: dict[str, tuple[Series, ...]] = {}  # by device name: those of the last scrape

    def collect(self) -> list[Metric]:
        stats = self.view.disk_stats()
        kept = self._series
        self._series = rendered = {name: kept.get(name) or device_series(name) for name in sorted(stats)}
        families: list[Metric] = []
        for column, disk in enumerate(metrics.DISK_METRICS):
            family = disk.spec.series_family()
            field, scale = disk.field, disk.scale
            for name, series in rendered.items():
                value = getattr(stats[name], field)
                if value is not None:  # a field this kernel does not print
                    family.add(series[column], value * scale)
            if family.series:
                families.append(family)
        return families
