"""Warm-ups of the targets that ask for one, each in its own thread, resumable from the volume's state."""

from __future__ import annotations

import logging
import threading
import time

from ..state import StateStore
from ..targets import ResolvedTarget
from ..warmup import WarmupJob

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0


class WarmupManager:
    """The warm-ups of the running targets, one thread each; stopping one waits for its last checkpoint."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._jobs: list[tuple[ResolvedTarget, WarmupJob, threading.Thread]] = []
        self._lock = threading.Lock()

    def jobs(self) -> list[tuple[ResolvedTarget, WarmupJob]]:
        with self._lock:
            return [(target, job) for target, job, _ in self._jobs]

    def start(self, targets: list[ResolvedTarget]) -> None:
        for target in targets:
            spec = target.config.warmup
            if spec is None:
                continue
            if self.store.directory is None:
                log.warning(
                    "warm-up of %s: no writable state directory, so it cannot resume after a restart", target.name
                )
            job = WarmupJob.for_target(target, spec, self.store)
            thread = threading.Thread(target=job.run, name=f"warm-up {target.name}", daemon=True)
            with self._lock:
                self._jobs.append((target, job, thread))
            thread.start()
            log.info("warming up %s (%s) %s, state %s", target.name, target.path, spec.mode, job.state_path or "none")

    def stop(self, targets: list[ResolvedTarget], timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the targets' warm-ups and wait for them: each saves its checkpoint as it ends, and a write-mode
        warm-up holds its device (O_EXCL) until then."""
        ids = {id(t) for t in targets}
        with self._lock:
            stopping = [(job, thread) for t, job, thread in self._jobs if id(t) in ids]
            self._jobs = [entry for entry in self._jobs if id(entry[0]) not in ids]
        for job, _ in stopping:
            job.stop()
        deadline = time.monotonic() + timeout
        for job, thread in stopping:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("warm-up of %s is still blocked in the kernel; it ends when its request returns", job.path)

    def stop_all(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self.stop([t for t, _ in self.jobs()], timeout)
