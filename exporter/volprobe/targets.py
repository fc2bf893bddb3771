"""From configured targets to devices and probe files, with every check that needs the machine.

resolve() only reads: it finds each target's block device, checks block sizes against the device, checks
raw-write targets for blankness, and checks existing probe files. Nothing is opened for writing until every
target of the config has passed; then prepare() creates probe files and opens raw-write devices with O_EXCL.
Every open for writing, then and at each reopen, is judged on its descriptor (probefile.ProbeDirectory,
safety.check_raw_descriptor), never on the name it was opened by.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import stat
from dataclasses import dataclass, field

from . import metadata, mountcheck, ops, privatemount, probefile, safety
from .config import PROBE_FILE_NAME, Config, ConfigError, ProbeConfig, TargetConfig, default_probes
from .discovery import SKIP_BY_DEFAULT, BlockDevice, Host, Mount
from .kubelet import PodVolume
from .logs import fields
from .probe import IOTarget
from .safety import Refused

log = logging.getLogger(__name__)
_PAGE = os.sysconf("SC_PAGE_SIZE")

# Filesystems a directory target is refused on, and why: their "latency" says nothing of a volume. Network and
# FUSE filesystems (nfs, cifs, ceph, fuse.*) are probed through the probe file alone.
_IN_MEMORY = "keeps its data in memory: nothing to probe"
REFUSED_FILESYSTEMS = {
    "tmpfs": _IN_MEMORY,
    "ramfs": _IN_MEMORY,
    "proc": _IN_MEMORY,
    "sysfs": _IN_MEMORY,
    "devtmpfs": _IN_MEMORY,
    "overlay": "a container's layered root: give the directory of the volume mounted under it",
}


@dataclass
class ResolvedTarget:
    config: TargetConfig
    name: str
    kind: str  # "device" or "directory"
    path: str
    device: BlockDevice | None  # None: a directory on a filesystem without one (NFS, CephFS, SMB, FUSE)
    disks: list[str]  # whole disks underneath (partition parents, dm/md slaves)
    mount: Mount | None = None
    probe_file: str | None = None
    probe_dir: probefile.ProbeDirectory | None = None  # a directory target's directory, held by descriptor
    # The files prepare() checked, by name (the probe file, a commit log): every open must be that very file.
    file_pins: dict[str, probefile.FileIdentity] = field(default_factory=dict)
    metadata_pin: metadata.DirectoryPin | None = None  # the metadata probe's directory prepare() checked
    fds: dict[str, int] = field(default_factory=dict)  # op -> descriptor opened by prepare()
    discovered: bool = False  # added by discovery, not named in the configuration
    host: Host | None = None  # where its device is looked up again at each raw reopen
    reads_probe_file: bool = False  # a directory target whose device cannot be opened (or has none): the file
    pending: str = ""  # why a directory could not be resolved yet (its mount did not answer): probed once it does
    # A pod volume followed by runtime.pods (kubernetes:): checked by path, holding nothing between checks.
    pod_volume: PodVolume | None = None

    def open_raw(self, flags: int) -> int:
        """Open the device for raw writes (probes or a write warm-up): see open_raw_exclusive()."""
        assert self.host is not None, "resolved without a host"
        return open_raw_exclusive(self.host, self, flags)

    @property
    def probes(self) -> tuple[ProbeConfig, ...]:
        return self.config.probes

    @property
    def probe_pin(self) -> probefile.FileIdentity | None:
        """The probe file prepare() checked."""
        return self.file_pins.get(PROBE_FILE_NAME)

    @property
    def needs_probe_file(self) -> bool:
        """Write probes go to the probe file, and reads when the device cannot be opened."""
        return any(p.kind.writes and not p.kind.file for p in self.probes) or self.reads_probe_file

    @property
    def block(self) -> BlockDevice:
        """The device of a target that must have one: device targets, discovered ones, warm-ups (config.py
        allows a warm-up on device targets only)."""
        if self.device is None:
            raise ValueError(f"{self.name}: {self.path} has no block device")
        return self.device

    @property
    def device_name(self) -> str:
        """The device label: the kernel name, or empty for a target without a block device."""
        return self.device.name if self.device is not None else ""


def default_config_targets(host: Host) -> list[TargetConfig]:
    """With no configuration: every whole disk of the machine, read-only. A disk the kernel lists but whose node
    is not in /dev (a container given some devices only) is left out, as discovery leaves it, and logged: a
    default nobody asked for must not stop the start."""
    targets = []
    for name, device in sorted(host.devices().items()):
        if device.kind != "disk" or device.size_bytes == 0 or name.startswith(SKIP_BY_DEFAULT):
            continue
        if not os.path.lexists(device.devnode):
            log.warning("not probing %s: %s does not exist here", name, device.devnode, extra=fields(device=name))
            continue
        key = f"default[{name}]"
        targets.append(
            TargetConfig(
                key=key, name=name, device=device.devnode, probes=default_probes("device", key=f"{key}.probes")
            )
        )
    return targets


def _check_block_sizes(
    probes: tuple[ProbeConfig, ...], alignment: int, aligned_to: str, region: int, problems: list[str]
) -> None:
    """Each probe's block size: a multiple of `alignment` (O_DIRECT's; `aligned_to` names it, in the message)
    unless its op is buffered, and within the `region` bytes it may probe."""
    for probe in probes:
        key = f"{probe.key}.block_size"
        if probe.kind.offsets == "none":  # a metadata sequence's write has no region to fit in
            continue
        if probe.block_size % alignment and not probe.kind.buffered:  # O_DIRECT's alignment
            problems.append(f"{key}: {probe.block_size} is not a multiple of {aligned_to}")
        elif probe.block_size > region:
            problems.append(f"{key}: {probe.block_size} is larger than the {region} bytes it may probe")


def _device_alignment(device: BlockDevice) -> tuple[int, str]:
    size = device.logical_block_size
    return size, f"the device's logical block size {size} ({device.name})"


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
    alignment, aligned_to = _device_alignment(device)
    _check_block_sizes(target.probes, alignment, aligned_to, region, problems)
    if target.warmup and target.warmup.block_size % alignment:
        problems.append(f"{target.key}.warmup.block_size: {target.warmup.block_size} is not a multiple of {aligned_to}")
    if target.writes:
        refusal = safety.raw_write_refusal(host, device)
        if refusal:
            problems.append(f"{target.key}.allow_raw_writes: refusing raw writes: {path} ({device.name}) {refusal}")
    return ResolvedTarget(target, target.name or device.name, "device", path, device, host.leaf_disks(device.name))


def _resolve_directory(
    host: Host, target: TargetConfig, problems: list[str], held: probefile.ProbeDirectory | None = None
) -> ResolvedTarget | None:
    """A directory target's checks. With `held` (the directory a running target of that path holds, at a reload):
    that directory, asked through its descriptor (its filesystem, mount and device), not whatever the name leads
    to now. One let go of that is not recognised at its path (unmounted for an fsck, say) is pending, as a mount
    that does not answer is, and keeps its identity: it starts once that very directory answers there again; the
    rest of the reload applies."""
    if held is None:
        return _resolve_directory_at(host, target, problems, target.directory or "", None)
    try:
        with held.held(keep=False) as fd:
            return _resolve_directory_at(host, target, problems, f"/proc/self/fd/{fd}", held.again())
    except OSError as err:
        why = f"{err.strerror}" if isinstance(err, Refused) else f"cannot be opened: {err.strerror}"
        where = fields(target=target.name, key=target.key, path=held.path)
        log.warning("%s: %s %s: probed once it is there again", target.key, held.path, why, extra=where)
        return _pending(target, target.directory or "", f"{held.path} {why}", held.again())


def _resolve_directory_at(
    host: Host, target: TargetConfig, problems: list[str], where: str, probe_dir: probefile.ProbeDirectory | None
) -> ResolvedTarget | None:
    """_resolve_directory() of the directory at `where`: the configured path, or a held descriptor's
    /proc/self/fd/N with its ProbeDirectory."""
    path = target.directory or ""
    key = f"{target.key}.directory"
    if not os.path.isdir(where):
        problems.append(f"{key}: {path} is not a directory")
        return None
    mount = host.mount_for_path(where)
    if mount and mount.fstype in REFUSED_FILESYSTEMS:
        problems.append(f"{key}: {path} is on {mount.fstype}, {REFUSED_FILESYSTEMS[mount.fstype]}")
        return None
    name = host.device_for_path(where)
    device = host.device(name) if name else None
    # None: an anonymous st_dev (major 0) that no mount source names, as on NFS, CephFS, SMB or FUSE. Probed
    # through its probe file alone: writes and reads both, with no diskstats, throttle or provider statistics.
    if not os.access(where, os.W_OK):
        problems.append(f"{key}: {path} is not writable by this user; the probe file cannot be created")
    if probe_dir is not None:
        # Held by a running target: its files are judged where they are opened, through the descriptor (and
        # prepare() refuses a new one's as it would have here), never by the name of the directory.
        return _resolved_directory(host, target, problems, mount, device, probe_dir)
    try:
        probe_dir = probefile.ProbeDirectory(path, keep=target.hold)
    except OSError as err:
        problems.append(f"{key}: {path} cannot be opened: {err.strerror}")
        return None
    _check_existing_files(target, probe_dir, problems)
    return _resolved_directory(host, target, problems, mount, device, probe_dir)


def _check_existing_files(target: TargetConfig, probe_dir: probefile.ProbeDirectory, problems: list[str]) -> None:
    """The files a directory target's probes write that exist already: each must be volprobe's (only reads)."""
    problem = probefile.check_existing(probe_dir, PROBE_FILE_NAME, target.probe_file_size)
    if problem:
        problems.append(f"{target.key}.probe_file_size: {problem}")
    for probe in target.probes:
        if probe.kind is ops.COMMIT:
            problem = probefile.check_existing(probe_dir, probe.kind.file, target.probe_file_size)
        elif probe.kind is ops.METADATA:
            problem = metadata.check_existing(probe_dir)
        else:
            continue
        if problem:
            problems.append(f"{probe.key}.op: {problem}")


def resolve_pod_volume(host: Host, target: TargetConfig, volume: PodVolume) -> ResolvedTarget:
    """A rule's pod volume resolved as a directory target, by descriptor alone: its mount point is walked by
    open_tree(2) only (privatemount.open_directory, each time it is opened), never by a stat, an access or a
    realpath of its own, so that nothing in flight here (a hung server's) is ever on the kubelet's mount. The
    directory opened must be the mount the table listed (its device number); its writability (faccessat), its
    files (probefile.check_existing) and its identity are asked through the copy, its mount is the table's and
    its device the one sysfs (or the mount's /dev source) names for that number. The ProbeDirectory is known by
    that identity and never kept open (hold: false); nothing is left open when this returns. ConfigError with
    every problem."""
    path = target.directory or volume.path
    key = f"{target.key}.directory"
    mount = volume.mount
    if mount.fstype in REFUSED_FILESYSTEMS:
        raise ConfigError([f"{key}: {path} is on {mount.fstype}, {REFUSED_FILESYSTEMS[mount.fstype]}"])
    try:
        fd = privatemount.open_directory(path)
    except OSError as err:
        raise ConfigError([f"{key}: {path} cannot be opened: {err.strerror}"]) from None
    problems: list[str] = []
    try:
        st, vfs = os.fstat(fd), os.fstatvfs(fd)
        if (os.major(st.st_dev), os.minor(st.st_dev)) != (mount.major, mount.minor):
            raise ConfigError([f"{key}: {path} is no longer the mount of {mount.major}:{mount.minor}"])
        if not os.access(".", os.W_OK, dir_fd=fd):
            problems.append(f"{key}: {path} is not writable by this user; the probe file cannot be created")
    except OSError as err:
        raise ConfigError([f"{key}: {path} cannot be asked: {err.strerror}"]) from None
    finally:
        os.close(fd)
    identity = probefile.DirectoryIdentity(st.st_dev, st.st_ino, vfs.f_fsid)
    probe_dir = probefile.ProbeDirectory(path, identity, keep=False)  # not resolved by name: known by identity
    _check_existing_files(target, probe_dir, problems)
    name = host.name_for_devnum(mount.major, mount.minor)
    if name is None and mount.source.startswith("/dev/"):  # an anonymous st_dev (btrfs): its source names it
        with contextlib.suppress(OSError):
            rdev = os.stat(mount.source).st_rdev
            name = host.name_for_devnum(os.major(rdev), os.minor(rdev))
    device = host.device(name) if name else None
    resolved = _resolved_directory(host, target, problems, mount, device, probe_dir)
    if problems:
        raise ConfigError(problems)
    resolved.name, resolved.pod_volume, resolved.host = volume.path, volume, host
    return resolved


def _resolved_directory(
    host: Host,
    target: TargetConfig,
    problems: list[str],
    mount: Mount | None,
    device: BlockDevice | None,
    probe_dir: probefile.ProbeDirectory,
) -> ResolvedTarget:
    """The directory target found, once its block sizes are checked against where its probes read and write."""
    path = target.directory or ""
    probe_path = os.path.join(probe_dir.path, PROBE_FILE_NAME)
    file_region = target.probe_file_size - probefile.HEADER_BYTES
    for probe in target.probes:
        if device is None:
            # No logical block size to read: O_DIRECT's alignment on such filesystems is the page at most; its
            # reads go to the probe file too.
            alignment = (_PAGE, f"the page size {_PAGE} ({path} has no block device)")
            region = file_region
        else:
            alignment = _device_alignment(device)
            region = file_region if probe.kind.writes else device.size_bytes
        _check_block_sizes((probe,), *alignment, region, problems)
    return ResolvedTarget(
        target,
        target.name or (device.name if device else path),
        "directory",
        path,
        device,
        host.leaf_disks(device.name) if device else [],
        mount,
        probe_path,
        probe_dir,
        reads_probe_file=device is None,
    )


def _resolve_with_deadline(
    host: Host,
    target: TargetConfig,
    problems: list[str],
    checks: mountcheck.Checks,
    timeout: float,
    held: probefile.ProbeDirectory | None = None,
) -> ResolvedTarget | None:
    """A directory resolved in a thread of its own (it may be on a mount that hangs): one that does not answer
    within `timeout` is not refused but pending, probed once its mount answers (runtime.mounts)."""
    path = target.directory or ""
    found: list[str] = []
    try:
        resolved = checks.call(path, lambda: _resolve_directory(host, target, found, held), timeout)
    except mountcheck.Hung as hung:
        where = fields(target=target.name, key=target.key, path=path)
        log.warning("%s: %s does not answer (%s): probed once its mount answers", target.key, path, hung, extra=where)
        return _pending(target, path, str(hung), held.again() if held is not None else None)
    problems += found
    return resolved


def _pending(target: TargetConfig, path: str, why: str, held: probefile.ProbeDirectory | None) -> ResolvedTarget:
    """A directory target waiting for its mount (runtime.mounts): with `held`, the directory a running target held,
    which its mount check asks and its start must recognise (not whatever the name leads to by then)."""
    pending = ResolvedTarget(target, target.name or path, "directory", path, None, [], probe_dir=held, pending=why)
    pending.probe_file = os.path.join(held.path if held is not None else path, PROBE_FILE_NAME)
    return pending


def resolve(
    config: Config,
    host: Host,
    targets: list[TargetConfig] | None = None,
    checks: mountcheck.Checks | None = None,
    held: dict[str, probefile.ProbeDirectory] | None = None,
) -> list[ResolvedTarget]:
    """Resolve the config's targets (or the default set); ConfigError lists every problem. With `checks`, each
    directory is resolved with the deadline of config.mount_check (see _resolve_with_deadline). `held`: the
    directories running targets hold, by configured path, resolved when they started: a reload asks those
    (see _resolve_directory), never the names again."""
    held = held or {}
    chosen = list(config.targets) if targets is None else targets
    if targets is None and config.builtin:
        chosen = default_config_targets(host)
    problems: list[str] = []
    resolved: list[ResolvedTarget] = []
    for target in chosen:
        if target.directory and checks is not None:
            timeout = config.mount_check.timeout
            found = _resolve_with_deadline(host, target, problems, checks, timeout, held.get(target.directory))
        elif target.directory:
            found = _resolve_directory(host, target, problems, held.get(target.directory))
        else:
            found = _resolve_device(host, target, problems)
        if found is not None:
            found.host = host
            resolved.append(found)
    names: dict[str, str] = {}
    for one in resolved:
        if one.name in names:
            problems.append(
                f"{one.config.key}.name: {one.name!r} is also the name of {names[one.name]}; "
                f"give the targets distinct names"
            )
        names[one.name] = one.config.key
    if problems:
        raise ConfigError(problems)
    return resolved


def open_raw_exclusive(host: Host, target: ResolvedTarget, flags: int) -> int:
    """Open the target's device for writing: O_EXCL first (nothing can claim it from then on), then every check
    on what was opened (safety.check_raw_descriptor): the same volume and size as resolved, still blank and
    unclaimed. Refused, with nothing written, otherwise. Run at start and at every reopen."""
    fd = os.open(target.path, flags | os.O_EXCL | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        safety.check_raw_descriptor(host, target.block, fd, target.path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def io_target(host: Host, target: ResolvedTarget, probe: ProbeConfig) -> IOTarget:
    """Where a probe's I/O goes and how its descriptor is (re)opened and checked."""
    flags = probe.open_flags
    if not probe.kind.writes and not target.reads_probe_file:
        # A device target with a raw write probe holds its device open (O_EXCL) anyway: its reads keep their
        # descriptor too, which saves an open and a close per read (a third of a read's CPU) and keeps no
        # administrator out that the write's descriptor did not already.
        held = target.kind == "device" and any(p.kind.writes for p in target.probes)
        return IOTarget(target.block.devnode, flags, 0, target.block.size_bytes, held=held)
    if target.kind == "directory":
        directory, size = target.probe_dir, target.config.probe_file_size
        assert directory is not None
        if probe.kind is ops.METADATA:
            return IOTarget(
                os.path.join(directory.path, metadata.NAME),
                flags,
                0,
                probe.block_size,
                opener=lambda: metadata.open_checked(directory, target.metadata_pin),
                verify=lambda fd: metadata.recheck(directory, fd),
                release=directory.release,
                keep=target.config.hold,
            )
        name = probe.kind.file or PROBE_FILE_NAME  # a commit log, or the probe file
        return IOTarget(
            os.path.join(directory.path, name),
            flags,
            probefile.HEADER_BYTES,
            size,
            opener=lambda: directory.open_file(name, flags, size, target.file_pins.get(name)),
            verify=lambda fd: directory.recheck(fd, name, size),
            release=directory.release,
            keep=target.config.hold,
        )
    return IOTarget(
        target.path,
        flags | os.O_EXCL,
        safety.GUARD_BYTES,
        target.block.size_bytes - safety.GUARD_BYTES,
        opener=lambda: open_raw_exclusive(host, target, flags),
        verify=lambda fd: safety.check_size(fd, target.block.size_bytes, target.path),
    )


def prepare(host: Host, resolved: list[ResolvedTarget], strict: bool = True) -> list[str]:
    """Create probe files and open every descriptor; ConfigError (nothing left open) if any step fails.

    With strict=False (the built-in default targets), a read descriptor that cannot be opened is left to
    the worker, which counts the error and retries with back-off; the problems are returned as warnings.
    """
    warnings: list[str] = []
    problems: list[str] = []
    for target in resolved:
        if not target.pending:  # nothing to open until its mount answers
            problems += _prepare_probes(host, target, target.probes, strict, warnings, whole=True)
    if problems:
        close(resolved)
        raise ConfigError(problems)
    return warnings


@dataclass
class PreparedProbes:
    """What prepare_probes() made for the probes a reload starts on a running target, on a copy of it: the
    running target is left as it is until the reload commits (commit()), or nothing of it stays (close())."""

    running: ResolvedTarget
    trial: ResolvedTarget  # the copy: its read source, pins and descriptors
    probes: list[ProbeConfig]
    warnings: list[str] = field(default_factory=list)

    def commit(self) -> None:
        """The running target takes what was prepared (before its new probes start: targets.io_target reads it)."""
        running, trial = self.running, self.trial
        running.reads_probe_file = trial.reads_probe_file
        running.file_pins.update(trial.file_pins)
        running.metadata_pin = trial.metadata_pin
        for probe in self.probes:
            fd = trial.fds.pop(probe.op, None)
            if fd is not None:
                running.fds[probe.op] = fd

    def close(self) -> None:
        """Close the descriptors prepared and not committed: the running target is left as it was."""
        close_probes(self.trial, self.probes)


def prepare_probes(
    host: Host, target: ResolvedTarget, probes: list[ProbeConfig], strict: bool = True
) -> PreparedProbes:
    """prepare() for the probes a reload starts on a running target (changed or added ones): what they write to
    and their descriptors, with every check of a start. The running target and its probes are left alone: all
    of it is done on a copy, which the running target takes at commit(). ConfigError (nothing of theirs left
    open) if any step fails; PreparedProbes.close() undoes it."""
    trial = dataclasses.replace(target, file_pins=dict(target.file_pins), fds={})
    prepared = PreparedProbes(target, trial, list(probes))
    if target.pending or not probes:
        return prepared
    problems = _prepare_probes(host, trial, probes, strict, prepared.warnings)
    if problems:
        prepared.close()
        raise ConfigError(problems)
    return prepared


def _prepare_probes(
    host: Host,
    target: ResolvedTarget,
    probes: tuple[ProbeConfig, ...] | list[ProbeConfig],
    strict: bool,
    warnings: list[str],
    whole: bool = False,
) -> list[str]:
    """One target's part of prepare(), for `probes` (`whole`: all of the target's, at its start); the problems."""
    if target.kind == "directory":
        # The read source first: a device that cannot be opened sends the reads to the probe file, which must
        # then be made and pinned like a writer's.
        refused = _choose_read_source(target, probes)
        if not refused:
            refused = _prepare_files(target, probes, _wants_probe_file(target, probes, whole))
        if refused:
            return refused
    problems: list[str] = []
    for probe in probes:
        io = io_target(host, target, probe)
        try:
            fd = io.open()  # reads open per probe later; opening now checks access before anything starts
            if probe.kind.writes and io.keep:  # one that keeps nothing opens again at its first probe
                target.fds[probe.op] = fd
            else:
                os.close(fd)
        except OSError as err:
            message = f"{probe.key}: cannot open {io.path}: {err.strerror or err}"
            (warnings if not strict and not probe.kind.writes else problems).append(message)
    return problems


def _wants_probe_file(target: ResolvedTarget, probes: tuple[ProbeConfig, ...] | list[ProbeConfig], whole: bool) -> bool:
    """Whether `probes` need the probe file, once _choose_read_source() has chosen where reads go: the target's
    whole set as needs_probe_file says; some of its probes (a reload's), if they write it or read it."""
    if whole:
        return target.needs_probe_file
    reads = target.reads_probe_file and any(not p.kind.writes for p in probes)
    return reads or any(p.kind.writes and not p.kind.file for p in probes)


def _prepare_files(
    target: ResolvedTarget, probes: tuple[ProbeConfig, ...] | list[ProbeConfig], probe_file: bool
) -> list[str]:
    """Create or check what a directory target's `probes` write to (the probe file if `probe_file`, a commit
    log, the metadata probe's directory) and pin each, unless pinned already; returns the problems. From here the
    directory is held by descriptor for the target's life (let go on EROFS)."""
    directory, size = target.probe_dir, target.config.probe_file_size
    assert directory is not None
    wanted: list[tuple[str, str]] = []  # (key of the problem, file name or "" for the metadata directory)
    if probe_file:
        wanted.append((f"{target.config.key}.directory", PROBE_FILE_NAME))
    wanted += [(f"{p.key}.op", p.kind.file) for p in probes if p.kind.buffered]
    problems = []
    for key, name in wanted:
        if target.metadata_pin if name == metadata.NAME else name in target.file_pins:
            continue  # a running probe's: made and pinned when it started
        try:
            if name == metadata.NAME:
                target.metadata_pin = metadata.ensure(directory)
            else:
                target.file_pins[name] = probefile.ensure(directory, name, size, fill=name == PROBE_FILE_NAME)
        except (probefile.ProbeFileError, OSError) as err:
            why = f"{err.filename} {err.strerror}" if isinstance(err, Refused) else str(err)
            what = "the probe file" if name == PROBE_FILE_NAME else f"{directory.path}/{name}"
            problems.append(f"{key}: cannot prepare {what}: {why}")
    return problems


def _choose_read_source(target: ResolvedTarget, probes: tuple[ProbeConfig, ...] | list[ProbeConfig]) -> list[str]:
    """A directory target's reads go to its device; when the device cannot be opened (a container that does not
    expose it), to the probe file instead, which volprobe wrote whole: the target is still probed, not refused.
    Returns the problems that leaves (a read block larger than the probe file)."""
    reads = [p for p in probes if not p.kind.writes]
    if not reads or target.device is None:
        return []  # without a device, resolve() already sent reads to the probe file
    if not target.reads_probe_file:
        try:
            os.close(os.open(target.device.devnode, os.O_RDONLY | os.O_DIRECT | os.O_NONBLOCK | os.O_CLOEXEC))
            return []
        except OSError as err:
            target.reads_probe_file = True
            log.warning(
                "%s: cannot open %s (%s): its read probes read the probe file %s instead",
                target.name,
                target.device.devnode,
                err.strerror,
                target.probe_file,
                extra=fields(target=target.name, device=target.device_name, path=target.device.devnode),
            )
    size = target.config.probe_file_size - probefile.HEADER_BYTES
    return [
        f"{p.key}.block_size: {p.block_size} is larger than the {size} bytes of the probe file it reads"
        for p in reads
        if p.block_size > size
    ]


def close_probes(target: ResolvedTarget, probes: list[ProbeConfig]) -> None:
    """Close the descriptors opened for `probes` (PreparedProbes.close()) and no worker took."""
    for probe in probes:
        fd = target.fds.pop(probe.op, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def close(resolved: list[ResolvedTarget]) -> None:
    """Close what prepare() opened and let go of the targets' directories."""
    for target in resolved:
        for op in list(target.fds):
            try:
                os.close(target.fds.pop(op))
            except OSError:
                pass
        if target.probe_dir is not None:
            target.probe_dir.release()
