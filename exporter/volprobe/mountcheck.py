"""Calls into a filesystem that may hang (a dead NFS server, a stalled FUSE daemon), made with a deadline.

A thread blocked in such a call cannot be interrupted or joined: it returns when the server does, maybe never.
So each call runs in a daemon thread of its own, the caller waits for it up to a deadline, and at most one call
per key (a mount, or a directory not resolved yet) is outstanding: while one is, the next caller waits for that
one's deadline and then gives up (Hung) without starting another, so a hung mount costs one thread, never one
per check.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from . import privatemount
from .osthread import name_this_thread

T = TypeVar("T")

log = logging.getLogger(__name__)

# How long `--target PATH` waits for its path's stat. A device node answers at once (devtmpfs); a path that
# does not is on a hung mount, so it is a directory whichever the deadline: this only bounds the wait at start.
CLASSIFY_TIMEOUT_S = 1.0
# What a stat of a path says of the path itself, not of its filesystem.
PATH_ERRORS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EACCES, errno.EPERM})


class Hung(Exception):
    """The filesystem did not answer within the deadline."""


class Checks:
    """At most one outstanding call per key, each in a daemon thread of its own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._outstanding: dict[str, float] = {}  # key -> when its call started
        self._shared: dict[str, str] = {}  # a directory's key -> its mount's, once known (share())
        self._changed = threading.Condition()

    def share(self, mounts: dict[str, str]) -> None:
        """The mount of each directory key, as far as known: a call for the directory is then a call for its mount,
        so resolving a directory on a mount whose check is outstanding waits on that check, not on a thread of its
        own (a reload with dozens of directories on one hung server gives up once, not dozens of times)."""
        with self._changed:
            self._shared = dict(mounts)

    def outstanding_since(self, key: str) -> float | None:
        with self._changed:
            return self._outstanding.get(self._shared.get(key, key))

    def outstanding(self) -> int:
        with self._changed:
            return len(self._outstanding)

    def renew(self, key: str) -> None:
        """The outstanding call of `key` made progress: its deadline counts from now (a call that asks several
        directories in turn is late only if one of them is)."""
        with self._changed:
            key = self._shared.get(key, key)
            if key in self._outstanding:
                self._outstanding[key] = self._clock()

    def submit(
        self,
        key: str,
        function: Callable[[], object],
        done: Callable[[BaseException | None], None],
        name: str = "mount check",
    ) -> bool:
        """Start `function` in a thread named `name` (for `top -H`) unless a call of `key` is outstanding (False
        then); `done` gets its error (None on success) from that thread once it returns."""
        with self._changed:
            key = self._shared.get(key, key)
            if key in self._outstanding:
                return False
            self._outstanding[key] = self._clock()

        def run() -> None:
            name_this_thread(name)  # `top -H` then counts what a hung mount holds
            error: BaseException | None = None
            try:
                function()
            except BaseException as err:  # reported to `done`, whatever it is: the thread must end quietly
                error = err
            finally:
                with self._changed:
                    self._outstanding.pop(key, None)
                    self._changed.notify_all()
            done(error)

        threading.Thread(target=run, name=f"{name} {key}", daemon=True).start()
        return True

    def call(self, key: str, function: Callable[[], T], timeout: float, name: str = "mount check") -> T:
        """`function()`'s result, or its exception; Hung if it (or the call of `key` already outstanding) does not
        return within `timeout` of its start. The caller never waits longer than about twice `timeout`."""
        with self._changed:
            key = self._shared.get(key, key)
            since = self._outstanding.get(key)
            while since is not None:
                left = since + timeout - self._clock()
                if left <= 0:
                    raise Hung(f"a call started {self._clock() - since:.1f}s ago has not returned")
                self._changed.wait(left)
                since = self._outstanding.get(key)
        result: list[T] = []
        finished = threading.Event()
        errors: list[BaseException] = []

        def call() -> None:
            result.append(function())

        def done(error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)
            finished.set()

        if not self.submit(key, call, done, name):  # another caller started one in between: wait for it instead
            return self.call(key, function, timeout, name)
        if not finished.wait(timeout):
            raise Hung(f"no answer within {timeout:g}s")
        if errors:
            raise errors[0]
        return result[0]


def log_failure(what: str) -> Callable[[BaseException | None], None]:
    """A `done` for submit() whose call records its own outcome: what it raised is logged, so that no thread of a
    call ends silently."""

    def done(error: BaseException | None) -> None:
        if error is not None:
            log.error("%s failed: %r", what, error)

    return done


def answer(path: str) -> None:
    """What a mount check asks of a directory: statfs (the filesystem, from its server) and a stat (the
    directory's attributes, revalidated on network filesystems). Raises what they raise."""
    os.statvfs(path)
    os.stat(path)


def is_directory(path: str, timeout: float = CLASSIFY_TIMEOUT_S) -> bool:
    """Whether `--target PATH` names a directory, asked with a deadline. A path on a hung mount (an NFS server
    gone) is a directory: it becomes a directory target that waits, pending, until its mount answers, and the
    start never blocks on it. The stat may stay outstanding in a daemon thread of its own until then."""
    try:
        mode = Checks().call(path, lambda: os.stat(path).st_mode, timeout)
    except Hung:
        log.warning(
            "%s: no answer to a stat within %gs: a directory on a hung mount, probed once it answers", path, timeout
        )
        return True
    except OSError as err:
        if err.errno in PATH_ERRORS:
            return False  # a device target, then: its checks name what is wrong with the path
        # A mount that answers with an error (a FUSE daemon gone, ENOTCONN; a stale NFS handle): a directory
        # whose mount is broken, as a hung one is.
        log.warning("%s: %s: a directory on a broken mount, probed once it answers", path, os.strerror(err.errno or 0))
        return True
    return stat.S_ISDIR(mode)


def answer_mount(path: str, major: int, minor: int) -> None:
    """What a mount check asks of a mount it holds nothing of (a pod volume: the kubelet must be able to unmount
    it at any time): the directory opened (O_NOFOLLOW; through a private copy of the mount where one can be
    had, volprobe.privatemount, so that a check in flight, even one hung, is not on the kubelet's mount), checked
    on the descriptor to be that mount's (its device number; a path the volume was unmounted from shows the
    filesystem beneath), its fstatvfs, and closed again."""
    fd = privatemount.open_directory(path)
    try:
        st = os.fstat(fd)
        if (os.major(st.st_dev), os.minor(st.st_dev)) != (major, minor):
            raise OSError(errno.ENODEV, f"no longer the mount of {major}:{minor}", path)
        os.fstatvfs(fd)
    finally:
        os.close(fd)
