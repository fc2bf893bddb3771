"""Moved to support/harness.py. Kept only while test_fuzz.py, test_mixin.py and test_probe_loop.py, changed on
other branches, still import from here; once they import from .support.harness, delete this module."""

from .support.harness import MIB, PROMETHEUS_VERSIONS, REPO, prometheus_tool, volprobe_command

__all__ = ["MIB", "PROMETHEUS_VERSIONS", "REPO", "prometheus_tool", "volprobe_command"]
