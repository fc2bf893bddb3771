"""Collectors, one per source, registered by name as node_exporter's are.

Each module here reads one source (the probes, the targets' identity, /proc/diskstats, the throttle detector,
the warm-ups) through the runtime's narrow view (volprobe.view.RuntimeView: snapshots, never the running
objects) and returns fresh metric families on every scrape, built from the declarations in volprobe.metrics.
`--collector.NAME` / `--no-collector.NAME` turn one on or off; `--collector.disable-defaults` turns off every
one not turned on by name, as node_exporter's does. VolprobeCollector runs the
enabled ones, times each, and isolates failures: a collector that raises is reported by
volprobe_scrape_collector_success and the others are still served. Nothing here waits on a probed device.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PrometheusCollector

from .. import metrics
from ..view import ReloadOutcome, RuntimeView
from .registry import REGISTRY, Collector, Registration, register

__all__ = ["REGISTRY", "Collector", "Registration", "VolprobeCollector", "add_flags", "enabled_from_args", "register"]

log = logging.getLogger(__name__)


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--collector.disable-defaults",
        dest="collector_disable_defaults",
        action="store_true",
        help="turn every collector off except those turned on by name (--collector.NAME)",
    )
    for reg in REGISTRY.values():
        default = "enabled" if reg.enabled_by_default else "disabled"
        parser.add_argument(
            f"--collector.{reg.name}",
            dest=f"collector_{reg.name}",
            action=argparse.BooleanOptionalAction,
            default=None,  # not given: its default, or off with --collector.disable-defaults
            help=f"{reg.help} (default: {default})",
        )


def enabled_from_args(args: argparse.Namespace) -> list[str]:
    """The collectors the flags turn on: each as given by name, else its default, else (with
    --collector.disable-defaults) off."""
    defaults = not getattr(args, "collector_disable_defaults", False)
    enabled = []
    for name, reg in REGISTRY.items():
        given = getattr(args, f"collector_{name}", None)
        if given if given is not None else defaults and reg.enabled_by_default:
            enabled.append(name)
    return enabled


class VolprobeCollector(PrometheusCollector):
    """Runs the enabled collectors on every scrape: build info and the reload outcome (always), the enabled
    collectors' families, their success and duration."""

    def __init__(
        self, view: RuntimeView, enabled: Iterable[str] | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        chosen = set(REGISTRY if enabled is None else enabled)
        unknown = chosen - set(REGISTRY)
        if unknown:
            raise ValueError(f"unknown collectors: {', '.join(sorted(unknown))}")
        self.view = view
        self.clock = clock  # times each collector (a fixed clock makes the exposition reproducible)
        self.parts = [(name, reg.factory(view)) for name, reg in REGISTRY.items() if name in chosen]

    def collect(self) -> Iterator[Metric]:
        view = self.view
        build = metrics.BUILD_INFO.family()
        info = view.build_info()
        build.add_metric([info.version, info.python_version, info.timer], 1)
        yield build
        capability = metrics.CAPABILITY_AVAILABLE.family()
        for name, available in sorted(view.capabilities().items()):
            capability.add_metric([name], 1.0 if available else 0.0)
        yield capability
        kept = view.kept_capabilities()
        if kept is not None:  # dropped at start: not where tests run an exporter in-process
            family = metrics.CAPABILITIES_KEPT.family()
            family.add_metric([kept], 1.0)
            yield family
        restarts = metrics.THREAD_RESTARTS.family()
        for thread, count in view.thread_restarts().items():
            restarts.add_metric([thread], count)
        yield restarts
        config = view.config_reload()
        yield from _reload_families(config, metrics.CONFIG_RELOAD_SUCCESSFUL, metrics.CONFIG_RELOAD_SUCCESS_TIME)
        web = view.web_config_reload()
        if web is not None:  # exported with a web config watcher only
            web_ok, web_time = metrics.WEB_CONFIG_RELOAD_SUCCESSFUL, metrics.WEB_CONFIG_RELOAD_SUCCESS_TIME
            yield from _reload_families(web, web_ok, web_time)
        success = metrics.SCRAPE_SUCCESS.family()
        duration = metrics.SCRAPE_DURATION.family()
        for name, part in self.parts:
            start = self.clock()
            try:
                families = part.collect()
                ok = 1.0
            except Exception:
                log.exception("collector %s failed", name)
                families, ok = [], 0.0
            duration.add_metric([name], self.clock() - start)
            success.add_metric([name], ok)
            yield from families
        yield success
        yield duration


def _reload_families(
    outcome: ReloadOutcome, ok: metrics.MetricSpec[GaugeMetricFamily], when: metrics.MetricSpec[GaugeMetricFamily]
) -> list[Metric]:
    successful, success_time = ok.family(), when.family()
    successful.add_metric([], 1.0 if outcome.successful else 0.0)
    success_time.add_metric([], outcome.success_time)
    return [successful, success_time]


# The collectors register themselves on import.
from . import diskstats, nvme, probe, state, target, throttle, warmup  # noqa: E402, F401
