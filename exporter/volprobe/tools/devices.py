"""`volprobe devices`: the block devices, their identity, and whether volprobe may probe them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from .. import safety, units
from ..command import add_path_flags, host_from
from .registry import register


def _readable(devnode: str) -> str:
    try:
        os.close(os.open(devnode, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        return "yes"
    except OSError as err:
        return f"no: {err.strerror}"


@register("devices")
def run_devices(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="volprobe devices",
        description="Block devices, their identity, and whether volprobe may probe them.",
    )
    add_path_flags(parser)
    args = parser.parse_args(argv)
    host = host_from(args)
    rows = [("DEVICE", "KIND", "SIZE", "MODEL", "SERIAL", "VOLUME_ID", "MOUNTED", "READ", "RAW WRITE")]
    for name, device in sorted(host.devices().items()):
        read = _readable(device.devnode) if device.size_bytes else "no: no media"
        refusal = safety.raw_write_refusal(host, device) if device.size_bytes else "has no media"
        write = "blank (opt in with allow_raw_writes)" if refusal is None else f"no: {refusal}"
        mounts = ",".join(m.mount_point for m in host.mounts_of(device)) or "-"
        rows.append(
            (
                name,
                device.kind,
                units.format_size(device.size_bytes),
                device.model or "-",
                device.serial or "-",
                device.volume_id or "-",
                mounts,
                read,
                write,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0
