"""The dedicated probe file of a directory target: the only thing volprobe ever writes in a filesystem.

It is created once, at its full size, filled with random data and fsynced before the first probe, so block
allocation never pollutes steady-state latency. It starts with a header that marks it as ours; a file of
that name without the header, or of another size, is never touched. Probes write inside [HEADER_BYTES, size)
and never grow it.

The directory may belong to someone else (postgres owns /var/lib/postgresql), who can swap any name in it at
any time. So nothing here trusts a name: the directory is opened once, by the path resolved when the
configuration was applied, and known by its descriptor and identity (device, inode, filesystem id); names in
it are opened relative to that descriptor with O_NOFOLLOW|O_NONBLOCK (a symlink fails, a FIFO does not block),
and what was opened is judged by fstat and by its header read through the same descriptor: a regular file
with one link, owned by volprobe's user, on the directory's filesystem, of the expected size, and the very
file (inode and header id) checked when the target started. That runs on every open and every reopen.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import privatemount
from .safety import Refused

log = logging.getLogger(__name__)

MAGIC = b"VOLPROBE PROBE FILE v1\n"
HEADER_BYTES = 64 * 1024
_HEADER_READ = 4096  # the header's JSON fits in the first page; one page is also O_DIRECT's alignment
_CHUNK = 1024 * 1024
_SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Entries of a probe directory looked at for leftover temporaries, at most: a directory of millions of names
# (someone else's data) would otherwise hold up every start of its target.
SWEEP_LIMIT = 100_000


class ProbeFileError(Exception):
    pass


class ExtraLinks(Refused):
    """A probe file with another name too: refused, as a hard link could lead its writes to someone's data."""


@dataclass(frozen=True)
class FileIdentity:
    """The probe file a target checked: writes go to this inode with this header, or nowhere."""

    inode: int
    header_id: str


@dataclass(frozen=True)
class DirectoryIdentity:
    device: int
    inode: int
    fsid: int


class ProbeDirectory:
    """A target directory, held by descriptor while its probes run. On EROFS or a vanished mount it is let go
    (release()), so an operator can unmount and fsck; the next open() must find the same directory (device,
    inode and filesystem id) at the path, or is refused.

    Its probes' threads share the one descriptor: each uses it inside held(), and release() leaves a descriptor
    in use to its last user to close, so a thread that lets go never closes it under another (whose open at
    that number could otherwise land in whatever the number is reused for)."""

    def __init__(self, path: str, identity: DirectoryIdentity | None = None, keep: bool = True) -> None:
        """Resolve `path` (once) and fix its identity; with `identity`, a directory resolved before (again()).
        keep=False (a pod volume, which the kubelet must be able to unmount at any time): never kept open, every
        held() opens and recognises it for its block alone, as held(keep=False) does."""
        self.keep = keep
        self._fd: int | None = None
        self._users: dict[int, int] = {}  # descriptor -> threads using it (held())
        self._lock = threading.Lock()
        self.identity = identity
        if identity is not None:
            self.path = path
            return
        self.path = os.path.realpath(path)  # resolved once: later swaps of a component cannot redirect it
        self.open()  # fixes the identity; resolving only reads, so let go until the target starts
        self.release()

    def again(self) -> ProbeDirectory:
        """The same directory for another holder (a target restarted by a reload), not open yet: its first open
        must recognise it at the path first resolved, or is refused. It is never resolved by name again."""
        return ProbeDirectory(self.path, self.identity, self.keep)

    @property
    def st_dev(self) -> int:
        """The directory's filesystem: a probe file must be on it."""
        assert self.identity is not None
        return self.identity.device

    def open(self) -> int:
        """The directory's descriptor, opened (by the path, then recognised by identity) if it was let go. A
        thread beside the probes' should use held()."""
        return self._keep(use=False)

    def _keep(self, use: bool) -> int:
        """The descriptor kept, opened if it was let go: outside the lock, so that a mount that hangs hangs this
        thread alone, never release(), answer() or held() in others; then kept under the lock, unless another
        thread kept one meanwhile (that one is taken, this one closed). With `use`, counted as in use (held())."""
        opened: int | None = None
        while True:
            with self._lock:
                if self._fd is None and opened is not None:
                    self._fd, opened = opened, None
                fd = self._fd
                if fd is not None and use:
                    self._users[fd] = self._users.get(fd, 0) + 1
            if opened is not None:  # another thread kept one meanwhile
                os.close(opened)
                opened = None
            if fd is not None:
                return fd
            opened = self._recognise()

    def _recognise(self) -> int:
        """Open the path and check that it is still the directory first found there; Refused if not. One kept
        never (a pod volume's) is opened through a private copy of its mount (volprobe.privatemount): what is
        opened in it then holds the copy, and the kubelet's mount unmounts whatever probe is in flight."""
        if self.keep:
            fd = open_no_link(self.path, os.O_RDONLY | os.O_DIRECTORY)
        else:
            try:
                fd = privatemount.open_directory(self.path)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused("is not a directory (a symbolic link?); refusing to follow it", self.path) from None
                raise
        try:
            st, vfs = os.fstat(fd), os.fstatvfs(fd)
        except BaseException:
            os.close(fd)
            raise
        found = DirectoryIdentity(st.st_dev, st.st_ino, vfs.f_fsid)
        if self.identity is not None and found != self.identity:
            os.close(fd)
            raise Refused(f"is no longer the directory the target was configured with ({found})", self.path)
        self.identity = found
        return fd

    @contextlib.contextmanager
    def held(self, keep: bool = True) -> Iterator[int]:
        """The directory's descriptor, open until the block ends whatever another thread lets go of meanwhile.
        One let go of is opened again (and recognised); with keep=False, only for the block: a mount check must
        not hold what an unmount needs (nor does any held() of a directory made with keep=False)."""
        if keep and self.keep:
            fd: int | None = self._keep(use=True)
        else:
            with self._lock:
                fd = self._fd
                if fd is not None:
                    self._users[fd] = self._users.get(fd, 0) + 1
        if fd is None:
            fd = self._recognise()
            try:
                yield fd
            finally:
                os.close(fd)
            return
        try:
            yield fd
        finally:
            with self._lock:
                self._users[fd] -= 1
                last = not self._users[fd]
                if last:
                    del self._users[fd]
                close = last and fd != self._fd  # let go of meanwhile: its last user closes it
            if close:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def release(self) -> None:
        """Let go of the directory: closed now, or by the last thread still using it (held())."""
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is None or fd in self._users:
                return
        with contextlib.suppress(OSError):
            os.close(fd)

    def answer(self) -> None:
        """A mount check of the directory held, not of its name (a symlink or a mount put over the name would
        answer for something else): fstatvfs and fstat of its descriptor. One let go of is recognised first
        and not kept open. Raises what they raise."""
        with self.held(keep=False) as fd:
            os.fstatvfs(fd)
            os.fstat(fd)

    def open_file(self, name: str, flags: int, size: int, identity: FileIdentity | None = None) -> int:
        """Open `name` in the directory with `flags` and judge the descriptor (see judge()); with `identity`,
        it must be that very file. Refused (closed unwritten) otherwise."""
        with self.held() as dir_fd:
            fd = open_no_link(name, flags, dir_fd, f"{self.path}/{name}")
        try:
            self.check(fd, name, size, identity)
            os.set_blocking(fd, True)  # O_NONBLOCK only kept a FIFO from blocking the open
        except BaseException:
            os.close(fd)
            raise
        return fd

    def recheck(self, fd: int, name: str, size: int) -> None:
        """The held descriptor's checks that can change under it (links, owner, size), by fstat alone: no I/O
        is added to the device between probes."""
        st = _judge_stat(fd, self.st_dev, f"{self.path}/{name}")
        if st.st_size != size:
            raise Refused(f"changed size from {size} to {st.st_size} bytes", f"{self.path}/{name}")

    def check(self, fd: int, name: str, size: int, identity: FileIdentity | None) -> None:
        """judge() the descriptor; with `identity`, it must also be that very file."""
        found = judge(fd, size, self.st_dev, f"{self.path}/{name}")
        if identity is not None and found != identity:
            raise Refused(
                f"is not the probe file checked when the target started (inode {found.inode}, not "
                f"{identity.inode}); it was replaced",
                f"{self.path}/{name}",
            )

    def identify(self, name: str, size: int) -> FileIdentity:
        """The identity of the probe file `name`, judged read-only; Refused, or FileNotFoundError."""
        with self.held() as dir_fd:
            fd = open_no_link(name, os.O_RDONLY, dir_fd, f"{self.path}/{name}")
        try:
            return judge(fd, size, self.st_dev, f"{self.path}/{name}")
        finally:
            os.close(fd)


def open_no_link(name: str, flags: int, dir_fd: int | None = None, path: str = "") -> int:
    """Open without following a symlink or blocking on a FIFO; a symlink is Refused, as anything else unsafe.

    Only a directory (O_DIRECTORY, which the kernel checks before it opens anything) is opened by name. Any other
    name is looked at first through an O_PATH descriptor, which opens nothing: what is not a regular file (a
    device node, a FIFO, a socket, a symlink, a directory) is Refused there, unopened, since opening a device can
    act on it (a tape rewinds, a watchdog arms) whatever is written after. The regular file is then opened through
    that very descriptor (/proc/self/fd), so the name cannot be swapped between the look and the open."""
    where = path or name
    if flags & os.O_DIRECTORY:
        try:
            return os.open(name, flags | _SAFE_OPEN, dir_fd=dir_fd)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW|O_DIRECTORY meets a symlink, or a file
                raise Refused("is not a directory (a symbolic link?); refusing to follow it", where) from None
            raise
    found = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        mode = os.fstat(found).st_mode
        if stat.S_ISLNK(mode):
            raise Refused("is a symbolic link; refusing to follow it", where)
        if not stat.S_ISREG(mode):
            raise Refused(f"is {kind_of(mode)}, not a regular file; refusing to open it", where)
        # The magic link opens the inode `found` holds, not whatever the name leads to by now.
        return os.open(f"/proc/self/fd/{found}", (flags | _SAFE_OPEN) & ~os.O_NOFOLLOW)
    finally:
        os.close(found)


_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFBLK: "a block device",
    stat.S_IFCHR: "a character device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def kind_of(mode: int) -> str:
    """What a file of `mode` is, in words."""
    return _KINDS.get(stat.S_IFMT(mode), "a regular file" if stat.S_ISREG(mode) else "an unknown kind of file")


def _read_header_of(fd: int) -> dict[str, Any] | None:
    buffer = mmap.mmap(-1, _HEADER_READ)  # page aligned, as an O_DIRECT descriptor needs
    try:
        view = memoryview(buffer)
        done = os.preadv(fd, [view], 0)
        head = bytes(view[:done])
        view.release()
    finally:
        buffer.close()
    if not head.startswith(MAGIC):
        return None
    body = head[len(MAGIC) :].split(b"\0", 1)[0]
    try:
        header = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return header if isinstance(header, dict) else None


def read_header(path: str) -> dict[str, Any] | None:
    """The header of an existing probe file, or None if the file is not one of ours (or not a regular file)."""
    try:
        fd = open_no_link(path, os.O_RDONLY)
    except OSError:  # Refused too: not a regular file
        return None
    try:
        return _read_header_of(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def judge(fd: int, size: int, device: int, path: str) -> FileIdentity:
    """What an open descriptor must be before volprobe writes through it; Refused with the reason otherwise."""
    st = _judge_stat(fd, device, path)
    header = _read_header_of(fd)
    if header is None or not isinstance(header.get("id"), str):
        raise Refused("exists but is not a volprobe probe file; refusing to overwrite it", path)
    if st.st_size != size or header.get("size") != size:
        raise Refused(
            f"is a probe file of {st.st_size} bytes, not {size}; probe files are never resized: "
            f"delete it to change probe_file_size",
            path,
        )
    return FileIdentity(st.st_ino, header["id"])


def _judge_stat(fd: int, device: int, path: str) -> os.stat_result:
    """judge()'s checks that fstat alone answers: what can change under a descriptor already held."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused("exists and is not a regular file; refusing to touch it", path)
    if st.st_nlink != 1:
        raise ExtraLinks(f"has {st.st_nlink} links; a probe file has one, refusing to touch it", path)
    if st.st_uid != os.geteuid():
        raise Refused(f"belongs to uid {st.st_uid}, not to volprobe's uid {os.geteuid()}; refusing to touch it", path)
    if st.st_dev != device:
        raise Refused("is not on the directory's filesystem; refusing to touch it", path)
    return st


def check_existing(directory: ProbeDirectory, name: str, size: int) -> str | None:
    """Why an existing file `name` cannot be used as a probe file of `size` bytes, or None if it can (or there
    is none yet). Only reads."""
    try:
        directory.identify(name, size)
    except FileNotFoundError:
        return None
    except Refused as err:
        return f"{err.filename} {err.strerror}"
    except OSError as err:
        return f"{directory.path}/{name} cannot be opened safely ({err.strerror}); refusing to touch it"
    finally:
        directory.release()
    return None


def ensure(directory: ProbeDirectory, name: str, size: int, fill: bool = True) -> FileIdentity:
    """Create the probe file if it does not exist yet; verify it if it does. Its identity pins later opens.

    fill: random data throughout, so that block allocation never pollutes the probes' latency. Without it (a
    commit log) the blocks past the header are only preallocated, as etcd's WAL and fio's write jobs do: each
    commit's fdatasync then converts the extents it wrote, as theirs do."""
    with directory.held() as dir_fd:  # open throughout, whatever a running probe lets go of meanwhile
        return _ensure(directory, dir_fd, name, size, fill)


def _ensure(directory: ProbeDirectory, dir_fd: int, name: str, size: int, fill: bool) -> FileIdentity:
    try:
        return directory.identify(name, size)
    except FileNotFoundError:
        pass
    vfs = os.fstatvfs(dir_fd)
    if vfs.f_bavail * vfs.f_frsize < size:
        raise ProbeFileError(
            f"{directory.path} has {vfs.f_bavail * vfs.f_frsize} bytes free; the probe file needs {size}"
        )
    clear_leftover_temporaries(directory, name, dir_fd=dir_fd)
    tmp = f"{name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    # O_EXCL: a fresh probe file is only ever made under a name volprobe created.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE_OPEN, 0o600, dir_fd=dir_fd)
    try:
        # Held until the file is whole: the kernel drops it when its creator dies, however it dies, which is
        # how another start tells a leftover from a creation under way (a PID can be reused, or belong to
        # another container's namespace). Taken before the header is written, so no header without the lock.
        fcntl.flock(fd, fcntl.LOCK_EX)
        made, named = os.fstat(fd), os.stat(tmp, dir_fd=dir_fd, follow_symlinks=False)
        if (made.st_dev, made.st_ino) != (named.st_dev, named.st_ino):  # another start cleared it meanwhile
            raise ProbeFileError(f"{directory.path}/{tmp} was removed while it was being made; try again")
        header = json.dumps({"size": size, "id": str(uuid.uuid4()), "created": int(time.time())}).encode()
        os.write(fd, (MAGIC + header).ljust(HEADER_BYTES, b"\0"))
        written = HEADER_BYTES
        if not fill and size > written:
            os.posix_fallocate(fd, written, size - written)
            written = size
        while written < size:
            chunk = os.urandom(min(_CHUNK, size - written))
            written += os.write(fd, chunk)
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        os.close(fd)
        raise
    try:
        # Never replaces: fails if a file appeared there meanwhile. Whatever the name leads to by now is judged
        # through a descriptor below, and pins every later open.
        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        pass
    finally:
        # Closed before the temporary name goes: NFS keeps an open file's unlinked name as a hidden link (its
        # silly rename). Once linked, the temporary counts 2 links itself, so a start clearing leftovers leaves
        # it alone without the lock.
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
    os.fsync(dir_fd)
    return _identify_made(directory, name, size)


def _identify_made(directory: ProbeDirectory, name: str, size: int, settle: float = 2.0) -> FileIdentity:
    """identify() a probe file just made here. FUSE's high-level library also hides an unlinked name as a link
    while the file is open, and learns of its close only from a release the kernel sends after close() returned:
    the temporary name can outlive the unlink for a moment as that hidden link. So an extra link is waited out
    for `settle` seconds, then refused as ever."""
    deadline = time.monotonic() + settle
    while True:
        try:
            return directory.identify(name, size)
        except ExtraLinks:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _leftover_names(dir_fd: int, prefix: str, limit: int, path: str) -> Iterator[str]:
    """Names in the directory open on `dir_fd` that start with `prefix`, read lazily (a directory of millions of
    names costs no more memory than one of ten), among its first `limit` entries: the rest is left unread."""
    examined = 0
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if examined == limit:
                log.info("%s: looked for leftover temporaries among its first %d names only", path, limit)
                return
            examined += 1
            if entry.name.startswith(prefix):
                yield entry.name


def clear_leftover_temporaries(
    directory: ProbeDirectory, name: str, limit: int = SWEEP_LIMIT, dir_fd: int | None = None
) -> list[str]:
    """Remove the temporary files of creations interrupted by a crash, and say which: ours by name, owner and
    header, and no longer locked by their creator, among the directory's first `limit` entries. Each is judged
    through a descriptor opened without following links or blocking on FIFOs, and removed while its lock is
    held, only if the name still leads to it. `dir_fd`: the directory's descriptor the caller holds (held());
    without it, the directory is held for the sweep alone, not left open."""
    if dir_fd is None:
        with directory.held(keep=False) as held_fd:
            return clear_leftover_temporaries(directory, name, limit, held_fd)
    removed = []
    for entry in _leftover_names(dir_fd, f"{name}.tmp.", limit, directory.path):
        try:
            fd = open_no_link(entry, os.O_RDONLY, dir_fd)
        except OSError:
            continue  # not a regular file (Refused, unopened), or gone: not ours
        try:
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its creator is still at work
            # Empty: its creator died between making it and writing the header (a SIGTERM at that moment), and an
            # empty file holds nothing to lose. Otherwise only with our header.
            if os.fstat(fd).st_size != 0 and _read_header_of(fd) is None:
                continue
            named = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
            if (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(entry, dir_fd=dir_fd)
                removed.append(entry)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed
