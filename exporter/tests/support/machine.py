"""A fake machine for discovery: sysfs, /dev and /proc trees in a directory, laid out as real kernels lay them."""

from __future__ import annotations

import os
from pathlib import Path

from volprobe import discovery


class FakeMachine:
    """Builds sysfs, /dev and /proc trees with the same shape (directories, symlinks, files) as the kernel's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.dev = root / "dev"
        self.proc = root / "proc"
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

    def hold(self, holder: Path, slave: Path) -> None:
        self._link(holder / "slaves" / slave.name, slave)
        self._link(slave / "holders" / holder.name, holder)

    def dev_link(self, rel: str, name: str) -> None:
        self._link(self.dev / rel, self.dev / name)

    def host(self) -> discovery.Host:
        return discovery.Host(str(self.sys), str(self.proc), str(self.dev))
