"""AWS NVMe statistics log pages (0xD0) built from the documented layout, for the tests: no NVMe device can be
made on this kernel, so the exporter reads these through its test hook ($VOLPROBE_TEST_NVME_PAGES)."""

from __future__ import annotations

import struct

# The documented layout, written out independently of the module's own constants.
FIELDS = {  # offset -> value (u64 unless the magic)
    8: 101,  # read ops
    16: 202,  # write ops
    24: 303 * 4096,  # read bytes
    32: 404 * 8192,  # write bytes
    40: 5_000_000,  # total read time, us
    48: 6_500_000,  # total write time, us
    56: 7_000_000,  # EBS volume IOPS exceeded, us
    64: 8_000_000,  # EBS volume throughput exceeded, us
    72: 9_000_000,  # EC2 instance IOPS exceeded, us
    80: 10_000_000,  # EC2 instance throughput exceeded, us
    88: 11,  # queue length
}


Bins = tuple[tuple[int, int, int], ...]  # (lower, upper, count) of a latency histogram's bins


def page(
    magic: int = 0x3C23B510, read_bins: Bins = ((0, 100, 5), (100, 1000, 7)), write_bins: Bins = ((0, 500, 3),)
) -> bytes:
    data = bytearray(4096)
    struct.pack_into("<I", data, 0, magic)
    for offset, value in FIELDS.items():
        struct.pack_into("<Q", data, offset, value)
    for base, bins in ((512, read_bins), (2056, write_bins)):
        struct.pack_into("<Q", data, base, len(bins))
        for i, (lower, upper, count) in enumerate(bins):
            struct.pack_into("<QQI", data, base + 8 + 24 * i, lower, upper, count)
    return bytes(data)


def counters_page(t: float, exceeded_share: float = 0.0, overrides: dict[int, int] | None = None) -> bytes:
    """A page as an EBS volume would give it `t` seconds into the test: 100 reads/s of 4 KiB at 0.5 ms, the
    volume's IOPS limit exceeded `exceeded_share` of the time."""
    data = bytearray(page())
    values = {
        8: int(100 * t),
        16: int(10 * t),
        24: int(100 * t) * 4096,
        32: int(10 * t) * 4096,
        40: int(100 * t) * 500,
        48: int(10 * t) * 800,
        56: int(exceeded_share * t * 1e6),
        **(overrides or {}),
    }
    for offset, value in values.items():
        struct.pack_into("<Q", data, offset, value)
    return bytes(data)
