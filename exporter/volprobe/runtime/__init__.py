"""The running exporter, composed of small parts with one job each:

- probes.ProbeSet: the targets being probed and one worker per probe;
- warmups.WarmupManager: the targets' warm-ups;
- throttle.ThrottleWatch: the throttle detector, fed by the probes, and the probes' back-off;
- follow.DeviceFollower: devices that come and go under `discovery:`;
- pods.PodVolumeFollower: the pod volumes the kubelet mounts (`kubernetes:`), their mounts checked;
- provider.ProviderStats: the provider's own statistics of AWS NVMe devices, read in a thread;
- reload.plan: what a new configuration keeps, stops and starts.

Scrapes read this state and never wait on a device: workers publish counters and snapshots under short
locks, and a worker stuck in the kernel only ages its in-flight gauge. Exporter.reload() applies a new
configuration (SIGHUP): targets whose configuration and device are unchanged keep their warm-ups and the
workers, histograms and counters of every unchanged probe (a changed probe restarts alone); a configuration that
does not resolve is rejected and the old one kept.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .. import __version__, capabilities, diskstats, mountcheck, supervise
from .. import targets as targets_mod
from ..config import Config, ConfigError, TargetConfig
from ..discovery import BlockDevice, Host
from ..diskstats import DiskStats
from ..probe import TIMER
from ..state import StateStore, state_directory
from ..targets import ResolvedTarget
from ..view import (
    BuildInfo,
    DiskThrottle,
    MountReading,
    ProbeReading,
    ProviderDevice,
    ReloadOutcome,
    TargetReading,
    VolumeReading,
    WarmupReading,
)
from . import readings
from . import reload as reload_plan
from .follow import DeviceFollower
from .mounts import MountWatch
from .pods import PodVolumeFollower
from .probes import STOP_TIMEOUT_S, ProbeSet, RunningProbe
from .provider import ProviderStats
from .throttle import ThrottleWatch
from .warmups import WarmupManager

__all__ = ["Exporter", "RunningProbe"]

log = logging.getLogger(__name__)


class ReloadStatus(Protocol):
    """What a watcher of a reloaded file says of its last reload (webconfig.WebConfigWatcher)."""

    last_reload_successful: bool
    last_reload_success_time: float


class Exporter:
    """Owns the probes of one configuration. start() raises ConfigError before anything is written. The
    collectors see it through volprobe.view.RuntimeView, which it implements."""

    def __init__(self, config: Config, host: Host, web: ReloadStatus | None = None) -> None:
        self.config = config
        self.web = web  # the web config's watcher, whose reload outcome is exported
        self.host = host
        self.found = capabilities.Capabilities()  # what this process may do, as its parts find out
        self.probes = ProbeSet(host)
        self.state = StateStore(state_directory(config.state_directory))
        self.warmups = WarmupManager(self.state, self.found)
        self.throttle = ThrottleWatch(self.probes, host, lambda: self.state)
        self.provider = ProviderStats(
            host, self.throttle.devices, self.throttle.provider_changed, capabilities=self.found
        )
        self._lock = threading.Lock()  # reloads and discovery rescans, one at a time
        self._diskstats = diskstats.Reader(host.proc)  # held open for the scrapes' reads
        self.follower = DeviceFollower(
            host,
            self.probes,
            self._lock,
            self._start_targets,
            self._stop_targets,
            self._warm_discovered,
            capabilities=self.found,
        )
        self.pods = PodVolumeFollower(
            host, self.probes, self._lock, self._start_targets, self._stop_targets, capabilities=self.found
        )
        self.checks = mountcheck.Checks()  # calls into directories that may hang, one at a time per directory
        self.mounts = MountWatch(self.probes, self.checks, self._resume)
        self.last_reload_successful = True
        self.last_reload_success_time = time.time()
        self._stopping = threading.Event()  # no pending target starts from then on

    def start(self) -> None:
        resolved = targets_mod.resolve(self.config, self.host, checks=self.checks)
        for warning in targets_mod.prepare(self.host, resolved, strict=not self.config.builtin):
            log.warning("%s; will retry (run as root or in group disk, and expose the device to containers)", warning)
        with self._lock:
            self._start_targets(resolved)
            self.throttle.apply(self.config.throttle)
            self.follower.apply(self.config)
            self.pods.apply(self.config)
            self.mounts.apply(self.config.mount_check)
        self.provider.start()

    def _resume(self, pending: ResolvedTarget) -> None:
        """A directory that did not answer when it was resolved answers now (so says the mount watch): resolve,
        prepare and start it in a thread of its own, one at a time per directory. Making its probe file writes to a
        mount that may hang again meanwhile, so neither the watch nor a reload waits for it."""
        if self._stopping.is_set():
            return
        done = mountcheck.log_failure(f"{pending.name}: starting it once its mount answered")
        self.checks.submit(f"{pending.path} (resume)", lambda: self._resume_now(pending), done, name="target start")

    def _resume_now(self, pending: ResolvedTarget) -> None:
        """_resume()'s thread: prepared outside the lock, started under it unless a reload replaced or changed the
        target meanwhile (it is then let go, and the watch hands the current one over again), or the exporter
        stops. Another refusal (its directory is gone, say) is logged and it stays pending."""
        wanted, config = pending.config, self.config
        try:
            # One that a running target held (a reload found it let go of): that very directory, or none.
            held = {pending.path: pending.probe_dir} if pending.probe_dir is not None else None
            resolved = targets_mod.resolve(config, self.host, [wanted], checks=self.checks, held=held)
            if any(t.pending for t in resolved) or not self._current(pending, wanted):
                return  # nothing made: still pending, or replaced, or the exporter stops
            targets_mod.prepare(self.host, resolved, strict=not config.builtin)
        except ConfigError as err:
            why = "; ".join(err.problems)
            if why != pending.pending:
                log.error("%s: its mount answers, but it cannot be probed: %s", pending.name, why)
            pending.pending = why
            return
        with self._lock:
            started = self._current(pending, wanted)
            if started:
                self.probes.remove([pending], 0.0, "its mount answers")
                self._start_targets(resolved)
        if not started:
            targets_mod.close(resolved)  # outside the lock: a close on a network filesystem can block

    def _current(self, pending: ResolvedTarget, wanted: TargetConfig) -> bool:
        """Whether a pending target is still to be started as `wanted`: neither replaced nor changed by a reload
        (which gives kept targets equal configurations), nor the exporter stopping."""
        running = any(t is pending for t in self.probes.targets())
        return running and pending.config == wanted and not self._stopping.is_set()

    def _start_targets(self, resolved: list[ResolvedTarget]) -> None:
        new = self.probes.add(resolved, self.config.window, self.config.buckets, self.state)
        self.throttle.back_off_new(new)
        self.warmups.start(resolved)

    def _stop_targets(self, gone: list[ResolvedTarget], timeout: float = STOP_TIMEOUT_S, why: str = "") -> None:
        self.warmups.stop(gone, why=why)
        self.probes.remove(gone, timeout, why, hung=self.mounts.hung())

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

    def note_reload(self, ok: bool) -> None:
        """The outcome of the last reload, exported as volprobe_config_last_reload_*; a file that does not parse
        fails before reload() is reached."""
        self.last_reload_successful = ok
        if ok:
            self.last_reload_success_time = time.time()

    def _reload(self, config: Config) -> None:
        """The steps of a reload, in the only order that works. Until _prepare() returns, nothing running has
        changed, and a ConfigError leaves it so (all or nothing); from then on each step applies."""
        with self._lock:
            change = self._plan_reload(config)
            self._prepare(change)
            self._update_kept(change)
            self._stop_replaced(change)  # before the new ones start: they may take over the same names
            self._switch_config(change)  # before any new probe starts: it reads window and buckets from it
            self._start_new(change)
            self._apply_policies(change)  # last: throttle and discovery see the final set of targets
        # Noted before it is logged: once the log says it was reloaded, volprobe_config_last_reload_successful says
        # so too (a test that waited for the line read 0 once).
        self.note_reload(True)
        self._log_reload(change.plan)
        if self.config.discovery is not None:
            try:
                self.follower.rescan()  # apply discovery changes now, not at the next rescan
            except OSError as err:  # a device vanishing mid-read: the reload stands, the next rescan retries
                log.warning("rescan after the reload failed (the next one retries): %s", err)

    def _plan_reload(self, config: Config) -> _Change:
        """Resolve the new configuration (every check, as at start-up) and match it with what runs. No I/O
        beyond resolving; nothing changes."""
        # A directory a running target holds is asked through its descriptor, not resolved by name again.
        held = {t.path: t.probe_dir for t in self.probes.targets() if t.probe_dir is not None and not t.discovered}
        resolved = targets_mod.resolve(config, self.host, checks=self.checks, held=held)
        old = self.config
        restart_all = ""
        if (config.window, config.buckets) != (old.window, old.buckets):
            restart_all = "defaults.window or defaults.buckets changed: every histogram starts again"
        running = [t for t in self.probes.targets() if not t.discovered and t.pod_volume is None]  # ours to plan
        plan = reload_plan.plan(running, resolved, restart_all)
        # Kept targets whose warm-up settings changed: that warm-up alone restarts, from its checkpoint.
        rewarm = [current for current, reloaded in plan.keep if current.config.warmup != reloaded.config.warmup]
        return _Change(config, plan, restart_all, rewarm)

    def _prepare(self, change: _Change) -> None:
        """Everything the new targets need, prepared before anything running changes, so that a rejection
        leaves every probe, warm-up and limit as it was. Only a raw device that a stopping target holds with
        O_EXCL must be let go first (see _take_over)."""
        plan, strict = change.plan, not change.config.builtin
        held = {_raw_device(t) for t in plan.stop} - {None}
        later = [t for t in plan.start if _raw_device(t) in held]
        now = [t for t in plan.start if _raw_device(t) not in held]
        targets_mod.prepare(self.host, now, strict=strict)
        prepared = change.prepared
        try:
            for probes in plan.probes:  # a kept target's changed and added probes: their files and descriptors
                # Prepared on a copy of the running target, which takes it only in _start_new (commit()).
                prepared.append(targets_mod.prepare_probes(self.host, probes.running, probes.starting, strict=strict))
            self._take_over(plan, later, strict=strict)
        except ConfigError:
            for made in prepared:
                made.close()
            prepared.clear()
            targets_mod.close(plan.start)
            raise

    def _update_kept(self, change: _Change) -> None:
        """Kept targets take their new keys, limits, warm-up settings and probes: their changed and removed probes
        stop here (the changed ones start again in _start_new), and so does a changed warm-up."""
        self.warmups.stop(change.rewarm)
        hung = self.mounts.hung()
        for probes in change.plan.probes:
            self.probes.remove_probes(probes.running, probes.why, hung=hung)
        for current, reloaded in change.plan.keep:
            current.config = reloaded.config
            self.probes.rekey(current)

    def _stop_replaced(self, change: _Change) -> None:
        for target in change.plan.stop:
            self._stop_targets([target], why=change.plan.why[target.name])

    def _switch_config(self, change: _Change) -> None:
        """The new configuration becomes the running one. A configured target that now claims a device
        discovery was probing: the discovered one stops first. A new state directory serves what starts from
        now on; running probes and warm-ups keep the store they started with."""
        config = self.config = change.config
        claimed = {t.device_name for t in change.plan.start} - {""}
        taken = [t for t in self.probes.targets() if t.discovered and t.device_name in claimed]
        if taken:
            self._stop_targets(taken, why="now a configured target")
        directory = state_directory(config.state_directory)
        if directory != self.state.directory:
            self.state = self.warmups.store = StateStore(directory)

    def _start_new(self, change: _Change) -> None:
        """The new and changed targets and the kept targets' changed probes start, changed warm-ups restart;
        after a change every histogram must follow, discovered probes stop too (discovery starts them again with
        the new settings)."""
        self._start_targets(change.plan.start)
        for made in change.prepared:
            made.commit()  # the running target's read source, pins and descriptors for the probes starting
        for probes in change.plan.probes:
            config = self.config
            new = self.probes.add_probes(probes.running, probes.starting, config.window, config.buckets, self.state)
            self.throttle.back_off_new(new)
        self.warmups.start(change.rewarm)
        if change.restart_all:
            discovered = [t for t in self.probes.targets() if t.discovered]
            if discovered:
                self._stop_targets(discovered, 1.0, change.restart_all)

    def _apply_policies(self, change: _Change) -> None:
        """Throttle and discovery settings. Discovered devices' warm-ups follow discovery.warmup: changed
        settings restart them (from their checkpoints), a policy that now selects a running device starts its
        warm-up."""
        config = change.config
        self.throttle.apply(config.throttle)
        self.follower.apply(config)
        self.pods.apply(config)
        self.mounts.apply(config.mount_check)
        warm = config.discovery.warmup if config.discovery else None
        again = self.warmups.discovered_spec_changed(warm)
        self._warm_discovered([t for t, appeared in again if appeared], True)
        self._warm_discovered([t for t in self.probes.targets() if t.discovered], False)

    @staticmethod
    def _log_reload(plan: reload_plan.Plan) -> None:
        restarted = sum(1 for t in plan.stop if t.name in {s.name for s in plan.start})
        log.info(
            "configuration reloaded: %d kept, %d added, %d removed, %d restarted; %d probes of kept targets changed",
            len(plan.keep),
            len(plan.start) - restarted,
            len(plan.stop) - restarted,
            restarted,
            sum(len(p.why) for p in plan.probes),
        )

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

    # -- the collectors' view (volprobe.view.RuntimeView) -----------------------------------------------

    def build_info(self) -> BuildInfo:
        return BuildInfo(__version__, platform.python_version(), TIMER)

    def capabilities(self) -> dict[str, bool]:
        return self.found.known()

    def kept_capabilities(self) -> str | None:
        kept = self.found.kept
        return None if kept is None else kept.text

    def thread_restarts(self) -> dict[str, int]:
        return supervise.restarts()

    def config_reload(self) -> ReloadOutcome:
        return ReloadOutcome(self.last_reload_successful, self.last_reload_success_time)

    def web_config_reload(self) -> ReloadOutcome | None:
        if self.web is None:
            return None
        return ReloadOutcome(self.web.last_reload_successful, self.web.last_reload_success_time)

    def histogram_by_touch(self) -> bool:
        return self.config.histogram_by_touch

    def probe_readings(self) -> list[ProbeReading]:
        return readings.probe_readings(self.probes)

    def target_readings(self) -> list[TargetReading]:
        return readings.target_readings(self.probes)

    def kubernetes_volumes(self, devices: Sequence[BlockDevice]) -> dict[str, set[tuple[str, str]]]:
        return readings.kubernetes_volumes(self.host, devices)

    def pod_volume_drivers(self) -> dict[tuple[str, str], str]:
        return self.pods.drivers()

    def disk_stats(self) -> dict[str, DiskStats]:
        wanted = None if self.config.diskstats == "all" else self.probed_devices()
        return self._diskstats.read(wanted)

    def throttle_readings(self) -> dict[str, DiskThrottle] | None:
        return readings.throttle_readings(self.throttle)

    def provider_readings(self) -> dict[str, ProviderDevice]:
        return readings.provider_readings(self.provider)

    def mount_readings(self) -> list[MountReading]:
        return self.mounts.readings()

    def warmup_readings(self) -> list[WarmupReading]:
        return readings.warmup_readings(self.warmups)

    def volume_readings(self) -> dict[str, VolumeReading]:
        return readings.volume_readings(self.state)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[str]:
        """Stop every worker; return the names of those still stuck in the kernel after `timeout`."""
        hung = self.mounts.hung()
        # A pending target being started (_resume_now) finishes first, and none starts after; a lock held longer
        # (a rescan opening a stalled device) is not waited for.
        held = self._lock.acquire(timeout=1.0)
        self._stopping.set()
        if held:
            self._lock.release()
        self.mounts.stop()
        self.follower.stop()
        self.pods.stop()
        self.provider.stop()
        self.throttle.stop()
        self.warmups.stop_all()
        stuck = self.probes.stop(timeout, hung)
        self._diskstats.close()
        return stuck


@dataclass
class _Change:
    """A reload, planned: the new configuration, what it keeps, stops and starts, and what follows from it."""

    config: Config
    plan: reload_plan.Plan
    restart_all: str  # why every probe restarts (window or buckets changed), or ""
    rewarm: list[ResolvedTarget]  # kept targets whose warm-up restarts
    prepared: list[targets_mod.PreparedProbes] = field(default_factory=list)  # kept targets' new probes (_prepare)


def _raw_device(target: ResolvedTarget) -> tuple[int, int] | None:
    """The device a target holds with O_EXCL (raw write probes, a write warm-up), by number; else None."""
    if target.kind == "device" and target.config.writes:
        return target.block.major, target.block.minor
    return None
