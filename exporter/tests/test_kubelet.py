"""Pod volumes read from the kubelet's directory and the node's mount table (issue 43): pure parsing, on a fixture
tree laid out as the kubelet lays it out and a mountinfo shaped like the kernel's."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import yaml

from volprobe import config, kubelet, mountcheck
from volprobe.discovery import Host, Mount, parse_mountinfo
from volprobe.runtime.pods import PodVolumeFollower, pod_target

from .support.harness import OpenFiles, wait_until

POD_A = "6f1c2b3a-4d5e-4f60-8a7b-9c0d1e2f3a4b"
POD_B = "0a1b2c3d-4e5f-4061-8273-94a5b6c7d8e9"
PV_EBS = "pvc-1d2e3f4a-5b6c-4d7e-8f90-a1b2c3d4e5f6"
PV_EFS = "pvc-7e8f9a0b-1c2d-4e3f-9a4b-5c6d7e8f9a0b"
PV_FUSE = "pvc-fuse-s3"
ROOT = "/var/lib/kubelet"

VOL_DATA_EBS = {
    "attachmentID": "csi-0f3c9d8e7b6a5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d",
    "driverName": "ebs.csi.aws.com",
    "nodeName": "ip-10-0-1-23.ec2.internal",
    "specVolID": PV_EBS,
    "volumeHandle": "vol-0123456789abcdef0",
    "volumeLifecycleMode": "Persistent",
}
VOL_DATA_EFS = {
    "driverName": "efs.csi.aws.com",
    "nodeName": "ip-10-0-1-23.ec2.internal",
    "specVolID": PV_EFS,
    "volumeHandle": "fs-0a1b2c3d::fsap-0123456789abcdef0",
    "volumeLifecycleMode": "Persistent",
}


def mountinfo(root: str) -> str:
    """A node's /proc/1/mountinfo: an EBS claim (ext4 on nvme1n1, staged then bound into pod A), an EFS claim
    (nfs4) in pods A and B, a FUSE claim, an in-tree NFS volume, a projected token (tmpfs), a subPath bind (not a
    volume), a path that only looks like one, and a volume mounted over (the top mount counts)."""
    return f"""\
24 1 259:1 / / rw,relatime shared:1 - xfs /dev/nvme0n1p1 rw,attr2,inode64,logbufs=8,logbsize=32k,noquota
612 24 0:54 / {root}/pods/{POD_A}/volumes/kubernetes.io~projected/kube-api-access-8x7zq rw,relatime \
shared:300 - tmpfs tmpfs rw,size=7602176k
1021 24 259:4 / {root}/plugins/kubernetes.io/csi/ebs.csi.aws.com/8a5f0c1e/globalmount rw,relatime shared:489 - \
ext4 /dev/nvme1n1 rw
1087 24 259:4 / {root}/pods/{POD_A}/volumes/kubernetes.io~csi/{PV_EBS}/mount rw,relatime shared:489 - ext4 \
/dev/nvme1n1 rw
1101 24 0:61 / {root}/pods/{POD_A}/volumes/kubernetes.io~csi/{PV_EFS}/mount rw,relatime shared:510 - nfs4 \
127.0.0.1:/ rw,vers=4.1,rsize=1048576,wsize=1048576,hard,proto=tcp,timeo=600,retrans=2,sec=sys
1102 24 0:61 / {root}/pods/{POD_B}/volumes/kubernetes.io~csi/{PV_EFS}/mount rw,relatime shared:510 - nfs4 \
127.0.0.1:/ rw,vers=4.1
1110 24 0:70 / {root}/pods/{POD_B}/volumes/kubernetes.io~csi/{PV_FUSE}/mount rw,nosuid,nodev shared:520 - \
fuse.mountpoint-s3 mountpoint-s3 rw,user_id=0,group_id=0
1120 24 0:72 / {root}/pods/{POD_B}/volumes/kubernetes.io~nfs/shared\\040data rw,relatime shared:530 - nfs \
nas.example.com:/export/shared rw,vers=3
1130 24 259:4 /sub {root}/pods/{POD_A}/volume-subpaths/{PV_EBS}/app/0 rw,relatime shared:489 - ext4 /dev/nvme1n1 rw
1140 24 0:80 / {root}/pods/not-a-uid/volumes/kubernetes.io~nfs/x rw - nfs nas:/x rw
1150 24 0:81 / {root}/pods/{POD_A}/volumes/kubernetes.io~csi/{PV_EFS}/mount/deeper rw - nfs4 nas:/y rw
1160 24 0:82 / {root}/pods/{POD_A}/volumes/kubernetes.io~csi/no-mount-dir rw - nfs4 nas:/z rw
1170 1101 0:90 / {root}/pods/{POD_A}/volumes/kubernetes.io~csi/{PV_EFS}/mount rw - nfs4 10.0.0.9:/ rw,vers=4.1
"""


def kubelet_tree(root: Path, vol_data: dict[str, bytes]) -> None:
    """The directories (and vol_data.json files) of mountinfo(str(root))'s CSI volumes, by PV name."""
    for pod, pv in ((POD_A, PV_EBS), (POD_A, PV_EFS), (POD_B, PV_EFS), (POD_B, PV_FUSE)):
        volume = root / "pods" / pod / "volumes" / "kubernetes.io~csi" / pv
        (volume / "mount").mkdir(parents=True)
        if pv in vol_data:
            (volume / "vol_data.json").write_bytes(vol_data[pv])


@pytest.fixture
def node(tmp_path: Path) -> Path:
    root = tmp_path / "kubelet"
    data = {PV_EBS: json.dumps(VOL_DATA_EBS).encode(), PV_EFS: json.dumps(VOL_DATA_EFS).encode()}
    kubelet_tree(root, data)
    return root


def volumes(root: Path, read: bool = True) -> list[kubelet.PodVolume]:
    return kubelet.pod_volumes(str(root), parse_mountinfo(mountinfo(str(root))), read=read)


def test_every_mounted_pod_volume_with_its_claim_driver_and_backing(node: Path) -> None:
    found = {(v.pod_uid, v.name): v for v in volumes(node)}
    token = (POD_A, "kube-api-access-8x7zq")
    assert set(found) == {
        (POD_A, PV_EBS),
        (POD_A, PV_EFS),
        (POD_B, PV_EFS),
        (POD_B, PV_FUSE),
        (POD_B, "shared data"),
        token,
    }
    assert (found[token].backing, found[token].driver) == ("virtual", "kubernetes.io/projected")  # left alone
    ebs = found[POD_A, PV_EBS]
    assert (ebs.pv, ebs.driver, ebs.csi.volume_handle, ebs.backing) == (
        PV_EBS,
        "ebs.csi.aws.com",
        "vol-0123456789abcdef0",
        "block",
    )
    assert ebs.path == f"{node}/pods/{POD_A}/volumes/kubernetes.io~csi/{PV_EBS}/mount"
    assert (ebs.mount.major, ebs.mount.minor, ebs.mount.fstype, ebs.mount.source) == (259, 4, "ext4", "/dev/nvme1n1")
    assert ebs.csi.node_name == "ip-10-0-1-23.ec2.internal" and ebs.csi.lifecycle_mode == "Persistent"
    efs = found[POD_A, PV_EFS]
    # The top mount of a stacked mount point: the one mounted over the first.
    assert (efs.driver, efs.backing, efs.mount.source, efs.mount.minor) == (
        "efs.csi.aws.com",
        "filesystem",
        "10.0.0.9:/",
        90,
    )
    assert found[POD_B, PV_EFS].mount.source == "127.0.0.1:/"
    fuse = found[POD_B, PV_FUSE]  # no vol_data.json: no driver, and no record of a PersistentVolume
    assert (fuse.pv, fuse.driver, fuse.backing, fuse.mount.fstype) == ("", "", "filesystem", "fuse.mountpoint-s3")
    nfs = found[POD_B, "shared data"]  # in-tree: the directory itself is the mount; mountinfo's \040 unescaped
    assert (nfs.plugin, nfs.driver, nfs.backing, nfs.pv) == ("kubernetes.io~nfs", "kubernetes.io/nfs", "filesystem", "")
    assert nfs.path.endswith("/volumes/kubernetes.io~nfs/shared data")


def test_subpath_staging_and_lookalike_mounts_are_not_pod_volumes(node: Path) -> None:
    paths = {v.path for v in volumes(node)}
    assert not any("volume-subpaths" in p or "not-a-uid" in p for p in paths)
    assert not any(p.endswith(("/deeper", "/no-mount-dir")) for p in paths)
    assert not any("/plugins/" in p for p in paths)  # the staging globalmount is the node's, not a pod's
    assert kubelet.backing(Mount(0, 54, "/x", "tmpfs", "tmpfs")) == "virtual"  # nothing to check, no disk
    assert kubelet.backing(Mount(0, 55, "/x", "overlay", "overlay")) == "virtual"
    assert kubelet.backing(Mount(0, 40, "/x", "btrfs", "/dev/sda2")) == "block"  # anonymous st_dev, a device
    assert kubelet.backing(Mount(8, 1, "/x", "fuseblk", "/dev/sdb1")) == "block"
    assert kubelet.backing(Mount(0, 41, "/x", "ceph", "10.0.0.1:6789:/")) == "filesystem"


def test_only_mounted_volumes_count(node: Path) -> None:
    """A volume directory the table has no mount for (unmounted, a pod still terminating) is not a volume."""
    assert kubelet.pod_volumes(str(node), []) == []
    other_root = kubelet.pod_volumes("/var/lib/other-kubelet", parse_mountinfo(mountinfo(str(node))))
    assert other_root == []
    # The kubelet directory given with a trailing slash names the same tree.
    assert len(kubelet.pod_volumes(f"{node}/", parse_mountinfo(mountinfo(str(node))))) == 6


HOSTILE = {
    "huge": b'{"driverName": "' + b"a" * (kubelet.VOL_DATA_MAX_BYTES * 4) + b'"}',
    "huge-valid-prefix": json.dumps(VOL_DATA_EFS).encode() + b" " * (kubelet.VOL_DATA_MAX_BYTES * 2),
    "not-json": b"driverName: efs.csi.aws.com\n",
    "not-utf8": b'{"driverName": "efs\xff\xfe.csi"}',
    "a-list": b'["efs.csi.aws.com"]',
    "wrong-types": b'{"driverName": 7, "volumeHandle": {"a": 1}, "specVolID": ["x"]}',
    "control-chars": b'{"driverName": "efs\\n\\u0000evil", "volumeHandle": "h"}',
    "deep": b"[" * 100000 + b"]" * 100000,
    "empty": b"",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_vol_data_names_no_driver_and_never_fails(node: Path, name: str) -> None:
    target = node / "pods" / POD_A / "volumes" / "kubernetes.io~csi" / PV_EFS / "vol_data.json"
    target.write_bytes(HOSTILE[name])
    efs = next(v for v in volumes(node) if v.pod_uid == POD_A and v.name == PV_EFS)
    assert efs.driver == "" and efs.pv == "" and efs.backing == "filesystem"
    if name == "control-chars":
        assert efs.csi.volume_handle == "h"  # what is printable is kept, field by field


def test_vol_data_is_never_followed_out_of_the_tree_nor_read_if_not_a_file(node: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**VOL_DATA_EFS, "driverName": "followed.example.com"}))
    volume = node / "pods" / POD_A / "volumes" / "kubernetes.io~csi" / PV_EFS
    (volume / "vol_data.json").unlink()
    (volume / "vol_data.json").symlink_to(elsewhere)
    assert next(v for v in volumes(node) if v.name == PV_EFS and v.pod_uid == POD_A).driver == ""
    (volume / "vol_data.json").unlink()
    os.mkfifo(volume / "vol_data.json")  # a FIFO: never opened for a blocking read
    assert next(v for v in volumes(node) if v.name == PV_EFS and v.pod_uid == POD_A).driver == ""
    (volume / "vol_data.json").unlink()
    (volume / "vol_data.json").mkdir()
    assert next(v for v in volumes(node) if v.name == PV_EFS and v.pod_uid == POD_A).driver == ""
    # Not read at all when asked not to.
    assert all(v.csi == kubelet.CsiData() for v in volumes(node, read=False))


def test_the_kubernetes_section_is_validated_like_the_others() -> None:
    parsed = config.parse({"kubernetes": {"kubelet_directory": "/k", "rescan_interval": "2s", "enabled": True}})
    assert parsed.kubernetes == config.KubernetesConfig(enabled=True, kubelet_directory="/k", rescan_interval=2.0)
    assert parsed.pod_volume_interval == 2.0
    assert config.parse({"discovery": {"rescan_interval": "7s"}}).pod_volume_interval == 7.0
    assert config.parse(None).pod_volume_interval == 5.0
    assert config.parse(None).kubernetes.kubelet_directory == "/var/lib/kubelet"
    with pytest.raises(config.ConfigError) as err:
        config.parse({"kubernetes": {"kubelet_dir": "/k", "kubelet_directory": "relative", "rescan_interval": "0s"}})
    problems = "\n".join(err.value.problems)
    assert "kubernetes.kubelet_dir: unknown key" in problems
    assert "kubernetes.kubelet_directory" in problems and "kubernetes.rescan_interval" in problems


def test_enabled_unset_follows_when_the_kubelet_directory_exists(tmp_path: Path) -> None:
    assert kubelet.enabled(None, str(tmp_path)) is True
    assert kubelet.enabled(None, str(tmp_path / "missing")) is False
    assert kubelet.enabled(False, str(tmp_path)) is False
    assert kubelet.enabled(True, str(tmp_path / "missing")) is True


class _Targets:
    """A ProbeSet stand-in: what the follower starts and stops."""

    def __init__(self) -> None:
        self.running: list = []

    def targets(self) -> list:
        return list(self.running)


def test_the_follower_starts_filesystem_volumes_only_and_stops_what_went(node: Path, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "mountinfo").write_bytes(os.fsencode(mountinfo(str(node))))
    probes = _Targets()
    stopped: list[tuple[str, str]] = []

    def start(targets: list) -> None:
        probes.running += targets

    def stop(targets: list, _timeout: float, why: str) -> None:
        stopped.extend((t.path, why) for t in targets)
        probes.running = [t for t in probes.running if t not in targets]

    follower = PodVolumeFollower(Host(str(tmp_path / "sys"), str(proc)), probes, threading.Lock(), start, stop)  # type: ignore[arg-type]
    follower.config = config.parse({"kubernetes": {"kubelet_directory": str(node)}})
    follower.rescan()
    started = {(t.pod_volume.pod_uid, t.pod_volume.name) for t in probes.running}
    # The EBS claim is its disk's (discovery's); the tmpfs token is nothing to check.
    assert started == {(POD_A, PV_EFS), (POD_B, PV_EFS), (POD_B, PV_FUSE), (POD_B, "shared data")}
    assert all(t.probes == () and t.probe_dir is None and t.kind == "directory" for t in probes.running)
    assert all(t.name == t.path == t.pod_volume.path for t in probes.running)
    first = list(probes.running)
    follower.rescan()
    assert probes.running == first and not stopped  # the same mounts: the same targets
    # Pod B goes: its volumes are unmounted.
    (proc / "1" / "mountinfo").write_bytes(
        os.fsencode("".join(line + "\n" for line in mountinfo(str(node)).splitlines() if POD_B not in line))
    )
    follower.rescan()
    assert {t.pod_volume.pod_uid for t in probes.running} == {POD_A}
    assert {why for _, why in stopped} == {"pod volume unmounted"} and len(stopped) == 3
    follower.config = config.parse({"kubernetes": {"kubelet_directory": str(node), "enabled": False}})
    follower.rescan()
    follower.apply(follower.config)
    assert probes.running == []


def test_the_check_of_a_pod_volume_holds_nothing_and_knows_its_mount(tmp_path: Path) -> None:
    """Opened, asked, closed: no descriptor stays; and a directory that is not the mount's device (the volume
    unmounted from under its path) is an error, not an answer from the filesystem beneath."""
    st = os.stat(tmp_path)
    before = set(os.listdir("/proc/self/fd"))
    mountcheck.answer_mount(str(tmp_path), os.major(st.st_dev), os.minor(st.st_dev))
    assert set(os.listdir("/proc/self/fd")) == before
    with pytest.raises(OSError, match="no longer the mount"):
        mountcheck.answer_mount(str(tmp_path), os.major(st.st_dev) + 1, 0)
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(OSError):
        mountcheck.answer_mount(str(tmp_path / "link"), os.major(st.st_dev), os.minor(st.st_dev))
    assert set(os.listdir("/proc/self/fd")) == before


def test_a_pod_target_is_named_by_its_mount_point(node: Path) -> None:
    fuse = next(v for v in volumes(node) if v.name == PV_FUSE)
    target = pod_target(fuse)
    assert (target.name, target.path, target.device, target.mount, target.pod_volume) == (
        fuse.path,
        fuse.path,
        None,
        fuse.mount,
        fuse,
    )


def test_the_mount_watch_checks_a_pod_volume_by_its_device_and_times_it(tmp_path: Path) -> None:
    """The watch asks a pod volume's mount with nothing held (answer_mount), records how long it took, and a
    volume whose path now shows another filesystem (unmounted from under it) is not responsive."""
    from volprobe.runtime.mounts import MountWatch

    st = os.stat(tmp_path)
    here = Mount(os.major(st.st_dev), os.minor(st.st_dev), str(tmp_path / "a"), "nfs4", "nas:/a")
    elsewhere = Mount(os.major(st.st_dev) + 1, 7, str(tmp_path / "b"), "nfs4", "nas:/b")
    pod = f"{tmp_path}/pods/{POD_A}/volumes/kubernetes.io~nfs"
    targets = []
    for mount in (here, elsewhere):
        Path(mount.mount_point).mkdir()
        volume = kubelet.PodVolume(
            POD_A, "kubernetes.io~nfs", Path(mount.mount_point).name, pod, mount, kubelet.CsiData()
        )
        target = pod_target(volume)
        target.name = target.path = mount.mount_point  # one target per directory of this test
        targets.append(target)
    probes = _Targets()
    probes.running = targets
    watch = MountWatch(probes, mountcheck.Checks(), resume=lambda _t: None)  # type: ignore[arg-type]
    before = set(os.listdir("/proc/self/fd"))
    watch.apply(config.MountCheckConfig(interval=0.05, timeout=1.0))
    try:
        for _ in range(200):
            readings = {r.target: r for r in watch.readings()}
            if readings[here.mount_point].responsive and readings[elsewhere.mount_point].check_counts[-1] >= 2:
                break
            time.sleep(0.02)
        good, bad = readings[here.mount_point], readings[elsewhere.mount_point]
        assert good.responsive and good.last_response_time > 0 and good.check_counts[-1] >= 1
        assert good.check_seconds > 0 and good.check_counts[0] <= good.check_counts[-1]
        assert not bad.responsive and bad.last_response_time == 0 and bad.check_counts[-1] >= 2
    finally:
        watch.stop()
    assert set(os.listdir("/proc/self/fd")) == before


def test_the_exporter_follows_pod_volumes_from_the_node_mount_table(tmp_path: Path) -> None:
    """The running exporter, in process, on a fixture /proc whose PID 1 mounted two pod volumes (nfs4 and FUSE,
    at directories of this test's filesystem, so that their checks answer): each gets its mount check and
    target_info with pod_uid, and pv and driver where vol_data.json records them; the one whose line goes
    (unmounted) loses its series at the next rescan; a reload keeps the other; nothing of the exporter's stays open
    in the kubelet's directory."""
    from volprobe.collectors.target import TargetCollector
    from volprobe.runtime import Exporter

    root = tmp_path / "kubelet"
    kubelet_tree(root, {PV_EFS: json.dumps(VOL_DATA_EFS).encode()})
    st = os.stat(root)
    devnum = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    efs = f"{root}/pods/{POD_A}/volumes/kubernetes.io~csi/{PV_EFS}/mount"
    fuse = f"{root}/pods/{POD_B}/volumes/kubernetes.io~csi/{PV_FUSE}/mount"
    lines = {
        efs: f"1101 24 {devnum} / {efs} rw,relatime shared:510 - nfs4 127.0.0.1:/ rw,vers=4.1\n",
        fuse: f"1110 24 {devnum} / {fuse} rw,nosuid,nodev shared:520 - fuse.mountpoint-s3 mountpoint-s3 rw\n",
    }
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "diskstats").write_text("")
    mountinfo_file = proc / "1" / "mountinfo"
    mountinfo_file.write_text("24 1 259:1 / / rw - xfs /dev/nvme0n1p1 rw\n" + "".join(lines.values()))
    text = (
        "mount_check: {interval: 50ms, timeout: 1s}\n"
        f"kubernetes: {{kubelet_directory: {root}, rescan_interval: 100ms}}\n"
    )
    opened = OpenFiles(tmp_path, besides=[proc / "diskstats"])  # which the exporter keeps open, as on a node
    exporter = Exporter(config.parse(yaml.safe_load(text)), Host(str(tmp_path / "sys"), str(proc)))
    exporter.start()
    try:

        def responsive() -> set[str]:
            return {m.target for m in exporter.mount_readings() if m.responsive and m.check_counts[-1] >= 1}

        deadline = time.monotonic() + 10
        while responsive() != {efs, fuse}:
            assert time.monotonic() < deadline, exporter.mount_readings()
            time.sleep(0.02)
        info = {s.labels["target"]: s.labels for s in TargetCollector(exporter).collect()[0].samples}
        assert (info[efs]["pv"], info[efs]["pod_uid"], info[efs]["driver"]) == (PV_EFS, POD_A, "efs.csi.aws.com")
        assert (info[efs]["fstype"], info[efs]["device"]) == ("nfs4", "")
        assert (info[fuse]["pv"], info[fuse]["pod_uid"], info[fuse]["driver"]) == ("", POD_B, "")  # no record
        assert exporter.probe_readings() == []  # the mount check only: nothing probed, nothing written
        # Nothing held between checks (a check in flight holds its directory for a moment): told by the file, not
        # its name, as a check opens it through a private copy of the mount.
        wait_until(lambda: opened.new() == [], timeout=10, what="no descriptor on the volumes' filesystem")
        # A reload keeps following.
        exporter.reload(config.parse(yaml.safe_load(text + "defaults: {window: 60s}\n")))
        # The FUSE volume is unmounted: its series go at the next rescan.
        mountinfo_file.write_text("24 1 259:1 / / rw - xfs /dev/nvme0n1p1 rw\n" + lines[efs])
        gone = time.monotonic()
        while {m.target for m in exporter.mount_readings()} != {efs}:
            assert time.monotonic() - gone < 1.0, exporter.mount_readings()
            time.sleep(0.01)
        assert {r.name for r in exporter.target_readings()} == {efs}
        # kubernetes.enabled: false stops following.
        exporter.reload(config.parse({"kubernetes": {"kubelet_directory": str(root), "enabled": False}}))
        assert exporter.target_readings() == [] and exporter.pod_volume_drivers() == {}
    finally:
        exporter.stop(1.0)


# A tenant's pod (POD_B) names its inline ephemeral CSI volume after a real PersistentVolume (PV_EBS, pod A's claim):
# the kubelet makes pods/<uid>/volumes/kubernetes.io~csi/<that name>/ and records the volume there as it is.
VOL_DATA_INLINE = {
    "attachmentID": "csi-5e9b0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b",
    "driverName": "ebs.csi.aws.com",
    "nodeName": "ip-10-0-1-23.ec2.internal",
    "specVolID": PV_EBS,  # the pod's volume name
    "volumeHandle": "csi-8b0e2d7c4a1f3e5b9d6c2a0f8e4b1d7c3a9f5e2b0d8c6a4f1e3b7d9c5a2f0e8",
    "volumeLifecycleMode": "Ephemeral",
}
RECORDS = {
    "persistent": (VOL_DATA_EBS, PV_EBS),
    "persistent, no mode (an old kubelet)": (
        {k: v for k, v in VOL_DATA_EBS.items() if k != "volumeLifecycleMode"},
        PV_EBS,
    ),
    "inline ephemeral": (VOL_DATA_INLINE, ""),
    "persistent, of another directory": ({**VOL_DATA_EBS, "specVolID": PV_EFS}, ""),
    "persistent, no specVolID": ({k: v for k, v in VOL_DATA_EBS.items() if k != "specVolID"}, ""),
    "an unknown mode": ({**VOL_DATA_EBS, "volumeLifecycleMode": "persistent"}, ""),
    "no record": (None, ""),
}


@pytest.mark.parametrize("record", sorted(RECORDS))
def test_a_pv_is_only_what_the_kubelet_recorded_as_a_persistent_volume(tmp_path: Path, record: str) -> None:
    """A CSI volume's directory of pod B named PV_EBS, an ext4 on nvme1n1: its pv (PodVolume.pv, the label of the
    target at its path and of its disk, and what a rule's `pv` matches) is PV_EBS only where vol_data.json says it
    is that PersistentVolume's: Persistent (or no mode), specVolID the directory's name. Its driver's rule is
    unaffected (the kubelet's record of the driver)."""
    from volprobe import discovery

    data, expected = RECORDS[record]
    root = tmp_path / "kubelet"
    directory = root / "pods" / POD_B / "volumes" / "kubernetes.io~csi" / PV_EBS
    (directory / "mount").mkdir(parents=True)
    if data is not None:
        (directory / "vol_data.json").write_text(json.dumps(data))
    line = f"1087 24 259:4 / {directory}/mount rw,relatime shared:489 - ext4 /dev/nvme1n1 rw\n"
    mounts = parse_mountinfo(line)
    (volume,) = kubelet.pod_volumes(str(root), mounts)
    assert volume.pv == expected
    assert discovery.kubernetes_volume(f"{directory}/mount") == (expected, POD_B)
    assert discovery.kubernetes_volume(f"{directory}/mount/pgdata") == (expected, POD_B)  # a target inside it
    assert discovery.kubernetes_volumes_of(mounts, {(259, 4)}, set()) == ({(expected, POD_B)} if expected else set())
    by_pv = config.parse({"kubernetes": {"rules": [{"pv": PV_EBS}, {"pv": ".*"}]}}).kubernetes
    assert (by_pv.rule_for(volume.driver, volume.pv, volume.path) is not None) == bool(expected)
    by_driver = config.parse({"kubernetes": {"rules": [{"driver": "ebs.csi.aws.com"}]}}).kubernetes
    assert (by_driver.rule_for(volume.driver, volume.pv, volume.path) is not None) == (data is not None)


def test_an_in_tree_volume_names_no_pv_whatever_its_name(tmp_path: Path) -> None:
    """An in-tree plugin's volume (kubernetes.io~nfs) may be given inline in a pod's spec, named by its tenant, and
    nothing the kubelet keeps on the node tells it from a PersistentVolume's: no pv, no `pv` rule."""
    from volprobe import discovery

    point = tmp_path / "kubelet" / "pods" / POD_B / "volumes" / "kubernetes.io~nfs" / PV_EFS
    point.mkdir(parents=True)
    (volume,) = kubelet.pod_volumes(
        str(tmp_path / "kubelet"), parse_mountinfo(f"1 24 0:61 / {point} rw - nfs nas:/x rw\n")
    )
    assert (volume.pv, volume.driver) == ("", "kubernetes.io/nfs")
    assert discovery.kubernetes_volume(str(point)) == ("", POD_B)
    assert (
        config.parse({"kubernetes": {"rules": [{"pv": ".*"}]}}).kubernetes.rule_for(volume.driver, "", str(point))
        is None
    )
