"""Throttling of the disks under the targets: inferred by the detector (a plateau), or counted by the provider
(AWS NVMe statistics: the time demand exceeded a limit), and the configured limits.

A disk's series are rendered once, when it is first scraped, and kept while it is exported (as a probe's are,
in collectors/probe.py): a scrape only writes the values.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import Metric

from .. import metrics
from ..detectors import DIRECTIONS, LIMITS
from ..exposition import Series
from ..view import RuntimeView
from .registry import register

CHECK_RESULTS = ("capped", "uncapped", "inconclusive")
ACTIVE, SECONDS, CHECKS = metrics.THROTTLE_ACTIVE, metrics.THROTTLE_SECONDS, metrics.THROTTLE_CHECKS
CEILING_OPS, CEILING_BYTES = metrics.THROTTLE_CEILING_OPS, metrics.THROTTLE_CEILING_BYTES


class DiskSeries:
    """Every series of the detector's verdicts on one whole disk."""

    def __init__(self, disk: str) -> None:
        self.disk = disk
        self.active = {
            (direction, limit): ACTIVE.series(
                ACTIVE.name, {"device": disk, "limit": limit, "dir": direction, "source": "inferred"}
            )
            for direction in DIRECTIONS
            for limit in LIMITS
        }
        self.seconds = {
            (direction, limit): SECONDS.series(SECONDS.total, {"device": disk, "limit": limit, "dir": direction})
            for direction in DIRECTIONS
            for limit in LIMITS
        }
        self.checks = [CHECKS.series(CHECKS.total, {"device": disk, "result": result}) for result in CHECK_RESULTS]
        self.share = metrics.PROBE_SHARE.series(metrics.PROBE_SHARE.name, {"device": disk})
        self._by_direction: dict[tuple[str, str], Series] = {}  # (family, dir) -> series

    def of_direction(self, spec: metrics.MetricSpec[Any], direction: str) -> Series:
        """A ceiling's or the unloaded latency's series, made when it is first exported."""
        one = self._by_direction.get((spec.name, direction))
        if one is None:
            labels = {"device": self.disk, "dir": direction}
            one = self._by_direction[spec.name, direction] = spec.series(spec.name, labels)
        return one


@register("throttle", "throttling plateaus and provisioned limits")
class ThrottleCollector:
    def __init__(self, view: RuntimeView) -> None:
        self.view = view
        # The series of the last scrape, to be written again: by disk, by (target, disk), by (disk, limit).
        self._disks: dict[str, DiskSeries] = {}
        self._limits: dict[tuple[str, str], tuple[Series, Series]] = {}
        self._provider: dict[tuple[str, str], Series] = {}

    def collect(self) -> list[Metric]:
        limit_ops = metrics.LIMIT_OPS.series_family()
        limit_bytes = metrics.LIMIT_BYTES.series_family()
        kept_limits, self._limits = self._limits, {}
        for target in self.view.target_readings():
            limits = target.limits
            for disk in target.disks:
                ops, moved = self._limits[target.name, disk] = kept_limits.get((target.name, disk)) or (
                    metrics.LIMIT_OPS.series(metrics.LIMIT_OPS.name, {"target": target.name, "device": disk}),
                    metrics.LIMIT_BYTES.series(metrics.LIMIT_BYTES.name, {"target": target.name, "device": disk}),
                )
                if limits.iops:
                    limit_ops.add(ops, limits.iops)
                if limits.bandwidth:
                    limit_bytes.add(moved, limits.bandwidth)
        families: list[Metric] = [limit_ops, limit_bytes]
        disks = self.view.throttle_readings()
        if disks is None:  # the detector is off
            return families
        active = ACTIVE.series_family()
        ceiling_ops = CEILING_OPS.series_family()
        ceiling_bytes = CEILING_BYTES.series_family()
        seconds = SECONDS.series_family()
        share = metrics.PROBE_SHARE.series_family()
        checks = CHECKS.series_family()
        unloaded = metrics.THROTTLE_UNLOADED.series_family()
        kept_disks, self._disks = self._disks, {}
        for name, state in sorted(disks.items()):
            rendered = self._disks[name] = kept_disks.get(name) or DiskSeries(name)
            seconds_on = state.throttled_seconds
            for direction in DIRECTIONS:
                plateau = state.plateaus.get(direction)
                for limit in LIMITS:
                    flat = plateau is not None and plateau.limit == limit
                    active.add(rendered.active[direction, limit], 1.0 if flat else 0.0)
                    seconds.add(rendered.seconds[direction, limit], seconds_on.get((limit, direction), 0.0))
                if plateau:
                    ceiling_ops.add(rendered.of_direction(CEILING_OPS, direction), plateau.ceiling_ops)
                    ceiling_bytes.add(rendered.of_direction(CEILING_BYTES, direction), plateau.ceiling_bytes)
            if state.probe_share is not None:
                share.add(rendered.share, state.probe_share)
            for one, result in zip(rendered.checks, CHECK_RESULTS, strict=True):
                checks.add(one, state.checks.get(result, 0))
            for direction, value in sorted(state.unloaded.items()):
                if value is not None:
                    unloaded.add(rendered.of_direction(metrics.THROTTLE_UNLOADED, direction), value)
        kept_provider, self._provider = self._provider, {}
        for name, device in sorted(self.view.provider_readings().items()):
            for limit, throttled in device.verdicts.items():
                one = self._provider[name, limit] = kept_provider.get((name, limit)) or ACTIVE.series(
                    ACTIVE.name, {"device": name, "limit": limit, "dir": "total", "source": "provider"}
                )
                active.add(one, 1.0 if throttled else 0.0)
        return [*families, active, ceiling_ops, ceiling_bytes, seconds, share, checks, unloaded]
