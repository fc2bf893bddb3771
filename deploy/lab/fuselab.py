#!/usr/bin/env python3
"""The FUSE lab: a passthrough filesystem over a backing directory whose per-operation latency and stalls the
tests set at run time; a network filesystem's behaviour (no block device, a mount that can hang) on a machine
without an NFS server.

    fuselab.py serve MOUNTPOINT BACKING --control SOCKET [--latency op=seconds ...]

The control socket (a Unix stream socket, outside the mount: a stalled mount must not stall its own control)
takes one JSON object per line and answers one:

    {"latency": {"rename": 0.02}}      added before the operation is passed through (0 removes it)
    {"stall": "all"}                   every operation but close's blocks until released ("meta": statfs, getattr)
    {"stall": "off"}                   releases every blocked operation
    {"get": true}                      the settings and the count of operations served, per op

Built on mfusepy (ctypes over the system's libfuse3, see README.md). O_DIRECT: the kernel passes the open's
O_DIRECT to the daemon and sends O_DIRECT reads and writes through as they are (no page cache). The backing
file is opened with the same flags, so its O_DIRECT requests need aligned buffers: they go through a
page-aligned mmap buffer here, never through the bytes objects mfusepy hands over.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# What the tests can slow down or stall; each name is an operation of mfusepy's Operations.
OPS = (
    "getattr",
    "statfs",
    "open",
    "create",
    "read",
    "write",
    "fsync",
    "flush",
    "release",
    "rename",
    "unlink",
    "link",
    "mkdir",
    "rmdir",
    "readdir",
    "truncate",
    "chmod",
    "chown",
    "utimens",
    "access",
    "fallocate",
    "fsyncdir",
)
META_OPS = frozenset({"getattr", "statfs"})
# Never stalled: the kernel waits for FUSE's flush (every close) uninterruptibly, so a stalled flush would make
# any process with a file open in the mount unkillable, even its exit. NFS, which the lab stands in for, sends a
# close without dirty pages (O_DIRECT's) asynchronously: a hung server does not block it either.
UNSTALLED_OPS = frozenset({"flush", "release"})
FUSE_CAP_ASYNC_DIO = 1 << 15  # fuse_common.h
STALL_MODES = ("off", "all", "meta")


class Controls:
    """The settings the control socket changes, read by every operation."""

    def __init__(self, latency: dict[str, float], interrupted: Callable[[], bool] = lambda: False) -> None:
        self.interrupted = interrupted  # whether the kernel interrupted the operation this thread serves
        self.latency = dict(latency)
        self.stall = "off"
        self.released = threading.Event()
        self.released.set()
        self.counts: dict[str, int] = {}
        self.stalled = 0  # operations blocked right now
        self.lock = threading.Lock()

    def apply(self, request: dict[str, Any]) -> dict[str, Any]:
        for op, seconds in dict(request.get("latency") or {}).items():
            if op not in OPS or not isinstance(seconds, int | float) or not 0 <= seconds <= 3600:
                raise ValueError(f"bad latency {op}={seconds!r}")
            self.latency[op] = float(seconds)
        if "stall" in request:
            mode = request["stall"]
            if mode not in STALL_MODES:
                raise ValueError(f"stall must be one of {STALL_MODES}")
            self.stall = mode
            (self.released.set if mode == "off" else self.released.clear)()
        with self.lock:
            return {"latency": self.latency, "stall": self.stall, "counts": dict(self.counts), "stalled": self.stalled}

    def before(self, op: str) -> None:
        """An operation's added latency and stall, before it is passed through."""
        with self.lock:
            self.counts[op] = self.counts.get(op, 0) + 1
        mode = self.stall
        if (mode == "all" and op not in UNSTALLED_OPS) or (mode == "meta" and op in META_OPS):
            with self.lock:
                self.stalled += 1
            try:
                # The caller was signalled (killed, say): answer EINTR, or it stays in the kernel, unkillable,
                # until the stall ends (FUSE waits out a request the daemon has read). Others stay blocked.
                while not self.released.wait(0.05):
                    if self.interrupted():
                        raise OSError(errno.EINTR, "interrupted while stalled")
            finally:
                with self.lock:
                    self.stalled -= 1
        delay = self.latency.get(op, 0.0)
        if delay > 0:
            time.sleep(delay)


def _aligned_pread(fd: int, size: int, offset: int) -> bytes:
    buffer = mmap.mmap(-1, max(size, 1))
    try:
        view = memoryview(buffer)[:size]
        done = os.preadv(fd, [view], offset)
        view.release()
        return buffer[:done]
    finally:
        buffer.close()


def _aligned_pwrite(fd: int, data: bytes, offset: int) -> int:
    buffer = mmap.mmap(-1, max(len(data), 1))
    try:
        buffer[: len(data)] = data
        view = memoryview(buffer)[: len(data)]
        done = os.pwritev(fd, [view], offset)
        view.release()
        return done
    finally:
        buffer.close()


def make_operations(backing: str, controls: Controls) -> Any:
    """The passthrough, as an mfusepy Operations object (imported here: the fixture's side needs no mfusepy)."""
    import mfusepy

    root = os.path.realpath(backing)

    def real(path: str) -> str:
        return root + path  # FUSE paths are absolute within the mount and never contain '..'

    def timed(op: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            controls.before(op)
            try:
                return function(*args)
            except OSError as err:
                raise mfusepy.FuseOSError(err.errno or errno.EIO) from None

        return call

    direct: set[int] = set()  # descriptors opened with O_DIRECT: their I/O goes through aligned buffers
    files: set[int] = set()  # descriptors open() and create() made: only those are fh of a getattr (not opendir's 0)

    def getattr_(path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.fstat(fh) if fh is not None and fh in files else os.lstat(real(path))
        keys = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_rdev")
        attrs: dict[str, Any] = {key: getattr(st, key) for key in keys}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    def statfs(path: str) -> dict[str, int]:
        sv = os.statvfs(real(path))
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail")
        return {key: getattr(sv, key) for key in keys} | {"f_namemax": sv.f_namemax}

    def open_(path: str, flags: int) -> int:
        fd = os.open(real(path), flags & ~(os.O_CREAT | os.O_EXCL | os.O_NOCTTY))
        files.add(fd)
        if flags & os.O_DIRECT:
            direct.add(fd)
        return fd

    def create(path: str, mode: int, flags: int = os.O_WRONLY) -> int:
        fd = os.open(real(path), (flags | os.O_CREAT) & ~os.O_NOCTTY, mode)
        files.add(fd)
        if flags & os.O_DIRECT:
            direct.add(fd)
        return fd

    def read(path: str, size: int, offset: int, fh: int) -> bytes:
        return _aligned_pread(fh, size, offset) if fh in direct else os.pread(fh, size, offset)

    def write(path: str, data: bytes, offset: int, fh: int) -> int:
        return _aligned_pwrite(fh, data, offset) if fh in direct else os.pwrite(fh, data, offset)

    def fsync(path: str, datasync: int, fh: int) -> int:
        (os.fdatasync if datasync else os.fsync)(fh)
        return 0

    def fsyncdir(path: str, datasync: int, fh: int) -> int:
        fd = os.open(real(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return 0

    def release(path: str, fh: int) -> int:
        direct.discard(fh)
        files.discard(fh)
        os.close(fh)
        return 0

    def truncate(path: str, length: int, fh: int | None = None) -> int:
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(real(path), length)
        return 0

    def utimens(path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(real(path), ns=times, follow_symlinks=False) if times else os.utime(real(path))
        return 0

    def fallocate(path: str, mode: int, offset: int, size: int, fh: int) -> int:
        if mode:
            raise OSError(errno.EOPNOTSUPP, "only mode 0")
        os.posix_fallocate(fh, offset, size)
        return 0

    def readdir(path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        # With use_ino each entry carries its inode: readdir(3) skips an entry of inode 0 (a deleted one's mark).
        directory = real(path)
        here = os.lstat(directory)
        with os.scandir(directory) as entries:
            found = [(entry.name, entry.stat(follow_symlinks=False)) for entry in entries]
        return [
            (name, {"st_ino": st.st_ino, "st_mode": st.st_mode}, 0) for name, st in [(".", here), ("..", here), *found]
        ]

    def access(path: str, amode: int) -> int:
        if not os.access(real(path), amode):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return 0

    functions: dict[str, Callable[..., Any]] = {
        "getattr": getattr_,
        "statfs": statfs,
        "open": open_,
        "create": create,
        "read": read,
        "write": write,
        "fsync": fsync,
        "fsyncdir": fsyncdir,
        "flush": lambda path, fh: 0,
        "release": release,
        "rename": lambda old, new: os.rename(real(old), real(new)),
        "unlink": lambda path: os.unlink(real(path)),
        "link": lambda target, source: os.link(real(source), real(target)),
        "mkdir": lambda path, mode: os.mkdir(real(path), mode),
        "rmdir": lambda path: os.rmdir(real(path)),
        "readdir": readdir,
        "truncate": truncate,
        "chmod": lambda path, mode: os.chmod(real(path), mode),
        "chown": lambda path, uid, gid: os.chown(real(path), uid, gid, follow_symlinks=False),
        "utimens": utimens,
        "access": access,
        "fallocate": fallocate,
    }
    assert set(functions) == set(OPS)

    def init_with_config(conn: Any, config: Any) -> None:
        # Without async direct I/O: an O_DIRECT request is then one the caller waits for itself, interruptibly
        # (see Controls.before); with it, the kernel waits for its completion uninterruptibly, even at a kill -9.
        if conn is not None:
            conn.want &= ~FUSE_CAP_ASYNC_DIO

    namespace: dict[str, Any] = {"use_ns": True, "init_with_config": staticmethod(init_with_config)}
    namespace.update({op: staticmethod(timed(op, function)) for op, function in functions.items()})
    return type("LabOperations", (mfusepy.Operations,), namespace)()


def serve_control(path: str, controls: Controls) -> None:
    """Answer control requests, one connection at a time, in a daemon thread."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(8)

    def loop() -> None:
        while True:
            connection, _ = server.accept()
            with connection, connection.makefile("rwb") as stream:
                for line in stream:
                    try:
                        answer: dict[str, Any] = {"ok": True, **controls.apply(json.loads(line))}
                    except (ValueError, TypeError, AttributeError) as err:
                        answer = {"ok": False, "error": str(err)}
                    stream.write(json.dumps(answer).encode() + b"\n")
                    stream.flush()

    threading.Thread(target=loop, name="control", daemon=True).start()


def serve(mountpoint: str, backing: str, control: str, latency: dict[str, float]) -> None:
    import mfusepy

    libfuse = mfusepy._libfuse
    libfuse.fuse_interrupted.restype = ctypes.c_int
    controls = Controls(latency, lambda: bool(libfuse.fuse_interrupted()))
    serve_control(control, controls)
    # attr_timeout/entry_timeout 0: every stat reaches the daemon, as on a network filesystem that revalidates
    # (and so a stalled getattr is seen at once); use_ino: the backing inodes, which volprobe pins its probe file
    # by. Multithreaded (libfuse's default), so one stalled operation does not stall the others.
    mfusepy.FUSE(
        make_operations(backing, controls),
        mountpoint,
        foreground=True,
        fsname="volprobe-fuselab",
        subtype="fuselab",
        allow_other=True,
        use_ino=True,
        attr_timeout=0,
        entry_timeout=0,
        negative_timeout=0,
    )


# -- the tests' side ----------------------------------------------------------------------------------------


def mounted(path: str | Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


class FuseDirectory:
    """A running lab filesystem: `path` is its mount point; its settings change through the control socket."""

    def __init__(self, path: Path, backing: Path, control: Path, process: subprocess.Popen[bytes]) -> None:
        self.path = path
        self.backing = backing
        self.control = control
        self.process = process

    def request(self, **request: Any) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self.control))
            s.sendall(json.dumps(request).encode() + b"\n")
            answer: dict[str, Any] = json.loads(s.makefile("rb").readline())
        if not answer.get("ok"):
            raise ValueError(answer.get("error"))
        return answer

    def set_latency(self, op: str, seconds: float) -> None:
        self.request(latency={op: seconds})

    def stall(self, mode: str = "all") -> None:
        """Every operation ("all"), or statfs and getattr only ("meta"), blocks until release()."""
        self.request(stall=mode)

    def release(self) -> None:
        self.request(stall="off")

    def status(self) -> dict[str, Any]:
        return self.request(get=True)

    def stop(self) -> None:
        """Release, then end the daemon (killed if it does not end) and lazily unmount: works even while stalled,
        with processes still blocked in the mount (the kernel fails their requests once the daemon is gone)."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.release()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(3)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if mounted(self.path):
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
        with contextlib.suppress(OSError):
            self.control.unlink()


def start(directory: Path, backing: Path | None = None, timeout: float = 10.0, **latency: float) -> FuseDirectory:
    """Mount a lab filesystem at directory/mnt over `backing` (directory/backing by default)."""
    mountpoint, control = directory / "mnt", directory / "control.sock"
    backing = backing or directory / "backing"
    for made in (mountpoint, backing):
        made.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "serve", str(mountpoint), str(backing)]
    command += ["--control", str(control), *(f"--latency={op}={s}" for op, s in latency.items())]
    log = open(directory / "fuselab.log", "ab")  # noqa: SIM115 - the child's, for as long as it runs
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    lab = FuseDirectory(mountpoint, backing, control, process)
    deadline = time.monotonic() + timeout
    while not (mounted(mountpoint) and control.exists()):
        if process.poll() is not None or time.monotonic() > deadline:
            lab.stop()
            raise RuntimeError(f"the FUSE lab did not mount: {(directory / 'fuselab.log').read_text()[-2000:]}")
        time.sleep(0.02)
    return lab


def _fixture() -> Any:
    import pytest

    @pytest.fixture
    def fuse_directory(tmp_path_factory: Any) -> Iterator[Callable[..., FuseDirectory]]:
        """fuse_directory(backing=None, **latencies) -> FuseDirectory (`.path`, `.set_latency(op, s)`, `.stall()`,
        `.release()`), stopped after the test, pass or fail, stalled or not."""
        made: list[FuseDirectory] = []

        def make(backing: Path | None = None, **latency: float) -> FuseDirectory:
            lab = start(tmp_path_factory.mktemp("fuselab"), backing, **latency)
            made.append(lab)
            return lab

        yield make
        for lab in made:
            lab.stop()

    return fuse_directory


fuse_directory = _fixture()


def _latency(text: str) -> tuple[str, float]:
    op, _, seconds = text.partition("=")
    if op not in OPS:
        raise argparse.ArgumentTypeError(f"{op!r} is not one of {', '.join(OPS)}")
    return op, float(seconds)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="mount and serve until unmounted or signalled")
    serve_parser.add_argument("mountpoint")
    serve_parser.add_argument("backing")
    serve_parser.add_argument("--control", required=True, help="path of the control socket")
    serve_parser.add_argument("--latency", type=_latency, action="append", default=[], help="op=seconds")
    args = parser.parse_args(argv)
    if shutil.which("fusermount3") is None and os.geteuid() != 0:
        print("fuselab: needs root or fusermount3", file=sys.stderr)
        return 1
    serve(args.mountpoint, args.backing, args.control, dict(args.latency))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
