"""A root tenant of a volume (issue 52): what it can put at a name volprobe uses, with nothing but its own volume
and the capabilities a pod's root has by default (MKNOD included): a block device node of a disk of the node, a
character device node, a hard link to a file outside its volume, a symlink, a FIFO, a socket or a directory.

`Victims` holds what such a plant would reach, and a watch (inotify, on the planted inodes and the victims) that
tells whether anything opened or wrote them, by any path: /proc/self/fd included."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .harness import sha256_of

KINDS = ("block device", "character device", "hard link", "symlink", "FIFO", "socket", "directory")
# Special files: opening one at all can act on what it stands for (a tape rewinds, a watchdog arms), so none may
# ever be opened. A hard link's or a symlink's victim may be looked at, never written.
SPECIAL = ("block device", "character device", "FIFO", "socket")

_IN_ACCESS, _IN_MODIFY, _IN_OPEN = 0x1, 0x2, 0x20
_IN_NONBLOCK_CLOEXEC = os.O_NONBLOCK | os.O_CLOEXEC
_libc = ctypes.CDLL(None, use_errno=True)


class Watch:
    """inotify watches on inodes; events() gives each watched path's event masks so far."""

    def __init__(self) -> None:
        self.fd = _libc.inotify_init1(_IN_NONBLOCK_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.paths: dict[int, str] = {}
        self.seen: dict[str, int] = {}

    def add(self, path: Path | str, mask: int = _IN_OPEN | _IN_MODIFY) -> None:
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(str(path)), mask | 0x20000000)  # IN_DONT_FOLLOW
        assert wd >= 0, f"{path}: {os.strerror(ctypes.get_errno())}"
        self.paths[wd] = str(path)

    def events(self) -> dict[str, int]:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return dict(self.seen)
            at = 0
            while at < len(data):
                wd, mask, _, length = struct.unpack_from("iIII", data, at)
                at += 16 + length
                if wd in self.paths and mask & (_IN_OPEN | _IN_MODIFY | _IN_ACCESS):
                    self.seen[self.paths[wd]] = self.seen.get(self.paths[wd], 0) | mask

    def opened(self) -> list[str]:
        return sorted(path for path, mask in self.events().items() if mask & _IN_OPEN)

    def modified(self) -> list[str]:
        return sorted(path for path, mask in self.events().items() if mask & _IN_MODIFY)

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class Victims:
    """What the node stands to lose: `device`, a loop device of the node (its number is what a block device node
    planted in a volume names); `outside`, a file on the volume's filesystem but outside the volume (a hard link's
    victim, as on a hostPath or a local PV that is a subdirectory); `elsewhere`, a file anywhere (a symlink's)."""

    device: str
    outside: Path
    elsewhere: Path
    watch: Watch = field(default_factory=Watch)
    specials: list[Path] = field(default_factory=list)  # every special file planted
    sums: dict[str, str] = field(default_factory=dict)

    outsides: list[Path] = field(default_factory=list)  # `outside` and one more for each other filesystem

    def __post_init__(self) -> None:
        for path in (self.device, self.elsewhere):
            self.sums[str(path)] = sha256_of(str(path))
        self.watch.add(self.elsewhere, _IN_MODIFY)
        self.add_outside(self.outside)

    def add_outside(self, path: Path) -> None:
        """Another file outside the volumes, on another filesystem: hard links planted there link to it."""
        self.outsides.append(path)
        self.sums[str(path)] = sha256_of(str(path))
        self.watch.add(path, _IN_MODIFY)

    def _outside_for(self, path: Path) -> Path:
        device = os.stat(path.parent).st_dev
        return next(p for p in self.outsides if os.stat(p).st_dev == device)

    def plant(self, path: Path, kind: str) -> None:
        """Put a file of `kind` at `path`, as the tenant would (root in its pod)."""
        if kind == "block device":
            os.mknod(path, stat.S_IFBLK | 0o600, os.stat(self.device).st_rdev)
        elif kind == "character device":
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's: opening it is what is watched
        elif kind == "hard link":
            os.link(self._outside_for(path), path)
        elif kind == "symlink":
            os.symlink(self.elsewhere, path)
        elif kind == "FIFO":
            os.mkfifo(path, 0o600)
        elif kind == "socket":
            # Bound through its directory's descriptor: a socket's path is limited to 107 bytes, the test's are not.
            directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.bind(f"/proc/self/fd/{directory}/{path.name}")
            finally:
                os.close(directory)
        elif kind == "directory":
            os.mkdir(path, 0o700)
        else:
            raise ValueError(kind)
        if kind in SPECIAL:
            self.watch.add(path, _IN_OPEN | _IN_MODIFY)
            self.specials.append(path)

    def try_plant(self, path: Path, kind: str) -> bool:
        """plant(), unless the name is taken by now (a race the tenant lost)."""
        try:
            self.plant(path, kind)
        except OSError as err:  # EEXIST (EADDRINUSE for a socket): taken; ENOENT: its directory went meanwhile
            if err.errno in (errno.EEXIST, errno.EADDRINUSE, errno.ENOENT):
                return False
            raise
        return True

    def assert_untouched(self) -> None:
        """No victim changed, no special file was ever opened, no victim was ever written to, by any path."""
        assert self.watch.opened() == [], "special files planted by the tenant were opened"
        assert self.watch.modified() == [], "files outside the volume were written"
        for path, before in self.sums.items():
            assert sha256_of(path) == before, f"{path} changed"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.watch.close()
