"""Raw writes are refused on anything that is not a blank, unclaimed device. Signatures come from real tools."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from volprobe import discovery, safety

from .support.harness import MIB, REPO, have, run, volprobe_command
from .support.machine import FakeMachine

# (signature maker, the name our own scanner must report). Each runs the real tool on an image file.
MAKERS = [
    ("mkfs.ext4 -q -F", "ext2/3/4"),
    ("mkfs.xfs -q -f", "xfs"),
    ("mkfs.btrfs -q -f", "btrfs"),
    ("mkfs.vfat", "vfat"),
    ("mkfs.vfat -F 32", "vfat32"),
    ("mkswap", "swap"),
    ("sfdisk-gpt", "gpt"),
    ("sfdisk-dos", "dos partition table or boot sector"),
]


def make_signature(maker: str, image: Path) -> None:
    if maker.startswith("sfdisk"):
        label = maker.split("-")[1]
        run("sfdisk", "--quiet", str(image), input=f"label: {label}\n,\n")
    else:
        run(*maker.split(), str(image))


def ends(image: Path) -> tuple[bytes, bytes, int]:
    size = image.stat().st_size
    with open(image, "rb") as f:
        head = f.read(MIB)
        f.seek(size - MIB)
        tail = f.read(MIB)
    return head, tail, size


@pytest.mark.parametrize(("maker", "expected"), MAKERS, ids=[m[0].split()[0] for m in MAKERS])
def test_own_scanner_finds_real_signatures(maker, expected, tmp_path):
    tool = "sfdisk" if maker.startswith("sfdisk") else maker.split()[0]
    if not have(tool):
        pytest.fail(f"{tool} is missing; .ci/run installs it")
    image = tmp_path / "image"
    with open(image, "wb") as f:
        f.truncate(300 * MIB)  # btrfs wants more than 100 MiB
    make_signature(maker, image)
    found = safety.scan_signatures(*ends(image))
    assert expected in found, found


def test_blank_and_random_images_have_no_signature(tmp_path):
    image = tmp_path / "blank"
    with open(image, "wb") as f:
        f.truncate(16 * MIB)
    assert safety.scan_signatures(*ends(image)) == []


def test_lvm_label_in_any_of_the_first_four_sectors():
    for sector in range(4):
        head = bytearray(MIB)
        head[sector * 512 : sector * 512 + 8] = b"LABELONE"
        assert "LVM2_member" in safety.scan_signatures(bytes(head), bytes(MIB), 64 * MIB)


def test_md_superblocks_at_start_and_end():
    # This kernel has no md driver, so mdadm cannot write one here: place the magic where each version does.
    size = 64 * MIB
    head = bytearray(MIB)
    head[4096:4100] = b"\xfc\x4e\x2b\xa9"
    assert "linux_raid_member v1.2" in safety.scan_signatures(bytes(head), bytes(MIB), size)


def test_md_090_superblock_at_the_end():
    size = 64 * MIB
    tail = bytearray(MIB)
    position = (size & ~(64 * 1024 - 1)) - 64 * 1024 - (size - MIB)
    tail[position : position + 4] = b"\xfc\x4e\x2b\xa9"
    assert "linux_raid_member v0.90" in safety.scan_signatures(bytes(MIB), bytes(tail), size)


def test_holders_are_refused(tmp_path):
    # dm and md are not in this kernel: a fixture sysfs tree gives the disk a holder as dm would.
    machine = FakeMachine(tmp_path)
    disk = machine.block("pci0000:00/0000:00:04.0/virtio2/block", "vdb", "254:16", 2097152)
    dm = machine.block("virtual/block", "dm-0", "253:0", 2097152, {"dm/name": "vg-data\n"})
    machine.hold(dm, disk)
    host = machine.host()
    refusal = safety.raw_write_refusal(host, host.devices()["vdb"])
    assert refusal == "is held by dm-0 (device-mapper, md or similar)"


@pytest.mark.root
class TestRawWriteRefusal:
    def host(self) -> discovery.Host:
        return discovery.Host()

    def device(self, path: str) -> discovery.BlockDevice:
        host = self.host()
        found = host.device(host.device_for_path(path))
        assert found is not None
        return found

    def test_blank_loop_device_is_allowed(self, make_loop):
        loop = make_loop(64 * MIB)
        assert safety.raw_write_refusal(self.host(), self.device(loop)) is None

    def test_ext4_is_refused_by_name(self, make_loop):
        loop = make_loop(64 * MIB)
        run("mkfs.ext4", "-q", "-F", loop)
        refusal = safety.raw_write_refusal(self.host(), self.device(loop))
        assert refusal and "ext4" in refusal  # libblkid's name, alongside ours

    def test_mounted_device_is_refused(self, make_loop, mount_fs):
        loop = make_loop(64 * MIB)
        point = mount_fs(loop)
        refusal = safety.raw_write_refusal(self.host(), self.device(loop))
        assert refusal and f"mounted on {point}" in refusal

    def test_partitioned_device_is_refused(self, make_loop):
        loop = make_loop(64 * MIB)
        run("sfdisk", "--quiet", loop, input="label: gpt\n,\n")
        run("partx", "--add", loop)
        try:
            refusal = safety.raw_write_refusal(self.host(), self.device(loop))
            assert refusal and "has partitions" in refusal
        finally:
            subprocess.run(["partx", "--delete", loop], capture_output=True)

    def test_lvm_physical_volume_is_refused(self, make_loop):
        loop = make_loop(64 * MIB)
        run("pvcreate", "-qq", "--devices", loop, loop)
        refusal = safety.raw_write_refusal(self.host(), self.device(loop))
        assert refusal and "LVM2_member" in refusal

    def test_partition_itself_is_refused(self, make_loop):
        loop = make_loop(64 * MIB)
        run("sfdisk", "--quiet", loop, input="label: dos\n,\n")
        run("partx", "--add", loop)
        try:
            part = self.device(f"{loop}p1")
            assert part.kind == "part"
            assert "is a partition" in (safety.raw_write_refusal(self.host(), part) or "")
        finally:
            subprocess.run(["partx", "--delete", loop], capture_output=True)


def test_a_device_that_fails_every_read_is_refused_with_its_error_never_a_crash(lab_volume):
    """A device whose reads fail (a dying disk; here a lab volume failing every read) made the signature check
    raise BufferError from under the read's EIO, past the callers that handle OSError: `volprobe devices`, run
    while such a device was attached, crashed with a traceback. The read's own error comes through, and
    `devices` lists the host's devices."""
    volume = lab_volume(size=8 * MIB)
    volume.set(fail_reads=1.0)
    with pytest.raises(OSError):
        safety._read_ends(volume.device, 8 * MIB)
    listed = subprocess.run(volprobe_command("devices"), capture_output=True, cwd=REPO)
    assert listed.returncode == 0, listed.stderr.decode(errors="replace")
    assert Path(volume.device).name.encode() in listed.stdout
