"""What the process may do, where a hardened unit (seccomp, address families) or a container can take it away:
the idle I/O class for warm-ups (ioprio_set), the udev monitor for discovery (a netlink socket) and the NVMe
admin command of the provider's statistics (CAP_SYS_ADMIN). A missing one does not stop volprobe, which falls
back (normal I/O priority, sysfs rescans, no provider statistics), but it is logged once and exported
(volprobe_capability_available), never lost silently.

The exporter keeps one Capabilities and hands it to the parts that try each: the warm-ups, the device
follower and the provider's statistics. The idle I/O class is tried here, since both the warm-ups and the
start-up check set it (ioprio is per thread)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .privileges import Kept

log = logging.getLogger(__name__)

IDLE_IO_PRIORITY = "idle_io_priority"
UDEV_MONITOR = "udev_monitor"
NVME_ADMIN = "nvme_admin"  # the NVMe admin Get Log Page of the provider's statistics: CAP_SYS_ADMIN


class Capabilities:
    """Whether each capability could be had, as last tried; each is logged the first time it cannot be (and
    again after it was had in between)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, bool] = {}
        self.kept: Kept | None = None  # what the process kept of its capabilities at start (volprobe.privileges)

    def record(self, name: str, available: bool, why: str = "") -> None:
        """Note whether `name` could be had; the first time it cannot (or it stops being available), log why."""
        with self._lock:
            before = self._known.get(name)
            self._known[name] = available
        if not available and before is not False:
            log.warning("%s unavailable: %s", name, why or "unknown reason")

    def known(self) -> dict[str, bool]:
        with self._lock:
            return dict(self._known)


def set_idle_priority(capabilities: Capabilities) -> None:
    """Idle I/O class for the calling thread only (ioprio is per thread on Linux), so production comes first;
    whether it could be had goes to `capabilities`."""
    try:
        import psutil

        psutil.Process(threading.get_native_id()).ionice(psutil.IOPRIO_CLASS_IDLE)
    except Exception as err:  # not Linux, or not permitted (a seccomp filter): run at normal priority
        capabilities.record(IDLE_IO_PRIORITY, False, f"ioprio_set: {err}; warm-ups run at normal priority")
    else:
        capabilities.record(IDLE_IO_PRIORITY, True)


def check_idle_io_priority(capabilities: Capabilities) -> None:
    """Try the idle I/O class on a throwaway thread (ioprio is per thread), so that the metric is there before
    the first warm-up needs it."""
    thread = threading.Thread(target=set_idle_priority, args=(capabilities,), name="ioprio check", daemon=True)
    thread.start()
    thread.join(5)
