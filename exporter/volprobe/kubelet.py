"""Pod volumes, as the node's kubelet mounted them: pure parsing of its directory's layout and the mount table.

The kubelet mounts each volume of a pod at `<kubelet directory>/pods/<pod uid>/volumes/<plugin>/<name>`, where
`<plugin>` is `kubernetes.io~csi` (then the mount is that directory's `mount/`, and `vol_data.json` beside it
says which CSI driver and volume it is), or an in-tree plugin (`kubernetes.io~nfs`, `kubernetes.io~cephfs`,
...), whose mount is the directory itself. Only what is mounted counts: the mount table (discovery.Mount, the
host's mountinfo) says which of those paths are mounts, with their filesystem type, source and device number;
the directory is never listed, and nothing inside a volume is ever read. vol_data.json is read as bytes, at most
VOL_DATA_MAX_BYTES, opened with O_NOFOLLOW and checked to be a regular file by fstat: a file that is not what the
kubelet writes names no driver, and is never an error.

A volume's PersistentVolume (`pv`) is only what the kubelet's own record says: a CSI volume's vol_data.json whose
volumeLifecycleMode is Persistent (absent where kubelets wrote none) and whose specVolID is the volume's directory
name (persistent_volume()). An inline ephemeral CSI volume (Ephemeral) is named by its pod's spec, which its tenant
writes, as is an in-tree plugin's volume given inline, which nothing on the node tells from a PersistentVolume's:
none of those has a pv, and none matches a rule's `pv`.

A volume is `block` when a block device backs it (a real device number, or a mount source under /dev for a
filesystem such as btrfs that reports an anonymous one): its disk is discovery's to probe. It is `filesystem`
when it is a network or FUSE filesystem (NETWORK_FSTYPES, fuse.*): those get a mount check (runtime.pods).
Anything else (tmpfs of secrets and projected volumes, overlay) is `virtual`, and left alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .discovery import Mount
from .voldata import CSI_PLUGIN as CSI_PLUGIN
from .voldata import PERSISTENT as PERSISTENT
from .voldata import VOL_DATA as VOL_DATA
from .voldata import VOL_DATA_MAX_BYTES as VOL_DATA_MAX_BYTES
from .voldata import CsiData as CsiData
from .voldata import parse_vol_data as parse_vol_data
from .voldata import persistent_volume as persistent_volume
from .voldata import persistent_volume_at as persistent_volume_at
from .voldata import read_vol_data as read_vol_data

DEFAULT_DIRECTORY = "/var/lib/kubelet"
NETWORK_FSTYPES = frozenset({"nfs", "nfs4", "ceph", "cifs", "smb3", "glusterfs", "9p", "lustre", "virtiofs"})
BLOCK, FILESYSTEM, VIRTUAL = "block", "filesystem", "virtual"

_POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_PLUGIN = re.compile(r"[a-z0-9.-]+~[a-z0-9.-]+")


@dataclass(frozen=True)
class PodVolume:
    pod_uid: str
    plugin: str  # kubernetes.io~csi, kubernetes.io~nfs, ...
    name: str  # the volume's directory: the PV's name for a claim's volume, else the pod's (its tenant's) name
    path: str  # the mount point
    mount: Mount
    csi: CsiData

    @property
    def pv(self) -> str:
        """The PersistentVolume, as the kubelet recorded it (persistent_volume()); "" for any other volume."""
        return persistent_volume(self.plugin, self.name, self.csi)

    @property
    def driver(self) -> str:
        """The CSI driver, or the in-tree plugin's name (kubernetes.io/nfs)."""
        return self.csi.driver if self.plugin == CSI_PLUGIN else self.plugin.replace("~", "/")

    @property
    def backing(self) -> str:
        return backing(self.mount)

    @property
    def key(self) -> tuple[str, int, int, str, str]:
        """What makes it the same mount from one scan to the next: a volume mounted again is another."""
        return (self.path, self.mount.major, self.mount.minor, self.mount.fstype, self.mount.source)


def backing(mount: Mount) -> str:
    """block, filesystem (network or FUSE) or virtual (see the module's doc)."""
    if mount.fstype in NETWORK_FSTYPES or mount.fstype == "fuse" or mount.fstype.startswith("fuse."):
        return FILESYSTEM  # fuseblk (ntfs-3g, say) has a block device
    if mount.major != 0 or mount.source.startswith("/dev/"):
        return BLOCK
    return VIRTUAL


def split(directory: str, mount_point: str) -> tuple[str, str, str] | None:
    """(pod uid, plugin, volume name) of a pod volume's mount point under the kubelet `directory`, else None."""
    prefix = directory.rstrip("/") + "/pods/"
    if not mount_point.startswith(prefix):
        return None
    parts = mount_point[len(prefix) :].split("/")
    if len(parts) < 4 or parts[1] != "volumes" or not _POD_UID.fullmatch(parts[0]) or not _PLUGIN.fullmatch(parts[2]):
        return None
    pod, plugin, name, rest = parts[0], parts[2], parts[3], parts[4:]
    if not name or name in (".", ".."):
        return None
    if rest != (["mount"] if plugin == CSI_PLUGIN else []):
        return None
    return pod, plugin, name


def pod_volumes(directory: str, mounts: list[Mount], read: bool = True) -> list[PodVolume]:
    """The mounted pod volumes under the kubelet `directory`, by mount point (the mount on top where several
    are stacked: mountinfo lists them in the order they were made). With `read`, each CSI volume's vol_data.json
    is read (its directory is on the kubelet's filesystem, beside the mount, never in it)."""
    found: dict[str, PodVolume] = {}
    for mount in mounts:
        parts = split(directory, mount.mount_point)
        if parts is None:
            continue
        pod, plugin, name = parts
        csi = CsiData()
        if read and plugin == CSI_PLUGIN:
            csi = read_vol_data(os.path.join(os.path.dirname(mount.mount_point), VOL_DATA))
        found[mount.mount_point] = PodVolume(pod, plugin, name, mount.mount_point, mount, csi)
    return sorted(found.values(), key=lambda v: v.path)


def enabled(setting: bool | None, directory: str) -> bool:
    """`kubernetes.enabled`: as set, or (unset) whether the kubelet directory exists."""
    return setting if setting is not None else os.path.isdir(directory)
