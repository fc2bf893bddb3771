"""`volprobe warmup`: read every block of a device once (volume initialization), resumably; with --write,
first write every block (blank devices only)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

from .. import schema, targets, units, warmup
from ..command import add_path_flags, host_from, report
from ..config import Config, ConfigError, TargetConfig, WarmupConfig
from ..logs import setup_logging
from .registry import register


@register("warmup")
def run_warmup(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="volprobe warmup",
        description="Read every block of a device once (volume initialization), resumably. With --write, "
        "first write every block (blank devices only).",
    )
    parser.add_argument("device")
    parser.add_argument("--rate", default=None, help="bytes per second, e.g. 100MiB (default: unlimited)")
    parser.add_argument("--jobs", type=int, default=WarmupConfig.jobs, help="parallel requests (default 4)")
    parser.add_argument("--block-size", default=str(WarmupConfig.block_size), help="request size (default 1MiB)")
    parser.add_argument("--state", help="checkpoint file: resume from it, and keep progress in it")
    parser.add_argument(
        "--checkpoint-interval",
        default=units.format_duration(warmup.WarmupJob.checkpoint_interval),
        help="how often progress is saved (default 5s)",
    )
    parser.add_argument("--write", action="store_true", help="write every block first (blank devices only)")
    parser.add_argument("--no-idle-priority", action="store_true", help="do not lower the I/O priority")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar, only the summary")
    add_path_flags(parser)
    args = parser.parse_args(argv)
    setup_logging("warning")
    try:
        rate = schema.flag(schema.POSITIVE_SIZE, args.rate, "--rate") if args.rate else None
        block_size = schema.flag(schema.POSITIVE_SIZE, args.block_size, "--block-size")
        interval = schema.flag(schema.POSITIVE_DURATION, args.checkpoint_interval, "--checkpoint-interval")
        jobs = schema.flag(schema.POSITIVE_INT, args.jobs, "--jobs")
    except ValueError as err:
        return report(ConfigError([f"warmup: {err}"]))
    spec = WarmupConfig(
        mode="write" if args.write else "read",
        rate=rate,
        jobs=jobs,
        block_size=block_size,
        idle_priority=not args.no_idle_priority,
    )
    target = TargetConfig(key="warmup", device=args.device, allow_raw_writes=args.write, warmup=spec)
    try:
        resolved = targets.resolve(Config(targets=(target,)), host_from(args))[0]
    except ConfigError as err:
        return report(err)
    job = warmup.WarmupJob.for_target(resolved, spec, None, state_path=args.state)
    job.checkpoint_interval = interval
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()
        job.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    progress = job.progress
    if args.quiet or not sys.stderr.isatty():
        result = job.run()
    else:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskProgressColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            TaskProgressColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=False,
        ) as bar:
            task = bar.add_task(f"warm-up {args.device}", total=progress.total_bytes)
            job.on_progress = lambda p: bar.update(task, completed=p.done_bytes, description=f"{p.phase} {args.device}")
            result = job.run()
            bar.update(task, completed=result.done_bytes)
    elapsed = (result.finished or time.monotonic()) - (result.started or time.monotonic())
    moved = result.done_bytes - result.resumed_blocks * block_size
    speed = f"{moved / elapsed / 2**20:.1f} MiB/s" if elapsed > 0 else "-"
    resumed = f", resumed at {result.resumed_blocks * block_size / result.size:.0%}" if result.resumed_blocks else ""
    if result.state == "done":
        print(f"{args.device}: warm: {units.format_size(result.total_bytes)} in {elapsed:.3f}s ({speed}){resumed}")
        return 0
    if result.state == "failed":
        print(f"{args.device}: warm-up failed at {result.ratio:.1%}: {result.error}", file=sys.stderr)
        return 1
    print(f"{args.device}: stopped at {result.ratio:.1%}{'; resume with the same --state' if args.state else ''}")
    return 130 if stop.is_set() else 1
