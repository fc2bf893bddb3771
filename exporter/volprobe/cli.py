"""Command line: the exporter, and the check-config, devices and ping tools. Exit 2 on any bad config."""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import math
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from . import __version__, capabilities, ops, safety, schema, targets, units, warmup, webconfig
from .collectors import Sources, VolprobeCollector, add_flags, enabled_from_args
from .config import Config, ConfigError, ProbeConfig, TargetConfig, WarmupConfig, from_paths, load
from .discovery import Host
from .probe import Pacer, ProbeIO
from .runtime import Exporter
from .runtime.follow import pattern_matches
from .server import ExporterHTTPServer, landing_page, parse_listen_address
from .webconfig import WebConfigWatcher

log = logging.getLogger("volprobe")
EXIT_CONFIG = 2
DEFAULT_LISTEN = ":10130"


class _LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        message = record.getMessage().replace('"', '\\"').replace("\n", " | ")
        line = f'ts={ts} level={record.levelname.lower()} logger={record.name} msg="{message}"'
        if record.exc_info:
            line += ' err="' + self.formatException(record.exc_info).replace('"', "'").replace("\n", " | ") + '"'
        return line


class _JSONFormatter(logging.Formatter):
    """One JSON object per line, with logfmt's keys (as Prometheus' --log.format=json)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = {"ts": ts, "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            line["err"] = self.formatException(record.exc_info)
        return json.dumps(line)


LOG_FORMATS = {"logfmt": _LogfmtFormatter, "json": _JSONFormatter}


def setup_logging(level: str, format: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LOG_FORMATS[format]())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives each thread that allocates its own malloc arena; with a thread per probe that is most of
    the exporter's memory. Two arenas serve a few dozen mostly idle threads just as well."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def _report(err: ConfigError) -> int:
    for problem in err.problems:
        print(f"volprobe: {problem}", file=sys.stderr)
    return EXIT_CONFIG


def _host(args: argparse.Namespace) -> Host:
    return Host(args.sysfs, args.procfs, args.devfs)


def _add_path_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path.sysfs", dest="sysfs", default="/sys", help="sysfs mount point (default /sys)")
    parser.add_argument("--path.procfs", dest="procfs", default="/proc", help="procfs mount point (default /proc)")
    parser.add_argument("--path.devfs", dest="devfs", default="/dev", help="devfs mount point (default /dev)")


def _load_config(args: argparse.Namespace) -> Config:
    if args.config and args.target:
        raise ConfigError(["--config and --target: give one or the other"])
    if args.config:
        return load(args.config)
    return from_paths(args.target or [])


# -- the exporter -----------------------------------------------------------------------------------


def run_exporter(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="volprobe",
        description="Prometheus exporter: queue-depth-1 direct I/O probes of block volumes. "
        "Subcommands: check-config, compare, devices, ping, warmup (volprobe SUBCOMMAND --help).",
    )
    parser.add_argument("--config", help="YAML configuration file (default: probe every whole disk, read-only)")
    parser.add_argument("--target", action="append", metavar="PATH", help="probe a device or directory (repeatable)")
    parser.add_argument(
        "--web.listen-address",
        dest="listen",
        action="append",
        help=f"address to listen on (repeatable: one server on each; default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--web.telemetry-path", dest="telemetry_path", default="/metrics", help="path of the metrics (default /metrics)"
    )
    parser.add_argument("--web.config.file", dest="web_config", help="exporter-toolkit web config (TLS, basic auth)")
    parser.add_argument("--log.level", dest="log_level", default="info", choices=["debug", "info", "warn", "error"])
    parser.add_argument("--log.format", dest="log_format", default="logfmt", choices=sorted(LOG_FORMATS))
    parser.add_argument("--version", action="version", version=f"volprobe {__version__}")
    _add_path_flags(parser)
    add_flags(parser)
    args = parser.parse_args(argv)
    setup_logging("warning" if args.log_level == "warn" else args.log_level, args.log_format)
    limit_malloc_arenas()
    listen = args.listen or [DEFAULT_LISTEN]
    if not args.telemetry_path.startswith("/") or args.telemetry_path.startswith(("/-/", "//")):
        return _report(ConfigError([f"--web.telemetry-path: {args.telemetry_path!r} must start with / (not /-/)"]))

    try:
        config = _load_config(args)
        addresses = [parse_listen_address(address) for address in listen]
        web = WebConfigWatcher(args.web_config)
    except ConfigError as err:
        return _report(err)
    except ValueError as err:
        return _report(ConfigError([f"--web.listen-address: {err}"]))
    host = _host(args)
    exporter = Exporter(config, host)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VolprobeCollector(Sources(exporter, Path(args.procfs), web), enabled_from_args(args)))
    ProcessCollector(registry=registry, proc=args.procfs)
    PlatformCollector(registry=registry)

    def landing() -> str:
        resolved = exporter.probes.targets()
        return landing_page(
            [
                (
                    t.name,
                    t.path,
                    t.device.name,
                    ", ".join(f"{p.op} {units.format_size(p.block_size)}" for p in t.probes),
                )
                for t in resolved
            ],
            args.telemetry_path,
        )

    servers: list[ExporterHTTPServer] = []
    for text, address in zip(listen, addresses, strict=True):
        try:
            servers.append(ExporterHTTPServer(address, registry, web, landing, args.telemetry_path))
        except OSError as err:
            log.error("cannot listen on %s: %s", text, err.strerror or err)
            for server in servers:
                server.server_close()
            return 1
    try:
        exporter.start()
    except ConfigError as err:
        for server in servers:
            server.server_close()
        return _report(err)
    capabilities.check_idle_io_priority()  # logged and exported now, not first at a warm-up
    if not exporter.probes.running() and config.discovery is None:
        log.warning("no targets: nothing to probe (give --config or --target)")
    # What start-up made lives as long as the process: the cyclic collector need not walk it on every full
    # collection (these landed in the middle of scrapes, doubling their p99; bench/series).
    gc.freeze()

    wake = threading.Event()
    requests: collections.deque[str] = collections.deque()

    def on_signal(signum: int, _frame: object) -> None:
        requests.append(signal.Signals(signum).name)
        wake.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        server.ready.set()
    log.info("volprobe %s listening on %s (%d probes)", __version__, ", ".join(listen), len(exporter.probes.running()))
    while True:
        wake.wait()
        wake.clear()
        # Popped one by one: a handler runs between any two bytecodes, and a copy-then-clear could drop a
        # SIGTERM that arrived in between (the loop would then reload instead of stopping).
        pending = [requests.popleft() for _ in range(len(requests))]
        if not pending:  # drained by the previous turn, whose wake came after the clear
            continue
        stops = [name for name in pending if name != "SIGHUP"]
        if stops:
            log.info("received %s, shutting down", stops[0])
            break
        reload_config(args, exporter)
    stuck = exporter.stop()
    for server in servers:
        server.shutdown()
        server.server_close()
    if stuck:
        log.warning("probes still blocked in the kernel at exit: %s", ", ".join(stuck))
    return 0


def reload_config(args: argparse.Namespace, exporter: Exporter) -> None:
    """SIGHUP: read the configuration again and apply it; a bad one is logged and the running one kept."""
    if not args.config:
        log.warning("SIGHUP: no --config file to reload (targets came from the command line or the default)")
        return
    log.info("SIGHUP: reloading %s", args.config)
    try:
        config = load(args.config)
    except ConfigError as err:
        exporter.note_reload(False)
        log.error("configuration %s rejected, keeping the running one: %s", args.config, " | ".join(err.problems))
        return
    try:
        exporter.reload(config)  # records its own outcome
    except ConfigError as err:
        log.error("configuration %s rejected, keeping the running one: %s", args.config, " | ".join(err.problems))
    except Exception:  # a bug must not end the exporter: it keeps serving what it had
        exporter.note_reload(False)
        log.exception("reloading %s failed; the running configuration is kept", args.config)


# -- check-config ------------------------------------------------------------------------------------


def _describe_probe(probe: ProbeConfig) -> str:
    sync = " O_DSYNC" if probe.sync else ""
    return (
        f"{probe.op} {units.format_size(probe.block_size)} every {units.format_duration(probe.interval)}"
        f"{sync}, jitter {probe.jitter:.0%}, revisit {probe.revisit:.0%}"
    )


def run_check_config(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="volprobe check-config", description="Validate a config, print its targets.")
    parser.add_argument("file")
    parser.add_argument("--web.config.file", dest="web_config", help="also validate this exporter-toolkit web config")
    _add_path_flags(parser)
    args = parser.parse_args(argv)
    host = _host(args)
    try:
        config = load(args.file)
        resolved = targets.resolve(config, host)
        web = webconfig.load(args.web_config) if args.web_config else None
    except ConfigError as err:
        return _report(err)
    print(f"{args.file}: OK, {len(resolved)} target(s), window {units.format_duration(config.window)}")
    for target in resolved:
        where = f"{target.path} on {target.device.name}" if target.kind == "directory" else target.path
        print(f"- {target.name}: {target.kind} {where} ({units.format_size(target.device.size_bytes)})")
        if target.probe_file:
            print(f"    probe file {target.probe_file}, {units.format_size(target.config.probe_file_size)}")
        for probe in target.probes:
            print(f"    {_describe_probe(probe)}")
    if config.discovery:
        d = config.discovery
        print(
            f"- discovery: include {list(d.include) or ['*']}, exclude {list(d.exclude)}, "
            f"rescan every {units.format_duration(d.rescan_interval)}"
        )
        for key, pattern, matched in pattern_matches(host, d):
            found = ", ".join(matched) if matched else "no device now (patterns match whole kernel names)"
            print(f"    {key} {pattern!r}: {found}")
        for probe in d.probes:
            print(f"    {_describe_probe(probe)}")
    if web is not None:
        print(f"{args.web_config}: OK, web config: {_describe_web(web)}")
    return 0


def _describe_web(web: webconfig.WebConfig) -> str:
    parts = [f"TLS, client certificates {web.client_auth_type}" if web.tls else "no TLS (plain HTTP)"]
    if web.allowed_sans is not None:
        parts.append(f"client SANs {', '.join(web.allowed_sans) or '(none)'}")
    if web.users:
        parts.append(f"basic auth ({len(web.users)} users)")
    if web.rate_limit:
        every = units.format_duration(web.rate_limit.interval_s)
        parts.append(f"rate limit 1 request per {every}, burst {web.rate_limit.burst}")
    if web.headers:
        parts.append(f"headers {', '.join(web.headers)}")
    return "; ".join(parts)


# -- devices -------------------------------------------------------------------------------------------


def _readable(devnode: str) -> str:
    try:
        os.close(os.open(devnode, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        return "yes"
    except OSError as err:
        return f"no: {err.strerror}"


def run_devices(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="volprobe devices",
        description="Block devices, their identity, and whether volprobe may probe them.",
    )
    _add_path_flags(parser)
    args = parser.parse_args(argv)
    host = _host(args)
    rows = [("DEVICE", "KIND", "SIZE", "MODEL", "SERIAL", "VOLUME_ID", "MOUNTED", "READ", "RAW WRITE")]
    for name, device in sorted(host.devices().items()):
        read = _readable(device.devnode) if device.size_bytes else "no: no media"
        refusal = safety.raw_write_refusal(host, device) if device.size_bytes else "has no media"
        write = "blank (opt in with allow_raw_writes)" if refusal is None else f"no: {refusal}"
        mounts = ",".join(m.mount_point for m in host.mounts_of(device)) or "-"
        rows.append(
            (
                name,
                device.kind,
                units.format_size(device.size_bytes),
                device.model or "-",
                device.serial or "-",
                device.volume_id or "-",
                mounts,
                read,
                write,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


# -- ping --------------------------------------------------------------------------------------------------


def _nearest_rank(sorted_values: list[float], q: float) -> float:
    return sorted_values[max(1, math.ceil(q * len(sorted_values))) - 1]


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
    parser.add_argument("-s", "--block-size", default=None, help="request size (default 4KiB read, 8KiB write)")
    parser.add_argument("--write", action="store_true", help="write probes (O_DSYNC) instead of reads")
    parser.add_argument("--no-sync", action="store_true", help="writes without O_DSYNC")
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
    kind = ops.WRITE if args.write else ops.READ
    try:
        interval = schema.flag(schema.POSITIVE_DURATION, args.interval, "--interval")
        block_size = schema.flag(schema.POSITIVE_SIZE, args.block_size, "--block-size") if args.block_size else 0
        file_size = schema.flag(schema.POSITIVE_SIZE, args.probe_file_size, "--probe-file-size")
    except ValueError as err:
        return _report(ConfigError([f"ping: {err}"]))
    is_dir = os.path.isdir(args.path)
    probe = ProbeConfig(kind.name, block_size, interval, sync=not args.no_sync, jitter=0.0, revisit=0.0, key="ping")
    target = TargetConfig(
        key="ping",
        device=None if is_dir else args.path,
        directory=args.path if is_dir else None,
        probe_file_size=file_size,
        allow_raw_writes=args.allow_raw_writes,
        probes=(probe,),
    )
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
    runner = ProbeIO(probe, io, random.Random(), chosen.fds.pop(probe.op, None))
    where = "probe file" if (is_dir and kind.writes) else "block device"
    size = chosen.config.probe_file_size if where == "probe file" else chosen.device.size_bytes
    title = f"{io.path} ({where} {units.format_size(size)}, {chosen.device.name})"
    arrow = kind.arrow
    block_size = probe.block_size
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    latencies: list[float] = []
    errors = 0
    pacer = Pacer(interval, 0.0, random.Random(), time.perf_counter_ns())
    started = time.monotonic()
    request = 0
    while not stop.is_set() and (args.count <= 0 or request < args.count):
        wait = (pacer.deadline() - time.perf_counter_ns()) / 1e9
        if request and wait > 0 and stop.wait(wait):
            break
        request += 1
        try:
            runner.open()
        except OSError as err:
            print(f"{arrow} {title}: request={request} error: {err}")
            errors += 1
            continue
        outcome = runner.once()
        pacer.advance(time.perf_counter_ns())
        if outcome.error:
            errors += 1
            print(f"{arrow} {title}: request={request} error={outcome.error} ({outcome.detail})")
            continue
        latencies.append(outcome.latency_ns / 1e9)
        if not args.quiet:
            zero = " zeros" if outcome.zero else ""
            print(
                f"{units.format_size(block_size)} {arrow} {title}: request={request} "
                f"time={units.format_duration(latencies[-1])} ({outcome.touch}{zero})"
            )
    runner.close()
    elapsed = time.monotonic() - started
    print(f"\n--- {title} volprobe ping statistics ---")
    if not latencies:
        print(f"{request} requests, {errors} errors, no latency to report")
        return 1
    ordered = sorted(latencies)
    busy = sum(latencies)
    print(
        f"{len(latencies)} requests completed in {units.format_duration(busy)}, {errors} errors, "
        f"{units.format_size(block_size * len(latencies))} {'written' if kind.writes else 'read'}, "
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


# -- warmup ---------------------------------------------------------------------------------------------


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
    _add_path_flags(parser)
    args = parser.parse_args(argv)
    setup_logging("warning")
    try:
        rate = schema.flag(schema.POSITIVE_SIZE, args.rate, "--rate") if args.rate else None
        block_size = schema.flag(schema.POSITIVE_SIZE, args.block_size, "--block-size")
        interval = schema.flag(schema.POSITIVE_DURATION, args.checkpoint_interval, "--checkpoint-interval")
        jobs = schema.flag(schema.POSITIVE_INT, args.jobs, "--jobs")
    except ValueError as err:
        return _report(ConfigError([f"warmup: {err}"]))
    spec = WarmupConfig(
        mode="write" if args.write else "read",
        rate=rate,
        jobs=jobs,
        block_size=block_size,
        idle_priority=not args.no_idle_priority,
    )
    target = TargetConfig(key="warmup", device=args.device, allow_raw_writes=args.write, warmup=spec)
    try:
        resolved = targets.resolve(Config(targets=(target,)), _host(args))[0]
    except ConfigError as err:
        return _report(err)
    job = warmup.WarmupJob.for_target(resolved, spec, None, state_path=args.state)
    job.checkpoint_interval = interval
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: (stop.set(), job.stop()))
    signal.signal(signal.SIGTERM, lambda *_: (stop.set(), job.stop()))
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


def run_compare(argv: Sequence[str]) -> int:
    from .compare import command  # only this subcommand needs it

    return command.run(argv)


SUBCOMMANDS = {
    "check-config": run_check_config,
    "compare": run_compare,
    "devices": run_devices,
    "ping": run_ping,
    "warmup": run_warmup,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return SUBCOMMANDS[args[0]](args[1:])
    return run_exporter(args)
