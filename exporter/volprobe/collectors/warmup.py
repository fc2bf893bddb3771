"""Progress of the warm-ups (volume initialization) the exporter runs."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..warmup import STATES
from . import Sources, register


@register("warmup", "progress of warm-ups")
class WarmupCollector:
    def __init__(self, sources: Sources) -> None:
        self.exporter = sources.exporter

    def collect(self) -> list[Metric]:
        size = metrics.WARMUP_SIZE.family()
        done = metrics.WARMUP_DONE.family()
        ratio = metrics.WARMUP_PROGRESS.family()
        eta = metrics.WARMUP_ETA.family()
        state = metrics.WARMUP_STATE.family()
        for target, job in self.exporter.warmups.jobs():
            progress = job.progress
            values = [target.name, target.device.name]
            size.add_metric(values, progress.total_bytes)
            done.add_metric(values, progress.done_bytes)
            ratio.add_metric(values, progress.ratio)
            remaining = progress.eta()
            if remaining is not None:
                eta.add_metric(values, remaining)
            for name in STATES:
                state.add_metric([*values, name], 1.0 if progress.state == name else 0.0)
        return [size, done, ratio, eta, state]
