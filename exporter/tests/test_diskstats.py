"""/proc/diskstats in the 14-, 18- and 20-field formats, on captures from real kernels."""

import pytest

from volprobe import diskstats

from .support.harness import FIXTURES

DIR = FIXTURES / "diskstats"


def test_14_fields_linux_3_10():
    stats = diskstats.parse((DIR / "linux-3.10-centos7.txt").read_text())
    assert set(stats) == {"sda", "sda1", "sda2", "sdb", "sdc"}
    sda = stats["sda"]
    assert (sda.major, sda.minor) == (8, 0)
    assert sda.reads_completed == 20076
    assert sda.bytes_read == 798556 * 512
    assert sda.writes_completed == 23573766
    assert sda.weighted_io_time_ms == 24947775
    assert sda.discards_completed is None and sda.flushes_completed is None


def test_18_fields_linux_4_19():
    stats = diskstats.parse((DIR / "linux-4.19.txt").read_text())
    sde3 = stats["sde3"]
    assert sde3.sectors_written == 17264776
    assert sde3.discards_completed == 0 and sde3.discard_time_ms == 0
    assert sde3.flushes_completed is None


def test_20_fields_linux_5_6():
    sda = diskstats.parse((DIR / "linux-5.6-fedora30.txt").read_text())["sda"]
    assert sda.flushes_completed == 2303 and sda.flush_time_ms == 1625
    assert sda.io_time_ms == 35594


def test_20_fields_this_kernel():
    stats = diskstats.parse((DIR / "linux-6.18-this-vm.txt").read_text())
    assert stats["vda"].discards_completed == 5362 and stats["vda"].flushes_completed == 2918
    assert stats["zram0"].reads_completed == 0


def test_live_proc_diskstats_parses():
    stats = diskstats.read("/proc")
    assert stats, "this machine has block devices"
    assert all(s.flushes_completed is not None for s in stats.values())  # a 5.5+ kernel


def test_malformed_lines_are_skipped_not_fatal():
    text = "garbage\n   8 0 sda 1 2 3\n" + (DIR / "linux-4.19.txt").read_text()
    assert "sda" in diskstats.parse(text)
    with pytest.raises(ValueError):
        diskstats.parse_line("8 0 sda 1 2 3")


def test_only_the_named_devices_are_parsed():
    text = (DIR / "linux-3.10-centos7.txt").read_text()
    everything = diskstats.parse(text)
    chosen = diskstats.parse(text, {"sdb", "sda1", "nonesuch"})
    assert chosen == {name: everything[name] for name in ("sda1", "sdb")}
    assert diskstats.parse("garbage\n" + text, set()) == {}
