"""From configured targets to devices and probe files, with every check that needs the machine.

resolve() only reads: it finds each target's block device, checks block sizes against the device, checks
raw-write targets for blankness, and checks existing probe files. Nothing is opened for writing until every
target of the config has passed; then prepare() creates probe files and opens raw-write devices with O_EXCL.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from . import probefile, safety
from .config import PROBE_FILE_NAME, Config, ConfigError, ProbeConfig, TargetConfig, default_probes
from .discovery import SKIP_BY_DEFAULT, BlockDevice, Host, Mount
from .probe import IOTarget

NON_BLOCK_FILESYSTEMS = {
    "tmpfs",
    "ramfs",
    "proc",
    "sysfs",
    "devtmpfs",
    "overlay",
    "nfs",
    "nfs4",
    "cifs",
    "fuse",
}


@dataclass
class ResolvedTarget:
    config: TargetConfig
    name: str
    kind: str  # "device" or "directory"
    path: str
    device: BlockDevice
    disks: list[str]  # whole disks underneath (partition parents, dm/md slaves)
    mount: Mount | None = None
    probe_file: str | None = None
    fds: dict[str, int] = field(default_factory=dict)  # op -> descriptor opened by prepare()
    discovered: bool = False  # added by discovery, not named in the configuration

    @property
    def probes(self) -> tuple[ProbeConfig, ...]:
        return self.config.probes


def default_config_targets(host: Host) -> list[TargetConfig]:
    """With no configuration: every whole disk of the machine, read-only."""
    targets = []
    for name, device in sorted(host.devices().items()):
        if device.kind != "disk" or device.size_bytes == 0 or name.startswith(SKIP_BY_DEFAULT):
            continue
        key = f"default[{name}]"
        targets.append(
            TargetConfig(
                key=key, name=name, device=device.devnode, probes=default_probes("device", key=f"{key}.probes")
            )
        )
    return targets


def _check_block_sizes(probes: tuple[ProbeConfig, ...], device: BlockDevice, region: int, problems: list[str]) -> None:
    for probe in probes:
        key = f"{probe.key}.block_size"
        if probe.block_size % device.logical_block_size:
            problems.append(
                f"{key}: {probe.block_size} is not a multiple of the device's logical block size "
                f"{device.logical_block_size} ({device.name})"
            )
        elif probe.block_size > region:
            problems.append(f"{key}: {probe.block_size} is larger than the {region} bytes it may probe")


def _resolve_device(host: Host, target: TargetConfig, problems: list[str]) -> ResolvedTarget | None:
    path = target.device or ""
    key = f"{target.key}.device"
    try:
        st = os.stat(path)
    except OSError as err:
        problems.append(f"{key}: {path}: {err.strerror}")
        return None
    if not stat.S_ISBLK(st.st_mode):
        problems.append(f"{key}: {path} is not a block device")
        return None
    name = host.device_for_path(path)
    device = host.device(name) if name else None
    if device is None:
        problems.append(f"{key}: {path} has no entry in sysfs")
        return None
    if device.size_bytes == 0:
        problems.append(f"{key}: {path} ({device.name}) has no media (size 0)")
        return None
    region = device.size_bytes - (2 * safety.GUARD_BYTES if target.writes else 0)
    _check_block_sizes(target.probes, device, region, problems)
    if target.warmup and target.warmup.block_size % device.logical_block_size:
        problems.append(
            f"{target.key}.warmup.block_size: {target.warmup.block_size} is not a multiple of the device's "
            f"logical block size {device.logical_block_size} ({device.name})"
        )
    if target.writes:
        refusal = safety.raw_write_refusal(host, device)
        if refusal:
            problems.append(f"{target.key}.allow_raw_writes: refusing raw writes: {path} ({device.name}) {refusal}")
    return ResolvedTarget(target, target.name or device.name, "device", path, device, host.leaf_disks(device.name))


def _resolve_directory(host: Host, target: TargetConfig, problems: list[str]) -> ResolvedTarget | None:
    path = target.directory or ""
    key = f"{target.key}.directory"
    if not os.path.isdir(path):
        problems.append(f"{key}: {path} is not a directory")
        return None
    mount = host.mount_for_path(path)
    if mount and mount.fstype.split(".")[0] in NON_BLOCK_FILESYSTEMS:
        problems.append(f"{key}: {path} is on {mount.fstype}, which has no block device to probe")
        return None
    name = host.device_for_path(path)
    device = host.device(name) if name else None
    if device is None:
        problems.append(f"{key}: {path} is not on a block device (st_dev has no entry in /sys/dev/block)")
        return None
    if not os.access(path, os.W_OK):
        problems.append(f"{key}: {path} is not writable by this user; the probe file cannot be created")
    probe_path = os.path.join(path, PROBE_FILE_NAME)
    problem = probefile.check_existing(probe_path, target.probe_file_size)
    if problem:
        problems.append(f"{target.key}.probe_file_size: {problem}")
    for probe in target.probes:
        region = target.probe_file_size - probefile.HEADER_BYTES if probe.kind.writes else device.size_bytes
        _check_block_sizes((probe,), device, region, problems)
    return ResolvedTarget(
        target,
        target.name or device.name,
        "directory",
        path,
        device,
        host.leaf_disks(device.name),
        mount,
        probe_path,
    )


def resolve(config: Config, host: Host, targets: list[TargetConfig] | None = None) -> list[ResolvedTarget]:
    """Resolve the config's targets (or the default set); ConfigError lists every problem."""
    chosen = list(config.targets) if targets is None else targets
    if targets is None and config.builtin:
        chosen = default_config_targets(host)
    problems: list[str] = []
    resolved: list[ResolvedTarget] = []
    for target in chosen:
        found = (_resolve_directory if target.directory else _resolve_device)(host, target, problems)
        if found is not None:
            resolved.append(found)
    names: dict[str, str] = {}
    for target in resolved:
        if target.name in names:
            problems.append(
                f"{target.config.key}.name: {target.name!r} is also the name of {names[target.name]}; "
                f"give the targets distinct names"
            )
        names[target.name] = target.config.key
    if problems:
        raise ConfigError(problems)
    return resolved


def open_raw_exclusive(host: Host, target: ResolvedTarget, flags: int) -> int:
    """Open a blank device for writing with O_EXCL, after checking again that it is still blank."""
    device = host.device(target.device.name)
    if device is None or (device.major, device.minor) != (target.device.major, target.device.minor):
        raise OSError(2, "the device went away or was replaced", target.path)
    refusal = safety.raw_write_refusal(host, device)
    if refusal:
        raise OSError(1, f"refusing raw writes: {refusal}", target.path)
    return os.open(target.path, flags | os.O_EXCL | os.O_CLOEXEC)


def io_target(host: Host, target: ResolvedTarget, probe: ProbeConfig) -> IOTarget:
    """Where a probe's I/O goes and how its descriptor is (re)opened."""
    flags = probe.open_flags
    if not probe.kind.writes:
        return IOTarget(target.device.devnode, flags, 0, target.device.size_bytes)
    if target.kind == "directory":
        return IOTarget(target.probe_file or "", flags, probefile.HEADER_BYTES, target.config.probe_file_size)
    return IOTarget(
        target.path,
        flags | os.O_EXCL,
        safety.GUARD_BYTES,
        target.device.size_bytes - safety.GUARD_BYTES,
        opener=lambda: open_raw_exclusive(host, target, flags),
    )


def prepare(host: Host, resolved: list[ResolvedTarget], strict: bool = True) -> list[str]:
    """Create probe files and open every descriptor; ConfigError (nothing left open) if any step fails.

    With strict=False (the built-in default targets), a read descriptor that cannot be opened is left to
    the worker, which counts the error and retries with back-off; the problems are returned as warnings.
    """
    warnings: list[str] = []
    problems: list[str] = []
    for target in resolved:
        if target.kind == "directory" and target.config.writes:
            try:
                probefile.ensure(target.path, PROBE_FILE_NAME, target.config.probe_file_size)
            except (probefile.ProbeFileError, OSError) as err:
                problems.append(f"{target.config.key}.directory: cannot prepare the probe file: {err}")
                continue
            if os.stat(target.probe_file or "").st_dev != os.stat(target.path).st_dev:
                problems.append(f"{target.config.key}.directory: the probe file is not on the directory's device")
                continue
        for probe in target.probes:
            io = io_target(host, target, probe)
            try:
                fd = io.open()  # reads open per probe later; opening now checks access before anything starts
                if probe.kind.writes:
                    target.fds[probe.op] = fd
                else:
                    os.close(fd)
            except OSError as err:
                message = f"{probe.key}: cannot open {io.path}: {err.strerror or err}"
                (warnings if not strict and not probe.kind.writes else problems).append(message)
    if problems:
        close(resolved)
        raise ConfigError(problems)
    return warnings


def close(resolved: list[ResolvedTarget]) -> None:
    for target in resolved:
        for op in list(target.fds):
            try:
                os.close(target.fds.pop(op))
            except OSError:
                pass
