"""Following pod volumes (`kubernetes:`): a mount check for each network or FUSE filesystem the kubelet mounted
for a pod, and the probes of `kubernetes.rules` on the volumes a rule matches, started as each appears and gone
as it goes.

Every `rescan_interval` the host's mount table (Host.kubelet_mounts: PID 1's, with --path.procfs the node's) is
read for the pod volumes under the kubelet's directory (volprobe.kubelet). A filesystem-only one (nfs, nfs4,
ceph, cifs, fuse.*) becomes a target without probes, whose mount the mount watch (runtime.mounts) asks like any
directory target's, but holding nothing between checks: the kubelet must be able to unmount it at any time, and
a descriptor kept there would make its unmount fail (EBUSY) and the pod hang in Terminating. A block-backed one is
its disk's: discovery probes the disk (reads only) and the target collector gives it the volume's pv. Nothing is
written into a pod volume, and nothing of it is read (vol_data.json is beside the mount, not in it), unless a rule
matches it: then, whatever backs it, it is a directory target of the rule's probes (targets.resolve_pod_volume,
through the private copy of its mount alone, and prepare: every check of a directory target's, its probe file
made and judged on the descriptor, a hostile owner's names never trusted), made with `hold: false`
(config.TargetConfig.hold): its directory and files are opened, checked on their descriptors, probed and closed
again for each probe (probe.ProbeWorker), so that between probes volprobe holds nothing there either. Resolving
and preparing one (making its probe file) runs in the rescan thread, outside the exporter's lock.

A volume no longer in the mount table (unmounted, its pod gone), or mounted again (another device number, type
or source), stops at the next rescan, and its series go with it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from .. import kubelet, mountcheck, privatemount, supervise
from .. import targets as targets_mod
from ..capabilities import Capabilities
from ..config import Config, ConfigError, PodVolumeRule, TargetConfig
from ..discovery import Host, Mount
from ..logs import fields
from ..osthread import name_this_thread
from ..targets import ResolvedTarget
from .probes import ProbeSet

log = logging.getLogger(__name__)
POD_STOP_TIMEOUT_S = 1.0  # a pod volume's target has no workers: there is nothing to wait for


def pod_target(volume: kubelet.PodVolume) -> ResolvedTarget:
    """The target of a filesystem-only pod volume: its mount point as name and path, no probes, no descriptor."""
    return ResolvedTarget(
        wanted(volume, None), volume.path, "directory", volume.path, None, [], volume.mount, pod_volume=volume
    )


def wanted(volume: kubelet.PodVolume, rule: PodVolumeRule | None) -> TargetConfig:
    """A pod volume's target configuration: no probes, or its rule's, in a probe file of the rule's size; held
    never (hold=False)."""
    if rule is None:
        return TargetConfig(key=f"kubernetes[{volume.path}]", directory=volume.path, probes=(), hold=False)
    return TargetConfig(
        key=rule.key,
        directory=volume.path,
        probe_file_size=rule.probe_file_size,
        probes=rule.probes,
        hold=False,
    )


class PodVolumeFollower:
    """Runs the rescans of `kubernetes:` in a thread, under the exporter's lock, starting and stopping pod
    volumes' targets through the exporter's callbacks."""

    def __init__(
        self,
        host: Host,
        probes: ProbeSet,
        lock: threading.Lock,
        start: Callable[[list[ResolvedTarget]], None],
        stop: Callable[[list[ResolvedTarget], float, str], None],
        read: Callable[[str, list[Mount]], list[kubelet.PodVolume]] = kubelet.pod_volumes,
        capabilities: Capabilities | None = None,
    ) -> None:
        self.host = host
        self.capabilities = capabilities
        self.probes = probes
        self.lock = lock  # the exporter's: rescans and reloads one at a time
        self._start_targets = start
        self._stop_targets = stop
        self._read = read
        self.config: Config | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._missing_logged = False
        self._drivers: dict[tuple[str, str], str] = {}  # of every pod volume at the last rescan, block-backed too
        self._refused: dict[tuple[str, TargetConfig], str] = {}  # rule targets that could not start, logged once
        self._checks = mountcheck.Checks()  # rule targets' preparations, one outstanding per volume

    def drivers(self) -> dict[tuple[str, str], str]:
        """{(pv, pod_uid): driver}, and (pv, "") for the node's staging mount, of the last rescan's pod volumes."""
        return self._drivers

    def apply(self, config: Config) -> None:
        """Follow with a new configuration (called with the lock held): the thread wakes to rescan at once. With
        `kubernetes.enabled: false` every pod volume's target stops."""
        self.config = config
        if config.kubernetes.enabled is False:
            self._drivers = {}
            self._signal_stop()
            self._stop_all("kubernetes.enabled is false")
            return
        if self._thread is None:
            self._stopping = stopping = threading.Event()
            self._thread = threading.Thread(target=self._follow, args=(stopping,), name="pod volumes", daemon=True)
            self._thread.start()
        self._wake.set()

    def _signal_stop(self) -> threading.Thread | None:
        thread, self._thread = self._thread, None
        self._stopping.set()
        self._wake.set()
        return thread

    def stop(self) -> None:
        """End following and wait for the thread (called without the lock)."""
        thread = self._signal_stop()
        if thread is not None:
            thread.join(10)

    def _stop_all(self, why: str) -> None:
        gone = [t for t in self.probes.targets() if t.pod_volume is not None]
        if gone:
            self._stop_targets(gone, POD_STOP_TIMEOUT_S, why)

    def _follow(self, stopping: threading.Event) -> None:
        name_this_thread("vp pod volumes")

        def rescans() -> None:
            while not stopping.is_set():
                self.rescan(stopping)
                config = self.config
                self._wake.wait(config.pod_volume_interval if config is not None else 5.0)
                self._wake.clear()

        # A bad scan is logged, counted (as discovery's) and retried after a back-off.
        supervise.run("discovery", rescans, stopping, "pod volume rescan")

    def found(self, config: Config) -> dict[tuple[str, int, int, str, str], tuple[kubelet.PodVolume, TargetConfig]]:
        """The pod volumes to follow now, by PodVolume.key, with their target configuration (wanted()): each one a
        rule matches, whatever backs it, and each filesystem-only one."""
        directory = config.kubernetes.kubelet_directory
        if not kubelet.enabled(config.kubernetes.enabled, directory):
            self._drivers = {}
            return {}
        if not os.path.isdir(directory):
            if not self._missing_logged:
                log.warning("kubernetes.kubelet_directory %s is not a directory: no pod volumes yet", directory)
                self._missing_logged = True
            self._drivers = {}
            return {}
        self._missing_logged = False
        if self.capabilities is not None and config.kubernetes.rules:
            # A rule's probes open the volume through a private copy of its mount where they can: say if not.
            self.capabilities.record(privatemount.PRIVATE_MOUNT, *privatemount.available())
        volumes = self._read(directory, self.host.kubelet_mounts())
        # By PersistentVolume, as the kubelet recorded it: a volume without one (inline, ephemeral) names none.
        drivers = {(v.pv, ""): v.driver for v in volumes if v.driver and v.pv}
        self._drivers = {**drivers, **{(v.pv, v.pod_uid): v.driver for v in volumes if v.driver and v.pv}}
        found = {}
        for volume in volumes:
            rule = config.kubernetes.rule_for(volume.driver, volume.pv, volume.path)
            if rule is not None or volume.backing == kubelet.FILESYSTEM:
                found[volume.key] = (volume, wanted(volume, rule))
        return found

    def _prepare(self, config: Config, volume: kubelet.PodVolume, target: TargetConfig) -> ResolvedTarget | None:
        """A rule's target resolved and prepared (its probe file made or checked): every check of a directory
        target's, in a thread of its own with the mount check's deadline, so that a volume that does not answer (a
        server gone) holds up neither this rescan nor the other volumes. None, logged once for that volume and
        rule, if it is refused or does not answer; tried again at the next rescan (a volume whose last try is
        still outstanding is not tried again until it returns)."""

        def make() -> ResolvedTarget:
            # Nothing is held open by what this returns (hold=False): one returning after its caller gave up
            # (Hung) is dropped as it is.
            resolved = targets_mod.resolve_pod_volume(self.host, target, volume)  # through the copy alone
            targets_mod.prepare(self.host, [resolved])
            return resolved

        try:
            if self._checks.outstanding_since(volume.path) is not None:
                raise mountcheck.Hung("its last try has not returned")
            resolved = self._checks.call(volume.path, make, config.mount_check.timeout, name="pod volume prepare")
        except mountcheck.Hung as err:
            self._refuse(volume, target, f"the volume does not answer ({err}); probed once it does")
            return None
        except ConfigError as err:
            self._refuse(volume, target, "; ".join(err.problems))
            return None
        self._refused.pop((volume.path, target), None)
        return resolved

    def _refuse(self, volume: kubelet.PodVolume, target: TargetConfig, why: str) -> None:
        if self._refused.get((volume.path, target)) != why:
            log.error(
                "pod volume %s of pod %s matches %s, but cannot be probed: %s",
                volume.pv or volume.name,
                volume.pod_uid,
                target.key,
                why,
                extra=fields(target=volume.path, path=volume.path),
            )
        self._refused[(volume.path, target)] = why

    def rescan(self, stopping: threading.Event | None = None) -> None:
        """Start a target for each pod volume to follow that appeared (or whose rule changed); stop those that
        went. A rule's target is prepared first, outside the lock (making its probe file writes to the volume)."""
        config = self.config
        if config is None:
            return
        found = self.found(config) if config.kubernetes.enabled is not False else {}
        targets = self.probes.targets()
        running = {t.pod_volume.key: t for t in targets if t.pod_volume is not None}
        configured = {t.path for t in targets if t.pod_volume is None}  # the configuration's: never prepared here
        prepared: dict[tuple[str, int, int, str, str], ResolvedTarget] = {}
        for key, (volume, target) in sorted(found.items()):
            current = running.get(key)
            if target.probes and volume.path not in configured and (current is None or current.config != target):
                resolved = self._prepare(config, volume, target)
                if resolved is not None:
                    prepared[key] = resolved
        paths = {volume.path for volume, _ in found.values()}
        self._refused = {key: why for key, why in self._refused.items() if key[0] in paths}
        started: list[ResolvedTarget] = []
        try:
            with self.lock:
                if self.config is not config or (stopping is not None and stopping.is_set()):
                    return  # a reload came in between: the next rescan (now) has its configuration
                started = self._apply(found, prepared)
        finally:
            unused = [t for t in prepared.values() if not any(t is s for s in started)]
            if unused:
                targets_mod.close(unused)

    def _apply(
        self,
        found: dict[tuple[str, int, int, str, str], tuple[kubelet.PodVolume, TargetConfig]],
        prepared: dict[tuple[str, int, int, str, str], ResolvedTarget],
    ) -> list[ResolvedTarget]:
        """rescan()'s changes, with the lock held: the targets started."""
        targets = self.probes.targets()
        configured = {t.path for t in targets if t.pod_volume is None}  # a directory target there is the config's
        found = {key: pair for key, pair in found.items() if pair[0].path not in configured}
        running = {t.pod_volume.key: t for t in targets if t.pod_volume is not None}
        for key, (volume, config) in list(found.items()):
            if config.probes and key not in prepared and not (key in running and running[key].config == config):
                # A rule's target not ready (refused, or its volume not answering: logged), meanwhile what the volume
                # has without a rule: a filesystem's mount check (a hung one shows), a block-backed one's disk.
                if volume.backing == kubelet.FILESYSTEM:
                    found[key] = (volume, wanted(volume, None))
                else:
                    del found[key]
        gone = [t for key, t in running.items() if key not in found or found[key][1] != t.config]
        for target in gone:
            if target.path in configured:
                why = "now a configured target"
            elif target.pod_volume is not None and target.pod_volume.key in found:
                why = "its kubernetes rule changed" if target.config.probes else "its rule's probe file is ready"
            elif target.path in {volume.path for volume, _ in found.values()}:
                why = "pod volume mounted again"
            else:
                why = "pod volume unmounted"
            self._stop_targets([target], POD_STOP_TIMEOUT_S, why)
        kept = {key for key, t in running.items() if t not in gone}
        new: list[ResolvedTarget] = []
        for key, (volume, config) in sorted(found.items()):
            if key in kept:
                continue
            if not config.probes:
                new.append(pod_target(volume))
            else:
                new.append(prepared[key])
            probes = ", ".join(f"{p.op} every {p.interval:g}s" for p in config.probes) or "mount check only"
            log.info(
                "pod volume %s of pod %s (%s, %s): %s",
                volume.pv or volume.name,
                volume.pod_uid,
                volume.driver or volume.plugin,
                volume.mount.fstype,
                probes,
                extra=fields(target=volume.path, path=volume.path),
            )
        if new:
            self._start_targets(new)
        return new
