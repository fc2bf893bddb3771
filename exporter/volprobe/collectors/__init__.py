"""Collectors, one per source, registered by name as node_exporter's are.

Each module here reads one source (the probes, the targets' identity, /proc/diskstats, the throttle detector,
the warm-ups) and returns fresh metric families on every scrape, built from the declarations in
volprobe.metrics. `--collector.NAME` / `--no-collector.NAME` turn one on or off. VolprobeCollector runs the
enabled ones, times each, and isolates failures: a collector that raises is reported by
volprobe_scrape_collector_success and the others are still served. Nothing here waits on a probed device.
"""

from __future__ import annotations

import argparse
import logging
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector as PrometheusCollector

from .. import __version__, capabilities, metrics, supervise
from ..probe import TIMER

if TYPE_CHECKING:
    from ..runtime import Exporter
    from ..webconfig import WebConfigWatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sources:
    """What collectors read: the running exporter's in-memory state, and the host's /proc."""

    exporter: Exporter
    proc_root: Path = Path("/proc")
    web: WebConfigWatcher | None = None  # the web config's reload outcome, exported when given


class Collector(Protocol):
    def collect(self) -> list[Metric]: ...


@dataclass(frozen=True)
class Registration:
    name: str
    factory: Callable[[Sources], Collector]
    enabled_by_default: bool
    help: str


REGISTRY: dict[str, Registration] = {}


def register(name: str, help_text: str, enabled_by_default: bool = True):
    """Class decorator: make a collector known by `name` (its flag and its `collector` label)."""

    def add(factory: Callable[[Sources], Collector]) -> Callable[[Sources], Collector]:
        REGISTRY[name] = Registration(name, factory, enabled_by_default, help_text)
        return factory

    return add


def add_flags(parser: argparse.ArgumentParser) -> None:
    for reg in REGISTRY.values():
        default = "enabled" if reg.enabled_by_default else "disabled"
        parser.add_argument(
            f"--collector.{reg.name}",
            dest=f"collector_{reg.name}",
            action=argparse.BooleanOptionalAction,
            default=reg.enabled_by_default,
            help=f"{reg.help} (default: {default})",
        )


def enabled_from_args(args: argparse.Namespace) -> list[str]:
    return [name for name in REGISTRY if getattr(args, f"collector_{name}", REGISTRY[name].enabled_by_default)]


class VolprobeCollector(PrometheusCollector):
    """Runs the enabled collectors on every scrape: build info and the reload outcome (always), the enabled
    collectors' families, their success and duration."""

    def __init__(self, sources: Sources, enabled: Iterable[str] | None = None) -> None:
        chosen = set(REGISTRY if enabled is None else enabled)
        unknown = chosen - set(REGISTRY)
        if unknown:
            raise ValueError(f"unknown collectors: {', '.join(sorted(unknown))}")
        self.sources = sources
        self.parts = [(name, reg.factory(sources)) for name, reg in REGISTRY.items() if name in chosen]

    def collect(self) -> Iterator[Metric]:
        build = metrics.BUILD_INFO.family()
        build.add_metric([__version__, platform.python_version(), TIMER], 1)
        yield build
        capability = metrics.CAPABILITY_AVAILABLE.family()
        for name, available in sorted(capabilities.known().items()):
            capability.add_metric([name], 1.0 if available else 0.0)
        yield capability
        restarts = metrics.THREAD_RESTARTS.family()
        for thread, count in supervise.restarts().items():
            restarts.add_metric([thread], count)
        yield restarts
        exporter = self.sources.exporter
        reload_ok = metrics.CONFIG_RELOAD_SUCCESSFUL.family()
        reload_ok.add_metric([], 1.0 if exporter.last_reload_successful else 0.0)
        yield reload_ok
        reload_time = metrics.CONFIG_RELOAD_SUCCESS_TIME.family()
        reload_time.add_metric([], exporter.last_reload_success_time)
        yield reload_time
        if self.sources.web is not None:
            web_ok = metrics.WEB_CONFIG_RELOAD_SUCCESSFUL.family()
            web_ok.add_metric([], 1.0 if self.sources.web.last_reload_successful else 0.0)
            yield web_ok
            web_time = metrics.WEB_CONFIG_RELOAD_SUCCESS_TIME.family()
            web_time.add_metric([], self.sources.web.last_reload_success_time)
            yield web_time
        success = metrics.SCRAPE_SUCCESS.family()
        duration = metrics.SCRAPE_DURATION.family()
        for name, part in self.parts:
            start = time.perf_counter()
            try:
                families = part.collect()
                ok = 1.0
            except Exception:
                log.exception("collector %s failed", name)
                families, ok = [], 0.0
            duration.add_metric([name], time.perf_counter() - start)
            success.add_metric([name], ok)
            yield from families
        yield success
        yield duration


# The collectors register themselves on import.
from . import diskstats, nvme, probe, state, target, throttle, warmup  # noqa: E402, F401
