"""The directory of a target's metadata probe: a subdirectory of the target directory that volprobe makes and
owns, in which each sequence creates, writes, renames and unlinks its two names (timer.METADATA_NEW and
METADATA_RENAMED followed by a random suffix drawn for each sequence; _timedio.c has the same), through the
directory's descriptor. The file is created O_EXCL and the rename never replaces: what a root tenant puts in the
directory (it can, whatever its mode) is never opened nor written (timer.py, _timedio.c).

The target directory may belong to someone else, who can swap any name in it, so the subdirectory is judged as
the probe file is (probefile.py): opened relative to the target directory's descriptor without following a
symlink, then by fstat: a directory, owned by volprobe's user, on the target's filesystem, writable by no one
else (mode 0700: nobody else can put a name in it, so whatever its two names lead to was made there by us), and
at every reopen the very directory made or checked when the target started: its inode, and the id in its file
`volprobe.id` (an inode number is reused as soon as a directory is removed; the id is not).

A crash (kill -9) mid-sequence leaves one of the two names behind. Each open clears them (and the unsuffixed
names of volprobe 0.x's sequences), each only if it is a regular file of volprobe's user with one link, among the
directory's first probefile.SWEEP_LIMIT names; nothing else in the directory, nor outside it, is touched.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from dataclasses import dataclass

from . import ops, timer
from .probefile import SWEEP_LIMIT, ProbeDirectory, open_no_link
from .safety import Refused

NAME = ops.METADATA.file
# The sequence's names: each of these, a dot and timer.METADATA_SUFFIX_HEX hex digits. Unsuffixed, an earlier
# version's (its leftovers are cleared too).
OUR_NAMES = (timer.METADATA_NEW, timer.METADATA_RENAMED)
ID_NAME = "volprobe.id"
_MODE = 0o700
_ID_BYTES = 64


@dataclass(frozen=True)
class DirectoryPin:
    """The metadata directory a target checked: sequences run in this inode with this id, or nowhere."""

    inode: int
    id: str


def _judge(fd: int, directory: ProbeDirectory) -> os.stat_result:
    """What the subdirectory's descriptor must be before a sequence runs in it; Refused otherwise."""
    path = f"{directory.path}/{NAME}"
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise Refused("exists and is not a directory; refusing to touch it", path)
    if st.st_uid != os.geteuid():
        raise Refused(f"belongs to uid {st.st_uid}, not to volprobe's uid {os.geteuid()}; refusing to touch it", path)
    if st.st_dev != directory.st_dev:
        raise Refused("is not on the directory's filesystem; refusing to touch it", path)
    if st.st_mode & 0o022:
        raise Refused(f"is writable by others (mode {stat.S_IMODE(st.st_mode):o}); refusing to use it", path)
    return st


def _open(directory: ProbeDirectory) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY
    with directory.held() as dir_fd:
        return open_no_link(NAME, flags, dir_fd, f"{directory.path}/{NAME}")


def _read_id(fd: int, path: str = ID_NAME) -> str | None:
    """The id in the directory's `volprobe.id`, or None if there is none yet. Refused if something that is not
    volprobe's is at that name (looked at unopened if it is not a regular file: probefile.open_no_link)."""
    try:
        id_fd = open_no_link(ID_NAME, os.O_RDONLY | os.O_NONBLOCK, fd, path)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(id_fd)
        if st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise Refused(
                f"is not volprobe's (uid {st.st_uid}, {st.st_nlink} links); refusing to use its directory", path
            )
        return os.read(id_fd, _ID_BYTES).decode("ascii", "replace").strip() or None
    finally:
        os.close(id_fd)


def _write_id(fd: int) -> str:
    made = str(uuid.uuid4())
    id_fd = os.open(ID_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
    try:
        os.write(id_fd, made.encode())
        os.fsync(id_fd)
    finally:
        os.close(id_fd)
    os.fsync(fd)
    return made


def open_checked(directory: ProbeDirectory, pin: DirectoryPin | None) -> int:
    """The subdirectory's descriptor, judged; with `pin`, it must be that very directory (inode and id).
    Leftovers of an interrupted sequence are cleared. Refused (closed) otherwise."""
    fd = _open(directory)
    try:
        st = _judge(fd, directory)
        if pin is not None and (st.st_ino, _read_id(fd, f"{directory.path}/{NAME}/{ID_NAME}")) != (pin.inode, pin.id):
            raise Refused(
                f"is not the directory checked when the target started (inode {st.st_ino}, not {pin.inode}, or "
                "another id); it was replaced",
                f"{directory.path}/{NAME}",
            )
        clear_leftovers(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def recheck(directory: ProbeDirectory, fd: int) -> None:
    """The held descriptor's checks that can change under it (owner, mode), by fstat alone."""
    _judge(fd, directory)


def ensure(directory: ProbeDirectory) -> DirectoryPin:
    """Make the subdirectory if it does not exist yet, judge it, clear leftovers; it pins later opens."""
    with directory.held() as dir_fd:  # open throughout, whatever a running probe lets go of meanwhile
        return _ensure(directory, dir_fd)


def _ensure(directory: ProbeDirectory, dir_fd: int) -> DirectoryPin:
    made = False
    try:
        os.mkdir(NAME, _MODE, dir_fd=dir_fd)
        made = True
    except FileExistsError:
        pass  # judged below, through a descriptor, like one just made
    fd = open_checked(directory, None)
    try:
        if made:
            os.fsync(dir_fd)
        return DirectoryPin(os.fstat(fd).st_ino, _read_id(fd, f"{directory.path}/{NAME}/{ID_NAME}") or _write_id(fd))
    finally:
        os.close(fd)


def check_existing(directory: ProbeDirectory) -> str | None:
    """Why an existing subdirectory cannot be used, or None if it can (or there is none yet). Only reads."""
    try:
        fd = _open(directory)
    except FileNotFoundError:
        return None
    except Refused as err:
        return f"{err.filename} {err.strerror}"
    except OSError as err:
        return f"{directory.path}/{NAME} cannot be opened safely ({err.strerror}); refusing to touch it"
    else:
        try:
            _judge(fd, directory)
            _read_id(fd, f"{directory.path}/{NAME}/{ID_NAME}")
        except Refused as err:
            return f"{err.filename} {err.strerror}"
        except OSError as err:
            return f"{directory.path}/{NAME}/{ID_NAME} cannot be read safely ({err.strerror}); refusing to touch it"
        finally:
            os.close(fd)
    finally:
        directory.release()
    return None


def is_our_name(name: str) -> bool:
    """Whether `name` is one a sequence uses (or an earlier version's did)."""
    for prefix in OUR_NAMES:
        if name == prefix:
            return True
        suffix = name[len(prefix) + 1 :] if name.startswith(prefix + ".") else ""
        if len(suffix) == timer.METADATA_SUFFIX_HEX and all(c in "0123456789abcdef" for c in suffix):
            return True
    return False


def clear_leftovers(fd: int, limit: int = SWEEP_LIMIT) -> list[str]:
    """Remove what an interrupted sequence left in the subdirectory (open on `fd`): its names, each only if it
    is a regular file of ours with one link, among the directory's first `limit` entries. Returns the names
    removed."""
    removed = []
    with os.scandir(fd) as entries:
        names = [entry.name for _, entry in zip(range(limit), entries, strict=False)]
    for name in names:
        if not is_our_name(name):
            continue
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
                os.unlink(name, dir_fd=fd)
                removed.append(name)
    return removed
