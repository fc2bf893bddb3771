"""Throttling of the disks under the targets: inferred by the detector (a plateau), or counted by the provider
(AWS NVMe statistics: the time demand exceeded a limit), and the configured limits."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..detectors import DIRECTIONS, LIMITS
from ..view import RuntimeView
from .registry import register


@register("throttle", "throttling plateaus and provisioned limits")
class ThrottleCollector:
    def __init__(self, view: RuntimeView) -> None:
        self.view = view

    def collect(self) -> list[Metric]:
        limit_ops = metrics.LIMIT_OPS.family()
        limit_bytes = metrics.LIMIT_BYTES.family()
        for target in self.view.target_readings():
            limits = target.limits
            for disk in target.disks:
                if limits.iops:
                    limit_ops.add_metric([target.name, disk], limits.iops)
                if limits.bandwidth:
                    limit_bytes.add_metric([target.name, disk], limits.bandwidth)
        families: list[Metric] = [limit_ops, limit_bytes]
        disks = self.view.throttle_readings()
        if disks is None:  # the detector is off
            return families
        active = metrics.THROTTLE_ACTIVE.family()
        ceiling_ops = metrics.THROTTLE_CEILING_OPS.family()
        ceiling_bytes = metrics.THROTTLE_CEILING_BYTES.family()
        seconds = metrics.THROTTLE_SECONDS.family()
        share = metrics.PROBE_SHARE.family()
        checks = metrics.THROTTLE_CHECKS.family()
        unloaded = metrics.THROTTLE_UNLOADED.family()
        for name, state in sorted(disks.items()):
            for direction in DIRECTIONS:
                plateau = state.plateaus.get(direction)
                for limit in LIMITS:
                    flat = plateau is not None and plateau.limit == limit
                    active.add_metric([name, limit, direction, "inferred"], 1.0 if flat else 0.0)
                    seconds.add_metric([name, limit, direction], state.throttled_seconds.get((limit, direction), 0.0))
                if plateau:
                    ceiling_ops.add_metric([name, direction], plateau.ceiling_ops)
                    ceiling_bytes.add_metric([name, direction], plateau.ceiling_bytes)
            if state.probe_share is not None:
                share.add_metric([name], state.probe_share)
            for result in ("capped", "uncapped", "inconclusive"):
                checks.add_metric([name, result], state.checks.get(result, 0))
            for direction, value in sorted(state.unloaded.items()):
                if value is not None:
                    unloaded.add_metric([name, direction], value)
        for name, device in sorted(self.view.provider_readings().items()):
            for limit, throttled in device.verdicts.items():
                active.add_metric([name, limit, "total", "provider"], 1.0 if throttled else 0.0)
        return [*families, active, ceiling_ops, ceiling_bytes, seconds, share, checks, unloaded]
