"""Progress of the warm-ups (volume initialization) the exporter runs."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..view import RuntimeView
from ..warmup import STATES
from .registry import register


@register("warmup", "progress of warm-ups")
class WarmupCollector:
    def __init__(self, view: RuntimeView) -> None:
        self.view = view

    def collect(self) -> list[Metric]:
        size = metrics.WARMUP_SIZE.family()
        done = metrics.WARMUP_DONE.family()
        ratio = metrics.WARMUP_PROGRESS.family()
        eta = metrics.WARMUP_ETA.family()
        state = metrics.WARMUP_STATE.family()
        for job in self.view.warmup_readings():
            values = [job.target, job.device]
            size.add_metric(values, job.total_bytes)
            done.add_metric(values, job.done_bytes)
            ratio.add_metric(values, job.ratio)
            if job.eta_seconds is not None:
                eta.add_metric(values, job.eta_seconds)
            for name in STATES:
                state.add_metric([*values, name], 1.0 if job.state == name else 0.0)
        return [size, done, ratio, eta, state]
