"""Following devices (`discovery:`): probe matching devices as they appear, stop as they go.

A periodic sysfs rescan does the work (udev events, where udevd runs, only wake it early); it reads a device's
identity only when the kernel made a new device under its name (Host.known_device). A discovered
device whose probes are unchanged keeps running across rescans and reloads; one whose effective probes
changed restarts, and the log says which key changed.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import replace

from .. import supervise
from .. import targets as targets_mod
from ..capabilities import UDEV_MONITOR, Capabilities
from ..config import Config, ConfigError, DiscoveryConfig, TargetConfig
from ..discovery import SKIP_BY_DEFAULT, Host
from ..osthread import name_this_thread
from ..state import VolumeIdentity
from ..targets import ResolvedTarget
from .probes import ProbeSet
from .reload import changes, device_identity, fingerprint

log = logging.getLogger(__name__)
# Rescans hold the exporter's lock: a worker of a vanished device gets this long to end (a probe sleeps at most
# a second before its request), then finishes on its own.
DISCOVERED_STOP_TIMEOUT_S = 2.0


def candidates(host: Host, discovery: DiscoveryConfig) -> dict[str, str]:
    """Kernel name -> device node of every device the discovery rules select now (patterns match whole names).
    Names are judged first, and only the devices they select are looked at, as known_device() knows them (read
    again only when the kernel made a new device under the name): a rescan every few seconds reads two small
    files per selected device, not the whole of sysfs."""
    chosen = {}
    for name in host.names():
        if discovery.include:
            if not any(re.fullmatch(pattern, name) for pattern in discovery.include):
                continue
        elif name.startswith(SKIP_BY_DEFAULT):
            continue
        if any(re.fullmatch(pattern, name) for pattern in discovery.exclude):
            continue
        device = host.known_device(name)
        if device is None or device.size_bytes == 0:
            continue  # gone, an empty loop or a removed medium: nothing to probe
        if not discovery.include and device.kind != "disk":
            continue
        chosen[name] = device.devnode
    return chosen


def pattern_matches(host: Host, discovery: DiscoveryConfig) -> list[tuple[str, str, list[str]]]:
    """(key, pattern, kernel names it matches now) for each include and exclude pattern."""
    names = sorted(name for name, device in host.devices().items() if device.size_bytes)
    return [
        (f"discovery.{section}[{i}]", pattern, [n for n in names if re.fullmatch(pattern, n)])
        for section, patterns in (("include", discovery.include), ("exclude", discovery.exclude))
        for i, pattern in enumerate(patterns)
    ]


def warn_unmatched(host: Host, discovery: DiscoveryConfig) -> None:
    for key, pattern, matched in pattern_matches(host, discovery):
        if key.startswith("discovery.include") and not matched:
            log.warning(
                "%s %r matches no device now (patterns match whole kernel names: 'loop\\d+', not '^loop')",
                key,
                pattern,
            )


def discovered_target(name: str, devnode: str, discovery: DiscoveryConfig) -> TargetConfig:
    key = f"discovery[{name}]"
    probes = tuple(replace(p, key=f"{key}.probes[{i}]") for i, p in enumerate(discovery.probes))
    return TargetConfig(key=key, name=name, device=devnode, probes=probes)


class DeviceFollower:
    """Runs the rescans of `discovery:` in a thread, under the exporter's lock, starting and stopping the
    discovered targets through the exporter's callbacks."""

    def __init__(
        self,
        host: Host,
        probes: ProbeSet,
        lock: threading.Lock,
        start: Callable[[list[ResolvedTarget]], None],
        stop: Callable[[list[ResolvedTarget], float, str], None],
        warm: Callable[[list[ResolvedTarget], bool], None] = lambda _targets, _appeared: None,
        *,
        capabilities: Capabilities,
    ) -> None:
        self.host = host
        self.capabilities = capabilities  # whether the udev monitor could be had
        self.probes = probes
        self.lock = lock  # the exporter's: rescans and reloads one at a time
        self._start_targets = start
        self._stop_targets = stop
        self._warm = warm  # discovery.warmup: (targets, appeared since discovery started)
        # Volumes there when discovery started (by identity), taken before the exporter serves: a volume attached
        # a moment later, before the first scan ran, has appeared; a later scan that finds one of these again (a
        # reload restarted the discovered targets, say) has not. discovery.warmup's policy "new" depends on it.
        self._there_at_start: set[str] | None = None
        # Their kernel names too, for the first rescan only: udev may have completed a device's properties
        # (serial, WWN) in between, which changes its identity, not what it is.
        self._names_at_start: set[str] = set()
        self.config: Config | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()  # of the current thread; each thread gets its own
        self._events: threading.Event | None = None  # set on udev events, where udevd runs
        self._udev_tried = False

    def apply(self, config: Config) -> None:
        """Follow with a new configuration (called with the lock held). The next rescan keeps every discovered
        device whose probes are unchanged; without `discovery:` every discovered device stops."""
        self.config = config
        if config.discovery is None:
            self._signal_stop()
            gone = [t for t in self.probes.targets() if t.discovered]
            if gone:
                self._stop_targets(gone, DISCOVERED_STOP_TIMEOUT_S, "discovery is no longer configured")
            return
        warn_unmatched(self.host, config.discovery)
        if self._there_at_start is None:
            found = candidates(self.host, config.discovery)
            self._there_at_start, self._names_at_start = self._identities(found), set(found)
        if self._thread is None:
            if not self._udev_tried:
                self._udev_tried, self._events = True, udev_events(self.capabilities)
            self._stopping = stopping = threading.Event()
            self._thread = threading.Thread(target=self._follow, args=(stopping,), name="device follower", daemon=True)
            self._thread.start()

    def _signal_stop(self) -> threading.Thread | None:
        """Tell the thread to end, without waiting: it may be waiting for the lock our caller holds."""
        thread, self._thread = self._thread, None
        self._stopping.set()
        if self._events is not None:
            self._events.set()  # wakes a thread waiting for udev events
        return thread

    def stop(self) -> None:
        """End following and wait for the thread (called without the lock)."""
        thread = self._signal_stop()
        if thread is not None:
            thread.join(10)

    def _follow(self, stopping: threading.Event) -> None:
        name_this_thread("vp discovery")

        def rescans() -> None:
            while not stopping.is_set():
                self.rescan(stopping)
                discovery = self.config.discovery if self.config else None
                interval = discovery.rescan_interval if discovery else DiscoveryConfig.rescan_interval
                if self._events is not None:
                    self._events.wait(interval)  # a udev event wakes the rescan early
                    self._events.clear()
                else:
                    stopping.wait(interval)

        # A bad scan (a device vanishing mid-read) is logged, counted and retried after a back-off.
        supervise.run("discovery", rescans, stopping, "device rescan")

    def rescan(self, stopping: threading.Event | None = None) -> None:
        """Start probing devices that appeared and match; stop those that went or whose probes changed."""
        with self.lock:
            config = self.config
            if config is None or config.discovery is None or (stopping is not None and stopping.is_set()):
                return
            discovery = config.discovery
            found = candidates(self.host, discovery)
            running = self.probes.targets()
            configured = {t.device_name for t in running if not t.discovered}
            kept: set[str] = set()
            for target in (t for t in running if t.discovered):
                name = target.block.name
                why = self._why_stop(target, found, configured, discovery)
                if why:
                    if why.startswith(("no longer", "the device was replaced")) and self._there_at_start:
                        self._there_at_start.discard(VolumeIdentity.of(target.block).key)  # back later: appeared
                    self._stop_targets([target], DISCOVERED_STOP_TIMEOUT_S, why)
                else:
                    kept.add(name)
            for name, devnode in sorted(found.items()):
                if name in configured or name in kept:
                    continue
                try:
                    resolved = targets_mod.resolve(config, self.host, [discovered_target(name, devnode, discovery)])
                    targets_mod.prepare(self.host, resolved, strict=False)
                except ConfigError as err:
                    log.warning("not probing discovered %s: %s", name, "; ".join(err.problems))
                    continue
                for target in resolved:
                    target.discovered = True
                log.info("discovered %s (%s)", name, devnode)
                self._start_targets(resolved)
                there = self._there_at_start if self._there_at_start is not None else set()
                if name in self._names_at_start:  # the first rescan: there at start, whatever udev added since
                    there |= {VolumeIdentity.of(t.block).key for t in resolved}
                appeared = [t for t in resolved if VolumeIdentity.of(t.block).key not in there]
                self._warm(appeared, True)
                self._warm([t for t in resolved if t not in appeared], False)
            self._names_at_start = set()

    def _identities(self, found: dict[str, str]) -> set[str]:
        devices = (self.host.device(name) for name in found)
        return {VolumeIdentity.of(device).key for device in devices if device is not None}

    def _why_stop(
        self, target: ResolvedTarget, found: dict[str, str], configured: set[str], discovery: DiscoveryConfig
    ) -> str:
        name = target.block.name
        if name not in found:
            present = self.host.known_device(name)
            if present is None or present.size_bytes == 0:  # gone, or a loop device left with no file
                return "no longer present"
            return "no longer selected by discovery"
        if name in configured:
            return "now a configured target"
        now = self.host.known_device(name)
        if now is None or device_identity(now) != device_identity(target.block):
            return "the device was replaced"
        wanted = discovered_target(name, found[name], discovery)
        if fingerprint(target.config) != fingerprint(wanted):
            return "; ".join(changes(target.config, wanted)) or "its probes changed"
        return ""


def udev_events(capabilities: Capabilities) -> threading.Event | None:
    """An Event set on every block-device udev event, where udevd runs; None elsewhere (rescans do the work).
    Whether the monitor could be had goes to `capabilities`."""
    if not os.path.isdir("/run/udev"):
        capabilities.record(UDEV_MONITOR, False, "no udevd (/run/udev is missing); rescanning sysfs")
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
        capabilities.record(UDEV_MONITOR, True)
        return event
    except Exception as err:  # no netlink (RestrictAddressFamilies, a container), or libudev missing
        capabilities.record(UDEV_MONITOR, False, f"{err}; following devices by rescanning sysfs")
        return None
