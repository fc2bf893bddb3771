"""The probe engine's pure parts: offsets, pacing, write data; then single probes on real devices."""

from __future__ import annotations

import itertools
import mmap
import os
import random
import sys
import zlib

import pytest

from volprobe import probe, timer
from volprobe.config import ProbeConfig

from .support.harness import MIB


def spec(op: str, block_size: int, revisit: float) -> ProbeConfig:
    return ProbeConfig(op, block_size, revisit=revisit)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection(n):
    perm = probe.BlockPermutation(n, key=42)
    assert sorted(perm(i) for i in range(n)) == list(range(n))


def test_permutation_depends_on_the_key_and_looks_random():
    n = 1 << 20
    a = [probe.BlockPermutation(n, 1)(i) for i in range(1000)]
    b = [probe.BlockPermutation(n, 2)(i) for i in range(1000)]
    assert a != b
    steps = {(y - x) % n for x, y in itertools.pairwise(a)}
    assert len(steps) > 990  # no fixed stride the storage could prefetch


def test_offset_picker_first_touches_never_repeat_and_repeats_were_seen():
    picker = probe.OffsetPicker(500, revisit=0.3, rng=random.Random(7))
    seen: set[int] = set()
    touches = {"first": 0, "repeat": 0}
    for _ in range(400):
        block, touch = picker.next()
        touches[touch] += 1
        if touch == "first":
            assert block not in seen
            seen.add(block)
        else:
            assert block in seen
    assert 0.2 < touches["repeat"] / 400 < 0.4


def test_offset_picker_all_repeat_once_every_block_was_probed():
    picker = probe.OffsetPicker(10, revisit=0.0, rng=random.Random(1))
    assert {picker.next() for _ in range(10)} == {(b, "first") for b in range(10)}
    assert all(picker.next()[1] == "repeat" for _ in range(20))


class _FailingCursor:
    """A volume state whose reservation write raises once, at the `fail_at`-th fresh offset."""

    def __init__(self, fail_at: int) -> None:
        self.key, self.start, self.gaps, self.fail_at = 42, 0, [], fail_at

    def reserve(self, needed: int) -> bool:
        if needed == self.fail_at:
            self.fail_at = -1
            raise OverflowError("a reservation that cannot be written")
        return True

    def release(self, used: int) -> None:
        pass


def test_offset_picker_keeps_the_picks_made_before_a_failed_reservation():
    """The supervised worker restarts after the failure: the fresh offsets picked before it must still come, in
    order, or they would count as touched when they never were."""
    picker = probe.OffsetPicker(1000, revisit=0.0, rng=random.Random(1), cursor=_FailingCursor(fail_at=5))
    with pytest.raises(OverflowError):
        picker.next()
    first = [picker.next() for _ in range(6)]
    assert first == [(picker.permutation(i), "first") for i in range(6)]


SECOND = 1_000_000_000


def test_a_batch_of_picks_reads_as_the_picks_it_was_made_of_in_an_eighth_of_their_memory():
    picker = probe.OffsetPicker(1 << 40, revisit=0.5, rng=random.Random(3))
    picks = [picker.next() for _ in range(probe.MAX_BATCH)]
    assert {touch for _, touch in picks} == {"first", "repeat"}
    batch = probe.Picks(picks)
    assert len(batch) == len(picks) and list(batch) == picks
    assert [batch[i] for i in range(len(picks))] == picks
    assert batch[7:] == picks[7:] and batch[:0] == []
    with pytest.raises(IndexError):
        batch[len(picks)]
    as_tuples = sys.getsizeof(picks) + sum(sys.getsizeof(p) + sys.getsizeof(p[0]) for p in picks)
    compact = sys.getsizeof(batch.blocks) + sys.getsizeof(batch.first)
    assert compact * 8 < as_tuples


def test_pacer_skips_overrun_slots_without_replaying_them():
    pacer = timer.Pacer(0.0, random.Random(0))
    pacer.schedule(0, SECOND)
    assert pacer.deadline_ns == 0
    assert pacer.advance(now_ns=SECOND // 10) == 0  # a fast probe: next slot is slot 1
    assert pacer.deadline_ns == SECOND
    # The probe of slot 1 takes 3.5 s: slots 2, 3 and 4 started meanwhile and are skipped.
    assert pacer.advance(now_ns=4 * SECOND + SECOND // 2) == 3
    assert pacer.deadline_ns == 5 * SECOND


def test_pacer_jitter_stays_inside_the_slot():
    pacer = timer.Pacer(0.5, random.Random(3))
    pacer.schedule(0, SECOND)
    offsets = []
    for slot in range(100):
        offsets.append(pacer.deadline_ns - slot * SECOND)
        assert pacer.advance(now_ns=pacer.deadline_ns) == 0  # probed at its deadline: on to the next slot
    assert all(0 <= d < SECOND // 2 for d in offsets)
    assert len(set(offsets)) > 90


def test_write_data_is_non_zero_incompressible_and_never_repeats():
    buffer = mmap.mmap(-1, 8192)
    data = timer.WriteData(buffer)
    seen_blocks, seen_sectors = set(), set()
    for _ in range(200):
        data.stamp()
        block = bytes(buffer)
        assert block not in seen_blocks
        seen_blocks.add(block)
        for i in range(0, len(block), 512):
            seen_sectors.add(block[i : i + 512])
    assert len(seen_sectors) == 200 * 16  # every sector of every write differs: no dedupe at any grain
    assert len(zlib.compress(bytes(buffer))) > 8000
    assert bytes(buffer).count(0) < 100


@pytest.mark.root
@pytest.mark.parametrize("kind", ["c", "python"])
def test_one_read_and_one_write_on_a_loop_device(make_loop, monkeypatch, kind):
    if os.environ.get(timer.TEST_TIMER_ENV) == "python":
        if kind == "c":
            pytest.skip(f"the C timer is not in use (${timer.TEST_TIMER_ENV})")
    else:
        assert probe.TIMER == "c", "the C timer builds wherever the tests run (gcc and Python headers are there)"
    if kind == "python":
        monkeypatch.setattr(timer, "_timedio", None)
    loop = make_loop(16 * MIB)
    fd = os.open(loop, os.O_RDWR | os.O_DIRECT)
    try:
        io = probe.IOTarget(loop, os.O_RDWR | os.O_DIRECT, MIB, 15 * MIB)
        writer = probe.ProbeIO(spec("write", 8192, 0.0), io, random.Random(1), fd)
        outcome = writer.once()
        assert not outcome.error and outcome.latency_ns > 0
        assert MIB <= outcome.offset < 15 * MIB and outcome.offset % 8192 == 0
        written = bytes(writer.buffer)
        reader = probe.ProbeIO(spec("read", 8192, 1.0), io, random.Random(1), os.dup(fd))
        back = reader.once()  # same seed, same first offset
        assert back.offset == outcome.offset and bytes(reader.buffer) == written and not back.zero
        reader.close()
    finally:
        os.close(fd)


@pytest.mark.root
def test_reads_of_never_written_blocks_are_flagged_as_zero(make_loop):
    loop = make_loop(16 * MIB)
    io = probe.IOTarget(loop, os.O_RDONLY | os.O_DIRECT, 0, 16 * MIB)
    reader = probe.ProbeIO(spec("read", 4096, 0.0), io, random.Random(2))
    reader.open()
    assert reader.once().zero
    reader.close()


def test_errors_are_reported_by_errno_and_a_vanished_device_is_closed(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"x" * 100)
    # Reads open per request: a missing device is an open error, named by errno and path.
    gone = probe.ProbeIO(
        spec("read", 4096, 0.0), probe.IOTarget(str(tmp_path / "gone"), os.O_RDONLY, 0, 16 * MIB), random.Random(2)
    )
    outcome = gone.once()
    assert outcome.error == "ENOENT" and "open" in outcome.detail
    # A short transfer (here: past the end of a small file) is SHORT.
    reader = probe.ProbeIO(
        spec("read", 4096, 0.0), probe.IOTarget(str(short), os.O_RDONLY, 0, 16 * MIB), random.Random(2)
    )
    assert reader.once().error == "SHORT"
    # A write probe keeps its descriptor; EBADF closes it so that the next probe reopens.
    writer = probe.ProbeIO(
        spec("write", 4096, 0.0), probe.IOTarget(str(short), os.O_RDWR, 0, 16 * MIB), random.Random(2), fd=987654
    )
    outcome = writer.once()
    assert outcome.error == "EBADF" and writer.fd is None


@pytest.mark.root
def test_reads_do_not_hold_the_device_open(make_loop):
    loop = make_loop(16 * MIB)
    reader = probe.ProbeIO(
        spec("read", 4096, 0.0), probe.IOTarget(loop, os.O_RDONLY | os.O_DIRECT, 0, 16 * MIB), random.Random(2)
    )
    assert not reader.once().error
    name = os.path.basename(loop)
    holders = [fd for pid in os.listdir("/proc") if pid.isdigit() for fd in _fds(pid) if _points_to(fd, loop)]
    assert holders == [], f"{name} still open: {holders}"


def _points_to(link: str, path: str) -> bool:
    try:
        return os.readlink(link) == path
    except OSError:
        return False


def _fds(pid: str) -> list[str]:
    try:
        return [os.path.join(f"/proc/{pid}/fd", fd) for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return []
