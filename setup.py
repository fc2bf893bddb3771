"""setuptools reads everything else from pyproject.toml; this adds one step to build_py: volprobe/_build.py, the
commit and build `volprobe --version` reports (volprobe/version.py). Not in an editable install, which asks
its checkout's git at run time instead."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        sys.path.insert(0, str(ROOT / "exporter"))
        try:
            from volprobe.version import stamp
        finally:
            sys.path.pop(0)
        target = Path(self.build_lib) / "volprobe" / "_build.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(stamp(ROOT))


setup(cmdclass={"build_py": BuildPy})
