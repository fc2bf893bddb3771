"""A CSI volume's record in the kubelet's directory (vol_data.json, beside the volume's mount/): which driver and
volume it is, and whether it is a PersistentVolume's. Read by discovery (a disk's `pv` label) and by kubelet (pod
volumes), which both need it: a module of its own, importing neither.

vol_data.json is read as bytes, at most VOL_DATA_MAX_BYTES, opened with O_NOFOLLOW and checked to be a regular
file by fstat: a file that is not what the kubelet writes names nothing, and is never an error. A PersistentVolume
is only what that record says (kubelet's module doc says why)."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

CSI_PLUGIN = "kubernetes.io~csi"
VOL_DATA = "vol_data.json"
VOL_DATA_MAX_BYTES = 64 * 1024  # the kubelet writes a few hundred bytes
PERSISTENT = "Persistent"  # vol_data.json's volumeLifecycleMode of a PersistentVolume's volume


@dataclass(frozen=True)
class CsiData:
    """What vol_data.json says (empty strings where it says nothing usable)."""

    driver: str = ""
    volume_handle: str = ""
    spec_volume_id: str = ""
    attachment_id: str = ""
    node_name: str = ""
    lifecycle_mode: str = ""

    @property
    def persistent(self) -> bool:
        """Whether the kubelet recorded a PersistentVolume's: Persistent, or no mode at all (kubelets before
        inline ephemeral volumes wrote none), with a specVolID."""
        return self.lifecycle_mode in ("", PERSISTENT) and self.spec_volume_id != ""


def persistent_volume(plugin: str, name: str, csi: CsiData) -> str:
    """The PersistentVolume a pod volume (`plugin`, directory `name`) is, as the kubelet's record `csi` says; ""
    where it does not say one (see the module's doc)."""
    if plugin != CSI_PLUGIN or not csi.persistent or csi.spec_volume_id != name:
        return ""
    return csi.spec_volume_id


def persistent_volume_at(directory: str) -> str:
    """persistent_volume() of the CSI volume directory `directory` (pods/<uid>/volumes/kubernetes.io~csi/<name>),
    from its vol_data.json (read_vol_data())."""
    return persistent_volume(CSI_PLUGIN, os.path.basename(directory), read_vol_data(os.path.join(directory, VOL_DATA)))


def _text(value: object, limit: int = 1024) -> str:
    """A vol_data.json field as a label may carry it: a string of printable characters, bounded; else ""."""
    if not isinstance(value, str) or len(value) > limit or not value.isprintable():
        return ""
    return value


def parse_vol_data(raw: bytes) -> CsiData:
    """vol_data.json's fields; CsiData() for anything that is not a JSON object in UTF-8."""
    if len(raw) > VOL_DATA_MAX_BYTES:
        return CsiData()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return CsiData()
    if not isinstance(data, dict):
        return CsiData()
    return CsiData(
        driver=_text(data.get("driverName")),
        volume_handle=_text(data.get("volumeHandle")),
        spec_volume_id=_text(data.get("specVolID")),
        attachment_id=_text(data.get("attachmentID")),
        node_name=_text(data.get("nodeName")),
        lifecycle_mode=_text(data.get("volumeLifecycleMode")),
    )


def read_vol_data(path: str) -> CsiData:
    """vol_data.json at `path`: opened without following a symlink (nor blocking on a FIFO), a regular file by
    fstat, at most VOL_DATA_MAX_BYTES read; CsiData() if any of it fails."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return CsiData()
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return CsiData()
        chunks, size = [], 0
        while size <= VOL_DATA_MAX_BYTES and (chunk := os.read(fd, VOL_DATA_MAX_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        return parse_vol_data(b"".join(chunks))
    except OSError:
        return CsiData()
    finally:
        os.close(fd)
