"""The golden exposition: the whole registry /metrics serves (volprobe.app.build_registry) over a fixed runtime
view (fakeview.golden_view), rendered as the exporter renders it. test_golden.py compares it byte for byte
with fixtures/e2e-output.txt, as node_exporter's end-to-end test does.

After a deliberate change to what is exported, regenerate it and review the diff:

    PYTHONPATH=exporter python -m exporter.tests.support.golden --update
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

from prometheus_client import CollectorRegistry

from volprobe import voldata
from volprobe.app import build_registry
from volprobe.exposition import generate_text

from .fakeview import golden_view

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = FIXTURES / "e2e-output.txt"
PROC = FIXTURES / "golden-proc"  # process_*: a process that used no CPU, from a fixed boot time


class FixedPlatform:
    """python_info of a fixed interpreter, not of the one running the test."""

    @staticmethod
    def python_version_tuple() -> tuple[str, str, str]:
        return ("3", "11", "2")

    @staticmethod
    def python_version() -> str:
        return "3.11.2"

    @staticmethod
    def python_implementation() -> str:
        return "CPython"

    @staticmethod
    def system() -> str:
        return "Linux"


def registry() -> CollectorRegistry:
    """What /metrics serves for the golden view, every collector enabled, collectors timed by a clock that stands:
    the same families on every collect()."""
    return build_registry(golden_view(), None, str(PROC), FixedPlatform(), clock=lambda: 0.0)


def recorded_persistent_volume(directory: str) -> str:
    """voldata.persistent_volume_at() on the golden view's node: its one CSI volume's vol_data.json says it is the
    PersistentVolume pvc-42 (the directory is not on this machine)."""
    return "pvc-42" if directory.endswith("/volumes/kubernetes.io~csi/pvc-42") else ""


def render() -> bytes:
    """The exposition of the golden view."""
    with mock.patch.object(voldata, "persistent_volume_at", recorded_persistent_volume):
        return generate_text(registry())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exporter.tests.support.golden", description=__doc__)
    parser.add_argument("--update", action="store_true", help=f"write {GOLDEN.name} (else print the exposition)")
    args = parser.parse_args(argv)
    text = render()
    if args.update:
        GOLDEN.write_bytes(text)
        print(f"wrote {GOLDEN}")
    else:
        sys.stdout.buffer.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
