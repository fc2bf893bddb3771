"""The running exporter, composed of small parts with one job each:

- probes.ProbeSet: the targets being probed and one worker per probe;
- warmups.WarmupManager: the targets' warm-ups;
- throttle.ThrottleWatch: the throttle detector, fed by the probes, and the probes' back-off;
- follow.DeviceFollower: devices that come and go under `discovery:`;
- provider.ProviderStats: the provider's own statistics of AWS NVMe devices, read in a thread;
- reload.plan: what a new configuration keeps, stops and starts.

Scrapes read this state and never wait on a device: workers publish counters and snapshots under short
locks, and a worker stuck in the kernel only ages its in-flight gauge. Exporter.reload() applies a new
configuration (SIGHUP): targets whose configuration and device are unchanged keep their workers,
histograms, counters and warm-ups; a configuration that does not resolve is rejected and the old one kept.
"""

from __future__ import annotations

import logging
import threading
import time

from .. import targets as targets_mod
from ..config import Config, ConfigError
from ..discovery import Host
from ..state import StateStore, state_directory
from ..targets import ResolvedTarget
from . import reload as reload_plan
from .follow import DeviceFollower
from .probes import STOP_TIMEOUT_S, ProbeSet, RunningProbe
from .provider import ProviderStats
from .throttle import ThrottleWatch
from .warmups import WarmupManager

__all__ = ["Exporter", "RunningProbe"]

log = logging.getLogger(__name__)


class Exporter:
    """Owns the probes of one configuration. start() raises ConfigError before anything is written."""

    def __init__(self, config: Config, host: Host) -> None:
        self.config = config
        self.host = host
        self.probes = ProbeSet(host)
        self.state = StateStore(state_directory(config.state_directory))
        self.warmups = WarmupManager(self.state)
        self.throttle = ThrottleWatch(self.probes, host, lambda: self.state)
        self.provider = ProviderStats(host, self.throttle.devices, self.throttle.provider_changed)
        self._lock = threading.Lock()  # reloads and discovery rescans, one at a time
        self.follower = DeviceFollower(
            host, self.probes, self._lock, self._start_targets, self._stop_targets, self._warm_discovered
        )
        self.last_reload_successful = True
        self.last_reload_success_time = time.time()

    def start(self) -> None:
        resolved = targets_mod.resolve(self.config, self.host)
        for warning in targets_mod.prepare(self.host, resolved, strict=not self.config.builtin):
            log.warning("%s; will retry (run as root or in group disk, and expose the device to containers)", warning)
        with self._lock:
            self._start_targets(resolved)
            self.throttle.apply(self.config.throttle)
            self.follower.apply(self.config)
        self.provider.start()

    def _start_targets(self, resolved: list[ResolvedTarget]) -> None:
        new = self.probes.add(resolved, self.config.window, self.config.buckets, self.state)
        self.throttle.back_off_new(new)
        self.warmups.start(resolved)

    def _stop_targets(self, gone: list[ResolvedTarget], timeout: float = STOP_TIMEOUT_S, why: str = "") -> None:
        self.warmups.stop(gone, why=why)
        self.probes.remove(gone, timeout, why)

    def _warm_discovered(self, found: list[ResolvedTarget], appeared: bool) -> None:
        discovery = self.config.discovery
        if discovery is not None and discovery.warmup is not None:
            self.warmups.offer(found, discovery.warmup, appeared)

    def reload(self, config: Config) -> None:
        """Apply a new configuration; ConfigError (and nothing changed) if it does not resolve."""
        try:
            self._reload(config)
        except ConfigError:
            self.note_reload(False)
            raise
        self.note_reload(True)

    def note_reload(self, ok: bool) -> None:
        """The outcome of the last reload, exported as volprobe_config_last_reload_*; a file that does not parse
        fails before reload() is reached."""
        self.last_reload_successful = ok
        if ok:
            self.last_reload_success_time = time.time()

    def _reload(self, config: Config) -> None:
        with self._lock:
            resolved = targets_mod.resolve(config, self.host)  # every check, as at start-up
            old = self.config
            restart_all = ""
            if (config.window, config.buckets) != (old.window, old.buckets):
                restart_all = "defaults.window or defaults.buckets changed: every histogram starts again"
            running = [t for t in self.probes.targets() if not t.discovered]
            plan = reload_plan.plan(running, resolved, restart_all)
            # All or nothing: everything the new targets need is prepared before anything running changes, so
            # a rejection leaves every probe, warm-up and limit as it was. Only a raw device that a stopping
            # target holds with O_EXCL must be let go first (see _take_over).
            held = {_raw_device(t) for t in plan.stop} - {None}
            later = [t for t in plan.start if _raw_device(t) in held]
            now = [t for t in plan.start if _raw_device(t) not in held]
            targets_mod.prepare(self.host, now, strict=not config.builtin)
            try:
                self._take_over(plan, later, strict=not config.builtin)
            except ConfigError:
                targets_mod.close(plan.start)
                raise
            # Accepted. Kept targets take their new keys, limits and warm-up settings; a changed warm-up
            # restarts alone, from its checkpoint.
            rewarm = [current for current, reloaded in plan.keep if current.config.warmup != reloaded.config.warmup]
            self.warmups.stop(rewarm)
            for current, reloaded in plan.keep:
                current.config = reloaded.config
                self.probes.rekey(current)
            for target in plan.stop:
                self._stop_targets([target], why=plan.why[target.name])
            self.config = config
            # A configured target now claims a device discovery was probing: the discovered one stops first.
            claimed = {t.device.name for t in plan.start}
            taken = [t for t in self.probes.targets() if t.discovered and t.device.name in claimed]
            if taken:
                self._stop_targets(taken, why="now a configured target")
            directory = state_directory(config.state_directory)
            if directory != self.state.directory:
                # Running probes and warm-ups keep the store they started with; new ones use the new directory.
                self.state = self.warmups.store = StateStore(directory)
            self._start_targets(plan.start)
            self.warmups.start(rewarm)
            if restart_all:
                discovered = [t for t in self.probes.targets() if t.discovered]
                if discovered:
                    self._stop_targets(discovered, 1.0, restart_all)
            self.throttle.apply(config.throttle)
            self.follower.apply(config)
            # Discovered devices' warm-ups follow discovery.warmup: changed settings restart them (from their
            # checkpoints), a policy that now selects a running device starts its warm-up.
            warm = config.discovery.warmup if config.discovery else None
            again = self.warmups.discovered_spec_changed(warm)
            self._warm_discovered([t for t, appeared in again if appeared], True)
            self._warm_discovered([t for t in self.probes.targets() if t.discovered], False)
        restarted = sum(1 for t in plan.stop if t.name in {s.name for s in plan.start})
        log.info(
            "configuration reloaded: %d kept, %d added, %d removed, %d restarted",
            len(plan.keep),
            len(plan.start) - restarted,
            len(plan.stop) - restarted,
            restarted,
        )
        if self.config.discovery is not None:
            self.follower.rescan()  # apply discovery changes now, not at the next rescan

    def _take_over(self, plan: reload_plan.Plan, later: list[ResolvedTarget], strict: bool) -> None:
        """Prepare the new targets that write to a raw device a stopping target holds with O_EXCL: the holders
        stop first. Their checks passed in resolve(); should the open still fail (another process took the
        device in between), the holders are started again as they were, and the first error is raised."""
        if not later:
            return
        devices = {_raw_device(t) for t in later}
        holders = [t for t in plan.stop if _raw_device(t) in devices]
        for target in holders:
            self._stop_targets([target], why=plan.why[target.name])
        plan.stop = [t for t in plan.stop if _raw_device(t) not in devices]
        try:
            targets_mod.prepare(self.host, later, strict=strict)
        except ConfigError as err:
            try:
                targets_mod.prepare(self.host, holders, strict=False)
                self._start_targets(holders)
            except Exception as again:  # the first error is the one to report; the second is logged
                log.error("reload rejected, and the targets it stopped could not be started again: %s", again)
            raise err from None

    def probed_devices(self) -> set[str]:
        """Devices whose diskstats are exported: each probed device and the whole disks beneath it."""
        return self.probes.devices()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[str]:
        """Stop every worker; return the names of those still stuck in the kernel after `timeout`."""
        self.follower.stop()
        self.provider.stop()
        self.throttle.stop()
        self.warmups.stop_all()
        return self.probes.stop(timeout)


def _raw_device(target: ResolvedTarget) -> tuple[int, int] | None:
    """The device a target holds with O_EXCL (raw write probes, a write warm-up), by number; else None."""
    if target.kind == "device" and target.config.writes:
        return target.device.major, target.device.minor
    return None
