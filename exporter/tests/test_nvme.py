"""The provider's NVMe statistics: the log page parser on pages built from AWS's documented layout (each field
at its offset), the Get Log Page command's bytes, and the ioctl path on real non-NVMe devices here (no NVMe
device can be made on this kernel: its NVMe drivers are compiled out) and on the statuses AWS devices answer."""

from __future__ import annotations

import ctypes
import errno
import json
import struct
import time

import pytest

from volprobe import discovery, nvme
from volprobe.capabilities import Capabilities
from volprobe.runtime.provider import ProviderStats

from .support.dashboards import panels, substitute
from .support.harness import MIB, REPO, sample_value, wait_until
from .support.machine import FakeMachine
from .support.nvme_pages import counters_page, page
from .support.rules import firing, start_with_rules


def test_each_field_is_read_from_its_offset_in_base_units():
    stats = nvme.parse_log_page(page())
    assert stats.kind == "ebs"
    assert (stats.read_ops, stats.write_ops, stats.read_bytes, stats.write_bytes) == (101, 202, 303 * 4096, 404 * 8192)
    assert (stats.read_seconds, stats.write_seconds) == (5.0, 6.5)
    assert (stats.ebs_iops_exceeded_seconds, stats.ebs_throughput_exceeded_seconds) == (7.0, 8.0)
    assert (stats.ec2_iops_exceeded_seconds, stats.ec2_throughput_exceeded_seconds) == (9.0, 10.0)
    assert stats.queue_length == 11
    # Cumulative buckets, upper bounds in seconds.
    assert stats.read_latency.buckets == ((100e-6, 5), (1000e-6, 12))
    assert stats.write_latency.buckets == ((500e-6, 3),)


def test_instance_store_is_told_apart_by_its_magic():
    assert nvme.parse_log_page(page(magic=0xEC2C0D7E)).kind == "instance_store"


def test_a_wrong_magic_is_unsupported_and_a_short_page_an_error():
    with pytest.raises(nvme.Unsupported, match="magic"):
        nvme.parse_log_page(page(magic=0x12345678))
    with pytest.raises(ValueError, match="shorter"):
        nvme.parse_log_page(page()[:3000])


def test_zero_and_sixty_four_bins():
    empty = nvme.parse_log_page(page(read_bins=(), write_bins=()))
    assert empty.read_latency.buckets == () and empty.read_latency.count == 0
    full = [(1000 * i, 1000 * (i + 1), i) for i in range(64)]
    stats = nvme.parse_log_page(page(read_bins=full))
    assert len(stats.read_latency.buckets) == 64 and stats.read_latency.count == sum(range(64))
    assert stats.read_latency.buckets[-1] == (0.064, sum(range(64)))


def test_histograms_that_make_no_sense_are_refused():
    with pytest.raises(ValueError, match="more than 64"):
        nvme.parse_log_page(page(read_bins=[(0, i + 1, 1) for i in range(65)])[:4096])
    with pytest.raises(ValueError, match="not above"):
        nvme.parse_log_page(page(read_bins=((0, 100, 1), (100, 100, 1))))


def test_the_get_log_page_command():
    command = nvme.get_log_page_command(0xDEADBEEF000)
    assert len(command) == 72
    assert command[0] == 0x02 and command[1] == 0  # opcode Get Log Page, no flags
    assert struct.unpack_from("<I", command, 4)[0] == 1  # namespace 1
    assert struct.unpack_from("<Q", command, 24)[0] == 0xDEADBEEF000  # the buffer
    assert struct.unpack_from("<I", command, 36)[0] == 4096  # data_len
    assert struct.unpack_from("<I", command, 40)[0] == 0xD0 | (1023 << 16)  # log 0xD0, 1024 dwords (0-based)


@pytest.mark.root
def test_a_device_that_is_not_nvme_is_unsupported(make_loop):
    """The real ioctl on a loop device and on /dev/null: ENOTTY, a clean "unsupported"."""
    for devnode in (make_loop(4 * MIB), "/dev/null"):
        with pytest.raises(nvme.Unsupported, match="no NVMe admin commands"):
            nvme.read_log_page(devnode)


def fake_kernel(status: int = 0, error: int = 0, data: bytes = b""):
    """An ioctl standing in for the NVMe driver: it checks the command, fills the buffer, returns a status."""

    def ioctl(fd: int, request: int, command: bytearray) -> int:
        assert request == 0xC0484E41
        if error:
            raise OSError(error, "fake")
        address, length = struct.unpack_from("<Q", command, 24)[0], struct.unpack_from("<I", command, 36)[0]
        ctypes.memmove(address, data, min(length, len(data)))
        return status

    return ioctl


def test_the_statuses_aws_devices_answer():
    assert nvme.parse_log_page(nvme.read_log_page("/dev/null", fake_kernel(data=page()))).read_ops == 101
    # Instance store before 2025: Invalid Log Page, with the More bit (CSI driver issue 2232: 8457).
    with pytest.raises(nvme.Unsupported):
        nvme.read_log_page("/dev/null", fake_kernel(status=8457))
    with pytest.raises(nvme.Unsupported):
        nvme.read_log_page("/dev/null", fake_kernel(status=0x4002))  # Invalid Field, Do Not Retry
    with pytest.raises(nvme.NotPermitted, match="CAP_SYS_ADMIN"):
        nvme.read_log_page("/dev/null", fake_kernel(error=errno.EACCES))
    with pytest.raises(OSError, match="status 0x6"):
        nvme.read_log_page("/dev/null", fake_kernel(status=0x6))  # internal error: an error, not "unsupported"


@pytest.mark.slow
@pytest.mark.root
def test_provider_statistics_metrics_throttle_verdict_and_alert_on_a_real_prometheus(
    tmp_path, make_loop, start_exporter, start_prometheus
):
    """The page served from a file (the test hook) for one loop device, a page with a foreign magic for
    another: the metrics in base units, joined to volprobe_target_info by device; the detector's
    source="provider" verdict when the provider counts demand over the volume's IOPS limit; VolprobeThrottled
    firing on a real Prometheus with the shipped rules; the Volume dashboard's provider panels with data; and
    the foreign device said once in the log, not at every read."""
    import threading

    ebs, other = make_loop(16 * MIB, name="ebs"), make_loop(16 * MIB, name="other")
    ebs_name, other_name = ebs.rsplit("/", 1)[1], other.rsplit("/", 1)[1]
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / other_name).write_bytes(page(magic=0xDEADBEEF))
    started = time.monotonic()

    def publish(share: float) -> None:
        temporary = pages / ".page"
        temporary.write_bytes(counters_page(time.monotonic() - started, share))
        temporary.replace(pages / ebs_name)

    publish(0.0)
    config = tmp_path / "volprobe.yml"
    config.write_text(
        f"targets: [{{name: db, device: {ebs}, probes: [{{op: read, interval: 100ms}}]}},"
        f" {{name: other, device: {other}, probes: [{{op: read, interval: 100ms}}]}}]\n"
    )
    exporter = start_exporter("--config", str(config), env={"VOLPROBE_TEST_NVME_PAGES": str(pages)})
    prometheus = start_with_rules(start_prometheus, tmp_path, exporter.port, "1s")
    stop = threading.Event()
    share = [0.0]

    def writer() -> None:
        while not stop.wait(0.25):
            publish(share[0])

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        # Unthrottled first: the verdict is exported, at 0.
        samples = exporter.wait_for(
            lambda s: (
                sample_value(s, "volprobe_throttle_active", device=ebs_name, source="provider", limit="iops") == 0
            ),
            what="the provider's verdict, not throttled",
        )
        assert sample_value(samples, "volprobe_throttle_active", device=ebs_name, source="inferred", dir="read") == 0
        # The volume's IOPS limit exceeded 90% of the time: throttled, by the provider's own count.
        share[0] = 0.9
        exporter.wait_for(
            lambda s: (
                sample_value(s, "volprobe_throttle_active", device=ebs_name, source="provider", limit="iops") == 1
            ),
            timeout=40,
            what="the provider's verdict: throttled",
        )
        # volprobe adds nothing to a throttled volume's queue: its probes back off (10x), as on a plateau.
        samples = exporter.wait_for(
            lambda s: sample_value(s, "volprobe_probe_interval_seconds", target="db") == 1.0,
            timeout=10,
            what="the probes backing off",
        )
        assert sample_value(samples, "volprobe_probe_interval_seconds", target="other") == 0.1
        throttled = {"device": ebs_name, "source": "provider"}
        wait_until(lambda: firing(prometheus.alerts(), "VolprobeThrottled", **throttled), 60, "the alert", every=1)
        joined = prometheus.query(
            f'volprobe_nvme_ops_total{{device="{ebs_name}"}} * on (instance, device) group_left (target) '
            "volprobe_target_info"
        )
        assert {r["metric"]["target"] for r in joined} == {"db"} and len(joined) == 2  # read and write
        volume = json.loads((REPO / "dashboards" / "volprobe-volume.json").read_text())
        values = {
            "$cluster": ".*", "$job": "volprobe", "$instance": f"127.0.0.1:{exporter.port}", "$target": "db",
            "$device": ebs_name, "$disk": ebs_name, "$__rate_interval": "10s",
        }  # fmt: skip
        provider_panels = [p for p in panels(volume) if "provider" in p["title"]]
        assert len(provider_panels) == 2
        for panel in provider_panels:
            for target in panel["targets"]:
                assert prometheus.query(substitute(target["expr"], values)), (panel["title"], target["expr"])
    finally:
        stop.set()
        thread.join()
    # Exact values, from a page known to the byte.
    (pages / ebs_name).write_bytes(counters_page(10.0, 0.5, {88: 7}))
    samples = exporter.wait_for(
        lambda s: sample_value(s, "volprobe_nvme_queue_length", device=ebs_name) == 7, what="the last page read"
    )
    labels = {"device": ebs_name, "kind": "ebs"}
    assert sample_value(samples, "volprobe_nvme_ops_total", **labels, op="read") == 1000
    assert sample_value(samples, "volprobe_nvme_bytes_total", **labels, op="read") == 1000 * 4096
    assert sample_value(samples, "volprobe_nvme_seconds_total", **labels, op="read") == 0.5
    assert sample_value(samples, "volprobe_nvme_exceeded_seconds_total", **labels, scope="volume", limit="iops") == 5
    assert sample_value(samples, "volprobe_nvme_exceeded_seconds_total", **labels, scope="instance", limit="iops") == 9
    bucket = "volprobe_nvme_latency_seconds_bucket"
    assert sample_value(samples, bucket, **labels, op="read", le="0.0001") == 5
    assert sample_value(samples, bucket, **labels, op="read", le="0.001") == 12
    assert sample_value(samples, bucket, **labels, op="read", le="+Inf") == 12
    assert sample_value(samples, "volprobe_nvme_latency_seconds_sum", **labels, op="read") == 0.5
    assert sample_value(samples, "volprobe_nvme_stats_up", **labels) == 1
    # The device whose page is not AWS's: no series, and one line in the log for the whole run.
    assert not any(labels["device"] == other_name for labels, _ in samples.get("volprobe_nvme_stats_up", []))
    assert exporter.log().count(f"no provider statistics for {other_name}") == 1
    assert exporter.stop() == 0


def test_the_devices_32_bit_bin_counts_are_unwrapped_into_monotonic_buckets():
    """A busy bin passes 2**32 in days: the counts the exporter gives keep rising (no false counter reset)."""
    first = nvme.parse_log_page(page(read_bins=((0, 100, 2**32 - 10), (100, 1000, 7))))
    wrapped = nvme.parse_log_page(page(read_bins=((0, 100, 5), (100, 1000, 9))))
    unwrapped = wrapped.read_latency.unwrap(first.read_latency, first.read_latency)
    assert unwrapped.buckets == ((100e-6, 2**32 + 5), (1000e-6, 2**32 + 14))
    later = nvme.parse_log_page(page(read_bins=((0, 100, 8), (100, 1000, 9))))
    assert later.read_latency.unwrap(unwrapped, wrapped.read_latency).buckets[0] == (100e-6, 2**32 + 8)


@pytest.mark.slow
def test_a_device_whose_page_read_hangs_blocks_neither_scrapes_nor_other_devices(tmp_path, make_loop, start_exporter):
    """One device's read never returns (its page is a FIFO nobody writes: the test hook's stand-in for a Get Log
    Page to a wedged controller). The other device is still read every second, scrapes stay fast, the hung one
    is reported down and said once in the log, and the exporter stops cleanly while the read still hangs."""
    import contextlib
    import os

    healthy, hung = make_loop(16 * MIB, name="healthy"), make_loop(16 * MIB, name="hung")
    healthy_name, hung_name = healthy.rsplit("/", 1)[1], hung.rsplit("/", 1)[1]
    pages = tmp_path / "pages"
    pages.mkdir()
    os.mkfifo(pages / hung_name)
    config = tmp_path / "volprobe.yml"
    config.write_text(
        f"targets: [{{name: healthy, device: {healthy}, probes: [{{op: read, interval: 100ms}}]}},"
        f" {{name: hung, device: {hung}, probes: [{{op: read, interval: 100ms}}]}}]\n"
    )
    started = time.monotonic()
    try:
        exporter = start_exporter("--config", str(config), env={"VOLPROBE_TEST_NVME_PAGES": str(pages)})
        slowest, seen_healthy, seen_hung = 0.0, [], []
        while time.monotonic() - started < 10:
            # The healthy page changes every second: each fresh reading is a new one.
            temporary = pages / ".page"
            temporary.write_bytes(counters_page(time.monotonic() - started))
            temporary.replace(pages / healthy_name)
            before = time.monotonic()
            samples = exporter.metrics()
            slowest = max(slowest, time.monotonic() - before)
            seen_healthy.append(sample_value(samples, "volprobe_nvme_stats_up", device=healthy_name))
            seen_hung.append(sample_value(samples, "volprobe_nvme_stats_up", device=hung_name))
            time.sleep(0.5)
        # Down, from its first read on: absent only until the first poll has waited for it.
        assert set(seen_hung) <= {None, 0.0} and seen_hung[-1] == 0.0, seen_hung
        # Fresh all along once first read (the hung read never stalls it, past the first poll's wait).
        first = seen_healthy.index(1.0)
        assert first < 8 and all(up == 1.0 for up in seen_healthy[first:]), seen_healthy
        assert slowest < 1.0, f"a scrape took {slowest:.2f} s"
        assert exporter.log().count(f"provider statistics of {hung_name}: its log page read has not returned") == 1
        assert exporter.stop() == 0
    finally:
        with contextlib.suppress(OSError):  # let the hung read end, if the exporter is still there to read
            os.close(os.open(pages / hung_name, os.O_WRONLY | os.O_NONBLOCK))


def test_a_provider_poll_reads_nothing_of_disks_that_cannot_be_aws(tmp_path, monkeypatch):
    """Only NVMe namespaces can be AWS devices; each is resolved from sysfs once, and again when it changes."""
    monkeypatch.setattr(discovery, "KNOWN_RECHECK_S", 0.0)  # each poll looks: the change below is seen at once
    machine = FakeMachine(tmp_path)
    for name, devnum in (("sda", "8:0"), ("loop0", "7:0"), ("vda", "253:0")):
        machine.block("virtual/block", name, devnum, 2048)
    controller = "pci0000:00/0000:00:1f.0/nvme/nvme0"
    (machine.sys / "devices" / controller).mkdir(parents=True)
    (machine.sys / "devices" / controller / "model").write_text("QEMU NVMe Ctrl\n")
    (machine.block(controller, "nvme0n1", "259:0", 2048) / "device").symlink_to("..")
    host = machine.counting_host()
    disks = {"sda", "loop0", "vda", "nvme0n1"}
    provider = ProviderStats(host, lambda: disks, capabilities=Capabilities())
    for _ in range(5):
        provider.poll()
    assert host.resolved == 1  # nvme0n1, once: not an AWS model, and not changed since
    assert provider.snapshot() == {}
    machine.remake("nvme0n1")
    provider.poll()
    assert host.resolved == 2
