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


@pytest.mark.parametrize("capture", sorted(p.name for p in DIR.glob("*.txt")))
def test_named_devices_are_found_by_search_as_a_full_parse_finds_them(capture):
    """Every name, one at a time and all together, and names that are prefixes or suffixes of others (sda and
    sda1, loop1 and loop10), are found exactly as a parse of every line finds them."""
    text = (DIR / capture).read_text()
    everything = diskstats.parse(text)
    for name in everything:
        assert diskstats.parse(text, {name}) == {name: everything[name]}
    assert diskstats.parse(text, set(everything)) == everything
    near = {n[:-1] for n in everything} | {n + "0" for n in everything} | {n[1:] for n in everything}
    assert diskstats.parse(text, near - set(everything)) == {}
    last = text.rstrip("\n").rsplit("\n", 1)[-1].split()[2]  # a last line without its newline
    assert diskstats.parse(text.rstrip("\n"), {last}) == {last: everything[last]}


def test_hinted_line_numbers_follow_devices_that_move_or_go():
    """The sampler's Reader remembers where each device's line was; a device added before it, or one gone,
    moves the lines, and every device is still found where it now is (or not at all)."""
    text = (DIR / "linux-6.18-this-vm.txt").read_text()
    everything = diskstats.parse(text)
    names = sorted(everything)[::2]
    hints: dict[str, int] = {}
    assert diskstats.parse(text, names, hints) == {n: everything[n] for n in names}
    assert set(hints) == set(names)
    lines = text.splitlines(keepends=True)
    moved = [*lines[1:], "   7     999 loop999 1 0 8 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"]  # one gone, one new
    gone = lines[0].split()[2]
    expected = {n: everything[n] for n in names if n != gone}
    assert diskstats.parse("".join(moved), names, hints) == expected
    assert diskstats.parse("".join(moved), names, hints) == expected  # with the hints it just updated
    assert diskstats.parse("".join(reversed(moved)), names, hints) == expected


def test_the_reader_reads_this_machines_diskstats_again_from_its_start():
    reader = diskstats.Reader()
    try:
        first = reader.read()
        again = reader.read(set(first))
    finally:
        reader.close()
    assert again and set(again) <= set(first)  # devices that other tests detach meanwhile are gone
    assert all(again[n].reads_completed >= first[n].reads_completed for n in again)
