"""The running exporter: resolved targets, their probe workers and the background samplers.

Scrapes read this state and never wait on a device: workers publish counters and snapshots under short
locks, and a worker stuck in the kernel only ages its in-flight gauge.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from . import targets as targets_mod
from . import warmup
from .config import Config, ProbeConfig
from .detectors import ThrottleDetector
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
        self.detector: ThrottleDetector | None = None
        self.warmups: list[tuple[ResolvedTarget, warmup.WarmupJob]] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        resolved = targets_mod.resolve(self.config, self.host)
        builtin = not self.config.targets and self.config.discovery is None
        for warning in targets_mod.prepare(self.host, resolved, strict=not builtin):
            log.warning("%s; will retry (run as root or in group disk, and expose the device to containers)", warning)
        self._add(resolved)
        throttle = self.config.throttle
        if throttle.enabled:
            self.detector = ThrottleDetector(
                devices=self.throttle_devices,
                unloaded_latency=self.unloaded_latency,
                limits=self.device_limits,
                on_change=self._throttle_changed,
                probe_completions=self.probe_completions,
                proc_root=self.host.proc,
                sample_interval=throttle.sample_interval,
                window=throttle.window,
            )
            self.detector.start()
        for target in resolved:
            if target.config.warmup is not None:
                self._start_warmup(target)

    def state_directory(self) -> str | None:
        """Where warm-up checkpoints go: the config's, systemd's $STATE_DIRECTORY, or /var/lib/volprobe."""
        for candidate in (
            self.config.state_directory,
            os.environ.get("STATE_DIRECTORY", "").split(":")[0],
            "/var/lib/volprobe",
        ):
            if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
                return candidate
        return None

    def _start_warmup(self, target: ResolvedTarget) -> None:
        spec = target.config.warmup
        assert spec is not None
        directory = self.state_directory()
        state_path = None
        if directory:
            state_path = os.path.join(directory, f"warmup-{re.sub(r'[^A-Za-z0-9_.-]', '_', target.name)}.json")
        else:
            log.warning("warm-up of %s: no writable state directory, so it cannot resume after a restart", target.name)
        job = warmup.job_for(
            self.host,
            target.path,
            spec.mode,
            spec.block_size,
            spec.jobs,
            spec.rate,
            state_path,
            spec.idle_priority,
            key=f"{target.config.key}.warmup",
        )
        with self._lock:
            self.warmups.append((target, job))
        threading.Thread(target=job.run, name=f"warm-up {target.name}", daemon=True).start()
        log.info("warming up %s (%s) %s, state %s", target.name, target.path, spec.mode, state_path or "none")

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

    # -- throttling: the detector watches the whole disks under the targets -------------------------------

    def _probes_on(self, disk: str) -> list[RunningProbe]:
        return [p for p in self.snapshot()[1] if disk in p.target.disks]

    def throttle_devices(self) -> set[str]:
        return {disk for target in self.snapshot()[0] for disk in target.disks}

    def unloaded_latency(self, disk: str, direction: str) -> float | None:
        """The lowest latency the probes of this direction (any direction for "total") have seen."""
        probes = self._probes_on(disk)
        chosen = [p for p in probes if p.config.op == direction] or probes
        floors = [f for f in (p.stats.floor() for p in chosen) if f is not None]
        return min(floors) if floors else None

    def device_limits(self, disk: str) -> tuple[float | None, float | None]:
        for target in self.snapshot()[0]:
            if disk in target.disks and (target.config.limits.iops or target.config.limits.bandwidth):
                return target.config.limits.iops, target.config.limits.bandwidth
        return None, None

    def probe_completions(self, disk: str) -> int:
        return sum(p.worker.completed for p in self._probes_on(disk))

    def _throttle_changed(self, disk: str, throttled: bool) -> None:
        """Probes back off while their disk is throttled, so volprobe never adds to the throttling it reports."""
        factor = self.config.throttle.backoff if throttled else 1.0
        for running in self._probes_on(disk):
            running.worker.set_slowdown(factor)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[str]:
        """Stop every worker; return the names of those still stuck in the kernel after `timeout`."""
        if self.detector is not None:
            self.detector.stop()
        for _, job in self.warmups:
            job.stop()
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
