"""`volprobe --version`, in node_exporter's form, and where the commit it was built from comes from.

The version itself is declared once, volprobe.__version__ (pyproject.toml reads it). The commit is found, in
this order:
- a source checkout (an editable install, `python -m volprobe` from the tree): git, asked now, so the answer
  follows the checkout as it moves;
- a built package (a wheel, the .deb, the image): volprobe/_build.py, which setup.py's build_py writes into the
  build from git at build time (or from $VOLPROBE_REVISION / $VOLPROBE_BRANCH where the build has no .git,
  as the image's does), with the build's user and date ($SOURCE_DATE_EPOCH if set, as Debian's builds do);
- else "unknown".

Only the standard library here: setup.py imports this module at build time.
"""

from __future__ import annotations

import getpass
import importlib
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from . import __version__

UNKNOWN = "unknown"
# The checkout this module sits in, if it sits in one: exporter/volprobe/version.py -> the repository root.
_CHECKOUT = Path(__file__).resolve().parents[2]
# Go's GOARCH names for the machines Python names otherwise (node_exporter's `platform: linux/amd64`).
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "i686": "386", "i386": "386", "armv7l": "arm", "ppc64le": "ppc64le"}


class Build(NamedTuple):
    revision: str = UNKNOWN
    branch: str = UNKNOWN
    user: str = UNKNOWN
    date: str = UNKNOWN


def _git(root: Path, *args: str) -> str:
    """git's answer in `root`, or "unknown" (no git, not a checkout, a checkout git will not read)."""
    try:
        result = subprocess.run(
            ["git", "-c", f"safe.directory={root}", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    answer = result.stdout.strip()
    return answer if result.returncode == 0 and answer else UNKNOWN


def from_git(root: Path) -> tuple[str, str]:
    """(revision, branch) of the checkout at `root`: the commit's full hash, and the branch (HEAD if detached)."""
    if not (root / ".git").exists():
        return UNKNOWN, UNKNOWN
    return _git(root, "rev-parse", "HEAD"), _git(root, "rev-parse", "--abbrev-ref", "HEAD")


def stamp(root: Path, environ: dict[str, str] | None = None) -> str:
    """The text of volprobe/_build.py for a build from `root` (setup.py's build_py writes it)."""
    env = os.environ if environ is None else environ
    revision, branch = from_git(root)
    revision = env.get("VOLPROBE_REVISION", "").strip() or revision
    branch = env.get("VOLPROBE_BRANCH", "").strip() or branch
    try:
        user = f"{getpass.getuser()}@{socket.gethostname()}"
    except (OSError, KeyError):
        user = UNKNOWN
    user = env.get("VOLPROBE_BUILD_USER") or user
    epoch = env.get("SOURCE_DATE_EPOCH", "")
    date = time.strftime("%Y%m%d-%H:%M:%S", time.gmtime(int(epoch) if epoch.isdigit() else None))
    values = Build(revision, branch, user, date)._asdict()
    return '"""Written by setup.py at build time: what `volprobe --version` says."""\n\n' + "".join(
        f"{name.upper()} = {value!r}\n" for name, value in values.items()
    )


def build() -> Build:
    """The commit and build this volprobe comes from: the checkout's, the build's, or unknown (module docstring)."""
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / ".git").exists():
        revision, branch = from_git(_CHECKOUT)
        return Build(revision, branch)
    try:
        made = importlib.import_module("volprobe._build")
    except ImportError:
        return Build()
    return Build(*(str(getattr(made, name.upper(), UNKNOWN)) for name in Build._fields))


def platform_name() -> str:
    """`linux/amd64`, as Go names them."""
    machine = platform.machine()
    return f"{sys.platform}/{_GOARCH.get(machine, machine.lower() or UNKNOWN)}"


def text(timer: str) -> str:
    """`volprobe --version`: node_exporter's lines, with the Python and the probe timer (c or python) in Go's
    place."""
    made = build()
    python = f"{platform.python_implementation()} {platform.python_version()}"
    return (
        f"volprobe, version {__version__} (branch: {made.branch}, revision: {made.revision})\n"
        f"  build user:       {made.user}\n"
        f"  build date:       {made.date}\n"
        f"  python version:   {python}\n"
        f"  probe timer:      {timer}\n"
        f"  platform:         {platform_name()}\n"
    )
