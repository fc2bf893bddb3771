"""What the process keeps of the privileges it was started with: only the capabilities its configuration uses.

A privileged container (the chart's and the kustomize DaemonSet's: the only way Kubernetes lets a container open
the host's block devices) gets every capability whatever its `capabilities:` list says, no seccomp filter and
no_new_privs 0. volprobe parses HTTP, TLS, bcrypt and YAML in that process, so at start, once its listeners are
bound and before any thread runs, it takes away itself what it does not use:

- its effective, permitted and inheritable sets become what it keeps, and the ambient set is cleared;
- the bounding set loses every other capability (PR_CAPBSET_DROP needs CAP_SETPCAP, so this comes before the
  sets are narrowed, while CAP_SETPCAP is still held), so nothing it executes (blkid, for a raw device's safety
  check) can have more;
- no_new_privs is set (PR_SET_NO_NEW_PRIVS): no set-user-ID program or file capability gives more either.

Capabilities are per thread on Linux (and capset(2) and prctl(2) act on the calling thread alone): a thread that
existed before would keep everything. So this runs while the process has one thread, and refuses otherwise.

What each configuration uses (every other capability is dropped):

- `kubernetes.rules`: CAP_SYS_ADMIN, for open_tree(2)'s private copies of the pod volumes' mounts
  (volprobe.privatemount). Writing in a volume needs no capability: volprobe is root there, and writes where root
  may as an owner (a volume's root directory is root's unless its owner changed it; one it may not write in is
  refused and logged, as the chart has always said). CAP_DAC_OVERRIDE is not kept for them.
- `--nvme.provider-statistics`: CAP_SYS_ADMIN, for the NVMe admin command Get Log Page (volprobe.nvme).
- a directory target (`targets[].directory`, `--target DIR`): CAP_DAC_OVERRIDE, so that volprobe run as root
  makes and probes its probe file in a directory another user owns (postgres's /var/lib/postgresql, 0700), as it
  did before; without it such a target is refused ("not writable by this user").
- Nothing else volprobe does needs one: reading block devices as root or in group disk is their mode's (root:disk
  0660), O_DIRECT and BLKGETSIZE64 need none, the idle I/O class of ioprio_set needs none (only the real-time
  class does), the udev monitor's netlink socket receives as any user, raising the open files limit to its hard
  limit needs none, and the listeners are bound before the drop (a port below 1024 keeps working).

With none of these, it keeps none.

Test hook: $VOLPROBE_TEST_KEEP_CAPABILITIES (names, comma-separated: CAP_DAC_READ_SEARCH) is kept too, where the
process holds it: the tests run volprobe as nobody with CAP_DAC_READ_SEARCH alone, to reach an interpreter
under /root, whose modules it imports as it goes.

A reload (SIGHUP) that adds a rule later cannot have CAP_SYS_ADMIN back: it is said
in the log, and volprobe_capability_available{capability="private_mount"} is 0 (the volumes are opened at
their paths); restarting volprobe gives it back.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from dataclasses import dataclass

CAP_DAC_OVERRIDE = 1
CAP_SETPCAP = 8
CAP_SYS_ADMIN = 21
NAMES = {
    0: "CAP_CHOWN",
    1: "CAP_DAC_OVERRIDE",
    2: "CAP_DAC_READ_SEARCH",
    3: "CAP_FOWNER",
    4: "CAP_FSETID",
    5: "CAP_KILL",
    6: "CAP_SETGID",
    7: "CAP_SETUID",
    8: "CAP_SETPCAP",
    9: "CAP_LINUX_IMMUTABLE",
    10: "CAP_NET_BIND_SERVICE",
    11: "CAP_NET_BROADCAST",
    12: "CAP_NET_ADMIN",
    13: "CAP_NET_RAW",
    14: "CAP_IPC_LOCK",
    15: "CAP_IPC_OWNER",
    16: "CAP_SYS_MODULE",
    17: "CAP_SYS_RAWIO",
    18: "CAP_SYS_CHROOT",
    19: "CAP_SYS_PTRACE",
    20: "CAP_SYS_PACCT",
    21: "CAP_SYS_ADMIN",
    22: "CAP_SYS_BOOT",
    23: "CAP_SYS_NICE",
    24: "CAP_SYS_RESOURCE",
    25: "CAP_SYS_TIME",
    26: "CAP_SYS_TTY_CONFIG",
    27: "CAP_MKNOD",
    28: "CAP_LEASE",
    29: "CAP_AUDIT_WRITE",
    30: "CAP_AUDIT_CONTROL",
    31: "CAP_SETFCAP",
    32: "CAP_MAC_OVERRIDE",
    33: "CAP_MAC_ADMIN",
    34: "CAP_SYSLOG",
    35: "CAP_WAKE_ALARM",
    36: "CAP_BLOCK_SUSPEND",
    37: "CAP_AUDIT_READ",
    38: "CAP_PERFMON",
    39: "CAP_BPF",
    40: "CAP_CHECKPOINT_RESTORE",
}

_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_PR_CAPBSET_READ = 23
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _prctl(option: int, arg: int = 0) -> int:
    result = int(_libc.prctl(option, arg, 0, 0, 0))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}): {os.strerror(err)}")
    return result


def _sets() -> tuple[int, int, int]:
    """The calling thread's (effective, permitted, inheritable) sets, as bit masks."""
    header, data = _Header(_LINUX_CAPABILITY_VERSION_3, 0), (_Data * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capget: {os.strerror(err)}")
    low, high = data[0], data[1]
    return (
        low.effective | high.effective << 32,
        low.permitted | high.permitted << 32,
        low.inheritable | high.inheritable << 32,
    )


def _set(effective: int, permitted: int, inheritable: int) -> None:
    header, data = _Header(_LINUX_CAPABILITY_VERSION_3, 0), (_Data * 2)()
    for index in (0, 1):
        shift = 32 * index
        data[index].effective = (effective >> shift) & 0xFFFFFFFF
        data[index].permitted = (permitted >> shift) & 0xFFFFFFFF
        data[index].inheritable = (inheritable >> shift) & 0xFFFFFFFF
    if _libc.capset(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as file:
            return int(file.read())
    except (OSError, ValueError):
        return max(NAMES)


def mask(capabilities: Iterable[int]) -> int:
    return sum(1 << cap for cap in set(capabilities))


def names(bits: int) -> list[str]:
    """The names of the capabilities in a mask, lowest first."""
    return [NAMES.get(cap, f"CAP_{cap}") for cap in range(64) if bits >> cap & 1]


@dataclass(frozen=True)
class Kept:
    """What the process runs with after keep_only(): its capabilities (a mask), whether its bounding set could be
    narrowed to them (not without CAP_SETPCAP: a user that holds no capability, where nothing can be gained anyway
    with no_new_privs), and what was asked for but not held (a container that did not grant it)."""

    capabilities: int
    bounded: bool
    missing: int
    no_new_privs: bool = True
    held: int = 0  # the permitted set before: what was dropped is held & ~capabilities

    @property
    def text(self) -> str:
        return ",".join(names(self.capabilities)) or "none"


TEST_KEEP_ENV = "VOLPROBE_TEST_KEEP_CAPABILITIES"


def needed(rules: bool, provider_statistics: bool, directories: bool = False) -> int:
    """The capabilities (a mask) a configuration uses: CAP_SYS_ADMIN with `kubernetes.rules` (private mount copies)
    or with the provider's NVMe statistics (the admin command), CAP_DAC_OVERRIDE with directory targets (another
    user's directories); none otherwise. (And the test hook's.)"""
    by_name = {name: cap for cap, name in NAMES.items()}
    hook = [by_name[name.strip()] for name in os.environ.get(TEST_KEEP_ENV, "").split(",") if name.strip() in by_name]
    wanted = [CAP_SYS_ADMIN] if rules or provider_statistics else []
    wanted += [CAP_DAC_OVERRIDE] if directories else []
    return mask(wanted) | mask(hook)


def threads() -> int:
    """How many threads the process has (the kernel's count: C threads included)."""
    return len(os.listdir("/proc/self/task"))


def keep_only(wanted: int, others: int = 0) -> Kept:
    """Keep only `wanted` (a mask) of what the process holds, in every set, and set no_new_privs. Runs while the
    process has a single thread, or `others` more that the caller knows of (RuntimeError otherwise: a thread
    started before would keep what it had)."""
    count = threads()
    if count != 1 + others:
        raise RuntimeError(f"capabilities must be dropped before any thread starts; the process has {count}")
    effective, permitted, _inheritable = _sets()
    keep = wanted & permitted
    try:
        _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:  # a kernel before 4.3 has no ambient set
        pass
    setpcap = mask([CAP_SETPCAP])
    bounded = True
    bounding = [cap for cap in range(_last_cap() + 1) if not keep >> cap & 1 and _bounded(cap)]
    if bounding:
        if permitted & setpcap:
            if not effective & setpcap:
                _set(effective | setpcap, permitted, 0)
            for cap in bounding:
                _prctl(_PR_CAPBSET_DROP, cap)
        else:
            bounded = False  # cannot be narrowed; with no_new_privs nothing outside `keep` can be had anyway
    if _sets() != (keep, keep, 0):  # nothing to change is not asked: a unit's seccomp filter may refuse capset
        _set(keep, keep, 0)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    return Kept(keep, bounded, wanted & ~permitted, _prctl(_PR_GET_NO_NEW_PRIVS) == 1, permitted)


def _bounded(cap: int) -> bool:
    try:
        return _prctl(_PR_CAPBSET_READ, cap) == 1
    except OSError:  # beyond what this kernel knows
        return False
