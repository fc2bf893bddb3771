"""The status and age of what volprobe remembers about each volume (volprobe.state)."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..state import STATUSES
from ..view import RuntimeView
from .registry import register


@register("state", "status and age of each volume's remembered state")
class StateCollector:
    def __init__(self, view: RuntimeView) -> None:
        self.view = view

    def collect(self) -> list[Metric]:
        status = metrics.STATE_STATUS.family()
        age = metrics.STATE_AGE.family()
        for key, volume in sorted(self.view.volume_readings().items()):
            for name in STATUSES:
                status.add_metric([volume.device, key, name], 1.0 if volume.status == name else 0.0)
            age.add_metric([volume.device, key], volume.age_seconds)
        return [status, age]
