"""The running exporter: resolved targets, their probe workers and the background samplers.

Scrapes read this state and never wait on a device: workers publish counters and snapshots under short
locks, and a worker stuck in the kernel only ages its in-flight gauge.

The set of targets changes at run time in two ways. reload() applies a new configuration (SIGHUP):
targets whose configuration is unchanged keep their workers, histograms and counters; removed ones stop and
their series go; a configuration that does not resolve is rejected and the old one kept. With `discovery:`,
follow() adds matching devices that appear and removes those that go, from a periodic sysfs rescan (and
udev events where udevd runs).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, replace

from . import targets as targets_mod
from . import warmup
from .config import Config, ConfigError, DiscoveryConfig, ProbeConfig, TargetConfig
from .detectors import ThrottleDetector
from .discovery import SKIP_BY_DEFAULT, Host
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


def fingerprint(target: TargetConfig) -> TargetConfig:
    """A target's configuration without where it sits in the file: what decides "unchanged" on reload."""
    return replace(target, key="", probes=tuple(replace(p, key="") for p in target.probes))


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
        self._reload_lock = threading.Lock()  # reloads and discovery changes, one at a time
        self._follower: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        resolved = targets_mod.resolve(self.config, self.host)
        for warning in targets_mod.prepare(self.host, resolved, strict=not self.config.builtin):
            log.warning("%s; will retry (run as root or in group disk, and expose the device to containers)", warning)
        self._add(resolved)
        self._start_detector()
        if self.config.discovery is not None:
            self._start_follower()

    # -- targets come and go ------------------------------------------------------------------------------

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
        for target in resolved:
            if target.config.warmup is not None:
                self._start_warmup(target)

    def _remove(self, gone: list[ResolvedTarget], timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the targets' workers and warm-ups and drop them, so their series go with the next scrape."""
        ids = {id(t) for t in gone}
        with self._lock:
            probes = [p for p in self.probes if id(p.target) in ids]
            jobs = [job for t, job in self.warmups if id(t) in ids]
            self.probes = [p for p in self.probes if id(p.target) not in ids]
            self.targets = [t for t in self.targets if id(t) not in ids]
            self.warmups = [(t, job) for t, job in self.warmups if id(t) not in ids]
        for job in jobs:
            job.stop()
        for running in probes:
            running.worker.stop()
        deadline = time.monotonic() + timeout
        for running in probes:
            if not running.worker.join(max(0.0, deadline - time.monotonic())):
                log.warning(
                    "probe %s %s is still blocked in the kernel; it exits when its request returns",
                    running.target.name,
                    running.config.op,
                )
            running.worker.close()
        for target in gone:
            log.info("stopped probing %s (%s)", target.name, target.path)

    def reload(self, config: Config) -> None:
        """Apply a new configuration; ConfigError (and nothing changed) if it does not resolve."""
        with self._reload_lock:
            resolved = targets_mod.resolve(config, self.host)  # every check, as at start-up
            stats_changed = (config.window, config.buckets) != (self.config.window, self.config.buckets)
            current = {fingerprint(t.config): t for t in self.snapshot()[0] if not t.discovered}
            wanted = {fingerprint(t.config): t for t in resolved}
            keep = set() if stats_changed else set(current) & set(wanted)
            added = [t for f, t in wanted.items() if f not in keep]
            removed = [t for f, t in current.items() if f not in keep]
            # Re-key the kept targets: their place in the new file names their errors from now on.
            for f in keep:
                current[f].config = wanted[f].config
            # Free what the removed targets hold (an O_EXCL raw device, say) before opening the new ones.
            self._remove(removed)
            try:
                targets_mod.prepare(self.host, added, strict=not config.builtin)
            except ConfigError:
                # The old targets are gone already; bring them back as they were configured.
                targets_mod.prepare(self.host, removed, strict=False)
                self._add(removed)
                raise
            old = self.config
            self.config = config
            self._add(added)
            if config.throttle != old.throttle:
                self._stop_detector()
                self._start_detector()
            if config.discovery != old.discovery:
                self._stop_follower()
                self._remove([t for t in self.snapshot()[0] if t.discovered])
                if config.discovery is not None:
                    self._start_follower()
            log.info("configuration reloaded: %d kept, %d added, %d removed", len(keep), len(added), len(removed))

    # -- following devices ---------------------------------------------------------------------------------

    def _start_follower(self) -> None:
        self._stopping.clear()
        self._follower = threading.Thread(target=self._follow, name="device follower", daemon=True)
        self._follower.start()

    def _stop_follower(self) -> None:
        self._stopping.set()
        if self._follower is not None:
            self._follower.join(10)
            self._follower = None

    def _follow(self) -> None:
        events = udev_events()
        while not self._stopping.is_set():
            try:
                self.rescan()
            except Exception:  # one bad scan (a device vanishing mid-read) must not end following
                log.exception("device rescan failed")
            discovery = self.config.discovery
            interval = discovery.rescan_interval if discovery else 5.0
            if events is not None:
                events.wait(interval)  # a udev event wakes the rescan early
                events.clear()
            else:
                self._stopping.wait(interval)

    def discovery_candidates(self, discovery: DiscoveryConfig) -> dict[str, str]:
        """Kernel name -> device node of every device the discovery rules select now."""
        chosen = {}
        for name, device in self.host.devices().items():
            if device.size_bytes == 0:
                continue  # an empty loop or a removed medium: nothing to probe
            if discovery.include:
                if not any(re.fullmatch(pattern, name) for pattern in discovery.include):
                    continue
            elif device.kind != "disk" or name.startswith(SKIP_BY_DEFAULT):
                continue
            if any(re.fullmatch(pattern, name) for pattern in discovery.exclude):
                continue
            chosen[name] = device.devnode
        return chosen

    def rescan(self) -> None:
        """Start probing devices that appeared and match; stop those that went."""
        discovery = self.config.discovery
        if discovery is None:
            return
        with self._reload_lock:
            candidates = self.discovery_candidates(discovery)
            targets = self.snapshot()[0]
            configured = {t.device.name for t in targets if not t.discovered}
            present = {t.device.name: t for t in targets if t.discovered}
            gone = [t for name, t in present.items() if name not in candidates or not self._same_device(t)]
            if gone:
                self._remove(gone, timeout=1.0)
            for name, devnode in sorted(candidates.items()):
                if name in configured or (name in present and present[name] not in gone):
                    continue
                key = f"discovery[{name}]"
                probes = tuple(replace(p, key=f"{key}.probes[{i}]") for i, p in enumerate(discovery.probes))
                target = TargetConfig(key, name, devnode, None, 0, False, probes)
                try:
                    resolved = targets_mod.resolve(self.config, self.host, [target])
                    targets_mod.prepare(self.host, resolved, strict=False)
                except ConfigError as err:
                    log.warning("not probing discovered %s: %s", name, "; ".join(err.problems))
                    continue
                for found in resolved:
                    found.discovered = True
                log.info("discovered %s (%s)", name, devnode)
                self._add(resolved)

    def _same_device(self, target: ResolvedTarget) -> bool:
        now = self.host.device(target.device.name)
        return now is not None and (now.major, now.minor, now.size_bytes) == (
            target.device.major,
            target.device.minor,
            target.device.size_bytes,
        )

    # -- warm-up -----------------------------------------------------------------------------------------------

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

    # -- reading state -------------------------------------------------------------------------------------------

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

    def _start_detector(self) -> None:
        throttle = self.config.throttle
        if not throttle.enabled:
            return
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

    def _stop_detector(self) -> None:
        if self.detector is not None:
            self.detector.stop()
            self.detector = None
        for running in self.snapshot()[1]:
            running.worker.set_slowdown(1.0)

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
        self._stop_follower()
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


def udev_events() -> threading.Event | None:
    """An Event set on every block-device udev event, where udevd runs; None elsewhere (rescans do the work)."""
    if not os.path.isdir("/run/udev"):
        return None
    try:
        import pyudev

        context = pyudev.Context()
        monitor = pyudev.Monitor.from_netlink(context)
        monitor.filter_by("block")
        event = threading.Event()
        observer = pyudev.MonitorObserver(monitor, callback=lambda _device: event.set(), name="udev monitor")
        observer.daemon = True
        observer.start()
        return event
    except Exception as err:  # no netlink in this container, or libudev missing
        log.info("udev monitor unavailable (%s); following devices by rescanning sysfs", err)
        return None
