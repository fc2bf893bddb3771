"""The provider's own statistics of the probed AWS NVMe devices (EBS, instance store), as the device counts
them: read by runtime.provider in its own thread; a scrape only reads the latest."""

from __future__ import annotations

from prometheus_client.core import Metric

from .. import metrics
from ..runtime.provider import EXCEEDED
from ..view import RuntimeView
from .registry import register


@register("nvme", "the provider's statistics of AWS NVMe devices (EBS, instance store)")
class NvmeCollector:
    def __init__(self, view: RuntimeView) -> None:
        self.view = view

    def collect(self) -> list[Metric]:
        ops, moved, seconds = metrics.NVME_OPS.family(), metrics.NVME_BYTES.family(), metrics.NVME_SECONDS.family()
        exceeded, queue = metrics.NVME_EXCEEDED.family(), metrics.NVME_QUEUE.family()
        latency, up = metrics.NVME_LATENCY.family(), metrics.NVME_UP.family()
        for disk, device in sorted(self.view.provider_readings().items()):
            labels = [disk, device.kind]
            up.add_metric(labels, 1.0 if device.fresh else 0.0)
            stats = device.latest
            if stats is None:
                continue
            for op in ("read", "write"):
                ops.add_metric([*labels, op], getattr(stats, f"{op}_ops"))
                moved.add_metric([*labels, op], getattr(stats, f"{op}_bytes"))
                seconds.add_metric([*labels, op], getattr(stats, f"{op}_seconds"))
                histogram = getattr(stats, f"{op}_latency")
                buckets = [(_bound(upper), count) for upper, count in histogram.buckets]
                if not buckets or buckets[-1][0] != "+Inf":
                    buckets.append(("+Inf", histogram.count))
                latency.add_metric([*labels, op], buckets, getattr(stats, f"{op}_seconds"))
            for scope, limit, attribute in EXCEEDED:
                if scope == "volume" and device.kind != "ebs":
                    continue  # instance store has no volume limit: the fields are not applicable
                exceeded.add_metric([*labels, scope, limit], getattr(stats, attribute))
            queue.add_metric(labels, stats.queue_length)
        return [ops, moved, seconds, exceeded, queue, latency, up]


def _bound(seconds: float) -> str:
    return "+Inf" if seconds >= 1e12 else repr(seconds)
