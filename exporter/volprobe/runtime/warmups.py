"""Warm-ups: of the targets that ask for one, each in its own thread, and of discovered devices
(`discovery.warmup`), queued and run `max_concurrent` at a time. All resume from the volume's state, and a
volume whose state says it was warmed is not read again, whichever kernel name it now has."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from .. import supervise
from ..capabilities import Capabilities
from ..config import DiscoveryWarmupConfig, WarmupConfig
from ..state import StateStore
from ..targets import ResolvedTarget
from ..warmup import WarmupJob

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0
# A discovered device's warm-up that failed (its device vanished, say) stays exported this long after its
# device went, so that the dashboard and alerts see `failed`, and the log says why.
FAILED_RETENTION_S = 3600.0
# The state section that marks a discovered volume's warm-up as queued, before its own checkpoint exists: a
# restart finds the volume there "at start", and only this says it still owes a warm-up.
QUEUED_SECTION = "warmup_queued"


@dataclass
class _Entry:
    target: ResolvedTarget
    job: WarmupJob
    thread: threading.Thread | None = None  # None while queued
    discovered: bool = False
    spec: DiscoveryWarmupConfig | None = None
    gone: float = 0.0  # monotonic time its device went (kept to show `failed`); 0 while it is there
    finished: bool = False
    appeared: bool = False  # offered as a device that appeared after start (discovery.warmup)


class WarmupManager:
    """The warm-ups of the running targets; stopping one waits for its last checkpoint."""

    def __init__(self, store: StateStore, capabilities: Capabilities) -> None:
        self.store = store
        self.capabilities = capabilities  # whether the warm-ups could have the idle I/O class
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self._max_concurrent = 1

    def jobs(self) -> list[tuple[ResolvedTarget, WarmupJob]]:
        now = time.monotonic()
        with self._lock:
            self._entries = [e for e in self._entries if not e.gone or now - e.gone < FAILED_RETENTION_S]
            return [(e.target, e.job) for e in self._entries]

    def _job(self, target: ResolvedTarget, spec_warmup: WarmupConfig) -> WarmupJob:
        if self.store.directory is None:
            self._warn_unresumable(target)
        return WarmupJob.for_target(target, spec_warmup, self.store, capabilities=self.capabilities)

    @staticmethod
    def _warn_unresumable(target: ResolvedTarget) -> None:
        log.warning("warm-up of %s: no writable state directory, so it cannot resume after a restart", target.name)

    def _run(self, entry: _Entry) -> None:
        entry.thread = threading.Thread(target=self._body, args=(entry,), name=f"warm-up {entry.target.name}")
        entry.thread.daemon = True
        entry.thread.start()
        job, target = entry.job, entry.target
        log.info("warming up %s (%s) %s, state %s", target.name, target.path, job.identity.mode, job.state_path)

    def _body(self, entry: _Entry) -> None:
        """The warm-up's thread. A job's own errors end it `failed` (logged, exported, alerted on) and it is not
        retried: a failing or vanished device is not read again in a loop, and a reload, a re-attach or a restart
        resumes it from its checkpoint. Anything else that escapes is supervised (logged, counted, retried after
        a back-off), without running a finished job again."""

        def warm() -> None:
            if not entry.finished:
                progress = entry.job.run()
                entry.finished = True
                if progress.state == "done" and entry.discovered:
                    log.info("warm-up of discovered %s (%s) is done", entry.target.name, entry.job.identity.device)
            if entry.discovered:
                self._start_queued()  # the next queued warm-up takes this one's place

        # The job's stop event: stopping a warm-up also ends a back-off at once.
        supervise.run("warmup", warm, entry.job._stop, f"warm-up of {entry.target.name}")

    def start(self, targets: list[ResolvedTarget]) -> None:
        """The warm-ups the targets' configuration asks for, at once."""
        for target in targets:
            if target.config.warmup is None:
                continue
            entry = _Entry(target, self._job(target, target.config.warmup))
            with self._lock:
                self._entries.append(entry)
            self._run(entry)

    # -- discovered devices -------------------------------------------------------------------------------

    def offer(self, targets: list[ResolvedTarget], spec: DiscoveryWarmupConfig, appeared: bool) -> None:
        """Discovered devices, for `discovery.warmup`: queue those the policy selects. `appeared`: the device
        came after the exporter started. With policy "new", one that was there at start is warmed only if its
        state holds a warm-up a restart interrupted (begun, or queued when it appeared), and shown `done` if
        this very warm-up (same volume, size and block size) finished before."""
        for target in targets:
            with self._lock:
                if any(e.target is target for e in self._entries):
                    continue
            job = WarmupJob.for_target(target, spec.warmup, self.store, capabilities=self.capabilities)
            phase = job.saved_phase()
            if spec.policy == "new" and not appeared and not (phase or self._queued_before(target)):
                continue
            if self.store.directory is None:
                self._warn_unresumable(target)
            job.progress.state = "queued"
            entry = _Entry(target, job, discovered=True, spec=spec, appeared=appeared)
            with self._lock:
                # A volume seen again under its old name (re-attached) replaces its retained entry.
                self._entries = [e for e in self._entries if not (e.gone and e.target.name == target.name)]
                self._entries.append(entry)
                self._max_concurrent = spec.max_concurrent
            if appeared and phase != "done" and self.store.directory is not None:
                self.store.volume(target.block).put(QUEUED_SECTION, {"since": round(time.time(), 3)})
            log.info("discovered %s: warm-up queued (%s)", target.name, job.identity.device)
        self._start_queued()

    def _queued_before(self, target: ResolvedTarget) -> bool:
        """Queued when it appeared, before a restart, and not begun since (so no checkpoint of its own)."""
        return self.store.directory is not None and self.store.volume(target.block).get(QUEUED_SECTION) is not None

    def _start_queued(self) -> None:
        with self._lock:
            running = sum(1 for e in self._entries if e.discovered and e.thread is not None and not e.finished)
            ready = [e for e in self._entries if e.discovered and e.thread is None and not e.gone]
            chosen = ready[: max(0, self._max_concurrent - running)]
            for entry in chosen:
                entry.job.progress.state = "pending"
                entry.thread = threading.Thread()  # claimed: not chosen twice
        for entry in chosen:
            self._run(entry)

    def discovered_spec_changed(self, spec: DiscoveryWarmupConfig | None) -> list[tuple[ResolvedTarget, bool]]:
        """After a reload: stop the discovered warm-ups whose settings changed (they resume from their
        checkpoint when offered again); returns those targets, with whether each had appeared after start, to
        offer again under the new settings (a queued one, with no checkpoint yet, is not lost)."""
        with self._lock:
            changed = [e for e in self._entries if e.discovered and not e.gone and e.spec != spec]
        self._stop_entries(changed, "discovery.warmup changed")
        with self._lock:
            self._entries = [e for e in self._entries if e not in changed]
            if spec is not None:
                self._max_concurrent = spec.max_concurrent
        return [(e.target, e.appeared) for e in changed]

    # -- stopping -------------------------------------------------------------------------------------------

    def stop(self, targets: list[ResolvedTarget], timeout: float = STOP_TIMEOUT_S, why: str = "") -> None:
        """Stop the targets' warm-ups and wait for them: each saves its checkpoint as it ends, and a write-mode
        warm-up holds its device (O_EXCL) until then. A discovered device's unfinished warm-up whose device
        went ends `failed`, with the reason, and stays exported for FAILED_RETENTION_S."""
        ids = {id(t) for t in targets}
        with self._lock:
            stopping = [e for e in self._entries if id(e.target) in ids and not e.gone]
        self._stop_entries(stopping, why, timeout)
        vanished = why.startswith(("no longer present", "the device was replaced"))
        now = time.monotonic()
        with self._lock:
            for entry in stopping:
                progress = entry.job.progress
                if entry.discovered and vanished and progress.state != "done":
                    if progress.state != "failed":
                        progress.state, progress.error = "failed", f"device gone: {why}"
                    log.warning("warm-up of %s failed: %s", entry.target.name, progress.error)
                    entry.gone = now
            self._entries = [e for e in self._entries if id(e.target) not in ids or e.gone]
        self._start_queued()

    @staticmethod
    def _stop_entries(entries: list[_Entry], why: str, timeout: float = STOP_TIMEOUT_S) -> None:
        for entry in entries:
            entry.job.stop()
        deadline = time.monotonic() + timeout
        for entry in entries:
            if entry.thread is None or not entry.thread.ident:
                continue
            entry.thread.join(max(0.0, deadline - time.monotonic()))
            if entry.thread.is_alive():
                log.warning(
                    "warm-up of %s is still blocked in the kernel; it ends when its request returns", entry.job.path
                )

    def stop_all(self, timeout: float = STOP_TIMEOUT_S) -> None:
        with self._lock:
            entries, self._entries = list(self._entries), []
        self._stop_entries(entries, "exporter stopping", timeout)
