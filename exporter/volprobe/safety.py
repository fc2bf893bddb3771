"""Is a raw device blank enough to write to? Every check must pass; any doubt is a refusal.

A device may take raw write probes (or a write warm-up) only when the user opted in for it AND it carries no
filesystem, partition table, RAID, LVM, swap or crypto signature (our own magic checks of its first and last
MiB, plus libblkid through `blkid -p` and `wipefs` where installed), is not mounted or used as swap, has no
holders and no partitions.

Every check that guards a write is made on the descriptor the writes go through, never on a name: the device is
opened with O_EXCL first (the kernel refuses it while a mount, md, dm or swap claims it, and nothing can claim
it afterwards), then judged by its st_rdev (sysfs facts, mounts, holders), its own bytes (read through that
descriptor) and libblkid given that very descriptor (/dev/fd/N); its identity and size must be those of the
device the target was resolved to. A name that now leads elsewhere (a by-id link following a re-attached,
since-formatted volume) is refused, not written.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import stat
import struct
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

from .discovery import BlockDevice, Host
from .state import VolumeIdentity

MIB = 1024 * 1024
# Raw write probes never touch the first and last MiB, where every signature we know of lives, so a
# device written by volprobe stays recognisably blank and no label written later is clobbered.
GUARD_BYTES = MIB
PROBE_TIMEOUT_S = 10.0
_BLKGETSIZE64 = 0x80081272
T = TypeVar("T")


class Refused(OSError):
    """What a descriptor turned out to be, once opened, is not what volprobe may write: it is closed unwritten,
    and counted as errno="REFUSED"."""

    def __init__(self, why: str, path: str = "") -> None:
        super().__init__(errno.EPERM, why, path or None)


# (name, offset from the start, magic); negative offsets count from the end of the device.
_MAGICS: list[tuple[str, int, bytes]] = [
    ("ext2/3/4", 0x438, b"\x53\xef"),
    ("xfs", 0, b"XFSB"),
    ("btrfs", 0x10040, b"_BHRfS_M"),
    ("dos partition table or boot sector", 510, b"\x55\xaa"),
    ("gpt", 512, b"EFI PART"),
    ("gpt (4K sectors)", 4096, b"EFI PART"),
    ("gpt backup", -512, b"EFI PART"),
    ("gpt backup (4K sectors)", -4096, b"EFI PART"),
    ("linux_raid_member v1.1", 0, b"\xfc\x4e\x2b\xa9"),
    ("linux_raid_member v1.2", 4096, b"\xfc\x4e\x2b\xa9"),
    ("swap", 4086, b"SWAPSPACE2"),
    ("swap (old)", 4086, b"SWAP-SPACE"),
    ("swap (64K pages)", 65526, b"SWAPSPACE2"),
    ("crypto_LUKS", 0, b"LUKS\xba\xbe"),
    ("crypto_LUKS2 secondary", 0x4000, b"SKUL\xba\xbe"),
    ("iso9660", 0x8001, b"CD001"),
    ("squashfs", 0, b"hsqs"),
    ("f2fs", 0x400, b"\x10\x20\xf5\xf2"),
    ("erofs", 0x400, b"\xe2\xe1\xf5\xe0"),
    ("ntfs", 3, b"NTFS    "),
    ("vfat", 0x36, b"FAT1"),
    ("vfat32", 0x52, b"FAT32"),
    ("bcache", 0x1018, bytes.fromhex("c68573f64e1a45ca8265f57f48ba6d81")),
    ("ceph bluestore", 0, b"bluestore block device"),
    ("reiserfs", 0x10034, b"ReIsEr"),
]
_LVM_LABEL = b"LABELONE"
_ZFS_UBERBLOCK = (0x00BAB10C).to_bytes(8, "little")


def scan_signatures(head: bytes, tail: bytes, size: int) -> list[str]:
    """Names of the signatures found in the first (`head`) and last (`tail`) bytes of a device of `size`."""
    found: list[str] = []

    def at(offset: int, length: int) -> bytes:
        if offset >= 0:
            return head[offset : offset + length]
        start = len(tail) + offset
        return tail[start : start + length] if start >= 0 else b""

    for name, offset, magic in _MAGICS:
        if at(offset, len(magic)) == magic:
            found.append(name)
    for sector in range(4):  # LVM2 labels sit in one of the first four sectors
        if head[sector * 512 : sector * 512 + 8] == _LVM_LABEL:
            found.append("LVM2_member")
            break
    # md 0.90 and 1.0 superblocks live near the end of the device.
    for name, position in (
        ("linux_raid_member v0.90", (size & ~(64 * 1024 - 1)) - 64 * 1024),
        ("linux_raid_member v1.0", ((size - 8 * 1024) & ~(4 * 1024 - 1))),
    ):
        start = position - (size - len(tail))
        if start >= 0 and tail[start : start + 4] in (b"\xfc\x4e\x2b\xa9", b"\xa9\x2b\x4e\xfc"):
            found.append(name)
    # ZFS labels L0/L1 at the start and L2/L3 at the end keep uberblocks from 128 KiB into each label.
    for region in (head[128 * 1024 : 256 * 1024], head[(256 + 128) * 1024 : 512 * 1024], tail[-384 * 1024 :]):
        for offset in range(0, len(region) - 8, 1024):
            if region[offset : offset + 8] == _ZFS_UBERBLOCK:
                found.append("zfs_member")
                break
        if "zfs_member" in found:
            break
    return found


def _read_ends(devnode: str, size: int) -> tuple[bytes, bytes]:
    fd = os.open(devnode, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_ends_of(fd, size)
    finally:
        os.close(fd)


def _read_ends_of(fd: int, size: int) -> tuple[bytes, bytes]:
    """The first and last MiB through `fd`, which may be O_DIRECT (hence the page-aligned buffer)."""
    length = min(MIB, size)
    buffer = mmap.mmap(-1, MIB)
    try:
        # The views are released however the reads end: a buffer still exported cannot be closed, and its
        # BufferError would hide the read's own error (an EIO) from the callers that handle OSError.
        with memoryview(buffer) as whole, whole[:length] as view:
            ends = []
            for offset in (0, size - length):
                done = os.preadv(fd, [view], offset)
                ends.append(bytes(view[:done]))
    finally:
        buffer.close()
    return ends[0], ends[1]


def _run_with_timeout(func: Callable[[], T], timeout: float) -> T:
    """Run blocking device I/O in a daemon thread; a stalled device then costs a timeout, not a hang."""
    values: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            values.append(func())
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=target, name="volprobe-safety", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the device did not answer within {timeout:.0f}s")
    if errors:
        raise errors[0]
    return values[0]


def libblkid_signatures(devnode: str, timeout: float = PROBE_TIMEOUT_S, fd: int | None = None) -> list[str]:
    """Signatures libblkid finds, through `blkid -p` and `wipefs`; empty when neither is installed. With `fd`,
    they read that descriptor's device (as /dev/fd/N), whatever `devnode` names now."""
    if fd is not None:
        devnode = f"/dev/fd/{fd}"
    found: list[str] = []
    commands = []
    if shutil.which("blkid"):
        commands.append(["blkid", "-p", "-o", "export", devnode])
    if shutil.which("wipefs"):
        commands.append(["wipefs", "--no-act", "--noheadings", "--output", "TYPE", devnode])
    for command in commands:
        proc = subprocess.Popen(  # a label, or a message, may hold any byte: replaced, never a UnicodeDecodeError
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            pass_fds=() if fd is None else (fd,),
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # may linger in D state on a stalled device; we do not wait for it
            raise TimeoutError(f"{command[0]} did not answer within {timeout:.0f}s") from None
        if command[0] == "blkid":
            if proc.returncode == 0:
                for line in out.splitlines():
                    key, _, value = line.partition("=")
                    if key in ("TYPE", "PTTYPE"):
                        found.append(value)
            elif proc.returncode != 2:  # 2 means "nothing found"
                raise OSError(f"blkid -p failed ({proc.returncode}): {err.strip()}")
        else:
            if proc.returncode != 0:
                raise OSError(f"wipefs failed ({proc.returncode}): {err.strip()}")
            found.extend(line.strip() for line in out.splitlines() if line.strip())
    return sorted(set(found))


def raw_write_refusal(
    host: Host, device: BlockDevice, timeout: float = PROBE_TIMEOUT_S, fd: int | None = None
) -> str | None:
    """Why `device` must not take raw writes, or None if it is blank and unclaimed. With `fd` (a descriptor of
    that device), its bytes are read through the descriptor."""
    if device.kind == "part":
        return "is a partition; raw writes go to whole, blank devices only"
    if device.read_only:
        return "is read-only"
    if device.size_bytes < 2 * GUARD_BYTES + MIB:
        return f"is too small ({device.size_bytes} bytes) to keep clear of its first and last MiB"
    if device.partitions:
        return f"has partitions: {', '.join(device.partitions)}"
    if device.holders:
        return f"is held by {', '.join(device.holders)} (device-mapper, md or similar)"
    mounts = host.mounts_of(device)
    if mounts:
        return f"is mounted on {', '.join(m.mount_point for m in mounts)}"
    if device.devnode in host.swaps() or f"/dev/{device.name}" in host.swaps():
        return "is in use as swap"
    try:

        def read() -> tuple[bytes, bytes]:
            if fd is None:
                return _read_ends(device.devnode, device.size_bytes)
            return _read_ends_of(fd, device.size_bytes)

        head, tail = _run_with_timeout(read, timeout)
        ours = scan_signatures(head, tail, device.size_bytes)
        theirs = libblkid_signatures(device.devnode, timeout, fd)
    except (OSError, TimeoutError) as err:
        return f"could not be checked for signatures: {err}"
    signatures = sorted(set(ours) | set(theirs))
    if signatures:
        return f"carries a signature ({', '.join(signatures)})"
    return None


def device_size(fd: int) -> int:
    """The size of the block device open on `fd`, as the kernel has it now."""
    size: int = struct.unpack("Q", fcntl.ioctl(fd, _BLKGETSIZE64, b"\0" * 8))[0]
    return size


def check_raw_descriptor(host: Host, expected: BlockDevice, fd: int, path: str = "") -> None:
    """Refused unless `fd` is the block device `expected` (same volume identity and size) and it is still blank
    and unclaimed. Run on every open, before the first write through it."""
    st = os.fstat(fd)
    if not stat.S_ISBLK(st.st_mode):
        raise Refused("is not a block device", path)
    name = host.name_for_devnum(os.major(st.st_rdev), os.minor(st.st_rdev))
    device = host.device(name) if name else None
    if device is None:
        raise Refused(f"opens device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}, which has no entry in sysfs", path)
    if VolumeIdentity.of(device).key != VolumeIdentity.of(expected).key:
        raise Refused(
            f"now opens {device.name} ({VolumeIdentity.of(device).key}), not the volume it was resolved to "
            f"({expected.name}, {VolumeIdentity.of(expected).key})",
            path,
        )
    check_size(fd, expected.size_bytes, path)
    refusal = raw_write_refusal(host, device, fd=fd)
    if refusal:
        raise Refused(f"refusing raw writes: {device.name} {refusal}", path)


def check_size(fd: int, expected: int, path: str = "") -> None:
    """Refused when the device open on `fd` is no longer `expected` bytes: its last MiB has moved."""
    size = device_size(fd)
    if size != expected:
        raise Refused(f"changed size from {expected} to {size} bytes; raw writes stop", path)
