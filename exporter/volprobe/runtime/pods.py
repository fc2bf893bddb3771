"""Following pod volumes (`kubernetes:`): a mount check for each network or FUSE filesystem the kubelet mounted
for a pod, started as it appears and gone as it goes.

Every `rescan_interval` the host's mount table (Host.kubelet_mounts: PID 1's, with --path.procfs the node's) is
read for the pod volumes under the kubelet's directory (volprobe.kubelet). A filesystem-only one (nfs, nfs4,
ceph, cifs, fuse.*) becomes a target without probes, whose mount the mount watch (runtime.mounts) asks like any
directory target's, but holding nothing between checks: the kubelet must be able to unmount it at any time, and
a descriptor kept there would make its unmount fail (EBUSY) and the pod hang in Terminating. A block-backed one is
its disk's: discovery probes the disk (reads only) and the target collector gives it the volume's pv. Nothing is
written into any pod volume, and nothing of it is read: vol_data.json is beside the mount, not in it.

A volume no longer in the mount table (unmounted, its pod gone), or mounted again (another device number, type
or source), stops at the next rescan, and its series go with it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from .. import kubelet, supervise
from ..config import Config, TargetConfig
from ..discovery import Host, Mount
from ..logs import fields
from ..osthread import name_this_thread
from ..targets import ResolvedTarget
from .probes import ProbeSet

log = logging.getLogger(__name__)
POD_STOP_TIMEOUT_S = 1.0  # a pod volume's target has no workers: there is nothing to wait for


def pod_target(volume: kubelet.PodVolume) -> ResolvedTarget:
    """The target of a filesystem-only pod volume: its mount point as name and path, no probes, no descriptor."""
    config = TargetConfig(key=f"kubernetes[{volume.path}]", name=None, directory=volume.path, probes=())
    return ResolvedTarget(config, volume.path, "directory", volume.path, None, [], volume.mount, pod_volume=volume)


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
    ) -> None:
        self.host = host
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

    def found(self, config: Config) -> dict[tuple[str, int, int, str, str], kubelet.PodVolume]:
        """The filesystem-only pod volumes mounted now, by PodVolume.key."""
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
        volumes = self._read(directory, self.host.kubelet_mounts())
        drivers = {(v.pv, ""): v.driver for v in volumes if v.driver}
        self._drivers = {**drivers, **{(v.pv, v.pod_uid): v.driver for v in volumes if v.driver}}
        return {v.key: v for v in volumes if v.backing == kubelet.FILESYSTEM}

    def rescan(self, stopping: threading.Event | None = None) -> None:
        """Start a target for each filesystem-only pod volume that appeared; stop those that went."""
        config = self.config
        if config is None:
            return
        found = self.found(config) if config.kubernetes.enabled is not False else {}
        with self.lock:
            if self.config is not config or (stopping is not None and stopping.is_set()):
                return  # a reload came in between: the next rescan (now) has its configuration
            targets = self.probes.targets()
            configured = {t.path for t in targets if t.pod_volume is None}  # a directory target there is the config's
            found = {key: volume for key, volume in found.items() if volume.path not in configured}
            running = {t.pod_volume.key: t for t in targets if t.pod_volume is not None}
            gone = [t for key, t in running.items() if key not in found]
            for target in gone:
                if target.path in configured:
                    why = "now a configured target"
                elif target.path in {volume.path for volume in found.values()}:
                    why = "pod volume mounted again"
                else:
                    why = "pod volume unmounted"
                self._stop_targets([target], POD_STOP_TIMEOUT_S, why)
            new = [pod_target(volume) for key, volume in sorted(found.items()) if key not in running]
            for target in new:
                volume = target.pod_volume
                assert volume is not None
                log.info(
                    "pod volume %s of pod %s (%s, %s): mount check only",
                    volume.pv,
                    volume.pod_uid,
                    volume.driver or volume.plugin,
                    volume.mount.fstype,
                    extra=fields(target=target.name, path=target.path),
                )
            if new:
                self._start_targets(new)
