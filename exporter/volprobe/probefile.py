"""The dedicated probe file of a directory target: the only thing volprobe ever writes in a filesystem.

It is created once, at its full size, filled with random data and fsynced before the first probe, so block
allocation never pollutes steady-state latency. It starts with a header that marks it as ours; a file of
that name without the header, or of another size, is never touched. Probes write inside [HEADER_BYTES, size)
and never grow it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"VOLPROBE PROBE FILE v1\n"
HEADER_BYTES = 64 * 1024
_CHUNK = 1024 * 1024


class ProbeFileError(Exception):
    pass


@dataclass(frozen=True)
class ProbeFile:
    path: str
    size: int


def read_header(path: str) -> dict | None:
    """The header of an existing probe file, or None if the file is not one of ours."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if not head.startswith(MAGIC):
        return None
    body = head[len(MAGIC) :].split(b"\0", 1)[0]
    try:
        header = json.loads(body)
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


def check_existing(path: str, size: int) -> str | None:
    """Why an existing file at `path` cannot be used as a probe file of `size` bytes, or None if it can."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not os.path.isfile(path) or os.path.islink(path):
        return f"{path} exists and is not a regular file; refusing to touch it"
    header = read_header(path)
    if header is None:
        return f"{path} exists but is not a volprobe probe file; refusing to overwrite it"
    if st.st_size != size or header.get("size") != size:
        return (
            f"{path} is a probe file of {st.st_size} bytes, not {size}; probe files are never resized: "
            f"delete it to change probe_file_size"
        )
    return None


def ensure(directory: str, name: str, size: int) -> ProbeFile:
    """Create the probe file if it does not exist yet; verify it if it does."""
    path = os.path.join(directory, name)
    problem = check_existing(path, size)
    if problem:
        raise ProbeFileError(problem)
    if os.path.exists(path):
        return ProbeFile(path, size)
    vfs = os.statvfs(directory)
    if vfs.f_bavail * vfs.f_frsize < size:
        raise ProbeFileError(f"{directory} has {vfs.f_bavail * vfs.f_frsize} bytes free; the probe file needs {size}")
    for leftover in leftover_temporaries(directory, name):
        with contextlib.suppress(OSError):
            leftover.unlink()
    tmp = os.path.join(directory, f"{name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        header = json.dumps({"size": size, "id": str(uuid.uuid4()), "created": int(time.time())}).encode()
        os.write(fd, (MAGIC + header).ljust(HEADER_BYTES, b"\0"))
        written = HEADER_BYTES
        while written < size:
            chunk = os.urandom(min(_CHUNK, size - written))
            written += os.write(fd, chunk)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.link(tmp, path)  # never replaces: fails if a file appeared there meanwhile
    except FileExistsError:
        problem = check_existing(path, size)
        if problem:
            raise ProbeFileError(problem) from None
    finally:
        os.unlink(tmp)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return ProbeFile(path, size)


def leftover_temporaries(directory: str, name: str) -> list[Path]:
    """Temporary files of creations interrupted by a crash: ours by name and header, their creator gone."""
    found = []
    for path in Path(directory).glob(f"{name}.tmp.*"):
        pid = path.name.split(".")[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and read_header(str(path)) is not None:
            found.append(path)
    return found
