"""Pod volumes on a kubelet's layout built here, with real mounts (issue 43): an ext4 on a loop device bound at one
CSI volume's mount, a FUSE-lab filesystem (standing in for NFS) at another, probed by the real exporter with a
configuration that names the kubelet's directory. Nothing is written into either, nothing is held open there,
each unmounts (no -l) at the first try while probes run, and their series go within one rescan."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .support.harness import MIB, probes_done, run, sample_value, wait_until, write_config

pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.slow]

POD_DB = "3f2e1d0c-9b8a-4765-8432-10fedcba9876"
POD_WEB = "7a6b5c4d-3e2f-4109-8877-665544332211"
PV_EXT4 = "pvc-0c1d2e3f-4a5b-4c6d-8e7f-901a2b3c4d5e"
PV_FUSE = "pvc-9e8d7c6b-5a4f-4e3d-9c2b-1a0f9e8d7c6b"
RESCAN_S = 0.5
STALL_S = float(os.environ.get("VOLPROBE_TEST_STALL_S", "4"))
libc = ctypes.CDLL(None, use_errno=True)


def volume_directory(kubelet: Path, pod: str, pv: str, driver: str, handle: str) -> Path:
    """pods/<pod>/volumes/kubernetes.io~csi/<pv>/ with its vol_data.json as the kubelet writes it; its mount/."""
    directory = kubelet / "pods" / pod / "volumes" / "kubernetes.io~csi" / pv
    (directory / "mount").mkdir(parents=True)
    data = {
        "attachmentID": "csi-" + "ab" * 32,
        "driverName": driver,
        "nodeName": "node-1",
        "specVolID": pv,
        "volumeHandle": handle,
        "volumeLifecycleMode": "Persistent",
    }
    (directory / "vol_data.json").write_text(json.dumps(data))
    return directory / "mount"


@contextlib.contextmanager
def bound(source: str | Path, point: Path) -> Iterator[Path]:
    """`source` bind-mounted at `point`, as the kubelet publishes a staged volume; unmounted (lazily) at the end
    if the test did not."""
    run("mount", "--bind", str(source), str(point))
    try:
        yield point
    finally:
        if is_mount(point):
            subprocess.run(["umount", "-l", str(point)], check=False)


def is_mount(path: Path) -> bool:
    text = Path("/proc/self/mountinfo").read_bytes()
    return any(line.split(b" ")[4] == os.fsencode(str(path)) for line in text.splitlines() if line.strip())


def listing(*roots: Path) -> dict[str, tuple[int, int, int]]:
    """Every file and directory under `roots`: (size, mtime_ns, ctime_ns)."""
    found = {}
    for root in roots:
        for directory, names, files in os.walk(root):
            for name in names + files:
                st = os.lstat(os.path.join(directory, name))
                found[os.path.join(directory, name)] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return found


def sectors_written(loop: str) -> int:
    """The sectors written to `loop` (its stat's 7th field). Not its write requests (the 5th): a sync anywhere on
    the machine sends every ext4 an empty flush, counted there as a write of no sector (on 6.18: `sync` adds one
    to an idle ext4's loop device each time), and other tests run `sync` beside this one. Any data written has a
    sector."""
    return int(Path(f"/sys/block/{os.path.basename(loop)}/stat").read_text().split()[6])


def settled(loop: str, mount: Path) -> int:
    """The sectors written to the ext4 on `loop` once the kernel is done writing to it: synced, then frozen and
    thawed (which commits and checkpoints its journal and writes its superblock), then unchanged for a second:
    what follows in a window is not the mount's or mkfs's."""
    run("sync")
    run("fsfreeze", "-f", str(mount))
    run("fsfreeze", "-u", str(mount))
    last, quiet_since = sectors_written(loop), time.monotonic()
    deadline = quiet_since + 30
    while time.monotonic() - quiet_since < 1.0:
        assert time.monotonic() < deadline, f"{loop} never stopped being written"
        time.sleep(0.1)
        now = sectors_written(loop)
        if now != last:
            last, quiet_since = now, time.monotonic()
    return last


def held_under(pid: int, root: Path) -> list[str]:
    """What of process `pid` is open under `root`: descriptors, working directory, root, mapped files. Where `root`
    is a mount, anything of its filesystem too, by device number: a file opened through a private copy of the
    mount (volprobe.privatemount) is named from that copy's root, not under `root`."""
    prefix, found = str(root), []
    device = os.stat(root).st_dev if os.path.ismount(root) else None
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(prefix) or (device is not None and os.stat(f"/proc/{pid}/fd/{fd}").st_dev == device):
                found.append(f"fd {fd}: {target}")
    for link in ("cwd", "root"):
        if os.readlink(f"/proc/{pid}/{link}").startswith(prefix):
            found.append(link)
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        major, minor = (int(part, 16) for part in line.split()[3].split(":"))
        if prefix in line or (device is not None and os.makedev(major, minor) == device):
            found.append(line)
    return found


def nothing_held(pid: int, root: Path, within: float = 1.0) -> None:
    """Nothing of `pid` open under `root`. A check opens its volume for a few microseconds: a held descriptor is
    in every sample, a check's in one, so a clean sample within a second says nothing is held (`within`: let go
    by then, a request in flight having returned)."""
    samples: list[list[str]] = []
    deadline = time.monotonic() + within
    while not samples or samples[-1]:
        assert time.monotonic() < deadline, f"held under {root} in all {len(samples)} samples: {samples[-1]}"
        samples.append(held_under(pid, root))
        time.sleep(0.01)


def info(samples, target: str) -> dict[str, str] | None:
    return next((labels for labels, _ in samples.get("volprobe_target_info", []) if labels["target"] == target), None)


def config_text(kubelet: Path, loop: str) -> str:
    name = os.path.basename(loop)
    return (
        "mount_check: {interval: 200ms, timeout: 1s}\n"
        # Loop devices are skipped by default discovery: this one is named (patterns match whole kernel names).
        f"discovery: {{include: ['{name}'], rescan_interval: {RESCAN_S}s, probes: [{{op: read, interval: 100ms}}]}}\n"
        f"kubernetes: {{kubelet_directory: {kubelet}, rescan_interval: {RESCAN_S}s}}\n"
    )


def make_ext4(loop: str, point: Path) -> None:
    """ext4 with its inode tables and journal written at mkfs (no lazy init thread writing after the mount)."""
    run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
    point.mkdir(parents=True, exist_ok=True)
    run("mount", "-o", "noatime", loop, str(point))


def test_pod_volumes_are_checked_labelled_never_written_nor_held(
    tmp_path, make_loop, fuse_directory, start_exporter
) -> None:
    kubelet = tmp_path / "kubelet"
    db = volume_directory(kubelet, POD_DB, PV_EXT4, "ebs.csi.aws.com", "vol-0123456789abcdef0")
    web = volume_directory(kubelet, POD_WEB, PV_FUSE, "efs.csi.aws.com", "fs-0a1b2c3d")
    loop = make_loop(64 * MIB, name="pvc")
    disk = os.path.basename(loop)
    staging = kubelet / "plugins" / "kubernetes.io" / "csi" / "pv" / PV_EXT4 / "globalmount"
    make_ext4(loop, staging)
    lab = fuse_directory()
    (lab.path / "data.txt").write_text("the claim's own file\n")
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: subprocess.run(["umount", "-l", str(staging)], check=False))
        stack.enter_context(bound(staging, db))
        stack.enter_context(bound(lab.path, web))
        written = settled(loop, staging)
        before = listing(staging, lab.backing)

        exporter = start_exporter("--config", write_config(tmp_path, config_text(kubelet, loop)))
        pid = exporter.process.pid

        def ready(samples) -> bool:
            ours, theirs = info(samples, disk), info(samples, str(web))
            return (
                probes_done(samples, disk, "read") >= 5
                and ours is not None
                and (ours["pv"], ours["pod_uid"]) == (PV_EXT4, POD_DB)
                and theirs is not None
                and sample_value(samples, "volprobe_mount_responsive", target=str(web)) == 1
            )

        samples = exporter.wait_for(ready, what="the disk's reads with its pv, and the FUSE volume's mount check")
        fuse = info(samples, str(web))
        assert fuse is not None
        assert (fuse["pv"], fuse["pod_uid"], fuse["driver"], fuse["device"]) == (
            PV_FUSE,
            POD_WEB,
            "efs.csi.aws.com",
            "",
        )
        assert (info(samples, disk) or {}).get("driver") == "ebs.csi.aws.com"  # its vol_data.json, beside the mount
        assert fuse["fstype"].startswith("fuse")
        # The mount check only: no probe of the FUSE volume, nor of any path in the kubelet's directory.
        probed = {labels["target"] for labels, _ in samples.get("volprobe_probe_latency_seconds_count", [])}
        assert probed == {disk}
        # A few more checks answered: the checks run, and hold nothing.
        answered = sample_value(samples, "volprobe_mount_last_response_timestamp_seconds", target=str(web)) or 0
        exporter.wait_for(
            lambda s: (
                (sample_value(s, "volprobe_mount_last_response_timestamp_seconds", target=str(web)) or 0)
                > answered + 0.5
            ),
            what="more mount checks",
        )
        nothing_held(pid, kubelet)
        nothing_held(pid, lab.path)

        # Nothing written into either volume: no sector written to the disk, and the files as they were (a buffered
        # write would show there first).
        assert sectors_written(loop) == written
        assert listing(staging, lab.backing) == before

        # The kubelet unmounts while probes and checks run: the first plain umount succeeds.
        for point in (web, db):
            result = subprocess.run(["umount", str(point)], capture_output=True, text=True)
            assert result.returncode == 0, f"umount {point}: {result.stderr}"
        unmounted = time.monotonic()
        # The FUSE volume's target and series go within one rescan (and a scrape); the disk's pod is gone.
        gone = exporter.wait_for(
            lambda s: (
                info(s, str(web)) is None
                and sample_value(s, "volprobe_mount_responsive", target=str(web)) is None
                and (info(s, disk) or {}).get("pod_uid") == ""
            ),
            timeout=10,
            what="the unmounted volumes' series gone",
        )
        elapsed = time.monotonic() - unmounted
        assert elapsed <= RESCAN_S + 1.5, f"{elapsed:.2f}s after the unmount"
        # The disk is still probed; its staging mount (the node's, pod_uid "") still names its pv, until it goes too.
        assert (info(gone, disk) or {}).get("pv") == PV_EXT4
        result = subprocess.run(["umount", str(staging)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        exporter.wait_for(lambda s: (info(s, disk) or {}).get("pv") == "", timeout=10, what="the pv label gone")
        nothing_held(pid, kubelet)
        assert not any(str(web) in line for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines())
        assert "Traceback" not in exporter.log()


def test_a_stalled_fuse_volume_shows_not_responding_and_metrics_keep_answering(
    tmp_path, fuse_directory, start_exporter
) -> None:
    kubelet = tmp_path / "kubelet"
    web = volume_directory(kubelet, POD_WEB, PV_FUSE, "efs.csi.aws.com", "fs-0a1b2c3d")
    lab = fuse_directory()
    with bound(lab.path, web):
        text = (
            "mount_check: {interval: 200ms, timeout: 1s}\n"
            f"kubernetes: {{kubelet_directory: {kubelet}, rescan_interval: {RESCAN_S}s}}\n"
        )
        exporter = start_exporter("--config", write_config(tmp_path, text))
        exporter.wait_for(
            lambda s: sample_value(s, "volprobe_mount_responsive", target=str(web)) == 1, what="the mount check"
        )
        lab.stall()
        stalled = time.monotonic()
        try:
            exporter.wait_for(
                lambda s: sample_value(s, "volprobe_mount_responsive", target=str(web)) == 0,
                timeout=10,
                what="the stalled volume not responding",
            )
            # Within the check's timeout (1 s), its interval (0.2 s) and a scrape's poll (0.25 s).
            assert time.monotonic() - stalled <= 1.0 + 0.2 + 1.0
            slowest = 0.0
            while time.monotonic() - stalled < STALL_S:
                start = time.monotonic()
                samples = exporter.metrics()
                slowest = max(slowest, time.monotonic() - start)
                assert sample_value(samples, "volprobe_mount_responsive", target=str(web)) == 0
                assert info(samples, str(web)) is not None  # still mounted: still there, hung
                time.sleep(0.2)
            assert slowest < 1.0, f"a scrape took {slowest:.2f}s while the volume hung"
        finally:
            lab.release()
        exporter.wait_for(
            lambda s: sample_value(s, "volprobe_mount_responsive", target=str(web)) == 1,
            timeout=10,
            what="the volume answering again",
        )
        nothing_held(exporter.process.pid, kubelet)
        result = subprocess.run(["umount", str(web)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        exporter.wait_for(lambda s: info(s, str(web)) is None, timeout=5, what="its series gone")
        assert exporter.process.poll() is None


UMOUNT_TRIES = int(os.environ.get("VOLPROBE_TEST_UMOUNTS", "20"))


def test_a_rule_writes_into_its_volume_alone_and_the_kubelet_still_unmounts_it_at_the_first_try(
    tmp_path, make_loop, fuse_directory, start_exporter
) -> None:
    """`kubernetes.rules`: the FUSE volume (its driver matched) takes write and commit probes every second, into
    its probe file and commit log; the ext4 one is never written. Between probes nothing of volprobe's is open
    there, and a request in flight is on a private copy of the mount: unmounted (no -l) UMOUNT_TRIES times at
    random moments while the probes run, each time bound again, the first umount succeeds every time."""
    kubelet = tmp_path / "kubelet"
    db = volume_directory(kubelet, POD_DB, PV_EXT4, "ebs.csi.aws.com", "vol-0123456789abcdef0")
    web = volume_directory(kubelet, POD_WEB, PV_FUSE, "efs.csi.aws.com", "fs-0a1b2c3d")
    loop = make_loop(64 * MIB, name="pvc")
    staging = kubelet / "plugins" / "kubernetes.io" / "csi" / "pv" / PV_EXT4 / "globalmount"
    make_ext4(loop, staging)
    lab = fuse_directory()
    (lab.path / "data.txt").write_text("the claim's own file\n")
    rescan_s = 2.0  # longer than an unmount of the loop below lasts, mostly: the target usually stays
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: subprocess.run(["umount", "-l", str(staging)], check=False))
        stack.enter_context(bound(staging, db))
        stack.enter_context(bound(lab.path, web))
        written = settled(loop, staging)
        before, theirs = listing(staging), listing(lab.backing)
        text = (
            "mount_check: {interval: 200ms, timeout: 1s}\n"
            f"kubernetes: {{kubelet_directory: {kubelet}, rescan_interval: {rescan_s}s,\n"
            "  rules: [{driver: efs.csi.aws.com, "
            "probes: [{op: write, interval: 1s}, {op: commit, interval: 1s}]}]}\n"
        )
        exporter = start_exporter("--config", write_config(tmp_path, text))
        pid = exporter.process.pid

        def live(samples) -> bool:
            return probes_done(samples, str(web), "write") >= 2 and probes_done(samples, str(web), "commit") >= 2

        samples = exporter.wait_for(live, what="write and commit probes of the FUSE volume")
        # Only there: the ext4 volume has no probe, nor any other path.
        probed = {(labels["target"], labels["op"]) for labels, _ in samples["volprobe_probe_latency_seconds_count"]}
        assert probed == {(str(web), "write"), (str(web), "commit")}
        fuse = info(samples, str(web))
        assert fuse is not None and (fuse["pv"], fuse["pod_uid"], fuse["driver"]) == (
            PV_FUSE,
            POD_WEB,
            "efs.csi.aws.com",
        )
        # What is written where: the probe file and the commit log, 4 MiB each, in the volume; nothing else.
        made = {Path(p).name: size for p, (size, _, _) in listing(lab.backing).items() if p not in theirs}
        assert made == {".volprobe-probe": 4 * MIB, ".volprobe-commit": 4 * MIB}
        assert (lab.backing / "data.txt").read_text() == "the claim's own file\n"
        nothing_held(pid, kubelet)
        nothing_held(pid, lab.path)
        # The ext4 volume: no sector written to its disk (in the window the first test watches), its files as they were.
        assert sectors_written(loop) == written
        assert listing(staging) == before

        # The method sees a held descriptor: one of the test's own makes the plain umount fail.
        with open(web / "data.txt"):
            refused = subprocess.run(["umount", str(web)], capture_output=True, text=True)
        assert refused.returncode != 0 and "busy" in refused.stderr, refused.stderr

        for attempt in range(UMOUNT_TRIES):
            counts = (
                probes_done(exporter.metrics(), str(web), "write"),
                probes_done(exporter.metrics(), str(web), "commit"),
            )
            exporter.wait_for(
                lambda s, c=counts: (
                    probes_done(s, str(web), "write") not in (0, c[0])
                    and probes_done(s, str(web), "commit") not in (0, c[1])
                ),
                timeout=15,
                what=f"probes running on the volume before unmount {attempt}",
            )
            time.sleep(random.uniform(0, 1.0))  # anywhere in the probes' second, a request in flight or not
            result = subprocess.run(["umount", str(web)], capture_output=True, text=True)
            # The first try, every time: a request in flight holds a private copy of the mount, not this one.
            # (Opened at the path, 2 in 100 failed here, busy, in the milliseconds a request was in flight.)
            assert result.returncode == 0, f"unmount {attempt}: {result.stderr}"
            assert not is_mount(web)
            assert os.listdir(web) == []  # nothing written beneath the mount meanwhile
            time.sleep(0.1)
            run("mount", "--bind", str(lab.path), str(web))

        # The ext4 volume: its files as they were. Its disk's write counter is held to zero above, in the window the
        # first test watches: over the minute and more of unmounts here the kernel's own writes to an ext4 show
        # there too (measured without volprobe on 6.18: one within 10 s of a mount and sync, five within 30 s of
        # bind mounts elsewhere, a sync and an ls); nothing of volprobe's is ever open on it (nothing_held above
        # covers the kubelet's directory, that volume's mount included).
        assert listing(staging) == before
        exporter.wait_for(live, what="the probes after the last mount")
        nothing_held(pid, kubelet)

        # The pod goes: one umount, and its target and series are gone within one rescan.
        result = subprocess.run(["umount", str(web)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        unmounted = time.monotonic()
        exporter.wait_for(
            lambda s: (
                info(s, str(web)) is None
                and probes_done(s, str(web), "write") == 0
                and sample_value(s, "volprobe_mount_responsive", target=str(web)) is None
            ),
            timeout=10,
            what="its target and series gone",
        )
        elapsed = time.monotonic() - unmounted
        assert elapsed <= rescan_s + 1.5, f"{elapsed:.2f}s after the unmount"
        assert os.listdir(web) == []
        nothing_held(pid, kubelet)
        nothing_held(pid, lab.path)
        assert "Traceback" not in exporter.log()


def umount2(path: Path) -> None:
    """umount(2) itself, no -l: umount(8) stats the path first, which a stalled FUSE daemon never answers, with or
    without volprobe (the kernel's own lookup of a mount point asks the filesystem nothing)."""
    if libc.umount2(os.fsencode(str(path)), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))


def test_requests_in_flight_in_a_rule_volume_keep_no_unmount_from_succeeding_at_the_first_try(
    tmp_path, fuse_directory, start_exporter
) -> None:
    """The hardest moments for the kubelet: a probe's write in flight (its FUSE daemon slow to answer), then a
    probe's open and a mount check hung (the daemon stalled), when the pod goes. Opened at their path, they would
    hold the kubelet's mount until they return, and the unmount would fail, busy. Through a private copy of the
    mount, the first unmount succeeds; what was in flight ends when the volume answers, the copy goes with it,
    and the target with its series."""
    kubelet = tmp_path / "kubelet"
    web = volume_directory(kubelet, POD_WEB, PV_FUSE, "efs.csi.aws.com", "fs-0a1b2c3d")
    lab = fuse_directory()
    try:
        text = (
            "mount_check: {interval: 200ms, timeout: 1s}\n"
            f"kubernetes: {{kubelet_directory: {kubelet}, rescan_interval: {RESCAN_S}s,\n"
            "  rules: [{driver: efs.csi.aws.com, probes: [{op: write, interval: 200ms}]}]}\n"
        )
        run("mount", "--bind", str(lab.path), str(web))
        exporter = start_exporter("--config", write_config(tmp_path, text))
        pid = exporter.process.pid
        samples = exporter.wait_for(lambda s: probes_done(s, str(web), "write") >= 3, what="the write probes")
        assert sample_value(samples, "volprobe_capability_available", capability="private_mount") == 1

        def gone(s) -> bool:
            return info(s, str(web)) is None and probes_done(s, str(web), "write") == 0

        # A write in flight, its request in the FUSE daemon for 3 s: the timed request itself.
        lab.set_latency("write", 3.0)
        try:
            exporter.wait_for(
                lambda s: (sample_value(s, "volprobe_probe_inflight_seconds", target=str(web), op="write") or 0) > 0.5,
                timeout=10,
                what="a write probe in flight",
            )
            result = subprocess.run(["umount", str(web)], capture_output=True, text=True)
            assert result.returncode == 0, f"umount with a write in flight: {result.stderr}"
            assert lab.status()["counts"].get("write", 0) > 0
        finally:
            lab.set_latency("write", 0.0)
        exporter.wait_for(gone, timeout=10, what="its target and series gone")
        nothing_held(pid, lab.path, within=5.0)  # once the write returned (3 s after it was sent)

        # The daemon stalled: the next probe's open and a mount check hang in the volume.
        run("mount", "--bind", str(lab.path), str(web))
        exporter.wait_for(lambda s: probes_done(s, str(web), "write") >= 2, what="the write probes of the volume again")
        lab.stall()
        try:
            exporter.wait_for(
                lambda s: (
                    sample_value(s, "volprobe_mount_responsive", target=str(web)) == 0 and lab.status()["stalled"] >= 2
                ),
                timeout=10,
                what="a probe and a mount check hung in the volume",
            )
            umount2(web)  # no EBUSY
            assert not is_mount(web)
            assert lab.status()["stalled"] >= 2  # they were still hung when it went
        finally:
            lab.release()
        exporter.wait_for(gone, timeout=10, what="its target and series gone")
        assert os.listdir(web) == []  # nothing written beneath the mount
        nothing_held(pid, lab.path)
        assert exporter.process.poll() is None
        assert "Traceback" not in exporter.log()
    finally:  # a failure leaves no bind mount behind (the FUSE fixture unmounts its own mount only)
        if is_mount(web):
            subprocess.run(["umount", "-l", str(web)], check=False)


def test_a_rule_volume_that_does_not_answer_holds_up_no_other_pod_volume(
    tmp_path, fuse_directory, start_exporter
) -> None:
    """A rule's volume hung (its server gone) when volprobe starts: its probe file cannot be made, and its
    preparation waits in a thread of its own with the mount check's deadline. Meanwhile it has the mount check a
    volume has without a rule, which shows it hung; another pod volume mounted later is followed within a rescan
    or two; /metrics answers. Once it answers, it takes its rule's probes."""
    kubelet = tmp_path / "kubelet"
    web = volume_directory(kubelet, POD_WEB, PV_FUSE, "efs.csi.aws.com", "fs-0a1b2c3d")
    other = volume_directory(kubelet, POD_DB, PV_EXT4, "nfs.csi.k8s.io", "nfs-server#share")
    hung, later = fuse_directory(), fuse_directory()
    with bound(hung.path, web):
        hung.stall()
        try:
            text = (
                "mount_check: {interval: 200ms, timeout: 1s}\n"
                f"kubernetes: {{kubelet_directory: {kubelet}, rescan_interval: {RESCAN_S}s,\n"
                "  rules: [{driver: efs.csi.aws.com, probes: [{op: write, interval: 200ms}]}]}\n"
            )
            exporter = start_exporter("--config", write_config(tmp_path, text))
            exporter.wait_for(
                lambda s: sample_value(s, "volprobe_mount_responsive", target=str(web)) == 0,
                timeout=10,
                what="the hung rule volume's mount check, not responding",
            )
            with bound(later.path, other):
                slowest = 0.0

                def followed(samples) -> bool:
                    return sample_value(samples, "volprobe_mount_responsive", target=str(other)) == 1

                deadline = time.monotonic() + 10
                while True:
                    start = time.monotonic()
                    samples = exporter.metrics()
                    slowest = max(slowest, time.monotonic() - start)
                    if followed(samples):
                        break
                    assert time.monotonic() < deadline, "the volume mounted later was not followed"
                    time.sleep(0.25)
                assert slowest < 1.0, f"a scrape took {slowest:.2f}s"
                assert probes_done(samples, str(web), "write") == 0
                assert "does not answer" in exporter.log()
                umount2(other)
        finally:
            hung.release()
        exporter.wait_for(
            lambda s: probes_done(s, str(web), "write") >= 2, timeout=15, what="the rule's probes once it answers"
        )
        assert sample_value(exporter.metrics(), "volprobe_mount_responsive", target=str(web)) == 1
        assert "Traceback" not in exporter.log()


HUNG_RESOLUTIONS = 3


def test_a_rule_volume_is_resolved_through_its_private_copy_and_the_kubelet_unmounts_it_at_the_first_try(
    tmp_path, fuse_directory, start_exporter
) -> None:
    """A rule's volume appears while its server does not answer its metadata (getattr, statfs stalled): its
    resolution hangs in the volume. Through the private copy of the mount (the mount point walked by open_tree
    alone, every other question asked of the copy's descriptor), that hang keeps no unmount of the kubelet's mount
    from succeeding at the first try (asked at the path, with a stat, an access or a realpath, it would: busy),
    each of HUNG_RESOLUTIONS times; once the server answers, what was in flight finds the volume gone and writes
    nothing. Then, resolved and probed, the volume unmounts at the first try at random moments while its probes
    run, each time bound again and resolved anew, and nothing of it is left open."""
    kubelet = tmp_path / "kubelet"
    web = volume_directory(kubelet, POD_WEB, PV_FUSE, "efs.csi.aws.com", "fs-0a1b2c3d")
    lab = fuse_directory()
    text = (
        "mount_check: {interval: 200ms, timeout: 1s}\n"
        f"kubernetes: {{kubelet_directory: {kubelet}, rescan_interval: {RESCAN_S}s,\n"
        "  rules: [{driver: efs.csi.aws.com, probes: [{op: write, interval: 200ms}]}]}\n"
    )
    hung = "but cannot be probed: the volume does not answer"
    try:
        run("mount", "--bind", str(lab.path), str(web))
        lab.stall("meta")
        exporter = start_exporter("--config", write_config(tmp_path, text))
        pid = exporter.process.pid
        for attempt in range(HUNG_RESOLUTIONS):
            if attempt:
                run("mount", "--bind", str(lab.path), str(web))
                lab.stall("meta")
            seen = exporter.log().count(hung)
            wait_until(lambda s=seen: exporter.log().count(hung) > s, timeout=15, what=f"resolution {attempt} hung")
            assert lab.status()["stalled"] >= 1
            umount2(web)  # no EBUSY: what hangs is on the copy
            assert not is_mount(web)
            lab.release()
            exporter.wait_for(lambda s: info(s, str(web)) is None, timeout=10, what="its target gone")
            nothing_held(pid, lab.path, within=5.0)
        assert os.listdir(lab.backing) == []  # what returned after the unmount wrote nothing
        assert os.listdir(web) == []

        run("mount", "--bind", str(lab.path), str(web))
        exporter.wait_for(lambda s: probes_done(s, str(web), "write") >= 3, what="the write probes")
        for attempt in range(5):
            exporter.wait_for(
                lambda s: probes_done(s, str(web), "write") >= 2, timeout=15, what=f"probes before unmount {attempt}"
            )
            time.sleep(random.uniform(0, 0.2))
            result = subprocess.run(["umount", str(web)], capture_output=True, text=True)
            assert result.returncode == 0, f"unmount {attempt}: {result.stderr}"
            assert os.listdir(web) == []
            exporter.wait_for(lambda s: info(s, str(web)) is None, timeout=10, what="its target gone")
            run("mount", "--bind", str(lab.path), str(web))
        nothing_held(pid, kubelet)
        nothing_held(pid, lab.path)
        assert "Traceback" not in exporter.log()
    finally:  # a failure leaves no bind mount behind, nor the daemon stalled
        lab.release()
        if is_mount(web):
            subprocess.run(["umount", "-l", str(web)], check=False)
