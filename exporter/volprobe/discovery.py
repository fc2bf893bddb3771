"""Block devices, their identity and stacking, and the mounts above them, read from sysfs, /proc and /dev.

pyudev enumerates devices and adds udev's properties where udevd runs; where it does not (containers, the
development machines) libudev still enumerates but has no properties, and everything falls back to sysfs.
All roots are parameters so tests run on fixture trees.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import voldata

log = logging.getLogger(__name__)

# How long a cached identity is trusted where the kernel gives no DISKSEQ (before Linux 5.15), and so a disk
# re-made under the same name and size cannot be told from the one before without reading it all again.
UNSEQUENCED_TTL_S = 60.0
KNOWN_RECHECK_S = 1.0  # a disk's generation looked at this recently is not looked at again

# Kernel name prefixes that are never default targets: not volumes anyone provisioned.
SKIP_BY_DEFAULT = ("loop", "ram", "zram", "sr", "fd", "dm-", "md", "nbd")
_KIND_BY_PREFIX = (
    ("dm-", "dm"),
    ("md", "md"),
    ("loop", "loop"),
    ("zram", "zram"),
    ("ram", "ram"),
    ("nbd", "nbd"),
    ("sr", "rom"),
    ("fd", "floppy"),
)


@dataclass(frozen=True)
class Mount:
    major: int
    minor: int
    mount_point: str
    fstype: str
    source: str
    root: str = "/"  # the mounted directory within its filesystem: a bound device node's name on devtmpfs


@dataclass(frozen=True)
class BlockDevice:
    name: str
    major: int
    minor: int
    kind: str  # disk, part, dm, md, loop, zram, ram, nbd, rom, floppy
    devnode: str
    size_bytes: int
    logical_block_size: int
    physical_block_size: int
    rotational: bool = False
    read_only: bool = False
    parent: str | None = None  # the disk of a partition
    slaves: tuple[str, ...] = ()
    holders: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()
    serial: str = ""
    model: str = ""
    vendor: str = ""
    wwn: str = ""
    volume_id: str = ""
    dm_name: str = ""
    links: tuple[str, ...] = field(default=(), repr=False)
    backing_file: str = ""  # a loop device's: the image it shows, the same whichever loop it is attached to


@dataclass
class KnownDevice:
    """A device as Host.known_device() read it: its generation then, when it was read and last checked."""

    device: BlockDevice
    generation: str
    read: float
    checked: float


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _read_small(path: str) -> str:
    """A sysfs attribute, raw: without pathlib, for what is read every few seconds."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)


def _read_whole(path: str) -> str:
    """A procfs file of any length, raw: a seq_file gives a page per read. Decoded as the kernel's paths are
    (os.fsdecode): a byte that is not UTF-8 in a mount point or a swap file's path stays that byte, and the
    path it is in stays usable in os calls."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return os.fsdecode(b"".join(chunks))
    finally:
        os.close(fd)


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(_read(path))
    except ValueError:
        return default


def _unescape_mount(text: str) -> str:
    """mountinfo's octal escapes (`\\040` for a space), each back to its byte, as os.fsdecode gives it."""
    return re.sub(r"\\([0-7]{3})", lambda m: os.fsdecode(bytes([int(m.group(1), 8) & 0xFF])), text)


def parse_mountinfo(text: str) -> list[Mount]:
    """Mounts from /proc/self/mountinfo (see proc(5)), as _read_whole decodes it; bad lines are skipped. The
    kernel escapes only a space, a tab, a newline and a backslash in a path: lines end at a newline and fields
    at a space, nothing else (a form feed or U+3000 may be in a mount point)."""
    mounts = []
    for line in text.split("\n"):
        left, sep, right = line.partition(" - ")
        fields_left, fields_right = left.split(" "), right.split(" ")
        if not sep or len(fields_left) < 5 or len(fields_right) < 2:
            continue
        try:
            major, minor = (int(x) for x in fields_left[2].split(":"))
        except ValueError:
            continue
        mount_point, root = _unescape_mount(fields_left[4]), _unescape_mount(fields_left[3])
        mounts.append(Mount(major, minor, mount_point, fields_right[0], fields_right[1], root))
    return mounts


# A pod's volume: .../pods/<pod uid>/volumes/kubernetes.io~<plugin>/<name>[/mount]. Its name is the pod spec's (its
# tenant's) for an inline volume, the PersistentVolume's otherwise: a PersistentVolume only where the kubelet's
# record beside it says so (kubelet.persistent_volume_at). The other paths are a PersistentVolume's alone.
_POD_VOLUME = re.compile(
    r"/pods/(?P<pod>[0-9a-f-]{36})/volumes/kubernetes\.io~(?P<plugin>[^/]+)/(?P<pv>[^/]+)(?:/mount)?(?:/|$)"
)
_KUBELET_PATTERNS = [
    _POD_VOLUME,
    # Raw block volumes: .../pods/<pod uid>/volumeDevices/kubernetes.io~<plugin>/<pv>
    re.compile(r"/pods/(?P<pod>[0-9a-f-]{36})/volumeDevices/kubernetes\.io~[^/]+/(?P<pv>[^/]+)(?:/|$)"),
    # CSI block volumes as published: .../csi/volumeDevices/publish/<pv>/<pod uid>
    re.compile(r"/csi/volumeDevices/publish/(?P<pv>[^/]+)/(?P<pod>[0-9a-f-]{36})(?:/|$)"),
    # CSI staging (older kubelets): .../kubernetes.io/csi/pv/<pv>/globalmount
    re.compile(r"/kubernetes\.io/csi/pv/(?P<pv>[^/]+)/globalmount(?:/|$)"),
]


# A substring of every mount point the patterns above match, as it stands in mountinfo (which escapes only
# spaces, tabs, newlines and backslashes): lines without one are left out before they are parsed.
_KUBELET_MARKERS = ("kubernetes.io", "/csi/volumeDevices/publish/")


def kubelet_volume_path(path: str) -> bool:
    """Whether `path` is (or is in) a volume's path in the kubelet's layout: pure parsing, nothing read."""
    return any(pattern.search(path) for pattern in _KUBELET_PATTERNS)


def kubernetes_volume(*paths: str) -> tuple[str, str]:
    """(PersistentVolume name, pod UID) of the first kubelet volume path among `paths`, or ("", ""). A pod's
    volume directory names a PersistentVolume only where the kubelet recorded one there (a CSI volume's
    vol_data.json, read: kubelet.persistent_volume_at); any other (an inline ephemeral CSI volume, an in-tree
    plugin's) gives ("", pod UID)."""
    for path in paths:
        for pattern in _KUBELET_PATTERNS:
            match = pattern.search(path or "")
            if match:
                groups = match.groupdict()
                pv = groups.get("pv") or ""
                if pattern is _POD_VOLUME:
                    plugin = f"kubernetes.io~{groups['plugin']}"
                    pv = voldata.persistent_volume_at(path[: match.end("pv")]) if plugin == voldata.CSI_PLUGIN else ""
                return pv, groups.get("pod") or ""
    return "", ""


def kubernetes_volumes_of(mounts: list[Mount], devnums: set[tuple[int, int]], names: set[str]) -> set[tuple[str, str]]:
    """(PersistentVolume, pod UID) of every kubelet mount of a device: its filesystem mounted (by device
    number: the device's or a partition's) at a pod's volume or at the CSI staging globalmount (pod UID ""), or
    its device node bound (a devtmpfs mount whose root is /<kernel name>) at a raw block volume's path."""
    found = set()
    for mount in mounts:
        ours = (mount.major, mount.minor) in devnums
        if not ours and mount.fstype == "devtmpfs":
            ours = mount.root.lstrip("/") in names
        if ours:
            pv, pod = kubernetes_volume(mount.mount_point)
            if pv:
                found.add((pv, pod))
    return found


def choose_kubernetes_volume(found: set[tuple[str, str]], previous: tuple[str, str] = ("", "")) -> tuple[str, str]:
    """One (pv, pod_uid) for a device that several kubelet mounts show: a pod's mount before the node's staging
    mount; the previous choice while it still holds (a second pod mounting the volume, or the first one going
    while another stays, changes no label); otherwise the least in (pv, pod_uid) order."""
    with_pod = {v for v in found if v[1]}
    best = with_pod or found
    if previous in best:
        return previous
    return min(best) if best else ("", "")


def _loop_backing_file(base: Path) -> str:
    """The file a loop device shows, with the offset it starts at if not 0 (two loops on one image are two
    volumes); "" if none, or if the file was deleted (a path then says nothing stable)."""
    path = _read(base / "loop" / "backing_file")
    if not path or path.endswith(" (deleted)"):
        return ""
    offset = _read(base / "loop" / "offset")
    return f"{path}@{offset}" if offset not in ("", "0") else path


def ebs_volume_id(serial: str) -> str:
    """AWS EBS NVMe serials are the volume id without its dash: vol0123... -> vol-0123..."""
    match = re.fullmatch(r"vol-?([0-9a-f]{8,17})", serial.strip())
    return f"vol-{match.group(1)}" if match else ""


def _vpd_serial(raw: bytes) -> str:
    # SCSI VPD page 0x80: 4-byte header, then the serial number, space padded.
    return raw[4:].decode("ascii", "replace").strip(" \x00") if len(raw) > 4 else ""


class Host:
    """A view of the machine's block devices through injectable /sys, /proc and /dev roots."""

    def __init__(self, sys_root: str = "/sys", proc_root: str = "/proc", dev_root: str = "/dev") -> None:
        self.sys = Path(sys_root)
        self.proc = Path(proc_root)
        self.dev = Path(dev_root)
        self._known: dict[str, KnownDevice] = {}
        self._known_lock = threading.Lock()

    # -- enumeration -------------------------------------------------------------------------------

    def names(self) -> list[str]:
        try:
            return sorted(p.name for p in (self.sys / "class" / "block").iterdir())
        except OSError:
            return []

    def devices(self) -> dict[str, BlockDevice]:
        udev = self._udev_properties()
        links = self._dev_links()
        return {name: self._device(name, udev.get(name, {}), links.get(name, ())) for name in self.names()}

    def device(self, name: str) -> BlockDevice | None:
        if not (self.sys / "class" / "block" / name).exists():
            return None
        udev = self._udev_properties(only=name)
        return self._device(name, udev.get(name, {}), self._dev_links().get(name, ()))

    # -- identities, for those who ask every few seconds --------------------------------------------

    def generation(self, name: str) -> str | None:
        """What changes when the kernel makes a new device under this name, or resizes it: its uevent file (the
        device number and, since Linux 5.15, DISKSEQ, which every new disk and every newly attached loop file
        gets) and its size; where udevd runs, also when udev last wrote its properties (serials and WWNs come
        after the kernel's event). Two small reads where resolving the device takes dozens; None without it."""
        base = f"{self.sys}/class/block/{name}"
        try:
            size = _read_small(f"{base}/size")
            try:
                uevent = _read_small(f"{base}/uevent")
            except FileNotFoundError:  # a tree not laid out by a kernel: its device number, and the TTL
                uevent = "DEV=" + _read_small(f"{base}/dev")
        except OSError:
            return None
        found = f"{uevent}size={size}"
        if self._udev_in_use():
            numbers = re.search(r"MAJOR=(\d+)\s+MINOR=(\d+)", uevent)
            try:
                found += f";udev={os.stat(f'/run/udev/data/b{numbers[1]}:{numbers[2]}').st_mtime_ns}" if numbers else ""
            except OSError:
                found += ";udev=none"
        return found

    def known_device(self, name: str) -> BlockDevice | None:
        """device(name), read again only when its generation() changes (without DISKSEQ in it, also after
        UNSEQUENCED_TTL_S): for the pollers that look at the same disks every few seconds. A generation looked
        at less than KNOWN_RECHECK_S ago is not looked at again: the throttle sampler asks once per direction.
        Whatever judges whether a device may be written reads it afresh with device()."""
        now = time.monotonic()
        with self._known_lock:
            known = self._known.get(name)
        if known is not None and now - known.checked < KNOWN_RECHECK_S:
            return known.device
        generation = self.generation(name)
        if generation is None:
            with self._known_lock:
                self._known.pop(name, None)
            return None
        sequenced = "DISKSEQ=" in generation
        if known is not None and known.generation == generation and (sequenced or now - known.read < UNSEQUENCED_TTL_S):
            known.checked = now
            return known.device
        device = self.device(name)
        with self._known_lock:
            if device is None:
                self._known.pop(name, None)
            else:
                self._known[name] = KnownDevice(device, generation, read=now, checked=now)
        return device

    def _udev_in_use(self) -> bool:
        return str(self.sys) == "/sys" and os.path.isdir("/run/udev/data")

    def _udev_properties(self, only: str | None = None) -> dict[str, dict[str, str]]:
        """udev properties by kernel name: empty where udevd's database is missing, or off the real /sys."""
        if not self._udev_in_use():
            return {}
        try:
            import pyudev

            context = pyudev.Context()
            if only:
                found = [pyudev.Devices.from_name(context, "block", only)]
            else:
                found = list(context.list_devices(subsystem="block"))
            return {d.sys_name: dict(d.properties) for d in found}
        except Exception as err:  # libudev missing or a device vanished mid-walk: sysfs is enough
            log.debug("pyudev enumeration failed, using sysfs only: %s", err)
            return {}

    def _dev_links(self) -> dict[str, tuple[str, ...]]:
        """Symlinks under /dev/disk (by-id, azure, ...) by the kernel name they point at."""
        result: dict[str, list[str]] = {}
        base = self.dev / "disk"
        if not base.is_dir():
            return {}
        for dirpath, _dirnames, filenames in os.walk(base):
            for filename in filenames:
                link = Path(dirpath) / filename
                if not link.is_symlink():
                    continue
                target = os.path.normpath(os.path.join(dirpath, os.readlink(link)))
                result.setdefault(os.path.basename(target), []).append(str(link.relative_to(self.dev)))
        return {name: tuple(sorted(v)) for name, v in result.items()}

    def _device(self, name: str, udev: dict[str, str], links: tuple[str, ...]) -> BlockDevice:
        base = self.sys / "class" / "block" / name
        major, _, minor = _read(base / "dev").partition(":")
        is_partition = (base / "partition").exists()
        parent = None
        if is_partition:
            parent = base.resolve().parent.name
            if not (self.sys / "class" / "block" / parent).exists():
                parent = self._partition_parent(name)
        kind = "part" if is_partition else next((k for p, k in _KIND_BY_PREFIX if name.startswith(p)), "disk")
        queue = (self.sys / "class" / "block" / (parent or name)) / "queue"
        identity_base = self.sys / "class" / "block" / (parent or name)
        serial, model, vendor, wwn = self._identity(identity_base, udev)
        device = BlockDevice(
            name=name,
            major=int(major or 0),
            minor=int(minor or 0),
            kind=kind,
            devnode=str(self.dev / name),
            size_bytes=_read_int(base / "size") * 512,
            logical_block_size=_read_int(queue / "logical_block_size", 512),
            physical_block_size=_read_int(queue / "physical_block_size", 512),
            rotational=_read(queue / "rotational") == "1",
            read_only=_read(base / "ro") == "1",
            parent=parent,
            slaves=self._listdir(base / "slaves"),
            holders=self._listdir(base / "holders"),
            partitions=tuple(sorted(p.name for p in self._subdirs(base) if (p / "partition").exists())),
            serial=serial,
            model=model,
            vendor=vendor,
            wwn=wwn,
            dm_name=_read(base / "dm" / "name"),
            links=links,
            backing_file=_loop_backing_file(base),
        )
        volume = self._volume_id(device, links, udev)
        return replace(device, volume_id=volume) if volume else device

    def _partition_parent(self, name: str) -> str | None:
        for candidate in self.names():
            if (self.sys / "class" / "block" / candidate / name / "partition").exists():
                return candidate
        return None

    @staticmethod
    def _listdir(path: Path) -> tuple[str, ...]:
        try:
            return tuple(sorted(p.name for p in path.iterdir()))
        except OSError:
            return ()

    @staticmethod
    def _subdirs(path: Path) -> list[Path]:
        try:
            return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
        except OSError:
            return []

    @staticmethod
    def _identity(base: Path, udev: dict[str, str]) -> tuple[str, str, str, str]:
        device = base / "device"
        serial = udev.get("ID_SERIAL_SHORT") or _read(base / "serial") or _read(device / "serial")
        if not serial:
            try:
                serial = _vpd_serial((device / "vpd_pg80").read_bytes())
            except OSError:
                serial = ""
        model = udev.get("ID_MODEL") or _read(device / "model")
        vendor = udev.get("ID_VENDOR") or _read(device / "vendor")
        wwn = udev.get("ID_WWN") or _read(base / "wwid") or _read(device / "wwid")
        return serial.strip(), model.strip(), vendor.strip(), wwn.strip()

    @staticmethod
    def _volume_id(device: BlockDevice, links: tuple[str, ...], udev: dict[str, str]) -> str:
        if "Amazon Elastic Block Store" in device.model:
            return ebs_volume_id(device.serial)
        all_links = set(links) | {link.removeprefix("/dev/") for link in udev.get("DEVLINKS", "").split() if link}
        for link in sorted(all_links):
            match = re.fullmatch(r"disk/by-id/google-(.+)", link)
            if match and not re.search(r"-part\d+$", match.group(1)):
                return match.group(1)
        azure = sorted(link for link in all_links if link.startswith("disk/azure/"))
        for link in azure:
            if "/by-name/" in link:
                return link.rsplit("/", 1)[1]
        for link in azure:
            match = re.search(r"(?:by-lun/|lun)(\d+)$", link)
            if match:
                return f"lun{match.group(1)}"
        if device.vendor == "Google" and device.model == "PersistentDisk":
            return device.serial
        return ""

    # -- paths and mounts ---------------------------------------------------------------------------

    def mounts(self) -> list[Mount]:
        try:
            return parse_mountinfo(_read_whole(f"{self.proc}/self/mountinfo"))
        except OSError:
            return []

    def kubelet_mounts(self) -> list[Mount]:
        """The host's mounts at kubelet's volume paths (kubelet_volume_path()): PID 1's mount namespace
        (the host's init under hostPID, or with the host's /proc as --path.procfs), else this process's if PID
        1's cannot be read. Read at every scrape: the other mounts are left out before they are parsed."""
        for pid in ("1", "self"):
            try:
                text = _read_whole(f"{self.proc}/{pid}/mountinfo")
            except OSError:
                continue
            lines = [line for line in text.split("\n") if any(marker in line for marker in _KUBELET_MARKERS)]
            return [mount for mount in parse_mountinfo("\n".join(lines)) if kubelet_volume_path(mount.mount_point)]
        return []

    def kubernetes_volumes(self, device: BlockDevice, mounts: list[Mount]) -> set[tuple[str, str]]:
        """(pv, pod UID) of the kubelet mounts among `mounts` of a device or of its partitions."""
        devnums, names = {(device.major, device.minor)}, {device.name, *device.partitions}
        for part in device.partitions:
            major, _, minor = _read(self.sys / "class" / "block" / part / "dev").partition(":")
            if major.isdigit() and minor.isdigit():
                devnums.add((int(major), int(minor)))
        return kubernetes_volumes_of(mounts, devnums, names)

    def name_for_devnum(self, major: int, minor: int) -> str | None:
        link = self.sys / "dev" / "block" / f"{major}:{minor}"
        try:
            return Path(os.readlink(link)).name
        except OSError:
            return None

    def mount_for_path(self, path: str) -> Mount | None:
        """The mount a path lives on: same st_dev, longest mount point that is a prefix of the path."""
        real = os.path.realpath(path)
        try:
            st_dev = os.stat(real).st_dev
        except OSError:
            return None
        best = None
        for mount in self.mounts():
            prefix = mount.mount_point.rstrip("/") + "/"
            if real != mount.mount_point and not real.startswith(prefix) and mount.mount_point != "/":
                continue
            if (mount.major, mount.minor) != (os.major(st_dev), os.minor(st_dev)):
                continue
            if best is None or len(mount.mount_point) > len(best.mount_point):
                best = mount
        return best

    def device_for_path(self, path: str) -> str | None:
        """Kernel name of the block device a path is (a device node) or lives on (a file or directory)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        if stat.S_ISBLK(st.st_mode):
            return self.name_for_devnum(os.major(st.st_rdev), os.minor(st.st_rdev))
        name = self.name_for_devnum(os.major(st.st_dev), os.minor(st.st_dev))
        if name:
            return name
        # btrfs and others report an anonymous st_dev: the mount's source names the device.
        mount = self.mount_for_path(path)
        if mount and mount.source.startswith("/dev/"):
            try:
                rdev = os.stat(mount.source).st_rdev
                return self.name_for_devnum(os.major(rdev), os.minor(rdev))
            except OSError:
                return None
        return None

    def mounts_of(self, device: BlockDevice) -> list[Mount]:
        """Mounts of the device itself or of any of its partitions."""
        devnums = {(device.major, device.minor)}
        for part in device.partitions:
            other = self.device(part)
            if other:
                devnums.add((other.major, other.minor))
        return [m for m in self.mounts() if (m.major, m.minor) in devnums]

    def leaf_disks(self, name: str) -> list[str]:
        """Whole disks under a device: a partition's disk, the slaves of dm and md devices, recursively."""
        device = self.device(name)
        if device is None:
            return []
        if device.parent:
            return self.leaf_disks(device.parent)
        if device.slaves:
            result: list[str] = []
            for slave in device.slaves:
                result.extend(d for d in self.leaf_disks(slave) if d not in result)
            return result
        return [name]

    def swaps(self) -> set[str]:
        """Device nodes in use as swap."""
        try:
            lines = _read_whole(f"{self.proc}/swaps").split("\n")[1:]
        except OSError:
            return set()
        return {line.split(" ")[0] for line in lines if line.strip()}
