"""Swaps an attacker who owns a probe directory makes under volprobe's names (issue 24): each replaces `name` in
the directory `data` (or the directory itself) while volprobe has let go of it; `victim` is a file the attacker
would have volprobe write. Shared by the probe file's tests and the commit log's and metadata directory's."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from volprobe import targets
from volprobe.config import PROBE_FILE_NAME, load
from volprobe.discovery import Host

from .harness import write_config

ATTACKER = 1000  # the uid owning the probe directory, as postgres owns /var/lib/postgresql


def prepared(tmp_path: Path, data: Path, probes: str, size: str = "1MiB") -> tuple[Host, list[targets.ResolvedTarget]]:
    """A directory target on `data` with these probes (YAML), resolved and prepared as the exporter does at start:
    its files made, checked and pinned, the descriptors opened. The caller closes it (targets.close)."""
    text = f"targets: [{{name: d, directory: {data}, probe_file_size: {size}, probes: {probes}}}]\n"
    host = Host()
    resolved = targets.resolve(load(write_config(tmp_path, text)), host)
    targets.prepare(host, resolved)
    return host, resolved


def swap_symlink(data: Path, victim: Path, name: str = PROBE_FILE_NAME) -> None:
    os.unlink(data / name)
    os.symlink(victim, data / name)


def swap_hard_link(data: Path, victim: Path, name: str = PROBE_FILE_NAME) -> None:
    os.unlink(data / name)
    os.link(victim, data / name)


def swap_foreign_copy(data: Path, victim: Path, name: str = PROBE_FILE_NAME) -> None:
    # A copy of the real probe file, header and all, but made (and owned) by the directory's owner: the
    # attacker's copy could be a hard link's stand-in, or a file they mean volprobe to fill.
    shutil.copyfile(data / name, data / "copy")
    os.chown(data / "copy", ATTACKER, ATTACKER)
    os.replace(data / "copy", data / name)


def swap_our_own_file_copied(data: Path, victim: Path, name: str = PROBE_FILE_NAME) -> None:
    # Same owner, same header, same size: only the inode tells it is not the file checked at start.
    shutil.copyfile(data / name, data / "copy")
    os.replace(data / "copy", data / name)


def swap_directory_for_a_symlink(data: Path, victim: Path, name: str = PROBE_FILE_NAME) -> None:
    os.rename(data, data.with_name(f"{data.name}.old"))
    elsewhere = data.with_name("elsewhere")
    elsewhere.mkdir()
    os.rename(data.with_name(f"{data.name}.old") / name, elsewhere / name)
    os.symlink(elsewhere, data)


def swap_directory_for_another(data: Path, victim: Path, name: str = PROBE_FILE_NAME) -> None:
    os.rename(data, data.with_name(f"{data.name}.old"))
    data.mkdir()
    os.rename(data.with_name(f"{data.name}.old") / name, data / name)


SWAPS = {
    "symlink": swap_symlink,
    "hard link": swap_hard_link,
    "foreign-owned copy": swap_foreign_copy,
    "same-owner copy": swap_our_own_file_copied,
    "directory swapped for a symlink": swap_directory_for_a_symlink,
    "directory swapped for another": swap_directory_for_another,
}
