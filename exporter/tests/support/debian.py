"""The Debian releases volprobe is packaged for, their packages in dist/, and the host's Debian mirrors, for the
roots and images the tests make with mmdebstrap."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

from volprobe import __version__

from .harness import REPO, locked

# Held while dist/ is checked and, when the packages are missing, while .ci/package builds them.
PACKAGE_LOCK = Path(os.environ.get("VOLPROBE_PACKAGE_TEST_CACHE", "/var/cache/volprobe-ci/package-test-root")) / (
    "package.lock"
)


def debian_mirrors(release: str = "bookworm") -> list[str]:
    """One-line `deb URI SUITE COMPONENTS` entries of the host's bookworm sources (both formats of /etc/apt),
    for the suites of `release`: a later release is reached on the same mirrors, its suites named for it
    (bookworm-updates -> trixie-updates)."""
    lines: list[str] = []
    apt = Path("/etc/apt")
    for path in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]:
        if path.is_file():
            for line in path.read_text().splitlines():
                words = line.split("#", 1)[0].split()
                if len(words) >= 4 and words[0] == "deb" and not words[1].startswith("["):
                    lines.append(" ".join(words))
    for path in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    key, value = line.split(":", 1)
                    fields[key.strip()] = value.strip()
            if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
                for uri in fields.get("URIs", "").split():
                    for suite in fields.get("Suites", "").split():
                        lines.append(f"deb {uri} {suite} {fields.get('Components', 'main')}")
    return [line.replace(" bookworm", f" {release}", 1) for line in lines if line.split()[2].startswith("bookworm")]


@dataclasses.dataclass(frozen=True)
class Release:
    """A Debian release .ci/package builds a package for."""

    suite: str
    number: int
    python: str  # its python3's minor version, the package's venv's
    units: str  # where its packages put systemd units (relative to /): Debian 13's merged /usr has them in /usr

    @property
    def version(self) -> str:
        """The package's version: Debian revision 1 of volprobe's, built for this release."""
        return f"{__version__}-1+deb{self.number}"


RELEASES = [
    Release("bookworm", 12, "3.11", "lib/systemd/system"),
    Release("trixie", 13, "3.13", "usr/lib/systemd/system"),
]


def the_deb(release: Release) -> Path:
    """dist/volprobe_VERSION-1+debN_ARCH.deb, built by .ci/package when dist/ has none for this version."""
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout
    deb = REPO / "dist" / f"volprobe_{release.version}_{arch.strip()}.deb"
    PACKAGE_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with locked(PACKAGE_LOCK):
        if not deb.exists():
            built = subprocess.run(
                [str(REPO / ".ci" / "package")], capture_output=True, text=True, timeout=1200, cwd=REPO
            )
            assert built.returncode == 0, f".ci/package: exit {built.returncode}\n{built.stdout}\n{built.stderr}"
    assert deb.exists(), f".ci/package made no {deb}"
    return deb
