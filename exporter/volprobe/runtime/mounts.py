"""Whether each directory target's mount answers (`mount_check`): the mount watch.

Every `interval` each directory target's directory is asked (statfs, then a stat: of the directory volprobe
holds, through its descriptor, never of the name, which a symlink or a mount put over it would answer for) in a
thread of its own (mountcheck.Checks: at most one outstanding per mount, which the targets on it share, so a hung
server costs one thread, not one per check or per directory). A mount is responsive while its last check
answered without error and no check has been outstanding longer than `timeout`. The watch itself never touches a
filesystem, so neither do scrapes, which read its snapshot; a directory that did not answer when its target was
resolved (`pending`) is handed to `resume` once it answers.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import metrics, mountcheck, supervise
from ..config import MountCheckConfig
from ..logs import fields
from ..targets import ResolvedTarget
from ..view import MountReading
from .probes import ProbeSet

log = logging.getLogger(__name__)


@dataclass
class _Mount:
    answered_at: float = 0.0  # Unix time of the last answer without error; 0: none yet
    failed: str = ""  # the last check's error, "" if it answered
    hung_since: float | None = None  # the outstanding check said hung in the log (once per hang)
    counts: list[int] = field(default_factory=lambda: [0] * (len(metrics.MOUNT_CHECK_BUCKETS) + 1))  # not cumulative
    seconds: float = 0.0  # the checks' durations, summed

    def took(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(metrics.MOUNT_CHECK_BUCKETS, seconds)] += 1
        self.seconds += seconds

    def cumulative(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.counts))


class MountWatch:
    def __init__(
        self,
        probes: ProbeSet,
        checks: mountcheck.Checks,
        resume: Callable[[ResolvedTarget], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probes = probes
        self.checks = checks
        self.resume = resume  # starts a pending target once its mount answers
        self.clock = clock
        self.config = MountCheckConfig()
        self._mounts: dict[str, _Mount] = {}  # by directory; their checks' threads by mount (_key)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def apply(self, config: MountCheckConfig) -> None:
        self.config = config
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mount watch", daemon=True)
            self._thread.start()
        self._wake.set()  # check new targets now

    def stop(self) -> None:
        """Never waits on a check: the watch itself does not touch a filesystem, its checks' threads are left."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        supervise.run("mount", self._loop, self._stopping, "mount watch")

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._round()
            self._wake.wait(self.config.interval)
            self._wake.clear()

    def _round(self) -> None:
        directories = [t for t in self.probes.targets() if t.kind == "directory"]
        self.checks.share({t.path: _key(t) for t in directories if t.mount is not None})
        with self._lock:
            for gone in set(self._mounts) - {t.path for t in directories}:
                del self._mounts[gone]
        by_mount: dict[str, list[ResolvedTarget]] = {}
        for target in directories:
            by_mount.setdefault(_key(target), []).append(target)
            state = self._state(target.path)
            since = self._overdue(_key(target), self.clock())
            if since is not None and state.hung_since != since:
                state.hung_since = since
                log.warning(
                    "%s: the mount of %s has not answered for %.0fs",
                    target.name,
                    target.path,
                    self.clock() - since,
                    extra=fields(target=target.name, path=target.path),
                )
            if target.pending and state.answered_at and not state.failed:
                self.resume(target)  # resolves it again, with a deadline; starts it if that answers
        for key, targets in by_mount.items():  # nothing started for a mount whose last check is still outstanding
            self.checks.submit(
                key, functools.partial(self._check, key, targets), mountcheck.log_failure(f"mount check of {key}")
            )

    def _check(self, key: str, targets: list[ResolvedTarget]) -> None:
        """One mount's check, in its thread: each of its directories asked in turn, each answer recorded. A
        directory that hangs holds the rest, so the whole mount shows hung: one thread a mount is the price. The
        directory asked is the one the target holds; a pending target's, not found yet, by its name."""
        for path, target in {t.path: t for t in targets}.items():
            error: Exception | None = None
            started = time.monotonic()
            try:
                if target.pod_volume is not None:  # nothing held: opened, asked and closed again
                    mountcheck.answer_mount(path, target.pod_volume.mount.major, target.pod_volume.mount.minor)
                elif target.probe_dir is not None:
                    target.probe_dir.answer()
                else:
                    mountcheck.answer(path)
            except Exception as err:  # an answer too: recorded as the directory's failure
                error = err
            self._done(path, error, time.monotonic() - started)
            self.checks.renew(key)  # the next directory's deadline is its own

    def _state(self, path: str) -> _Mount:
        with self._lock:
            return self._mounts.setdefault(path, _Mount())

    def _done(self, path: str, error: BaseException | None, seconds: float) -> None:
        with self._lock:
            state = self._mounts.get(path)
            if state is None:
                return
            state.took(seconds)
            previous = state.failed
            if error is None:
                state.answered_at, state.failed = time.time(), ""
            else:
                state.failed = str(error) or type(error).__name__
        if error is not None and state.failed != previous:
            log.warning("mount check of %s failed: %s", path, state.failed, extra=fields(path=path))
        elif error is None and previous:
            log.info("mount check of %s answers again", path)

    def _overdue(self, key: str, now: float) -> float | None:
        """When the outstanding check of mount `key` started, if that is longer ago than the timeout: hung."""
        since = self.checks.outstanding_since(key)
        return since if since is not None and now - since > self.config.timeout else None

    def hung(self) -> frozenset[str]:
        """The directories whose check has been outstanding longer than the timeout."""
        now = self.clock()
        return frozenset(
            t.path for t in self.probes.targets() if t.kind == "directory" and self._overdue(_key(t), now) is not None
        )

    def readings(self) -> list[MountReading]:
        now = self.clock()
        result = []
        for target in self.probes.targets():
            if target.kind != "directory":
                continue
            with self._lock:
                state = self._mounts.get(target.path, _Mount())
                counts, seconds = state.cumulative(), state.seconds
            hung = self._overdue(_key(target), now) is not None
            responsive = bool(state.answered_at) and not state.failed and not hung and not target.pending
            reading = MountReading(target.name, target.device_name, responsive, state.answered_at, counts, seconds)
            result.append(reading)
        return result


def _key(target: ResolvedTarget) -> str:
    """The mount a target's checks are for: its mount point (as resolved), shared by the targets on that mount.
    While its mount is not known yet (pending: it did not answer when resolved), its directory: each such
    directory holds a thread of its own until its mount answers."""
    return target.mount.mount_point if target.mount is not None else target.path
