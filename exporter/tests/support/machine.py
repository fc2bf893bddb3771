"""A fake machine for discovery: sysfs, /dev and /proc trees in a directory, laid out as real kernels lay them."""

from __future__ import annotations

import os
import re
from pathlib import Path

from volprobe import discovery


class CountingHost(discovery.Host):
    """A Host over the fixture tree that counts the devices it resolves from sysfs."""

    resolved = 0

    def device(self, name: str) -> discovery.BlockDevice | None:
        self.resolved += 1
        return super().device(name)


class FakeMachine:
    """Builds sysfs, /dev and /proc trees with the same shape (directories, symlinks, files) as the kernel's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.dev = root / "dev"
        self.proc = root / "proc"
        self._diskseq = 0
        for path in (self.sys / "class" / "block", self.sys / "dev" / "block", self.dev, self.proc / "self"):
            path.mkdir(parents=True, exist_ok=True)
        (self.proc / "self" / "mountinfo").write_text("")
        (self.proc / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n")

    def _link(self, link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))

    def block(
        self,
        devpath: str,
        name: str,
        devnum: str,
        sectors: int,
        files: dict[str, str] | None = None,
        partition: int | None = None,
        lbs: int = 512,
    ) -> Path:
        """A block device directory at /sys/devices/<devpath>/<name> (a partition: inside its disk's)."""
        base = self.sys / "devices" / devpath / name
        base.mkdir(parents=True)
        (base / "dev").write_text(devnum + "\n")
        major, minor = devnum.split(":")
        kind = (
            f"DEVTYPE=partition\nPARTN={partition}" if partition is not None else f"DEVTYPE=disk\nDISKSEQ={self._seq()}"
        )
        (base / "uevent").write_text(f"MAJOR={major}\nMINOR={minor}\nDEVNAME={name}\n{kind}\n")
        (base / "size").write_text(f"{sectors}\n")
        (base / "ro").write_text("0\n")
        for sub in ("holders", "slaves"):
            (base / sub).mkdir()
        if partition is None:
            (base / "queue").mkdir()
            (base / "queue" / "logical_block_size").write_text(f"{lbs}\n")
            (base / "queue" / "physical_block_size").write_text(f"{lbs}\n")
            (base / "queue" / "rotational").write_text("0\n")
        else:
            (base / "partition").write_text(f"{partition}\n")
        for rel, content in (files or {}).items():
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_text(content)
        self._link(self.sys / "class" / "block" / name, base)
        self._link(self.sys / "dev" / "block" / devnum, base)
        (self.dev / name).touch()
        return base

    def _seq(self) -> int:
        """The next disk sequence number (the kernel's DISKSEQ: one per new disk or newly attached medium)."""
        self._diskseq += 1
        return self._diskseq

    def remake(self, name: str, files: dict[str, str] | None = None) -> None:
        """The disk under this name made anew (a new medium, a rescan): a new DISKSEQ, and these files changed."""
        base = (self.sys / "class" / "block" / name).resolve()
        uevent = (base / "uevent").read_text()
        (base / "uevent").write_text(re.sub(r"DISKSEQ=\d+", f"DISKSEQ={self._seq()}", uevent))
        for rel, content in (files or {}).items():
            (base / rel).write_text(content)

    def hold(self, holder: Path, slave: Path) -> None:
        self._link(holder / "slaves" / slave.name, slave)
        self._link(slave / "holders" / holder.name, holder)

    def dev_link(self, rel: str, name: str) -> None:
        self._link(self.dev / rel, self.dev / name)

    def host(self) -> discovery.Host:
        return discovery.Host(str(self.sys), str(self.proc), str(self.dev))

    def counting_host(self) -> CountingHost:
        return CountingHost(str(self.sys), str(self.proc), str(self.dev))
