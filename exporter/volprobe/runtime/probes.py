"""The targets being probed and their workers: scrapes read this set, reloads and discovery change it."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

from .. import targets as targets_mod
from ..config import PROBE_FILE_NAME, ProbeConfig
from ..discovery import Host
from ..probe import IOTarget, ProbeWorker
from ..state import ProbeCursor, StateStore
from ..stats import ProbeStats
from ..targets import ResolvedTarget

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0


@dataclass
class RunningProbe:
    target: ResolvedTarget
    spec: ProbeConfig
    stats: ProbeStats
    worker: ProbeWorker

    @property
    def source(self) -> str:
        """What the probe's requests go to: "probe_file" or "device" (or the op's own: a commit log...)."""
        if self.spec.kind.file:
            return self.spec.kind.source
        io_path = self.worker.probe.io.path
        return "probe_file" if self.target.probe_file and io_path == self.target.probe_file else "device"

    @property
    def labels(self) -> dict[str, str]:
        return {"target": self.target.name, "device": self.target.device_name, "op": self.spec.op}


class ProbeSet:
    """Owns one worker per probe of each target. Reads take a short lock and return copies."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._targets: list[ResolvedTarget] = []
        self._running: list[RunningProbe] = []
        self._by_disk: dict[str, list[RunningProbe]] = {}  # the throttle sampler asks every second, per disk
        self._disks: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def targets(self) -> list[ResolvedTarget]:
        with self._lock:
            return list(self._targets)

    def running(self) -> list[RunningProbe]:
        with self._lock:
            return list(self._running)

    def on_disk(self, disk: str) -> list[RunningProbe]:
        """The probes whose I/O lands on a whole disk (directly or through a partition, dm or md device)."""
        with self._lock:
            return list(self._by_disk.get(disk, ()))

    def disks(self) -> frozenset[str]:
        """The whole disks beneath the running probes."""
        return self._disks

    def completed_on(self, disk: str) -> int:
        """The requests the probes on a disk have completed."""
        with self._lock:
            return sum(running.worker.completed for running in self._by_disk.get(disk, ()))

    def devices(self) -> set[str]:
        """Each probed device and the whole disks beneath it."""
        names: set[str] = set()
        for target in self.targets():
            if target.device is not None:  # a network filesystem has no diskstats
                names.add(target.device.name)
            names.update(target.disks)
        return names

    def add(
        self, resolved: list[ResolvedTarget], window: float, buckets: tuple[float, ...], store: StateStore
    ) -> list[RunningProbe]:
        """Start a worker for every probe of the (prepared) targets; their fresh offsets carry on from the
        volume's state in `store`."""
        return self._start(resolved, [(t, p) for t in resolved for p in t.probes], window, buckets, store)

    def add_probes(
        self,
        target: ResolvedTarget,
        probes: list[ProbeConfig],
        window: float,
        buckets: tuple[float, ...],
        store: StateStore,
    ) -> list[RunningProbe]:
        """Start workers for `probes` (prepared: targets.prepare_probes) on a target that runs already."""
        return self._start([], [(target, p) for p in probes], window, buckets, store)

    def _start(
        self,
        resolved: list[ResolvedTarget],
        probes: list[tuple[ResolvedTarget, ProbeConfig]],
        window: float,
        buckets: tuple[float, ...],
        store: StateStore,
    ) -> list[RunningProbe]:
        """Add the targets `resolved` and start a worker for each of `probes`."""
        new = []
        for target, spec in probes:
            if target.pending:  # a pending target waits for its mount
                continue
            stats = ProbeStats(window, buckets)
            io = targets_mod.io_target(self.host, target, spec)
            cursor = _cursor(store, target, spec, io)
            worker = ProbeWorker(
                spec,
                io,
                stats,
                name=target.name,
                device=target.device_name or "",
                fd=target.fds.pop(spec.op, None),
                cursor=cursor,
            )
            new.append(RunningProbe(target, spec, stats, worker))
        with self._lock:
            self._targets.extend(resolved)
            self._running.extend(new)
            self._index()
        for running in new:
            running.worker.start()
            spec = running.spec
            log.info(
                "probing %s (%s, %s) with %s %dB every %gs",
                running.target.name,
                running.target.path,
                running.target.device_name or "no block device",
                spec.op,
                spec.block_size,
                spec.interval,
            )
        return new

    def rekey(self, target: ResolvedTarget) -> None:
        """After a reload kept the target: its probes take their new keys (their place in the new file)."""
        by_op = {spec.op: spec for spec in target.probes}
        with self._lock:
            for running in self._running:
                if running.target is target and running.spec.op in by_op:
                    running.spec = by_op[running.spec.op]

    def remove_probes(
        self,
        target: ResolvedTarget,
        why: dict[str, str],
        timeout: float = STOP_TIMEOUT_S,
        hung: frozenset[str] = frozenset(),
    ) -> None:
        """Stop the target's probes whose ops `why` names (a reload changed or removed them; it says how), and
        drop them, so their series go with the next scrape; the target and its other probes run on."""
        with self._lock:
            stopping = [p for p in self._running if p.target is target and p.spec.op in why]
            self._running = [p for p in self._running if not (p.target is target and p.spec.op in why)]
            self._index()
        for name in _stop(stopping, timeout, hung):
            log.warning("probe %s is still blocked in the kernel; it exits when its request returns", name)
        for running in stopping:
            log.info(
                "stopped probing %s (%s) with %s: %s", target.name, target.path, running.spec.op, why[running.spec.op]
            )

    def remove(
        self,
        gone: list[ResolvedTarget],
        timeout: float = STOP_TIMEOUT_S,
        why: str = "",
        hung: frozenset[str] = frozenset(),
    ) -> None:
        """Stop the targets' workers and drop them, so their series go with the next scrape. Directories in `hung`
        (their mount does not answer) are not waited for, and are let go of in a thread of their own."""
        ids = {id(t) for t in gone}
        with self._lock:
            stopping = [p for p in self._running if id(p.target) in ids]
            self._running = [p for p in self._running if id(p.target) not in ids]
            self._targets = [t for t in self._targets if id(t) not in ids]
            self._index()
        stuck = _stop(stopping, timeout, hung)
        for name in stuck:
            log.warning("probe %s is still blocked in the kernel; it exits when its request returns", name)
        directories = [t for t in gone if t.kind == "directory"]
        targets_mod.close([t for t in gone if t.kind != "directory"])
        if directories:  # let go of their directories, where a close may block
            threading.Thread(target=targets_mod.close, args=(directories,), name="close targets", daemon=True).start()
        for target in gone:
            log.info("stopped probing %s (%s)%s", target.name, target.path, f": {why}" if why else "")

    def _index(self) -> None:
        """Rebuild the probes by disk (with the lock held), in the order they run."""
        self._by_disk = {}
        for running in self._running:
            for disk in running.target.disks:
                self._by_disk.setdefault(disk, []).append(running)
        self._disks = frozenset(self._by_disk)

    def stop(self, timeout: float = STOP_TIMEOUT_S, hung: frozenset[str] = frozenset()) -> list[str]:
        """Stop every worker; return the names of those still stuck in the kernel after `timeout`."""
        return _stop(self.running(), timeout, hung)


def _cursor(store: StateStore, target: ResolvedTarget, spec: ProbeConfig, io: IOTarget) -> ProbeCursor | None:
    """The probe's place in the volume's permutation of blocks. A probe file is known by its inode too: a new
    file has new blocks, none of them touched."""
    if store.directory is None or spec.kind.offsets == "none" or target.device is None:
        # No state for a metadata sequence (no offsets), nor for a directory without a volume (state is kept
        # per volume): it starts fresh offsets at each start.
        return None
    where = "device"
    in_file = spec.kind.file or (target.probe_file and io.path == target.probe_file)
    if in_file:  # a commit log, or the probe file
        pin = target.file_pins.get(spec.kind.file or PROBE_FILE_NAME)
        if pin is None:
            return None
        where = f"file:{pin.inode}"  # the inode prepare() checked through its descriptor
    name = f"{spec.op}:{where}:{spec.block_size}:{io.region_start}-{io.region_end}"
    # Reserve about ten minutes of fresh offsets at a time (one small write per ten minutes per probe), but no
    # more than 1/64 of the blocks: a kill -9 skips at most that.
    nblocks = (io.region_end - io.region_start) // spec.block_size
    reserve = min(max(16, int(600 / spec.interval)), max(1, nblocks // 64))
    return ProbeCursor(store.volume(target.device), name, random.getrandbits(64), reserve)


def _stop(probes: list[RunningProbe], timeout: float, hung: frozenset[str] = frozenset()) -> list[str]:
    """Stop the workers, wait up to `timeout` for them (not at all for those of the directories in `hung`:
    their mount does not answer), close what they held. A directory target's descriptors are closed in a
    thread of their own: a close on a hung network filesystem or FUSE mount blocks (it flushes)."""
    for running in probes:
        running.worker.stop()
    stuck = []
    deadline = time.monotonic() + timeout
    later = []
    for running in probes:
        wait = 0.0 if running.target.path in hung else max(0.0, deadline - time.monotonic())
        if not running.worker.join(wait):
            stuck.append(f"{running.target.name} {running.spec.op}")
        if running.target.kind == "directory":
            later.append(running.worker.close)
        else:
            running.worker.close()
    if later:
        threading.Thread(target=lambda: [close() for close in later], name="close probes", daemon=True).start()
    return stuck
