"""Is a raw device blank enough to write to? Every check must pass; any doubt is a refusal.

A device may take raw write probes (or a write warm-up) only when the user opted in for it AND it carries no
filesystem, partition table, RAID, LVM, swap or crypto signature (our own magic checks of its first and last
MiB, plus libblkid through `blkid -p` and `wipefs` where installed), is not mounted or used as swap, has no
holders and no partitions. The caller then opens it with O_EXCL, which the kernel refuses while anything
else (a mount, md, dm, swap) claims the device.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable

from .discovery import BlockDevice, Host

MIB = 1024 * 1024
# Raw write probes never touch the first and last MiB, where every signature we know of lives, so a
# device written by volprobe stays recognisably blank and no label written later is clobbered.
GUARD_BYTES = MIB
PROBE_TIMEOUT_S = 10.0

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
        head = os.pread(fd, min(MIB, size), 0)
        tail_len = min(MIB, size)
        tail = os.pread(fd, tail_len, size - tail_len)
    finally:
        os.close(fd)
    return head, tail


def _run_with_timeout(func: Callable[[], object], timeout: float) -> object:
    """Run blocking device I/O in a daemon thread; a stalled device then costs a timeout, not a hang."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["value"] = func()
        except BaseException as err:
            result["error"] = err

    thread = threading.Thread(target=target, name="volprobe-safety", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the device did not answer within {timeout:.0f}s")
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result.get("value")


def libblkid_signatures(devnode: str, timeout: float = PROBE_TIMEOUT_S) -> list[str]:
    """Signatures libblkid finds, through `blkid -p` and `wipefs`; empty when neither is installed."""
    found: list[str] = []
    commands = []
    if shutil.which("blkid"):
        commands.append(["blkid", "-p", "-o", "export", devnode])
    if shutil.which("wipefs"):
        commands.append(["wipefs", "--no-act", "--noheadings", "--output", "TYPE", devnode])
    for command in commands:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def raw_write_refusal(host: Host, device: BlockDevice, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why `device` must not take raw writes, or None if it is blank and unclaimed."""
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
        head, tail = _run_with_timeout(lambda: _read_ends(device.devnode, device.size_bytes), timeout)  # type: ignore[misc]
        ours = scan_signatures(head, tail, device.size_bytes)
        theirs = libblkid_signatures(device.devnode, timeout)
    except (OSError, TimeoutError) as err:
        return f"could not be checked for signatures: {err}"
    signatures = sorted(set(ours) | set(theirs))
    if signatures:
        return f"carries a signature ({', '.join(signatures)})"
    return None
