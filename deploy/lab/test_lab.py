"""The lab's own claims, each checked with fio (or the kernel) on the real block device it makes."""

from __future__ import annotations

import mmap
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import pytest

from . import lab

MIB = lab.MIB

pytestmark = [pytest.mark.root, pytest.mark.lab]


def qd1(device: str, rw: str, bs: str = "4k", runtime: float = 3) -> dict:
    return lab.run_fio(device, "--ioengine=sync", "--iodepth=1", f"--rw={rw}", f"--bs={bs}", runtime=runtime)


@pytest.mark.xdist_group("lab-latency")  # exporter/tests/conftest.py
@pytest.mark.parametrize(("read", "write"), [(0.002, 0.005), (0.0005, 0.001)])
def test_qd1_latency_matches_the_configured_latency(lab_volume, read, write):
    volume = lab_volume(size=64 * MIB, read_latency=read, write_latency=write)
    for rw, op, configured in (("randread", "read", read), ("randwrite", "write", write)):
        p50 = lab.fio_percentile(qd1(volume.device, rw), op, 50)
        assert abs(p50 - configured) <= max(0.10 * configured, 0.0003), (rw, p50, configured)


# Alone: beside the parallel run the host delayed the tail's requests more than the fast ones (a tail 5.8 ms above
# the fast mode in one CI run, 26.5% of requests over 4 ms in another), which no bar that still tells a tail that
# replaces the latency (5 ms apart) from one added to it (6 ms) can allow.
@pytest.mark.alone
@pytest.mark.xdist_group("lab-latency")
def test_a_tail_fraction_takes_the_tail_latency_and_the_rest_the_base(lab_volume):
    volume = lab_volume(size=64 * MIB, read_latency=0.001, write_latency=0.001, tail_fraction=0.2, tail_latency=0.006)
    for rw, op in (("randread", "read"), ("randwrite", "write")):
        job = qd1(volume.device, rw)
        # 20% of the requests are slow: p40 is the fast ones' median, p90 the slow ones'. The tail takes 6 ms
        # instead of 1 ms: 5 ms apart, whatever the chain's overhead adds to both (the level is held by
        # test_qd1_latency_matches_the_configured_latency).
        p40, p90 = (lab.fio_percentile(job, op, p) for p in (40, 90))
        assert p40 < 0.003, (rw, p40)
        assert abs((p90 - p40) - 0.005) <= 0.0006, (rw, p40, p90)
        # fio's percent of requests in the tail's bucket (4-10 ms): 20, its standard deviation 1 at ~1500; fast ones
        # the host delays past 4 ms add to it, hence the room above.
        share = job["latency_ms"]["10"]
        assert 14 <= share <= 30, (rw, job["latency_ms"])


def test_a_tail_without_its_latency_and_rates_outside_0_1_are_refused():
    for settings in ({"tail_fraction": 0.02}, {"tail_fraction": 1.5, "tail_latency": 0.008}, {"fail_reads": -0.1}):
        with pytest.raises(ValueError, match=next(iter(settings))):
            lab.up("refused", **settings)
    assert not lab.Volume("refused").dir.exists()


# Throughput at a cap and the lazy volume's latencies need the machine to themselves: beside the parallel
# run's other tests, fio and the lab's daemons were starved below the caps (145 IOPS against 150; seconds of 454
# against 500) and zero reads slowed past their bound, in one CI run. .ci/run runs `alone` tests after the others.
@pytest.mark.alone
@pytest.mark.xdist_group("lab-load")  # exporter/tests/conftest.py
@pytest.mark.parametrize("cap", [150, 500, 1000])
def test_iops_cap_holds_under_parallel_load_from_two_processes(lab_volume, cap):
    volume = lab_volume(size=64 * MIB, read_latency=0.001, write_latency=0.001, iops_limit=cap)
    jobs: list[dict] = []

    def load(rw: str) -> None:
        jobs.append(
            lab.run_fio(
                volume.device, "--ioengine=libaio", "--iodepth=8", f"--rw={rw}", "--bs=4k", "--ramp_time=1", runtime=4
            )
        )

    threads = [threading.Thread(target=load, args=(rw,)) for rw in ("randread", "randwrite")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(job["read"]["iops"] + job["write"]["iops"] for job in jobs)
    assert abs(total - cap) <= 0.03 * cap, (total, cap)  # both processes share one device-wide bucket


@pytest.mark.xdist_group("lab-load")
def test_bandwidth_cap_holds_under_parallel_load(lab_volume):
    cap = 20 * MIB
    volume = lab_volume(size=64 * MIB, read_latency=0.0005)

    def rate(runtime: float) -> float:
        # 64 requests in flight: at the cap, 200 ms of work queued at the device. The cap is reached only while
        # a request is waiting for it; with 16 in flight (50 ms of work), the load generator's pauses on a busy
        # machine (fio and the loop device's workers share the CPUs with everything else) left the device idle
        # now and then, and a capped 18.8 MiB/s was measured in one CI run.
        job = lab.run_fio(
            volume.device,
            "--ioengine=libaio",
            "--iodepth=32",
            "--numjobs=2",
            "--rw=randread",
            "--bs=64k",
            "--ramp_time=1",
            runtime=runtime,
        )
        return job["read"]["bw_bytes"]

    # The reference, measured here and now: what this load moves without a cap. The cap can only be shown to be
    # reached by a demand above it; the capped rate is then the cap, neither less (not reached) nor more (not held).
    uncapped = rate(runtime=2)
    assert uncapped >= 2 * cap, f"the load moved only {uncapped / MIB:.1f} MiB/s uncapped: no test of a 20 MiB/s cap"
    volume.set(bandwidth_limit=cap)
    # Never more than the cap, in any window; the cap itself reached in one of three: on a busy machine (the suite's
    # four workers) the load generator and the lab's server wait for the CPU now and then, and one window of 4 s
    # measured 18.1 MiB/s (a CI run beside the whole suite).
    measured = []
    for _ in range(3):
        measured.append(rate(runtime=4))
        assert measured[-1] <= 1.03 * cap, f"the cap did not hold: {[m / MIB for m in measured]} MiB/s"
        if measured[-1] >= 0.97 * cap:
            break
    else:
        raise AssertionError(
            f"the cap was never reached: {[m / MIB for m in measured]} MiB/s, {uncapped / MIB} uncapped"
        )


def test_set_changes_a_live_device_without_detaching_it(lab_volume):
    volume = lab_volume(size=64 * MIB, read_latency=0.001)
    device = volume.device
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT)  # held open across the change
    buffer = mmap.mmap(-1, 4096)
    # The 10th percentiles: a busy machine adds its scheduling delays to a request's latency, which the low end of
    # the distribution has least of (a median 0.69 ms above the 4 ms set was measured in one CI run).
    try:
        before = lab.fio_percentile(qd1(device, "randread", runtime=2), "read", 10)
        volume.set(read_latency=0.004)
        start = time.perf_counter()
        os.preadv(fd, [buffer], 4096 * 17)
        assert time.perf_counter() - start >= 0.0035
        after = lab.fio_percentile(qd1(device, "randread", runtime=2), "read", 10)
    finally:
        os.close(fd)
    assert volume.device == device
    # The device and the chain in front of it are the same before and after: their overhead, whatever it is on
    # this machine now, is in both, and the difference is the change `set` made, 3 ms.
    assert before < 0.0015 and abs((after - before) - 0.003) <= 0.0004, (before, after)


def test_stall_blocks_and_release_resumes(lab_volume):
    volume = lab_volume(size=64 * MIB, read_latency=0.0005)
    volume.set(stall=True)
    done = threading.Event()

    def read() -> None:
        fd = os.open(volume.device, os.O_RDONLY | os.O_DIRECT)
        os.preadv(fd, [mmap.mmap(-1, 4096)], 8192)
        os.close(fd)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert not done.wait(1.5), "a stalled device must not answer"
    assert volume.stats()["stalled"] >= 1
    volume.set(stall=False)
    assert done.wait(5), "released I/O completes"


def test_injected_errors_are_eio_and_only_for_the_chosen_op(lab_volume):
    volume = lab_volume(size=64 * MIB)
    volume.set(fail_reads=1.0)
    fd = os.open(volume.device, os.O_RDWR | os.O_DIRECT)
    buffer = mmap.mmap(-1, 4096)
    try:
        with pytest.raises(OSError) as caught:
            os.preadv(fd, [buffer], 0)
        assert caught.value.errno == 5  # EIO
        assert os.pwrite(fd, buffer, 4096) == 4096
        volume.set(fail_reads=0.0)
        assert os.preadv(fd, [buffer], 0) == 4096
    finally:
        os.close(fd)


@pytest.mark.alone  # see test_iops_cap_holds_under_parallel_load_from_two_processes
def test_lazy_volume_reads_zeros_fast_and_first_writes_pay(lab_volume):
    volume = lab_volume(
        size=64 * MIB,
        alloc_unit=64 * 1024,
        read_latency=0.003,
        write_latency=0.002,
        lazy=True,
        first_write_latency=0.015,
    )
    fd = os.open(volume.device, os.O_RDWR | os.O_DIRECT)
    buffer = mmap.mmap(-1, 4096)
    buffer.write(os.urandom(4096))
    check = mmap.mmap(-1, 4096)

    def timed(call, *args) -> float:
        start = time.perf_counter()
        call(fd, *args)
        return time.perf_counter() - start

    # Medians over five allocation units, so one scheduling hiccup on a busy machine decides nothing.
    timings: dict[str, list[float]] = {"zero_read": [], "first": [], "repeat": [], "real_read": []}
    try:
        for unit in range(5):
            offset = 10 * MIB + unit * 256 * 1024  # distinct 64 KiB allocation units
            timings["zero_read"].append(timed(os.preadv, [check], offset))
            assert bytes(check) == bytes(4096)
            timings["first"].append(timed(os.pwrite, buffer, offset))
            timings["repeat"].append(timed(os.pwrite, buffer, offset + 4096))  # same unit: already allocated
            timings["real_read"].append(timed(os.preadv, [check], offset))
            assert bytes(check) == bytes(buffer)
    finally:
        os.close(fd)
    zero_read, first, repeat, real_read = (statistics.median(v) for v in timings.values())
    assert zero_read < 0.0015 < 0.0025 < real_read, timings
    assert first > 0.013 and repeat < 0.005, timings


def test_fio_mkfs_and_mount_work(lab_volume, tmp_path):
    volume = lab_volume(size=128 * MIB, read_latency=0.0002, write_latency=0.0002)
    subprocess.run(["mkfs.ext4", "-q", "-F", volume.device], check=True)
    point = tmp_path / "mnt"
    point.mkdir()
    subprocess.run(["mount", volume.device, str(point)], check=True)
    try:
        payload = os.urandom(MIB)
        (point / "file").write_bytes(payload)
        subprocess.run(["sync"], check=True)
        # Read back from the device, not from the page cache the write just filled: O_DIRECT into an aligned
        # buffer, and the volume itself must have served the MiB.
        served = sum(volume.read_coverage())
        back = mmap.mmap(-1, MIB)
        fd = os.open(point / "file", os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.preadv(fd, [back], 0) == MIB
        finally:
            os.close(fd)
        assert sum(volume.read_coverage()) - served >= MIB, "the read-back reached the volume"
        assert bytes(back) == payload
    finally:
        subprocess.run(["umount", str(point)], check=True)


def leftovers(volume_dir: Path, device: str) -> list[str]:
    found = []
    if volume_dir.exists():
        found.append(f"state dir {volume_dir}")
    listing = subprocess.run(
        ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"], capture_output=True, text=True
    ).stdout
    found += [line for line in listing.splitlines() if str(volume_dir) in line]
    found += [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(volume_dir) in line]
    processes = subprocess.run(["pgrep", "-af", str(volume_dir)], capture_output=True, text=True).stdout
    found += [line for line in processes.splitlines() if "pgrep" not in line]
    return found


def test_down_leaves_nothing_behind_even_with_io_stalled():
    name = f"pytest-{os.getpid()}-down"  # the pid: clean_stale_test_volumes of another worker leaves it alone
    volume = lab.up(name, size=32 * MIB, read_latency=0.001)
    device, volume_dir = volume.device, volume.dir
    volume.set(stall=True)
    done = threading.Event()

    def read() -> None:
        fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [mmap.mmap(-1, 4096)], 0)
        except OSError:
            pass
        os.close(fd)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    time.sleep(0.5)
    lab.down(name)
    assert done.wait(10), "down releases I/O that was stalled"
    time.sleep(0.5)
    assert leftovers(volume_dir, device) == []


def test_a_stale_volume_of_a_killed_run_is_cleaned_up_by_name():
    volume_name = f"pytest-{os.getpid()}-stale"
    first = lab.up(volume_name, size=32 * MIB, calibrate=False)
    old_pids = (first.state["nbdkit_pid"], first.state["nbdfuse_pid"])
    # The process that made it "dies" without tearing down; the next run makes one of the same name.
    second = lab.up(volume_name, size=32 * MIB, calibrate=False)
    device = second.device
    try:
        assert not any(lab._alive(pid, name) for pid, name in zip(old_pids, ("nbdkit", "nbdfuse"), strict=True))
        listing = subprocess.run(
            ["losetup", "--list", "--noheadings", "--output", "BACK-FILE"], capture_output=True, text=True
        ).stdout
        assert listing.count(str(second.backing)) == 1
    finally:
        lab.down(volume_name)
    assert leftovers(second.dir, device) == []


def test_cli_up_prints_the_device_last_and_status_lists_it():
    lab_py = str(Path(lab.__file__))
    name = f"pytest-{os.getpid()}-cli"
    try:
        result = subprocess.run(
            [lab_py, "up", name, "--size", "32MiB", "--read-latency", "1ms", "--iops-limit", "300"],
            capture_output=True,
            text=True,
            check=True,
        )
        device = result.stdout.strip().splitlines()[-1]
        assert device.startswith("/dev/loop") and Path(device).is_block_device()

        def status_line() -> str:  # this volume's: other tests' volumes may be listed too
            status = subprocess.run([lab_py, "status"], capture_output=True, text=True, check=True).stdout
            return next((line for line in status.splitlines() if line.startswith(f"{name} ")), "")

        line = status_line()
        assert f" {device} " in line and "300 IOPS cap" in line, line
        subprocess.run([lab_py, "set", name, "--iops-limit", "0", "--stall"], check=True, capture_output=True)
        assert "STALLED" in status_line()
    finally:
        subprocess.run([lab_py, "down", name], check=True)
    assert name not in subprocess.run([lab_py, "status"], capture_output=True, text=True).stdout


@pytest.mark.slow
@pytest.mark.alone  # see test_iops_cap_holds_under_parallel_load_from_two_processes
@pytest.mark.xdist_group("lab-load")
def test_fresh_lazy_volume_rises_to_a_flat_plateau_at_its_cap(lab_volume, tmp_path):
    """The seed's curve: random writes on fresh block storage start far below the provider's cap (every
    first write waits for the allocator) and rise to a flat plateau at it as blocks get allocated."""
    cap = 500
    volume = lab_volume(
        # A quarter of the blocks to allocate: the same curve in a quarter of the time, so that it reaches its
        # plateau within the run even when the lab's daemons share the machine with other tests.
        size=16 * MIB,
        alloc_unit=64 * 1024,
        read_latency=0.001,
        write_latency=0.001,
        lazy=True,
        first_write_latency=0.02,
        iops_limit=cap,
    )
    log = tmp_path / "iops"
    lab.run_fio(
        volume.device,
        "--ioengine=libaio",
        "--iodepth=16",
        "--rw=randwrite",
        "--bs=4k",
        f"--write_iops_log={log}",
        "--log_avg_msec=1000",
        runtime=16,
    )
    per_second = [int(line.split(",")[1]) for line in next(tmp_path.glob("iops_iops*.log")).read_text().splitlines()]
    assert len(per_second) >= 14
    head = per_second[: max(1, len(per_second) // 10)]
    tail = per_second[len(per_second) // 2 :]
    assert all(iops < 0.2 * cap for iops in head), str(per_second)
    # The plateau: the second half's median at the cap, and no second above it. A second or two below it is
    # the machine, not the volume: beside the other tests, fio and the lab's daemons are sometimes starved
    # (462 and 467 in one CI run, after eight seconds at 500).
    assert abs(statistics.median(tail) - cap) <= 0.02 * cap, str(per_second)
    assert max(tail) <= 1.05 * cap, str(per_second)
    assert volume.fresh_stats()["allocated_ratio"] > 0.95
