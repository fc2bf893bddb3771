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
the volume starts afresh. When the directory cannot be written the store says so (`status`), and its users
carry on in memory as if there were no state.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from .discovery import BlockDevice

log = logging.getLogger(__name__)

VERSION = 1
STATUSES = ("ok", "new", "corrupt", "foreign", "unwritable")  # see VolumeState.status


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
            with open(self.path) as f:
                document = json.load(f)
        except FileNotFoundError:
            self._carry_over()
            return
        except (OSError, ValueError) as err:
            self._set_aside("corrupt", f"unreadable or corrupt ({err})")
            return
        if not isinstance(document, dict) or document.get("version") != VERSION:
            self._set_aside("corrupt", "not a volprobe volume state")
            return
        if document.get("identity") != self.identity.to_json():
            self._set_aside("foreign", f"belongs to {document.get('identity')}, not {self.identity.to_json()}")
            return
        sections = document.get("sections")
        created = document.get("created")
        if not isinstance(sections, dict) or not isinstance(created, int | float):
            self._set_aside("corrupt", "has no sections")
            return
        self._sections, self.created, self.found = sections, float(created), "ok"

    def _carry_over(self) -> None:
        """The file of this volume's earlier identity (a loop device was keyed on its name and size before its
        backing file counted): its sections become this one's, and the old file is kept as `.migrated`."""
        if self._earlier is None or self.path is None:
            return
        earlier = os.path.join(os.path.dirname(self.path), self._earlier.file_name())
        try:
            with open(earlier) as f:
                document = json.load(f)
        except (OSError, ValueError):
            return
        if not (
            isinstance(document, dict)
            and document.get("version") == VERSION
            and document.get("identity") == self._earlier.to_json()
            and isinstance(document.get("sections"), dict)
            and isinstance(document.get("created"), int | float)
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
    file's permissions (else mkstemp's 0600)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".volprobe-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
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
    back): a set-aside file is evidence."""
    stem = f"{path}.{status}-{int(time.time())}"
    for n in itertools.count():
        aside = stem if n == 0 else f"{stem}.{n}"
        try:
            os.link(path, aside)  # fails if `aside` exists, where rename would replace it
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
        if isinstance(entry, dict) and isinstance(entry.get("key"), int) and isinstance(entry.get("next"), int):
            self.key, self.start, self.resumed = entry["key"], max(0, entry["next"]), True
            gaps = entry.get("gaps", [])
            if isinstance(gaps, list):
                self.gaps = [(a, b) for a, b in (g for g in gaps if _pair(g)) if 0 <= a < b <= self.start]
            used = entry.get("used")
            if isinstance(used, int) and used < self.start:  # the last run ended without a clean stop
                self.gaps = [*self.gaps, (max(0, used), self.start)][-self.MAX_GAPS :]
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


def _pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)


# -- sections as checkpoints ------------------------------------------------------------------------------------


class EarlierCheckpoint(Protocol):
    """A checkpoint file of an earlier version (volprobe.warmup.FileCheckpoint)."""

    path: str

    def read(self) -> object | None: ...


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
        value = self.volume.get(self.section)
        if value is None and self.earlier is not None:
            return self.earlier.read()
        return value

    def write(self, document: dict) -> None:
        if not self.volume.put(self.section, document):
            raise OSError(self.volume.problem or "the volume state cannot be written")
        earlier, self.earlier = self.earlier, None
        path = earlier.path if earlier is not None else None
        if path and os.path.exists(path):
            with contextlib.suppress(OSError):
                os.replace(path, path + ".migrated")
