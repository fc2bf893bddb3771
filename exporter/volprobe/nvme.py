"""The provider's own statistics of a cloud NVMe device: AWS's "NVMe detailed performance statistics" log page.

EBS volumes and EC2 instance-store NVMe answer an admin Get Log Page (opcode 0x02) for the vendor log 0xD0:
operations, bytes, time, the queue length, device-side read and write latency histograms, and, above all,
the microseconds during which demand exceeded the volume's provisioned IOPS or throughput, or the instance's
EBS (or local storage) limits. Layout (little-endian; AWS's documentation, the EBS CSI driver's
pkg/metrics/nvme.go and nvme-cli's amzn plugin agree on it):

    0    u32  magic: 0x3C23B510 (EBS) or 0xEC2C0D7E (instance store); u32 version at 4
    8    u64  read ops, write ops, read bytes, write bytes (at 8, 16, 24, 32)
    40   u64  total read time, total write time, in microseconds (40, 48)
    56   u64  EBS volume IOPS exceeded, EBS volume throughput exceeded (us; not used by instance store)
    72   u64  EC2 instance IOPS exceeded, EC2 instance throughput exceeded (us)
    88   u64  queue length (a gauge)
    96   416 reserved bytes
    512  read histogram: u64 number of bins, then 64 bins of (u64 lower us, u64 upper us, u32 count, u32 pad)
    2056 write histogram, the same

Instance store uses the same page with its own magic and version at 4; its volume-limit fields (56, 64) do
not apply, and its histograms by I/O size (from 3600, and a second 4 KiB that nvme-cli reads with a log page
offset) are not read here. Bin counts are 32 bits (nvme-cli's layout): Histogram.unwrap keeps them monotonic.

Pure parsing here; `read_log_page` sends the command, through an injected ioctl.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

LOG_PAGE_ID = 0xD0
PAGE_SIZE = 4096
EBS_MAGIC = 0x3C23B510
INSTANCE_STORE_MAGIC = 0xEC2C0D7E
KINDS = {EBS_MAGIC: "ebs", INSTANCE_STORE_MAGIC: "instance_store"}
# The models the devices report (sysfs .../device/model): only these are asked for the page.
MODELS = {"Amazon Elastic Block Store": "ebs", "Amazon EC2 NVMe Instance Storage": "instance_store"}
# The kernel's names of NVMe namespaces (nvme<controller>n<namespace>): the only disks that can be AWS's.
NAMESPACE_NAME = re.compile(r"nvme\d+n\d+")
MAX_BINS = 64
_COUNTERS = struct.Struct("<II11Q")  # magic, version, then the eleven u64 fields from offset 8
_BIN = struct.Struct("<QQII")  # lower us, upper us, count, pad
READ_HISTOGRAM_OFFSET = 512
WRITE_HISTOGRAM_OFFSET = READ_HISTOGRAM_OFFSET + 8 + MAX_BINS * _BIN.size  # 2056
# NVME_IOCTL_ADMIN_CMD = _IOWR('N', 0x41, struct nvme_admin_cmd), 72 bytes.
NVME_IOCTL_ADMIN_CMD = 0xC0484E41
_ADMIN_CMD = struct.Struct("<BBHIIIQQIIIIIIIIII")
ADMIN_GET_LOG_PAGE = 0x02
# NVMe statuses (the ioctl's positive return) that mean "this device has no such page".
_INVALID_LOG_PAGE = 0x109  # command specific: Invalid Log Page (AWS devices without the page)
_INVALID_FIELD = 0x002  # generic: Invalid Field in Command (other NVMe devices)


class Unsupported(Exception):
    """The device has no such page (not NVMe, not AWS, an older controller, a wrong magic): not an error."""


class NotPermitted(Exception):
    """The kernel refused the command: Get Log Page needs CAP_SYS_ADMIN (every kernel, 6.2+ included)."""


@dataclass(frozen=True)
class Histogram:
    """Device-side latency: (upper bound in seconds, count) per bin, ascending. The device keeps each count in
    32 bits (it wraps: see unwrap)."""

    bins: tuple[tuple[float, int], ...]

    @property
    def buckets(self) -> tuple[tuple[float, int], ...]:
        """(upper bound, cumulative count), as Prometheus buckets."""
        total, cumulative = 0, []
        for upper, count in self.bins:
            total += count
            cumulative.append((upper, total))
        return tuple(cumulative)

    @property
    def count(self) -> int:
        return sum(count for _, count in self.bins)

    def unwrap(self, previous: Histogram | None, raw_previous: Histogram | None) -> Histogram:
        """These counts made monotonic across the device's 32-bit wraps: `previous` is the last unwrapped
        histogram, `raw_previous` the last as read. A bin that went down wrapped (or the device restarted its
        counts: then the result keeps rising, a reset Prometheus would otherwise see as a huge rate)."""
        if previous is None or raw_previous is None or len(previous.bins) != len(self.bins):
            return self
        bins = []
        for (upper, raw), (_, before), (_, raw_before) in zip(self.bins, previous.bins, raw_previous.bins, strict=True):
            grown = (raw - raw_before) % 2**32
            bins.append((upper, before + grown))
        return Histogram(tuple(bins))


@dataclass(frozen=True)
class Stats:
    kind: str  # ebs or instance_store
    read_ops: int
    write_ops: int
    read_bytes: int
    write_bytes: int
    read_seconds: float
    write_seconds: float
    ebs_iops_exceeded_seconds: float
    ebs_throughput_exceeded_seconds: float
    ec2_iops_exceeded_seconds: float
    ec2_throughput_exceeded_seconds: float
    queue_length: int
    read_latency: Histogram
    write_latency: Histogram


def _histogram(page: bytes, offset: int, where: str) -> Histogram:
    (bins,) = struct.unpack_from("<Q", page, offset)
    if bins > MAX_BINS:
        raise ValueError(f"{where}: {bins} bins, more than {MAX_BINS}")
    result, previous = [], 0
    for i in range(bins):
        _lower, upper, count, _pad = _BIN.unpack_from(page, offset + 8 + i * _BIN.size)
        if upper <= previous and i:
            raise ValueError(f"{where}: bin {i} upper bound {upper} us is not above the previous {previous} us")
        previous = upper
        result.append((upper / 1e6, count))
    return Histogram(tuple(result))


def parse_log_page(page: bytes) -> Stats:
    """The statistics in a 0xD0 log page. Unsupported if the magic is neither AWS's; ValueError if the page is
    short or its histograms do not make sense."""
    needed = WRITE_HISTOGRAM_OFFSET + 8 + MAX_BINS * _BIN.size  # 3600: the rest of the 4096 is reserved
    if len(page) < needed:
        raise ValueError(f"log page of {len(page)} bytes, shorter than the {needed} its layout fills")
    magic, _version, *fields = _COUNTERS.unpack_from(page, 0)
    kind = KINDS.get(magic)
    if kind is None:
        raise Unsupported(f"log page 0xD0 has magic {magic:#x}, not AWS's")
    (read_ops, write_ops, read_bytes, write_bytes, read_us, write_us, ebs_iops, ebs_tp, ec2_iops, ec2_tp, queue) = (
        fields
    )
    return Stats(
        kind=kind,
        read_ops=read_ops,
        write_ops=write_ops,
        read_bytes=read_bytes,
        write_bytes=write_bytes,
        read_seconds=read_us / 1e6,
        write_seconds=write_us / 1e6,
        ebs_iops_exceeded_seconds=ebs_iops / 1e6,
        ebs_throughput_exceeded_seconds=ebs_tp / 1e6,
        ec2_iops_exceeded_seconds=ec2_iops / 1e6,
        ec2_throughput_exceeded_seconds=ec2_tp / 1e6,
        queue_length=queue,
        read_latency=_histogram(page, READ_HISTOGRAM_OFFSET, "read histogram"),
        write_latency=_histogram(page, WRITE_HISTOGRAM_OFFSET, "write histogram"),
    )


Ioctl = Callable[[int, int, bytearray], int]


def get_log_page_command(buffer_address: int, length: int = PAGE_SIZE) -> bytearray:
    """struct nvme_admin_cmd for Get Log Page 0xD0 of namespace 1: `length` bytes, NUMDL 0-based in dwords."""
    cdw10 = LOG_PAGE_ID | ((length // 4 - 1) << 16)
    return bytearray(
        _ADMIN_CMD.pack(ADMIN_GET_LOG_PAGE, 0, 0, 1, 0, 0, 0, buffer_address, 0, length, cdw10, 0, 0, 0, 0, 0, 0, 0)
    )


def _ioctl(fd: int, request: int, command: bytearray) -> int:
    return int(fcntl.ioctl(fd, request, command, True))


def read_log_page(devnode: str, ioctl: Ioctl = _ioctl) -> bytes:
    """The raw 0xD0 page of an NVMe namespace (opened read-only). Unsupported where there is none, NotPermitted
    without CAP_SYS_ADMIN, OSError for anything else."""
    page = ctypes.create_string_buffer(PAGE_SIZE)
    command = get_log_page_command(ctypes.addressof(page))
    fd = os.open(devnode, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        status = ioctl(fd, NVME_IOCTL_ADMIN_CMD, command)
    except OSError as err:
        if err.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            raise Unsupported(f"{devnode} takes no NVMe admin commands ({err.strerror})") from None
        if err.errno in (errno.EACCES, errno.EPERM):
            raise NotPermitted(f"{devnode}: Get Log Page needs CAP_SYS_ADMIN ({err.strerror})") from None
        raise
    finally:
        os.close(fd)
    code = status & 0x7FF  # status code type and code, without the More and Do Not Retry bits
    if code in (_INVALID_LOG_PAGE, _INVALID_FIELD):
        raise Unsupported(f"{devnode} has no log page 0xD0 (NVMe status {status:#x})")
    if status:
        raise OSError(errno.EIO, f"{devnode}: Get Log Page failed with NVMe status {status:#x}")
    return page.raw
