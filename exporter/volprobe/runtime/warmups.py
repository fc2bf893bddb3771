"""Warm-ups of the targets that ask for one, each in its own thread, resumable from the state directory."""

from __future__ import annotations

import logging
import os
import threading

from ..state import StateStore
from ..targets import ResolvedTarget
from ..warmup import WarmupJob

log = logging.getLogger(__name__)


def state_directory(configured: str | None) -> str | None:
    """Where state goes: the configured directory if it exists (writable or not: a read-only one still
    resumes what it holds, and the state's status says it cannot be written); else systemd's $STATE_DIRECTORY
    or /var/lib/volprobe if writable; else none."""
    if configured:
        if os.path.isdir(configured):
            return configured
        log.warning("state_directory %s does not exist: nothing is remembered across restarts", configured)
        return None
    for candidate in (os.environ.get("STATE_DIRECTORY", "").split(":")[0], "/var/lib/volprobe"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return None


class WarmupManager:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._jobs: list[tuple[ResolvedTarget, WarmupJob]] = []
        self._lock = threading.Lock()

    def jobs(self) -> list[tuple[ResolvedTarget, WarmupJob]]:
        with self._lock:
            return list(self._jobs)

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
            with self._lock:
                self._jobs.append((target, job))
            threading.Thread(target=job.run, name=f"warm-up {target.name}", daemon=True).start()
            log.info("warming up %s (%s) %s, state %s", target.name, target.path, spec.mode, job.state_path or "none")

    def stop(self, targets: list[ResolvedTarget]) -> None:
        """Stop the targets' warm-ups; each saves its checkpoint as it ends."""
        ids = {id(t) for t in targets}
        with self._lock:
            stopping = [job for t, job in self._jobs if id(t) in ids]
            self._jobs = [(t, job) for t, job in self._jobs if id(t) not in ids]
        for job in stopping:
            job.stop()

    def stop_all(self) -> None:
        self.stop([t for t, _ in self.jobs()])
