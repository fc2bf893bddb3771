import os
import sys
from pathlib import Path

# The shared test harness (exporter/tests/harness.py), importable here as `harness`, as in bench/.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "exporter" / "tests"))

from lab import clean_stale_test_volumes, lab_volume, loops_of_this_worker  # noqa: F401 - fixtures

if os.geteuid() != 0:
    collect_ignore_glob = ["test_*.py"]
