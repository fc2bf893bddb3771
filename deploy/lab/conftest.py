import os

from .fuselab import fuse_directory  # noqa: F401 - fixture
from .lab import clean_stale_test_volumes, lab_volume, latency_tests_first, loops_of_this_worker  # noqa: F401 - fixtures

if os.geteuid() != 0:
    collect_ignore_glob = ["test_*.py"]
