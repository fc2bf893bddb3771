"""What the exporter and every tool share on the command line: the host's mount points, the host they give,
and how a configuration error ends a command (its problems on stderr, exit 2)."""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError
from .discovery import Host

EXIT_CONFIG = 2


def report(err: ConfigError) -> int:
    """Print each problem of a rejected configuration, a line each naming its file, and return the exit code
    that says so."""
    for problem in err.problems:
        named = f"{err.source}: {problem}" if err.source and not problem.startswith(f"{err.source}: ") else problem
        print(f"volprobe: {named}", file=sys.stderr)
    return EXIT_CONFIG


def add_path_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path.sysfs", dest="sysfs", default="/sys", help="sysfs mount point (default /sys)")
    parser.add_argument("--path.procfs", dest="procfs", default="/proc", help="procfs mount point (default /proc)")
    parser.add_argument("--path.devfs", dest="devfs", default="/dev", help="devfs mount point (default /dev)")


def host_from(args: argparse.Namespace) -> Host:
    """The host seen through the --path.* flags."""
    return Host(args.sysfs, args.procfs, args.devfs)
