"""What the process may do, where a hardened unit (seccomp, address families) or a container can take it away:
the idle I/O class for warm-ups (ioprio_set), the udev monitor for discovery (a netlink socket) and the NVMe
admin command of the provider's statistics (CAP_SYS_ADMIN). A missing one does not stop volprobe, which falls
back (normal I/O priority, sysfs rescans, no provider statistics), but it is logged once and exported
(volprobe_capability_available), never lost silently."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

IDLE_IO_PRIORITY = "idle_io_priority"
UDEV_MONITOR = "udev_monitor"
NVME_ADMIN = "nvme_admin"  # the NVMe admin Get Log Page of the provider's statistics: CAP_SYS_ADMIN

_lock = threading.Lock()
_known: dict[str, bool] = {}


def record(name: str, available: bool, why: str = "") -> None:
    """Note whether `name` could be had; the first time it cannot (or it stops being available), log why."""
    with _lock:
        before = _known.get(name)
        _known[name] = available
    if not available and before is not False:
        log.warning("%s unavailable: %s", name, why or "unknown reason")


def known() -> dict[str, bool]:
    with _lock:
        return dict(_known)


def check_idle_io_priority() -> None:
    """Try the idle I/O class on a throwaway thread (ioprio is per thread), so that the metric is there before
    the first warm-up needs it."""
    from .warmup import set_idle_priority

    thread = threading.Thread(target=set_idle_priority, name="ioprio check", daemon=True)
    thread.start()
    thread.join(5)
