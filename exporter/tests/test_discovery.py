"""Device identity, stacking and mounts on fixture sysfs and /dev trees laid out as real kernels lay them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from volprobe import discovery
from volprobe.config import DiscoveryConfig
from volprobe.runtime.follow import candidates
from volprobe.targets import default_config_targets

from .support.harness import run
from .support.machine import CountingHost, FakeMachine


@pytest.fixture
def machine(tmp_path: Path) -> FakeMachine:
    return FakeMachine(tmp_path)


def nvme_controller(m: FakeMachine, ctrl: str, serial: str, model: str) -> str:
    path = f"pci0000:00/0000:00:1f.0/nvme/{ctrl}"
    controller = m.sys / "devices" / path
    controller.mkdir(parents=True)
    (controller / "serial").write_text(serial.ljust(20) + "\n")
    (controller / "model").write_text(model.ljust(40) + "\n")
    return path


def test_aws_ebs_nvme_volume_id_from_serial(machine):
    path = nvme_controller(machine, "nvme1", "vol0123456789abcdef0", "Amazon Elastic Block Store")
    disk = machine.block(path, "nvme1n1", "259:0", 2 * 1024**3 // 512, {"wwid": "nvme.1d0f-766f6c30313233"})
    (disk / "device").symlink_to("..")
    machine.block(f"{path}/nvme1n1", "nvme1n1p1", "259:1", 1000, partition=1)
    devices = machine.host().devices()
    ebs = devices["nvme1n1"]
    assert ebs.kind == "disk"
    assert ebs.serial == "vol0123456789abcdef0"
    assert ebs.model == "Amazon Elastic Block Store"
    assert ebs.volume_id == "vol-0123456789abcdef0"
    assert ebs.wwn == "nvme.1d0f-766f6c30313233"
    assert ebs.partitions == ("nvme1n1p1",)
    part = devices["nvme1n1p1"]
    assert part.kind == "part" and part.parent == "nvme1n1"
    assert part.volume_id == "vol-0123456789abcdef0"  # a partition carries its disk's identity


def test_gcp_persistent_disk_from_by_id_link(machine):
    scsi = "pci0000:00/0000:00:03.0/virtio0/host0/target0:0:2/0:0:2:0"
    base = machine.block(f"{scsi}/block", "sdb", "8:16", 20971520)
    device = machine.sys / "devices" / scsi
    (device / "vendor").write_text("Google  \n")
    (device / "model").write_text("PersistentDisk  \n")
    (device / "vpd_pg80").write_bytes(b"\x00\x80\x00\x0cpgdata-disk ")
    (base / "device").symlink_to("../../../0:0:2:0")
    machine.dev_link("disk/by-id/google-pgdata", "sdb")
    machine.dev_link("disk/by-id/google-pgdata-part1", "sdb1")
    sdb = machine.host().devices()["sdb"]
    assert sdb.vendor == "Google" and sdb.model == "PersistentDisk"
    assert sdb.serial == "pgdata-disk"
    assert sdb.volume_id == "pgdata"


def test_gcp_without_udev_links_falls_back_to_the_serial(machine):
    scsi = "pci0000:00/0000:00:03.0/virtio0/host0/target0:0:2/0:0:2:0"
    base = machine.block(f"{scsi}/block", "sdb", "8:16", 20971520)
    device = machine.sys / "devices" / scsi
    (device / "vendor").write_text("Google  \n")
    (device / "model").write_text("PersistentDisk  \n")
    (device / "vpd_pg80").write_bytes(b"\x00\x80\x00\x06pgdata")
    (base / "device").symlink_to("../../../0:0:2:0")
    assert machine.host().devices()["sdb"].volume_id == "pgdata"


@pytest.mark.parametrize(
    ("link", "expected"),
    [
        ("disk/azure/scsi1/lun0", "lun0"),
        ("disk/azure/data/by-lun/3", "lun3"),
        ("disk/azure/data/by-name/db-log", "db-log"),
    ],
)
def test_azure_data_disk_from_azure_links(machine, link, expected):
    scsi = "LNXSYSTM:00/LNXSYBUS:00/ACPI0004:00/VMBUS:00/f8b3781b/host3/target3:0:1/3:0:1:0"
    base = machine.block(f"{scsi}/block", "sdc", "8:32", 2 * 1024**3 // 512)
    device = machine.sys / "devices" / scsi
    (device / "vendor").write_text("Msft    \n")
    (device / "model").write_text("Virtual Disk    \n")
    (base / "device").symlink_to("../../../3:0:1:0")
    machine.dev_link(link, "sdc")
    sdc = machine.host().devices()["sdc"]
    assert sdc.vendor == "Msft"
    assert sdc.volume_id == expected


def test_dm_over_partition_stacks_down_to_the_disk(machine):
    path = nvme_controller(machine, "nvme0", "vol0aaaabbbbccccdddd0", "Amazon Elastic Block Store")
    disk = machine.block(path, "nvme0n1", "259:0", 4194304)
    part = machine.block(f"{path}/nvme0n1", "nvme0n1p2", "259:2", 4000000, partition=2)
    dm = machine.block("virtual/block", "dm-0", "253:0", 4000000, {"dm/name": "vg-data\n"})
    machine.hold(dm, part)
    host = machine.host()
    devices = host.devices()
    assert devices["dm-0"].kind == "dm" and devices["dm-0"].dm_name == "vg-data"
    assert devices["dm-0"].slaves == ("nvme0n1p2",)
    assert devices["nvme0n1p2"].holders == ("dm-0",)
    assert host.leaf_disks("dm-0") == ["nvme0n1"]
    assert host.leaf_disks("nvme0n1p2") == ["nvme0n1"]
    assert disk.name == "nvme0n1"


def test_md_raid_over_two_disks(machine):
    a = machine.block("pci0000:00/0000:00:04.0/virtio2/block", "vdb", "254:16", 2097152)
    b = machine.block("pci0000:00/0000:00:05.0/virtio3/block", "vdc", "254:32", 2097152)
    md = machine.block("virtual/block", "md0", "9:0", 2097152)
    machine.hold(md, a)
    machine.hold(md, b)
    assert machine.host().leaf_disks("md0") == ["vdb", "vdc"]


def test_mounts_and_4k_logical_blocks(machine):
    machine.block("pci0000:00/0000:00:04.0/virtio2/block", "vdb", "254:16", 2097152, lbs=4096)
    (machine.proc / "self" / "mountinfo").write_text(
        "22 1 254:16 / /var/lib/pg\\040data rw,relatime shared:1 - ext4 /dev/vdb rw\n"
        "23 1 0:21 / /proc rw - proc proc rw\n"
    )
    host = machine.host()
    vdb = host.devices()["vdb"]
    assert vdb.logical_block_size == 4096
    mounts = host.mounts_of(vdb)
    assert [m.mount_point for m in mounts] == ["/var/lib/pg data"]
    assert mounts[0].fstype == "ext4"


def test_ebs_volume_id_parsing():
    assert discovery.ebs_volume_id("vol0123456789abcdef0") == "vol-0123456789abcdef0"
    assert discovery.ebs_volume_id("vol-0123456789abcdef0") == "vol-0123456789abcdef0"
    assert discovery.ebs_volume_id("AWS12345") == ""


def test_real_sysfs_of_this_machine():
    host = discovery.Host()
    devices = host.devices()
    assert devices, "this machine has block devices"
    for device in devices.values():
        assert device.major > 0 and device.logical_block_size in (512, 1024, 2048, 4096)
    root = host.device_for_path("/")
    assert root in devices
    assert host.mount_for_path("/").mount_point == "/"


PERSISTENT = {"driverName": "ebs.csi.aws.com", "specVolID": "{name}", "volumeLifecycleMode": "Persistent"}
EPHEMERAL = {"driverName": "ebs.csi.aws.com", "specVolID": "{name}", "volumeLifecycleMode": "Ephemeral"}


def write_vol_data(volume: Path, record: dict[str, str]) -> None:
    """vol_data.json in a CSI volume's directory, as the kubelet writes it (specVolID: the directory's name)."""
    volume.mkdir(parents=True, exist_ok=True)
    (volume / "vol_data.json").write_text(json.dumps({k: v.replace("{name}", volume.name) for k, v in record.items()}))


@pytest.mark.parametrize(
    ("path", "record", "pv", "pod"),
    [
        (
            "pods/0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11/volumes/kubernetes.io~csi/pvc-8d1c2a4e-1b2f-4d3e-8f9a-0c1d2e3f4a5b/mount",
            PERSISTENT,
            "pvc-8d1c2a4e-1b2f-4d3e-8f9a-0c1d2e3f4a5b",
            "0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11",
        ),
        # An inline ephemeral CSI volume, named by its pod's spec: no PersistentVolume, whatever its name.
        (
            "pods/0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11/volumes/kubernetes.io~csi/pvc-8d1c2a4e-1b2f-4d3e-8f9a-0c1d2e3f4a5b/mount",
            EPHEMERAL,
            "",
            "0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11",
        ),
        # A CSI volume without the kubelet's record, and an in-tree plugin's (which may be inline): none either.
        (
            "pods/0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11/volumes/kubernetes.io~csi/pvc-8d1c2a4e-1b2f-4d3e-8f9a-0c1d2e3f4a5b/mount",
            None,
            "",
            "0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11",
        ),
        (
            "pods/0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11/volumes/kubernetes.io~aws-ebs/pv-data/pgdata",
            None,
            "",
            "0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11",
        ),
        # Raw block volumes and staging paths are a PersistentVolume's alone.
        (
            "plugins/kubernetes.io/csi/volumeDevices/publish/pvc-raw/0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11",
            None,
            "pvc-raw",
            "0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11",
        ),
        ("plugins/kubernetes.io/csi/pv/pvc-staged/globalmount", None, "pvc-staged", ""),
        ("/var/lib/postgresql", None, "", ""),
    ],
)
def test_kubernetes_volume_identity_from_kubelet_paths(tmp_path, path, record, pv, pod):
    kubelet = tmp_path / "var/lib/kubelet"
    if record is not None:
        write_vol_data((kubelet / path).parent, record)
    assert discovery.kubernetes_volume(str(kubelet / path)) == (pv, pod)


POD_A, POD_B = "0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11", "7c2e4d1a-9b3f-4e8a-b6c5-1d2e3f4a5b6c"
POD_RAW = "1e5d7f9a-2b4c-4d6e-8f0a-1b2c3d4e5f60"
PV_FS, PV_RAW, PV_OLD = (
    "pvc-8d1c2a4e-1b2f-4d3e-8f9a-0c1d2e3f4a5b",
    "pvc-3a4b5c6d-7e8f-4a0b-9c1d-2e3f4a5b6c7d",
    "pvc-old-staged",
)


# A kubelet node's /proc/1/mountinfo as the kernel writes it (EKS, EBS CSI driver): the root disk, devtmpfs,
# one filesystem PVC on nvme1n1 staged at its (hashed) globalmount and mounted by two pods, a raw block PVC
# whose device node nvme2n1 is bound from devtmpfs at its publish path, a partition staged at an old-style
# globalmount, a projected token volume (tmpfs), and a disk no pod mounts.
def kubelet_mountinfo(kubelet: str | Path) -> str:
    return KUBELET_MOUNTINFO.replace("/var/lib/kubelet", str(kubelet))


KUBELET_MOUNTINFO = f"""\
24 1 259:1 / / rw,relatime shared:1 - xfs /dev/nvme0n1p1 rw,attr2,inode64,logbufs=8,logbsize=32k,noquota
25 24 0:5 / /dev rw,nosuid shared:2 - devtmpfs devtmpfs rw,size=3977308k,nr_inodes=994327,mode=755
26 24 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
612 24 0:54 / /var/lib/kubelet/pods/{POD_A}/volumes/kubernetes.io~projected/kube-api-access-8x7zq rw,relatime \
shared:300 - tmpfs tmpfs rw,size=7602176k
1021 24 259:4 / /var/lib/kubelet/plugins/kubernetes.io/csi/ebs.csi.aws.com/\
8a5f0c1e2d3b4a5968778695a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5/globalmount rw,relatime shared:489 - ext4 \
/dev/nvme1n1 rw
1090 24 259:4 / /var/lib/kubelet/pods/{POD_B}/volumes/kubernetes.io~csi/{PV_FS}/mount rw,relatime shared:489 - \
ext4 /dev/nvme1n1 rw
1087 24 259:4 / /var/lib/kubelet/pods/{POD_A}/volumes/kubernetes.io~csi/{PV_FS}/mount rw,relatime shared:489 - \
ext4 /dev/nvme1n1 rw
1102 24 0:5 /nvme2n1 /var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/{PV_RAW}/{POD_RAW} \
rw,nosuid shared:2 - devtmpfs devtmpfs rw,size=3977308k,nr_inodes=994327,mode=755
1110 24 259:7 / /var/lib/kubelet/plugins/kubernetes.io/csi/pv/{PV_OLD}/globalmount rw,relatime shared:500 - xfs \
/dev/nvme3n1p1 rw,attr2,inode64,noquota
"""


@pytest.fixture
def kubelet_node(machine):
    for i, (name, devnum) in enumerate([("nvme1n1", "259:4"), ("nvme2n1", "259:5"), ("nvme3n1", "259:6")], 1):
        machine.block(f"pci0000:00/0000:00:1{i}.0/nvme/nvme{i}", name, devnum, 2097152)
        if name == "nvme3n1":
            machine.block(f"pci0000:00/0000:00:1{i}.0/nvme/nvme{i}/{name}", f"{name}p1", "259:7", 2095104, partition=1)
    machine.block("pci0000:00/0000:00:19.0/nvme/nvme9", "nvme9n1", "259:9", 2097152)
    (machine.proc / "1").mkdir()
    (machine.proc / "1" / "mountinfo").write_text(kubelet_mountinfo(machine.root / "var/lib/kubelet"))
    for pod in (POD_A, POD_B):  # the kubelet's records of the claim both pods mount
        write_vol_data(machine.root / f"var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~csi/{PV_FS}", PERSISTENT)
    return machine


def test_discovered_disks_get_the_persistent_volume_kubelet_mounts_from_them(kubelet_node):
    host = kubelet_node.host()
    mounts = host.kubelet_mounts()
    devices = host.devices()
    assert host.kubernetes_volumes(devices["nvme1n1"], mounts) == {(PV_FS, POD_A), (PV_FS, POD_B)}
    assert host.kubernetes_volumes(devices["nvme2n1"], mounts) == {(PV_RAW, POD_RAW)}
    assert host.kubernetes_volumes(devices["nvme3n1"], mounts) == {(PV_OLD, "")}  # by its partition's mount
    assert host.kubernetes_volumes(devices["nvme9n1"], mounts) == set()
    assert mounts[-2].root == "/nvme2n1" and mounts[0].root == "/"
    # Only the mounts at kubelet volume paths: not /, /dev, /proc, nor a CSI driver's own staging directory.
    kubelet = f"{kubelet_node.root}/var/lib/kubelet/"
    assert [m.mount_point.removeprefix(kubelet).split("/")[0] for m in mounts] == [
        "pods",
        "pods",
        "pods",
        "plugins",
        "plugins",
    ]


def test_without_pid_1s_mounts_kubelets_are_read_from_this_process(kubelet_node):
    (kubelet_node.proc / "1" / "mountinfo").unlink()
    (kubelet_node.proc / "self" / "mountinfo").write_text(kubelet_mountinfo(kubelet_node.root / "var/lib/kubelet"))
    host = kubelet_node.host()
    assert host.kubernetes_volumes(host.devices()["nvme2n1"], host.kubelet_mounts()) == {(PV_RAW, POD_RAW)}


def test_one_volume_is_chosen_for_a_disk_that_several_pods_mount():
    choose = discovery.choose_kubernetes_volume
    both = {(PV_FS, POD_B), (PV_FS, POD_A), (PV_FS, "")}
    first = choose(both)
    assert first == (PV_FS, min(POD_A, POD_B))  # a pod's mount before the staging mount; the least UID
    assert choose(both, (PV_FS, POD_B)) == (PV_FS, POD_B)  # the previous choice holds: no label churn
    assert choose({(PV_FS, POD_B), (PV_FS, "")}, first) == (PV_FS, POD_B)  # its pod went: another that mounts it
    assert choose({(PV_FS, "")}, (PV_FS, POD_B)) == (PV_FS, "")  # staged only (between two pods)
    assert choose({(PV_FS, ""), (PV_FS, POD_A)}, (PV_FS, "")) == (PV_FS, POD_A)  # a pod's mount is preferred
    assert choose(set()) == ("", "")


def test_the_target_collector_labels_a_discovered_disk_and_keeps_its_choice(kubelet_node):
    from volprobe.collectors.target import TargetCollector
    from volprobe.config import Limits
    from volprobe.runtime import readings
    from volprobe.view import TargetReading

    from .support.fakeview import FakeView

    host = kubelet_node.host()
    devices = host.devices()
    targets = [TargetReading(n, f"/dev/{n}", devices[n], None, (n,), Limits()) for n in ("nvme1n1", "nvme9n1")]
    view = FakeView(targets=targets, kubelet=lambda found: readings.kubernetes_volumes(host, found))
    collector = TargetCollector(view)

    def labels() -> dict[str, tuple[str, str]]:
        info = collector.collect()[0]
        return {s.labels["target"]: (s.labels["pv"], s.labels["pod_uid"]) for s in info.samples}

    first = min(POD_A, POD_B)
    assert labels() == {"nvme1n1": (PV_FS, first), "nvme9n1": ("", "")}  # one series per target, as before
    later = max(POD_A, POD_B)
    mountinfo = kubelet_node.proc / "1" / "mountinfo"
    text = mountinfo.read_text()
    mountinfo.write_text("\n".join(line for line in text.splitlines() if first not in line) + "\n")
    assert labels()["nvme1n1"] == (PV_FS, later)  # its pod went, the other still mounts it
    mountinfo.write_text(text)
    assert labels()["nvme1n1"] == (PV_FS, later)  # a pod mounting it again changes nothing


# -- identities the pollers ask for every few seconds ----------------------------------------------------------


def test_a_known_device_is_read_again_only_when_the_disk_changes(machine, monkeypatch):
    monkeypatch.setattr(discovery, "KNOWN_RECHECK_S", 0.0)  # looked at every time: each change is seen at once
    path = nvme_controller(machine, "nvme1", "vol0123456789abcdef0", "Amazon Elastic Block Store")
    disk = machine.block(path, "nvme1n1", "259:0", 2 * 1024**3 // 512)
    (disk / "device").symlink_to("..")
    host = machine.counting_host()
    for _ in range(5):
        assert host.known_device("nvme1n1").volume_id == "vol-0123456789abcdef0"
    assert host.resolved == 1
    # Another volume attached under the same name: the kernel gives the disk a new DISKSEQ.
    (machine.sys / "devices" / path / "serial").write_text("vol0fedcba9876543210\n")
    machine.remake("nvme1n1")
    assert host.known_device("nvme1n1").volume_id == "vol-0fedcba9876543210"
    assert host.resolved == 2
    machine.remake("nvme1n1", {"size": f"{4 * 1024**3 // 512}\n"})  # resized: read again for its size
    assert host.known_device("nvme1n1").size_bytes == 4 * 1024**3
    assert host.resolved == 3
    assert host.known_device("nvme9n1") is None  # no such disk: nothing resolved
    assert host.resolved == 3


def test_without_diskseq_a_known_device_is_read_again_after_a_while(machine, monkeypatch):
    """Kernels before 5.15 give no DISKSEQ: a loop device attached to another file of the same size would look
    the same, so the identity is trusted for UNSEQUENCED_TTL_S only."""
    disk = machine.block("virtual/block", "loop0", "7:0", 2048, {"loop/backing_file": "/images/a.img\n"})
    (disk / "uevent").write_text("MAJOR=7\nMINOR=0\nDEVNAME=loop0\nDEVTYPE=disk\n")
    host = machine.counting_host()
    assert host.known_device("loop0").backing_file == "/images/a.img"
    assert host.known_device("loop0").backing_file == "/images/a.img"
    assert host.resolved == 1
    (disk / "loop" / "backing_file").write_text("/images/b.img\n")
    monkeypatch.setattr(discovery, "UNSEQUENCED_TTL_S", 0.0)
    monkeypatch.setattr(discovery, "KNOWN_RECHECK_S", 0.0)
    assert host.known_device("loop0").backing_file == "/images/b.img"
    assert host.resolved == 2


@pytest.mark.root
def test_a_loop_device_attached_to_another_file_is_known_anew(make_loop, tmp_path, monkeypatch):
    """On this kernel: detaching a loop device and attaching another file gives it a new DISKSEQ, which is all
    known_device() reads to tell."""
    monkeypatch.setattr(discovery, "KNOWN_RECHECK_S", 0.0)
    device = make_loop(size=16 * 2**20)
    name = device.rsplit("/", 1)[1]
    host = CountingHost()
    first = host.known_device(name)
    assert first is not None and host.known_device(name) == first and host.resolved == 1
    other = tmp_path / "other.img"
    other.write_bytes(b"")
    os.truncate(other, 16 * 2**20)
    run("losetup", "--detach", device)
    run("losetup", "--direct-io=on", device, str(other))
    now = host.known_device(name)
    assert host.resolved == 2
    assert now is not None and now.backing_file == str(other) != first.backing_file


def test_a_known_device_checked_a_moment_ago_is_not_looked_at_again(machine, monkeypatch):
    """The throttle sampler asks once per direction in a row: the first look serves the others."""
    machine.block("virtual/block", "vdb", "253:16", 2048)
    host = machine.counting_host()
    looked = []
    generation = host.generation
    monkeypatch.setattr(host, "generation", lambda name: looked.append(name) or generation(name))
    for _ in range(3):
        assert host.known_device("vdb") is not None
    assert looked == ["vdb"] and host.resolved == 1
    monkeypatch.setattr(discovery, "KNOWN_RECHECK_S", 0.0)
    host.known_device("vdb")
    assert looked == ["vdb", "vdb"] and host.resolved == 1


def test_a_scrape_matches_devices_against_kubelet_volume_mounts_only(kubelet_node):
    """readings.kubernetes_volumes leaves out the mounts at no kubelet volume's path before matching any device:
    the same volumes are found, and on a host without kubelet volumes no device is looked at (nor are its
    partitions read from sysfs) at a scrape."""
    from volprobe.runtime import readings

    host = kubelet_node.host()
    devices = list(host.devices().values())
    every_mount = {d.name: host.kubernetes_volumes(d, host.kubelet_mounts()) for d in devices}
    looked: list[str] = []
    matched = host.kubernetes_volumes

    def looking(device: discovery.BlockDevice, mounts: list[discovery.Mount]) -> set[tuple[str, str]]:
        looked.append(device.name)
        return matched(device, mounts)

    host.kubernetes_volumes = looking  # type: ignore[method-assign]
    assert readings.kubernetes_volumes(host, devices) == every_mount
    assert sorted(looked) == sorted(d.name for d in devices)
    looked.clear()
    text = (kubelet_node.proc / "1" / "mountinfo").read_text()
    no_pods = "".join(line for line in text.splitlines(True) if "/kubelet/" not in line)
    (kubelet_node.proc / "1" / "mountinfo").write_text(no_pods)
    assert readings.kubernetes_volumes(host, devices) == {}
    assert looked == []


def test_a_rescan_looks_only_at_the_devices_its_rules_select_and_once(machine, monkeypatch):
    """Discovery rescans every few seconds: names are judged first, and a selected device is resolved from sysfs
    once, and again only when the kernel makes a new device under its name."""
    monkeypatch.setattr(discovery, "KNOWN_RECHECK_S", 0.0)
    sda = machine.block("pci0000:00/0000:00:10.0/host0/target0:0:0/0:0:0:0/block", "sda", "8:0", 2048)
    machine.block(str(sda.relative_to(machine.sys / "devices")), "sda1", "8:1", 1024, partition=1)
    machine.block("virtual/block", "loop0", "7:0", 2048)
    machine.block("virtual/block", "vdb", "253:16", 0)  # no medium
    host = machine.counting_host()
    for _ in range(3):
        assert candidates(host, DiscoveryConfig()) == {"sda": str(machine.dev / "sda")}
    assert host.resolved == 3  # sda, sda1 (a partition: not a default candidate) and vdb, once each
    assert candidates(host, DiscoveryConfig(include=("loop\\d+",))) == {"loop0": str(machine.dev / "loop0")}
    assert host.resolved == 4
    machine.remake("sda")
    candidates(host, DiscoveryConfig())
    assert host.resolved == 5


def test_without_a_configuration_a_disk_whose_node_is_not_in_dev_is_left_out(machine, caplog):
    """A container given some devices only sees every disk in sysfs: the default targets are those it can open,
    the others logged, and the start goes on (before, `default[vda].device: /dev/vda: No such file or
    directory` stopped it, found by test_readme_install)."""
    machine.block("virtual/block", "vda", "253:0", 2048)
    machine.block("virtual/block", "vdb", "253:16", 2048)
    (machine.dev / "vda").unlink()
    host = discovery.Host(str(machine.sys), str(machine.proc), str(machine.dev))
    with caplog.at_level("WARNING", logger="volprobe.targets"):
        chosen = default_config_targets(host)
    assert [target.name for target in chosen] == ["vdb"]
    assert [record.getMessage() for record in caplog.records] == [
        f"not probing vda: {machine.dev / 'vda'} does not exist here"
    ]
