"""The host's Debian 12 mirrors, for the roots and images the tests make with mmdebstrap."""

from __future__ import annotations

from pathlib import Path


def debian_mirrors() -> list[str]:
    """One-line `deb URI SUITE COMPONENTS` entries of the host's bookworm sources (both formats of /etc/apt)."""
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
    return [line for line in lines if line.split()[2].startswith("bookworm")]
