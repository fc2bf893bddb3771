"""The running exporter: resolved targets, their probe workers and the background samplers.

Scrapes read this state and never wait on a device: workers publish counters and snapshots under short
locks, and a worker stuck in the kernel only ages its in-flight gauge.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from . import targets as targets_mod
from .config import Config, ProbeConfig
from .discovery import Host
from .probe import ProbeWorker
from .stats import ProbeStats
from .targets import ResolvedTarget

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0


@dataclass
class RunningProbe:
    target: ResolvedTarget
    config: ProbeConfig
    stats: ProbeStats
    worker: ProbeWorker

    @property
    def labels(self) -> dict[str, str]:
        return {"target": self.target.name, "device": self.target.device.name, "op": self.config.op}


class Exporter:
    """Owns the probes of one configuration. start() raises ConfigError before anything is written."""

    def __init__(self, config: Config, host: Host) -> None:
        self.config = config
        self.host = host
        self.targets: list[ResolvedTarget] = []
        self.probes: list[RunningProbe] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        resolved = targets_mod.resolve(self.config, self.host)
        builtin = not self.config.targets and self.config.discovery is None
        for warning in targets_mod.prepare(self.host, resolved, strict=not builtin):
            log.warning("%s; will retry (run as root or in group disk, and expose the device to containers)", warning)
        self._add(resolved)

    def _add(self, resolved: list[ResolvedTarget]) -> None:
        new = []
        for target in resolved:
            for probe in target.probes:
                stats = ProbeStats(self.config.window, self.config.buckets)
                worker = ProbeWorker(
                    name=target.name,
                    op=probe.op,
                    io=targets_mod.io_target(self.host, target, probe),
                    block_size=probe.block_size,
                    interval_s=probe.interval,
                    jitter=probe.jitter,
                    revisit=probe.revisit,
                    stats=stats,
                    fd=target.fds.pop(probe.op, None),
                )
                new.append(RunningProbe(target, probe, stats, worker))
        with self._lock:
            self.targets.extend(resolved)
            self.probes.extend(new)
        for running in new:
            running.worker.start()
            log.info(
                "probing %s (%s, %s) with %s %dB every %gs",
                running.target.name,
                running.target.path,
                running.target.device.name,
                running.config.op,
                running.config.block_size,
                running.config.interval,
            )

    def snapshot(self) -> tuple[list[ResolvedTarget], list[RunningProbe]]:
        with self._lock:
            return list(self.targets), list(self.probes)

    def probed_devices(self) -> set[str]:
        """Devices whose diskstats are exported: each probed device and the whole disks beneath it."""
        names: set[str] = set()
        for target in self.snapshot()[0]:
            names.add(target.device.name)
            names.update(target.disks)
        return names

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[str]:
        """Stop every worker; return the names of those still stuck in the kernel after `timeout`."""
        _, probes = self.snapshot()
        for running in probes:
            running.worker.stop()
        stuck = []
        deadline = time.monotonic() + timeout
        for running in probes:
            if not running.worker.join(max(0.0, deadline - time.monotonic())):
                stuck.append(f"{running.target.name} {running.config.op}")
            running.worker.close()
        return stuck
