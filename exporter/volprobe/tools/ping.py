"""`volprobe ping`: ioping-like, one queue-depth-1 direct I/O probe per line, then statistics."""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import threading
import time
from collections.abc import Sequence

from .. import ops, schema, targets, units
from ..command import add_path_flags as _add_path_flags
from ..command import host_from as _host
from ..command import report as _report
from ..config import Config, ConfigError, ProbeConfig, TargetConfig
from ..logs import setup_logging
from ..probe import Outcome, ProbeWorker
from ..stats import ProbeStats
from .registry import register

# The helpers keep the names they had in cli.py: this module's body is cli.py's, moved as it was.


def _nearest_rank(sorted_values: list[float], q: float) -> float:
    return sorted_values[max(1, math.ceil(q * len(sorted_values))) - 1]


@register("ping")
def run_ping(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="volprobe ping",
        description="ioping-like: one queue-depth-1 direct I/O probe per line, then statistics.",
    )
    parser.add_argument("path", help="block device, or directory (writes go to its probe file)")
    parser.add_argument("-c", "--count", type=int, default=0, help="stop after N probes (default: until ^C)")
    parser.add_argument(
        "-i", "--interval", default=units.format_duration(ProbeConfig.interval), help="time between probes (default 1s)"
    )
    defaults = ", ".join(f"{units.format_size(op.default_block_size)} {op.name}" for op in ops.OPS.values())
    parser.add_argument("-s", "--block-size", default=None, help=f"request size (default {defaults})")
    parser.add_argument("--op", choices=ops.NAMES, default=ops.READ.name, help="kind of probe (default %(default)s)")
    parser.add_argument("--write", action="store_true", help=f"same as --op {ops.WRITE.name} (O_DSYNC)")
    parser.add_argument("--no-sync", action="store_true", help="writes without O_DSYNC (not commit, metadata)")
    parser.add_argument("--allow-raw-writes", action="store_true", help="permit writes to a blank raw device")
    parser.add_argument(
        "--probe-file-size",
        default=str(TargetConfig.probe_file_size),
        help="size of a new probe file (default 64MiB)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the statistics")
    _add_path_flags(parser)
    args = parser.parse_args(argv)
    setup_logging("warning")
    kind = ops.WRITE if args.write else ops.get(args.op)
    try:
        interval = schema.flag(schema.POSITIVE_DURATION, args.interval, "--interval")
        block_size = schema.flag(schema.POSITIVE_SIZE, args.block_size, "--block-size") if args.block_size else 0
        file_size = schema.flag(schema.POSITIVE_SIZE, args.probe_file_size, "--probe-file-size")
    except ValueError as err:
        return _report(ConfigError([f"ping: {err}"]))
    is_dir = os.path.isdir(args.path)
    if args.no_sync and kind.buffered:
        return _report(ConfigError([f"ping: --no-sync: {kind.name} probes always sync (that is what they time)"]))
    probe = ProbeConfig(kind.name, block_size, interval, sync=not args.no_sync, jitter=0.0, revisit=0.0, key="ping")
    target = TargetConfig(
        key="ping",
        device=None if is_dir else args.path,
        directory=args.path if is_dir else None,
        probe_file_size=file_size,
        allow_raw_writes=args.allow_raw_writes,
        probes=(probe,),
    )
    if kind.directory_only and not is_dir:
        return _report(ConfigError([f"ping: --op {kind.name} needs a directory (it times a filesystem's operations)"]))
    if kind.writes and not is_dir and not args.allow_raw_writes:
        return _report(ConfigError(["ping: --write on a raw device needs --allow-raw-writes (and a blank device)"]))
    host = _host(args)
    try:
        resolved = targets.resolve(Config(targets=(target,)), host)
        targets.prepare(host, resolved)
    except ConfigError as err:
        return _report(err)
    chosen = resolved[0]
    io = targets.io_target(host, chosen, probe)
    where = kind.source.replace("_", " ") if (is_dir and kind.writes) else "block device"
    where = "probe file" if io.path == chosen.probe_file else where
    size = chosen.config.probe_file_size if where != "block device" else chosen.block.size_bytes
    sized = "" if kind.offsets == "none" else f" {units.format_size(size)}"  # a directory has no size to tell
    title = f"{io.path} ({where}{sized}, {chosen.device_name or 'no block device'})"
    arrow = kind.arrow
    block_size = probe.block_size
    finished = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: finished.set())
    latencies: list[float] = []
    errors = 0
    request = 0

    def report(outcome: Outcome) -> None:
        """Each probe's line, from the worker's thread; the worker stops itself at --count."""
        nonlocal request, errors
        if finished.is_set():
            return
        request += 1
        if outcome.error:
            errors += 1
            print(f"{arrow} {title}: request={request} error={outcome.error} ({outcome.detail})", flush=True)
        else:
            latencies.append(outcome.latency_ns / 1e9)
            if not args.quiet:
                zero = " zeros" if outcome.zero else ""
                print(
                    f"{units.format_size(block_size)} {arrow} {title}: request={request} "
                    f"time={units.format_duration(latencies[-1])} ({outcome.touch}{zero})",
                    flush=True,
                )
        if 0 < args.count <= request:
            worker.stop()
            finished.set()

    # The exporter's worker, one probe a batch so that each is reported as it is made; failures back off.
    fd = chosen.fds.pop(probe.op, None)
    worker = ProbeWorker(probe, io, ProbeStats(60.0), name=chosen.name, fd=fd, max_batch=1, on_outcome=report)
    started = time.monotonic()
    worker.start()
    finished.wait()
    worker.stop()
    while not worker.join(1.0):  # a request stuck in the kernel: as long as it takes
        pass
    worker.close()
    elapsed = time.monotonic() - started
    print(f"\n--- {title} volprobe ping statistics ---")
    if not latencies:
        print(f"{request} requests, {errors} errors, no latency to report")
        return 1
    ordered = sorted(latencies)
    busy = sum(latencies)
    print(
        f"{len(latencies)} requests completed in {units.format_duration(busy)}, {errors} errors, "
        f"{units.format_size(block_size * len(latencies))} {kind.past_tense}, "
        f"{len(latencies) / busy:.0f} iops at queue depth 1, run {units.format_duration(elapsed)}"
    )
    mdev = statistics.pstdev(latencies) if len(latencies) > 1 else 0.0
    print(
        "min/avg/max/mdev = "
        + " / ".join(units.format_duration(v) for v in (ordered[0], statistics.fmean(latencies), ordered[-1], mdev))
    )
    print(
        f"p50/p99 = {units.format_duration(_nearest_rank(ordered, 0.5))} / "
        f"{units.format_duration(_nearest_rank(ordered, 0.99))}"
    )
    return 0 if not errors else 1
