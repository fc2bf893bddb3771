"""What volprobe remembers about a volume across restarts, one JSON file per volume in the state directory.

A volume is known by its most stable identity: the cloud volume id, else the WWN, else the serial, else (a
loop device) the file it shows, so a re-attached image is the same volume on whichever loop it lands. A device
with none of these (zram, some virtual disks) is keyed on its kernel name and size, and its state says so:
kernel names move between boots, so such a state may be a different volume's after a reboot.

The file holds, in sections:
- `probes`: per probe specification, the key of the offset permutation and how far into it fresh offsets
  have been reserved, so "first touch" means first on this volume, not first since the process started;
- `unloaded`: per direction, the lowest unloaded service time the probes measured, with when, for the
  throttle detector;
- `warmup`: the warm-up checkpoint.

Every write replaces the file atomically (temporary file, fsync, rename, fsync of the directory). A file that
is corrupt, or that belongs to another volume, is set aside (renamed `*.corrupt-TIME`, never overwritten) and
the volume starts afresh. Corrupt includes hostile: every state file and warm-up checkpoint is read by
read_state_file, which refuses (as corrupt) anything but a small regular file of shallow JSON with sane numbers,
without following a link or waiting on a FIFO. When the directory cannot be written the store says so
(`status`), and its users carry on in memory as if there were no state.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeGuard

from .discovery import BlockDevice

log = logging.getLogger(__name__)

VERSION = 1
STATUSES = ("ok", "new", "corrupt", "foreign", "unwritable")  # see VolumeState.status

# Limits on what a state file may hold; beyond them it is corrupt. State files are a few KiB (a cursor per probe,
# a warm-up checkpoint of about as many extents as it has jobs): 1 MiB is hundreds of times that, and still
# read and parsed in milliseconds.
MAX_STATE_BYTES = 1 << 20
MAX_DEPTH = 32  # documents nest 6 deep (document, sections, probes, probe, gaps, gap); json recurses per level
MAX_INT = 1 << 64  # keys are 64-bit, positions and sizes count blocks or bytes of a device, times are seconds
MAX_TIME = 1 << 33  # seconds since 1970: the year 2242. Not "now": the clock may have stepped back since.
MAX_POSITION = 1 << 63  # a probe cursor's positions count blocks of a device, whose size in bytes is below 2**63


@dataclass(frozen=True)
class VolumeIdentity:
    key: str
    source: str  # volume_id, wwn, serial, backing_file, or name+size
    size: int

    @classmethod
    def of(cls, device: BlockDevice) -> VolumeIdentity:
        # A partition inherits its disk's serial, WWN and volume id: its number keeps it apart from the disk
        # and from its sibling partitions.
        part = ""
        if device.parent and device.name.startswith(device.parent):
            part = ":part" + device.name[len(device.parent) :].lstrip("p")
        for source in ("volume_id", "wwn", "serial", "backing_file"):
            value = getattr(device, source)
            if value:
                return cls(f"{source}:{value}{part}", source, device.size_bytes)
        return cls(f"name:{device.name}:{device.size_bytes}", "name+size", device.size_bytes)

    @property
    def stable(self) -> bool:
        return self.source != "name+size"

    def file_name(self) -> str:
        return "volume-" + re.sub(r"[^A-Za-z0-9_.-]", "_", self.key) + ".json"

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "source": self.source, "size": self.size}


class VolumeState:
    """One volume's state file. Thread-safe: probes, warm-ups and the detector share it."""

    def __init__(
        self, directory: str | None, identity: VolumeIdentity, device: str = "", earlier: VolumeIdentity | None = None
    ) -> None:
        self.identity = identity
        self._earlier = earlier  # the identity this volume had in earlier versions: its file is carried over
        self.device = device  # the kernel name it was last seen under
        self.path = os.path.join(directory, identity.file_name()) if directory else None
        self._lock = threading.Lock()
        self._sections: dict[str, Any] = {}
        self.created = time.time()
        self.found = "new"  # what start-up found: new, ok, or corrupt / foreign (set aside), until a restart
        self.writable = directory is not None
        self.problem = "no writable state directory" if directory is None else ""
        if self.path:
            self._load()

    @property
    def status(self) -> str:
        """unwritable while writes fail; else what start-up found (corrupt and foreign stay until a restart)."""
        return self.found if self.writable else "unwritable"

    def _load(self) -> None:
        assert self.path is not None
        try:
            document = read_state_file(self.path)
        except (OSError, ValueError) as err:
            self._set_aside("corrupt", f"unreadable or corrupt ({err})")
            return
        if document is None:
            self._carry_over()
            return
        if not isinstance(document, dict) or document.get("version") != VERSION:
            self._set_aside("corrupt", "not a volprobe volume state")
            return
        if document.get("identity") != self.identity.to_json():
            self._set_aside(
                "foreign", f"belongs to {_clipped(document.get('identity'))}, not {self.identity.to_json()}"
            )
            return
        problem = _state_problem(document)
        if problem:
            self._set_aside("corrupt", problem)
            return
        self._sections, self.created, self.found = document["sections"], float(document["created"]), "ok"

    def _carry_over(self) -> None:
        """The file of this volume's earlier identity (a loop device was keyed on its name and size before its
        backing file counted): its sections become this one's, and the old file is kept as `.migrated`."""
        if self._earlier is None or self.path is None:
            return
        earlier = os.path.join(os.path.dirname(self.path), self._earlier.file_name())
        try:
            document = read_state_file(earlier)
        except (OSError, ValueError):
            return  # left alone: it may be the state of another volume of that name and size
        if not (
            isinstance(document, dict)
            and document.get("version") == VERSION
            and document.get("identity") == self._earlier.to_json()
            and _state_problem(document) is None
        ):
            return  # not a state of this volume's earlier identity: left alone
        self._sections, self.found, self.created = document["sections"], "ok", float(document["created"])
        with self._lock:
            written = self._write_locked()  # under the new identity first
        if written:
            try:
                log.info("state of %s: carried over from %s, kept as %s", self.identity.key, earlier,
                         move_aside(earlier, "migrated"))  # fmt: skip
            except OSError as err:
                log.warning("state of %s: carried over from %s, which stays (%s)", self.identity.key, earlier, err)

    def _set_aside(self, status: str, why: str) -> None:
        """Keep the bad file for a human to look at, and start afresh."""
        assert self.path is not None
        try:
            where = f"moved to {move_aside(self.path, status)}"
        except OSError as err:
            where = f"could not be moved aside ({err.strerror}); it will be replaced"
        self.found, self.problem = status, why
        log.warning("state of %s: %s %s; %s; starting afresh", self.identity.key, self.path, why, where)

    @property
    def age_seconds(self) -> float:
        return max(0.0, time.time() - self.created)

    def get(self, section: str) -> Any:
        with self._lock:
            return json.loads(json.dumps(self._sections.get(section)))  # a copy the caller may keep

    def put(self, section: str, value: Any) -> bool:
        """Set a section and write the file; False (and status "unwritable") when it cannot be written."""
        return self.update(section, lambda _old: value)

    def update(self, section: str, change: Callable[[Any], Any]) -> bool:
        """Replace a section by `change(current value)` and write the file, all under the volume's lock (the
        probes of one volume share its file)."""
        with self._lock:
            self._sections[section] = change(json.loads(json.dumps(self._sections.get(section))))
            return self._write_locked()

    def _write_locked(self) -> bool:
        if self.path is None:
            return False
        document = {
            "version": VERSION,
            "identity": self.identity.to_json(),
            "created": int(self.created),
            "saved": int(time.time()),
            "sections": self._sections,
        }
        try:
            write_atomically(self.path, json.dumps(document, sort_keys=True))
        except OSError as err:
            if self.writable:
                log.warning("state of %s: cannot write %s: %s", self.identity.key, self.path, err)
            self.writable, self.problem = False, str(err)
            return False
        if not self.writable:
            log.info("state of %s: %s can be written again", self.identity.key, self.path)
        self.writable = True
        if self.found == "new":
            self.found = "ok"
        return True


def write_atomically(path: str, text: str, mode: int | None = None) -> None:
    """Replace `path` with `text`: a crash leaves the old file or the new one, never half of one. `mode`: the
    file's permissions (else mkstemp's 0600).

    Nothing planted in the directory is written through: mkstemp creates a new file (O_CREAT|O_EXCL|O_NOFOLLOW,
    so not through a link at its name), the text and mode go through its descriptor, not its name, and rename
    replaces the name `path`, never the file a symbolic or hard link there leads to."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".volprobe-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # not chmod(tmp): the name could be swapped for a link meanwhile
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_state_file(path: str) -> Any:
    """The JSON document in `path`, None if there is no such file. ValueError if it is anything but a regular
    file of at most MAX_STATE_BYTES holding JSON that parse_state accepts: a symbolic link is not followed,
    a FIFO is not waited on (O_NONBLOCK), and what is checked (fstat) is what is read, through one descriptor.
    OSError if it cannot be read (permissions, I/O errors)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:  # what O_NOFOLLOW says of a link
            raise ValueError("a symbolic link, not followed") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"not a regular file (mode {info.st_mode:o})")
        if info.st_size > MAX_STATE_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than {MAX_STATE_BYTES}")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(MAX_STATE_BYTES + 1)  # one byte more: a file that grew since fstat is refused too
    finally:
        os.close(fd)
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(f"more than {MAX_STATE_BYTES} bytes")
    return parse_state(data.decode())


def parse_state(text: str) -> Any:
    """JSON of a state file, or ValueError: nesting at most MAX_DEPTH deep (so that no later copy or write of
    it recurses deeply), every number finite (no NaN, Infinity or 1e400) and every int below MAX_INT in
    magnitude (no 4000-digit int to convert)."""
    try:
        document = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise ValueError(f"nested more than {MAX_DEPTH} deep") from None
    stack = [(document, 1)]  # depth-first, without recursion
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise ValueError(f"nested more than {MAX_DEPTH} deep")
            stack.extend((child, depth + 1) for child in (value.values() if isinstance(value, dict) else value))
    return document


def _int(text: str) -> int:
    if len(text) > 21:  # 2**64 has 20 digits; checked before converting, as the conversion is quadratic
        raise ValueError(f"an int of {len(text)} digits")
    value = int(text)
    if not -MAX_INT < value < MAX_INT:
        raise ValueError(f"an int out of range ({value})")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400
        raise ValueError(f"a number out of range ({text:.40})")
    return value


def _constant(text: str) -> float:
    raise ValueError(f"{text} is not a number")  # NaN, Infinity, -Infinity: Python's json accepts them


def _int_in(value: object, low: int, high: int) -> bool:
    """An int (not a bool) in [low, high)."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _state_problem(document: dict[str, Any]) -> str | None:
    """What makes a volume state of this version unusable, if anything. Whatever is accepted must never make a
    later write raise, in a probe's thread: `created` is written as an int, and the probe cursors' numbers are
    read back as positions and keys."""
    sections, created = document.get("sections"), document.get("created")
    if not isinstance(sections, dict):
        return "has no sections"
    if not (isinstance(created, int | float) and not isinstance(created, bool) and 0 <= created < MAX_TIME):
        return f"has no sane creation time ({_clipped(created)})"
    probes = sections.get("probes", {})
    if not isinstance(probes, dict):
        return "has probe cursors that are not a mapping"
    for name, entry in probes.items():
        if not _valid_cursor(entry):
            return f"has a bad probe cursor {_clipped(name)}: {_clipped(entry)}"
    return None


def _clipped(value: object, limit: int = 200) -> str:
    """For a log line: whatever a state file holds, at most `limit` characters of it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def state_directory(configured: str | None) -> str | None:
    """Where state goes: the configured directory if it exists (writable or not: a read-only one still
    resumes what it holds, and the volumes' status says it cannot be written); else systemd's
    $STATE_DIRECTORY or /var/lib/volprobe if writable; else none."""
    if configured:
        if os.path.isdir(configured):
            return configured
        log.warning("state_directory %s does not exist: nothing is remembered across restarts", configured)
        return None
    for candidate in (os.environ.get("STATE_DIRECTORY", "").split(":")[0], "/var/lib/volprobe"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return None


def move_aside(path: str, status: str) -> str:
    """Rename `path` to `path.STATUS-UNIXTIME`, never over an earlier one (two in a second, or the clock stepped
    back): a set-aside file is evidence. What is renamed is the name: a symbolic link is moved, never followed,
    and a FIFO or device node is never opened."""
    stem = f"{path}.{status}-{int(time.time())}"
    for n in itertools.count():
        aside = stem if n == 0 else f"{stem}.{n}"
        try:
            # Fails if `aside` exists, where rename would replace it. Not following a link: the link itself is
            # kept, not a second name for whatever it leads to.
            os.link(path, aside, follow_symlinks=False)
        except FileExistsError:
            continue
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            if os.path.lexists(aside):  # no hard links here (vfat, some FUSE): rename to a name still free
                continue
            os.rename(path, aside)
            return aside
        os.unlink(path)
        return aside
    raise AssertionError("unreachable")


class StateStore:
    """The volume states of one state directory, one object per volume, shared by everything in the process."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._volumes: dict[str, VolumeState] = {}
        self._lock = threading.Lock()

    def volume(self, device: BlockDevice) -> VolumeState:
        identity = VolumeIdentity.of(device)
        with self._lock:
            state = self._volumes.get(identity.key)
        if state is None:
            # Read the file outside the store's lock: scrapes take it, and the state directory may be slow.
            # Earlier versions did not know a loop device's backing file: what they keyed its state on.
            earlier = VolumeIdentity.of(replace(device, backing_file="")) if identity.source == "backing_file" else None
            loaded = VolumeState(self.directory, identity, device.name, earlier)
            with self._lock:
                state = self._volumes.setdefault(identity.key, loaded)
            if state is loaded and not identity.stable:
                log.info(
                    "%s has no volume id, WWN or serial: its state is keyed on its name and size (%s)",
                    device.name,
                    identity.key,
                )
        state.device = device.name
        return state

    def volumes(self) -> dict[str, VolumeState]:
        with self._lock:
            return dict(self._volumes)


# -- the probes' fresh offsets --------------------------------------------------------------------------------


class ProbeCursor:
    """The permutation key and fresh-offset position of one probe on one volume.

    Fresh offsets are reserved ahead, `reserve_ahead` at a time, and the reservation is written before any of
    them is handed out (as a database sequence cache): a kill -9 skips the unused rest of a reservation but
    never hands out a touched block as fresh again. Each write also records how far offsets were handed out
    (`used`); after a crash, the skipped run [used, next) is a gap that revisits ("repeat" probes) avoid, since
    most of it was never touched. A clean stop records the exact position, leaving no gap.
    """

    MAX_GAPS = 32

    def __init__(self, volume: VolumeState, name: str, key: int, reserve: int) -> None:
        self.volume = volume
        self.name = name  # the probe specification this cursor belongs to
        self.reserve_ahead = max(1, reserve)
        entries = volume.get("probes")
        entry = entries.get(name) if isinstance(entries, dict) else None
        self.gaps: list[tuple[int, int]] = []
        if _valid_cursor(entry):  # always, from a loaded file: VolumeState sets aside one that is not
            self.key, self.start, self.resumed = entry["key"], entry["next"], True
            self.gaps = [(a, b) for a, b in entry.get("gaps", []) if a < b <= self.start]
            used = entry.get("used")
            if used is not None and used < self.start:  # the last run ended without a clean stop
                self.gaps = [*self.gaps, (used, self.start)][-self.MAX_GAPS :]
        else:
            self.key, self.start, self.resumed = key, 0, False
        self.reserved = self.start

    def _write(self, next_position: int, used: int) -> bool:
        def change(entries: Any) -> Any:
            entries = entries if isinstance(entries, dict) else {}
            saved = entries.get(self.name)
            position = next_position
            # Never below what another cursor of the same name reserved (a worker that outlived its stop, or a
            # configured and a discovered target on one device): only our own reservation may be given back.
            if isinstance(saved, dict) and isinstance(saved.get("next"), int) and saved["next"] > self.reserved:
                position = max(position, saved["next"])
            entries[self.name] = {
                "key": self.key,
                "next": position,
                "used": min(used, position),
                "gaps": [list(g) for g in self.gaps],
            }
            return entries

        return self.volume.update("probes", change)

    def reserve(self, needed: int) -> bool:
        """Make positions below `needed` usable; False if the reservation could not be written."""
        if needed <= self.reserved:
            return True
        upto = needed + self.reserve_ahead
        if not self._write(upto, needed - 1):
            return False
        self.reserved = upto
        return True

    def release(self, used: int) -> None:
        """On a clean stop: the next start resumes exactly after the last fresh offset used."""
        if self.start <= used <= self.reserved:
            self._write(used, used)


def _valid_cursor(entry: object) -> TypeGuard[dict[str, Any]]:
    """A probe cursor's entry as any version wrote it (the first wrote only `key` and `next`): a 64-bit key,
    positions in range, and at most MAX_GAPS gaps, each a pair of positions."""
    if not isinstance(entry, dict):
        return False
    used, gaps = entry.get("used", 0), entry.get("gaps", [])
    return (
        _int_in(entry.get("key"), 0, MAX_INT)
        and _int_in(entry.get("next"), 0, MAX_POSITION)
        and _int_in(used, 0, MAX_POSITION)
        and isinstance(gaps, list)
        and len(gaps) <= ProbeCursor.MAX_GAPS
        and all(isinstance(g, list) and len(g) == 2 and all(_int_in(v, 0, MAX_POSITION) for v in g) for g in gaps)
    )


# -- sections as checkpoints ------------------------------------------------------------------------------------


class EarlierCheckpoint(Protocol):
    """A checkpoint file of an earlier version (volprobe.warmup.FileCheckpoint)."""

    path: str

    def read(self) -> object | None: ...

    def set_aside(self) -> str: ...


class SectionCheckpoint:
    """A section of a volume's state used as a warm-up checkpoint (volprobe.warmup.Checkpoint). With `earlier`,
    a checkpoint kept elsewhere by an earlier version is read while the section is empty, and set aside
    (renamed *.migrated) once the section holds the progress."""

    def __init__(self, volume: VolumeState, section: str, earlier: EarlierCheckpoint | None = None) -> None:
        self.volume = volume
        self.section = section
        self.earlier = earlier
        self.where = f"{volume.path or '(no state directory)'} [{section}]"

    def read(self) -> object | None:
        value: object = self.volume.get(self.section)
        if value is None and self.earlier is not None:
            return self.earlier.read()
        return value

    def set_aside(self) -> str:
        """After a corrupt read: the earlier checkpoint, if that is what was read, is set aside (as a corrupt
        state is); a corrupt section is replaced by the next write."""
        if self.volume.get(self.section) is None and self.earlier is not None:
            return self.earlier.set_aside()
        return ""

    def write(self, document: dict[str, Any]) -> None:
        if not self.volume.put(self.section, document):
            raise OSError(self.volume.problem or "the volume state cannot be written")
        earlier, self.earlier = self.earlier, None
        path = earlier.path if earlier is not None else None
        if path and os.path.exists(path):
            with contextlib.suppress(OSError):
                os.replace(path, path + ".migrated")  # renames the name: a link there is moved, not followed
