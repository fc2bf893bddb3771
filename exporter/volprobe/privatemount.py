"""A pod volume's directory opened through a private copy of its mount, so that the kubelet's unmount never
meets volprobe there.

An unmount (without -l) fails with EBUSY while any descriptor is open on that mount (or on a copy of it that the
unmount propagates to: a container's HostToContainer copy). A pod volume's probes hold nothing between probes,
but a request in flight holds its file for the milliseconds it takes, and an unmount in those milliseconds fails:
a pod then waits for the kubelet's retry, 500 ms later. open_tree(2) with OPEN_TREE_CLONE (Linux 5.2) gives a
detached copy of the mount, not attached anywhere, of the same filesystem: files opened through it are the
volume's own files, but they hold the copy, not the kubelet's mount, which unmounts at the first try whatever is
in flight. The copy is dissolved when its last descriptor closes (the directory's, then each file opened through
it), so once a probe ends nothing of the filesystem is held: a detach or an fsck after the unmount finds it
free, as it would without volprobe, at most a request later.

The copy is made nodev, nosuid and noexec (mount_setattr(2), Linux 5.12) before anything is opened through it: a
device node a tenant made in its volume cannot be opened there (EACCES), whatever the kubelet's mount allows.
Where mount_setattr is missing (ENOSYS) or refused, no copy is used, not even one without those options: private
copies count as unavailable (from then on, for the process), and the directory is opened at its path as without
open_tree.

It needs CAP_SYS_ADMIN (root in the chart when a rule asks for writes, as the NVMe statistics do); without it
(EPERM), or on a kernel without open_tree or mount_setattr (ENOSYS), the directory is opened at its path as
before, and that is exported as volprobe_capability_available{capability="private_mount"} 0 with the reason,
logged once."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading

PRIVATE_MOUNT = "private_mount"  # its name among capabilities.Capabilities

_NR_OPEN_TREE = 428  # the same number on every architecture (it came after the tables were unified)
_NR_MOUNT_SETATTR = 442  # likewise
_AT_FDCWD = -100
_OPEN_TREE_CLONE = 1
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_NO_AUTOMOUNT = 0x800
_FLAGS = _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_SYMLINK_NOFOLLOW | _AT_NO_AUTOMOUNT
_AT_EMPTY_PATH = 0x1000
_MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOUNT_ATTR_NOEXEC = 0x2, 0x4, 0x8
LOCKED_DOWN = _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NOEXEC  # what every copy is made
# What says the copy cannot be had at all, as opposed to a path that does not open.
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_UNAVAILABLE = (errno.EPERM, errno.ENOSYS, errno.EACCES)


class _MountAttr(ctypes.Structure):
    """struct mount_attr (MOUNT_ATTR_SIZE_VER0: 32 bytes)."""

    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_lock = threading.Lock()
_available: bool | None = None  # None: not tried yet
_why = ""


def _open_tree(path: str) -> int:
    """A descriptor (O_PATH) of a detached copy of the mount at `path` (not following a final symlink)."""
    fd = _libc.syscall(
        ctypes.c_long(_NR_OPEN_TREE), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(os.fsencode(path)), ctypes.c_uint(_FLAGS)
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


class _Unsafe(Exception):
    """A copy was had but could not be made nodev, nosuid and noexec: none is used from then on."""


def _mount_setattr(tree: int, attr_set: int) -> None:
    """mount_setattr(2) of the (detached) mount `tree` is the root of: `attr_set` set, nothing cleared."""
    attr = _MountAttr(attr_set, 0, 0, 0)
    result = _libc.syscall(
        ctypes.c_long(_NR_MOUNT_SETATTR),
        ctypes.c_int(tree),
        ctypes.c_char_p(b""),
        ctypes.c_uint(_AT_EMPTY_PATH),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _copy(path: str) -> int:
    """open_tree()'s copy of the mount at `path`, made nodev, nosuid and noexec; _Unsafe if it cannot be."""
    tree = _open_tree(path)
    try:
        _mount_setattr(tree, LOCKED_DOWN)
    except OSError as err:
        os.close(tree)
        raise _Unsafe(f"mount_setattr: {err.strerror}; pod volumes are opened at their path") from err
    return tree


def _give_up(why: str) -> None:
    global _available, _why
    with _lock:
        _available, _why = False, why


def available() -> tuple[bool, str]:
    """Whether private copies can be had here, and why not: tried once (on /), then known; a copy of a volume
    that could not be made nodev, nosuid and noexec (open_directory()) makes them unavailable from then on."""
    global _available, _why
    with _lock:
        if _available is None:
            try:
                os.close(_copy("/"))
            except OSError as err:
                _available, _why = False, f"open_tree: {err.strerror}; pod volumes are opened at their path"
            except _Unsafe as unsafe:
                _available, _why = False, str(unsafe)
            else:
                _available, _why = True, ""
        return _available, _why


def open_directory(path: str) -> int:
    """The directory at `path`, opened through a private copy of its mount (nodev, nosuid, noexec) where that
    can be had, else at the path; never through a final symlink. Raises what the open raises (NotADirectoryError
    for anything but a directory)."""
    if available()[0]:
        try:
            tree = _copy(path)
        except OSError as err:
            if err.errno not in _UNAVAILABLE:
                raise
        except _Unsafe as unsafe:
            _give_up(str(unsafe))
        else:
            try:
                if not stat.S_ISDIR(os.fstat(tree).st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory (a symbolic link?)", path)
                # A directory descriptor proper (getdents, as a leftover sweep needs), of the copy: the copy lives
                # on while it is open (dissolved, not attached anywhere), and goes when it closes.
                return os.open(".", _DIRECTORY, dir_fd=tree)
            finally:
                os.close(tree)
    return os.open(path, _DIRECTORY)
