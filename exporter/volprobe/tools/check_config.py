"""`volprobe check-config`: validate a configuration (and a web config), and print the targets it resolves to."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .. import targets, units, webconfig
from ..command import add_path_flags, host_from, report
from ..config import ConfigError, ProbeConfig, load
from ..runtime.follow import pattern_matches
from .registry import register


def _describe_probe(probe: ProbeConfig, directory: str = "") -> str:
    kind = probe.kind
    if kind.buffered:  # synced by its own request, in a file or directory of its own
        where = f" in {directory}/{kind.file}" if directory else ""
        return (
            f"{probe.op} {units.format_size(probe.block_size)} every {units.format_duration(probe.interval)}"
            f"{where}, {' then '.join(kind.steps) if kind.steps else 'buffered, then fdatasync'}, "
            f"jitter {probe.jitter:.0%}"
        )
    sync = " O_DSYNC" if probe.sync else ""
    return (
        f"{probe.op} {units.format_size(probe.block_size)} every {units.format_duration(probe.interval)}"
        f"{sync}, jitter {probe.jitter:.0%}, revisit {probe.revisit:.0%}"
    )


@register("check-config")
def run_check_config(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="volprobe check-config", description="Validate a config, print its targets.")
    parser.add_argument("file")
    parser.add_argument("--web.config.file", dest="web_config", help="also validate this exporter-toolkit web config")
    add_path_flags(parser)
    args = parser.parse_args(argv)
    host = host_from(args)
    try:
        config = load(args.file)
        try:
            resolved = targets.resolve(config, host)
        except ConfigError as err:
            err.source = args.file  # its problems name keys of that file
            raise
        web = webconfig.load(args.web_config) if args.web_config else None
    except ConfigError as err:
        return report(err)
    print(f"{args.file}: OK, {len(resolved)} target(s), window {units.format_duration(config.window)}")
    for target in resolved:
        device = target.device
        if device is None:
            fstype = target.mount.fstype if target.mount else "unknown"
            print(f"- {target.name}: {target.kind} {target.path} on {fstype}, no block device")
        else:
            where = f"{target.path} on {device.name}" if target.kind == "directory" else target.path
            print(f"- {target.name}: {target.kind} {where} ({units.format_size(device.size_bytes)})")
        if target.probe_file and target.needs_probe_file:
            print(f"    probe file {target.probe_file}, {units.format_size(target.config.probe_file_size)}")
        for probe in target.probes:
            print(f"    {_describe_probe(probe, target.path)}")
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
