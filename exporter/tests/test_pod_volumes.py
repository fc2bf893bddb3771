"""Pod volumes on a kubelet's layout built here, with real mounts (issue 43): an ext4 on a loop device bound at one
CSI volume's mount, a FUSE-lab filesystem (standing in for NFS) at another, probed by the real exporter with a
configuration that names the kubelet's directory. Nothing is written into either, nothing is held open there,
each unmounts (no -l) at the first try while probes run, and their series go within one rescan."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .support.harness import MIB, probes_done, run, sample_value, write_config

pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.slow]

POD_DB = "3f2e1d0c-9b8a-4765-8432-10fedcba9876"
POD_WEB = "7a6b5c4d-3e2f-4109-8877-665544332211"
PV_EXT4 = "pvc-0c1d2e3f-4a5b-4c6d-8e7f-901a2b3c4d5e"
PV_FUSE = "pvc-9e8d7c6b-5a4f-4e3d-9c2b-1a0f9e8d7c6b"
RESCAN_S = 0.5
STALL_S = float(os.environ.get("VOLPROBE_TEST_STALL_S", "4"))


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


def writes_completed(loop: str) -> int:
    return int(Path(f"/sys/block/{os.path.basename(loop)}/stat").read_text().split()[4])


def held_under(pid: int, root: Path) -> list[str]:
    """What of process `pid` is open under `root`: descriptors, working directory, root, mapped files."""
    prefix, found = str(root), []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(prefix):
                found.append(f"fd {fd}: {target}")
    for link in ("cwd", "root"):
        if os.readlink(f"/proc/{pid}/{link}").startswith(prefix):
            found.append(link)
    found += [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if prefix in line]
    return found


def nothing_held(pid: int, root: Path) -> None:
    """Nothing of `pid` open under `root`. A check opens its volume for a few microseconds: a held descriptor is
    in every sample, a check's in one, so a clean sample within a second says nothing is held."""
    samples: list[list[str]] = []
    deadline = time.monotonic() + 1.0
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
        run("sync")
        before = listing(staging, lab.backing)
        written = writes_completed(loop)

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

        # Nothing written into either volume: no write request on the disk (counted before any sync: each sync of an
        # ext4 writes once itself), and the files as they were (a buffered write would show there first).
        assert writes_completed(loop) == written
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
