"""The YAML configuration: its keys (declared with volprobe.schema), defaults and validation. Pure: nothing
here touches a device. A new key is one `setting(default, kind, "doc")` field of the dataclass that holds it.

Every error names the key path it is about (`targets[1].probes[0].block_size: ...`), and all errors of a
file are reported together. Checks that need the machine (does the device exist, what is its logical block
size, is it blank) live in targets.py and report with the same key paths.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import ops, schema, stats, units, yamlfile
from .schema import Walker, section, setting

WARMUP_MODES = ("read", "write")
WARMUP_POLICIES = ("new", "all")
DISKSTATS_SCOPES = ("probed", "all")
NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
PROBE_FILE_NAME = ".volprobe-probe"
POD_PROBE_FILE_SIZE = 4 * 1024**2  # kubernetes.rules' probe files: small, in someone else's volume
BUILTIN = "<built-in default>"


class ConfigError(Exception):
    """One or more problems, each `key.path: message`; `source`: the file they are of, where the problems do not
    name it themselves (command.report names it)."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
        self.source = source


def _op(value: Any) -> str:
    """An op's name, as ops.py knows them."""
    try:
        return ops.get(value).name
    except (ValueError, TypeError):
        raise ValueError(f"{value!r} is not one of {', '.join(ops.NAMES)}") from None


def _buckets(value: Any) -> tuple[float, ...]:
    if value == "legacy":
        return stats.LEGACY_BUCKETS
    if not isinstance(value, list):
        raise ValueError("must be a list of durations, e.g. [100us, 1ms, 10ms], or legacy")
    return stats.validate_buckets(units.parse_duration(v) for v in value)


OP = schema.Kind(" \\| ".join(f"`{n}`" for n in ops.NAMES), _op, ops.NAMES, ("trim", "", 5, None, True))
NAME = schema.name_kind(NAME_RE, "letters, digits, '_', '.', ':', '-'; at most 64")
BUCKETS = schema.Kind(
    "durations, or `legacy`",
    _buckets,
    ("legacy", ["1ms", "10ms", "100ms"]),
    ("x", ["1ms", "1ms"], [-1], [5]),
    lambda b: f"{len(b)} from {units.format_duration(b[0])} to {units.format_duration(b[-1])}",
)


@dataclass(frozen=True)
class ProbeConfig:
    """One probe. Unset fields take the op's defaults: its block size, and O_DSYNC for writes."""

    op: str = setting(schema.REQUIRED, OP, "what the probe does")
    block_size: int = setting(
        0,
        schema.POSITIVE_SIZE,
        "bytes per request (metadata: written to its file)",
        shown="the op's: 4KiB read, 8KiB write, 2300 commit, 4KiB metadata",
    )
    interval: float = setting(1.0, schema.POSITIVE_DURATION, "time between two probes")
    sync: bool | None = setting(
        None,
        schema.BOOLEAN,
        "writes: O_DSYNC (reads: false only; commit and metadata always sync: true only)",
        shown="true for writes",
    )
    jitter: float = setting(0.1, schema.RATIO, "fraction of the interval each probe is randomly delayed by")
    revisit: float = setting(0.25, schema.RATIO, "fraction of probes sent to offsets probed before")
    hold_open: bool = setting(
        False, schema.BOOLEAN, "reads: keep the device open between probes (writes do, and reads beside a raw write)"
    )
    key: str = ""  # where it sits in the config file, for error messages

    def __post_init__(self) -> None:
        kind = ops.get(self.op)
        if not self.block_size:
            object.__setattr__(self, "block_size", kind.default_block_size)
        object.__setattr__(self, "sync", kind.writes if self.sync is None else bool(self.sync and kind.writes))

    @property
    def kind(self) -> ops.Op:
        return ops.OPS[self.op]

    @property
    def open_flags(self) -> int:
        return self.kind.open_flags(bool(self.sync))


@dataclass(frozen=True)
class Limits:
    iops: float | None = setting(None, schema.POSITIVE_NUMBER, "at most this many probe requests a second")
    bandwidth: float | None = setting(None, schema.POSITIVE_SIZE, "at most this many probe bytes a second")


@dataclass(frozen=True)
class WarmupConfig:
    mode: str = setting("read", schema.choice(WARMUP_MODES), "read every block once, or write it (raw only)")
    rate: float | None = setting(None, schema.POSITIVE_SIZE, "bytes per second; unset: unlimited")
    jobs: int = setting(4, schema.POSITIVE_INT, "requests in flight")
    block_size: int = setting(1024**2, schema.POSITIVE_SIZE, "bytes per request")
    idle_priority: bool = setting(True, schema.BOOLEAN, "run in the idle I/O scheduling class")


@dataclass(frozen=True)
class TargetConfig:
    key: str
    name: str | None = setting(None, NAME, "the target label; unset: the path")
    device: str | None = setting(None, schema.ABSOLUTE_PATH, "a block device (or a directory, not both)")
    directory: str | None = setting(None, schema.ABSOLUTE_PATH, "a directory: probes go to a probe file in it")
    probe_file_size: int = setting(
        64 * 1024**2, schema.POSITIVE_SIZE, "directories: size of the probe file (and of a commit probe's log)"
    )
    allow_raw_writes: bool = setting(False, schema.BOOLEAN, "devices: allow write probes or a write warm-up")
    probes: tuple[ProbeConfig, ...] = section(
        ProbeConfig,
        "unset: a read on a device; a sync write and a read in a directory (commit and metadata: opt-in)",
        default=(),
        many=True,
    )
    limits: Limits = section(Limits, "caps on the probes' own load")
    warmup: WarmupConfig | None = section(WarmupConfig, "read (or write) every block once, then probe", default=None)
    # False (a pod volume's, runtime.pods): nothing held open between probes, neither its directory nor a probe's
    # file; each probe opens and checks them on the descriptor, probes, and closes them (probe.ProbeWorker).
    hold: bool = True

    @property
    def path(self) -> str:
        return self.device or self.directory or ""

    @property
    def kind(self) -> str:
        return "directory" if self.directory else "device"

    @property
    def writes(self) -> bool:
        """Whether anything writes to the target: a write probe, or a warm-up in write mode."""
        return any(p.kind.writes for p in self.probes) or bool(self.warmup and self.warmup.mode == "write")


@dataclass(frozen=True)
class Defaults:
    """The `defaults:` section: settings of the whole file, and defaults of every probe and target."""

    interval: float | None = schema.inherited(ProbeConfig, "interval", "every probe's interval (1s)")
    jitter: float | None = schema.inherited(ProbeConfig, "jitter", "every probe's jitter (0.1)")
    revisit: float | None = schema.inherited(ProbeConfig, "revisit", "every probe's revisit (0.25)")
    probe_file_size: int | None = schema.inherited(
        TargetConfig, "probe_file_size", "every directory target's probe file size (64MiB)"
    )
    window: float = setting(300.0, schema.POSITIVE_DURATION, "window of the exported quantiles")
    buckets: tuple[float, ...] = setting(stats.DEFAULT_BUCKETS, BUCKETS, "latency histogram bucket bounds")
    histogram_by_touch: bool = setting(False, schema.BOOLEAN, "the touch label on the histogram too (2x series)")

    def probe(self) -> dict[str, Any]:
        """What it sets of every probe's keys."""
        chosen = {"interval": self.interval, "jitter": self.jitter, "revisit": self.revisit}
        return {name: value for name, value in chosen.items() if value is not None}


@dataclass(frozen=True)
class ThrottleConfig:
    enabled: bool = setting(True, schema.BOOLEAN, "detect throttling plateaus")
    sample_interval: float = setting(
        1.0,
        schema.POSITIVE_DURATION,
        "how often /proc/diskstats is sampled (up to 5 times less often while every followed disk is idle)",
    )
    window: float = setting(60.0, schema.POSITIVE_DURATION, "samples judged together (at least 10)")
    backoff: float = setting(10.0, schema.POSITIVE_NUMBER, "probes run this much slower while throttled; 1: off")


@dataclass(frozen=True)
class MountCheckConfig:
    """`mount_check`: every directory target's mount is asked (statfs and a stat of the directory) in a thread
    of its own; one that does not answer within `timeout` is reported hung (volprobe_mount_responsive 0)."""

    interval: float = setting(5.0, schema.POSITIVE_DURATION, "how often each directory target's mount is asked")
    timeout: float = setting(10.0, schema.POSITIVE_DURATION, "a mount that has not answered this long is hung")


@dataclass(frozen=True)
class DiscoveryWarmupConfig:
    """`discovery.warmup`: read every block of discovered devices once. `policy` "new" warms the devices that
    appear after the exporter started (and resumes warm-ups a restart interrupted); "all" every matching device.
    A volume is warmed once: its state remembers it by identity."""

    warmup: WarmupConfig = schema.inline(WarmupConfig, "the warm-up's own keys")
    policy: str = setting("new", schema.choice(WARMUP_POLICIES), "devices that appear after start, or all")
    max_concurrent: int = setting(2, schema.POSITIVE_INT, "devices warmed at once")


@dataclass(frozen=True)
class DiscoveryConfig:
    include: tuple[str, ...] = setting((), schema.REGEXES, "device names to probe; empty: every whole disk")
    exclude: tuple[str, ...] = setting((), schema.REGEXES, "device names never probed")
    probes: tuple[ProbeConfig, ...] = section(
        ProbeConfig,
        "probes of each discovered device (reads only)",
        default=tuple(ProbeConfig(op.name) for op in ops.DEVICE_DEFAULTS),
        many=True,
    )
    rescan_interval: float = setting(5.0, schema.POSITIVE_DURATION, "how often devices are listed again")
    warmup: DiscoveryWarmupConfig | None = section(
        DiscoveryWarmupConfig, "warm discovered devices once each", default=None
    )


def _regex(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{value!r} is not a regular expression (a non-empty string)")
    try:
        re.compile(value)
    except re.error as err:
        raise ValueError(f"{value!r} is not a regular expression: {err}") from None
    return value


def _glob(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"{value!r} is not a glob of absolute paths (e.g. /var/lib/kubelet/pods/*/volumes/*/pvc-*)")
    return value


def _driver(value: Any) -> str:
    if not isinstance(value, str) or not value or not value.isprintable():
        raise ValueError(f"{value!r} is not a driver's name (e.g. efs.csi.aws.com, kubernetes.io/nfs)")
    return value


REGEX = schema.Kind("regular expression", _regex, ("pvc-.*", "pv-db-[0-9]+"), ("pvc-[", "", 5, ["x"]))
GLOB = schema.Kind("glob of absolute paths", _glob, ("/var/lib/kubelet/pods/*/volumes/*/pvc-*",), ("pods/*", "", 5))
DRIVER = schema.Kind("string", _driver, ("efs.csi.aws.com", "kubernetes.io/nfs"), ("", 5, True, ["x"]))


@dataclass(frozen=True)
class PodVolumeRule:
    """One of `kubernetes.rules`: the pod volumes it matches (every criterion written must match; at least one is)
    may take its probes, writes included, into a probe file of `probe_file_size` in the volume. The first rule that
    matches a volume is its."""

    driver: str | None = setting(None, DRIVER, "the CSI driver (vol_data.json's driverName) or in-tree plugin, exact")
    pv: str | None = setting(
        None,
        REGEX,
        "the PersistentVolume's name, as the kubelet recorded it (never an inline volume's): a regular expression, "
        "matched whole",
    )
    path: str | None = setting(None, GLOB, "the volume's mount point: a glob (fnmatch: `*` matches `/` too)")
    probe_file_size: int = setting(
        POD_PROBE_FILE_SIZE, schema.POSITIVE_SIZE, "size of the probe file written in the volume (and of a commit log)"
    )
    probes: tuple[ProbeConfig, ...] = section(
        ProbeConfig,
        "the probes of each matching volume; unset: a sync write and a read (commit and metadata: opt-in)",
        default=(),
        many=True,
    )
    key: str = ""  # where it sits in the config file

    def matches(self, driver: str, pv: str, path: str) -> bool:
        """Whether a pod volume of that driver, PV name and mount point is this rule's. A volume that is no
        PersistentVolume (pv "": an inline ephemeral one) never matches a rule with `pv`, whatever it allows."""
        return (
            (self.driver is None or self.driver == driver)
            and (self.pv is None or (pv != "" and re.fullmatch(self.pv, pv) is not None))
            and (self.path is None or fnmatch.fnmatchcase(path, self.path))
        )


@dataclass(frozen=True)
class KubernetesConfig:
    """`kubernetes`: the pod volumes the node's kubelet mounted (volprobe.kubelet), followed as they come and go.
    A block-backed one is its disk's (discovery's reads, with its pv); a network or FUSE filesystem gets the mount
    check alone, which holds nothing open between checks. Nothing is written into a pod volume unless one of
    `rules` matches it: then it takes that rule's probes, holding nothing open between them either."""

    enabled: bool | None = setting(
        None, schema.BOOLEAN, "follow the pod volumes", shown="true while kubelet_directory exists"
    )
    kubelet_directory: str = setting(
        "/var/lib/kubelet",
        schema.ABSOLUTE_PATH,
        "the kubelet's root directory, as the node's mount table names it (mount it at that path in a container)",
    )
    rescan_interval: float | None = setting(
        None,
        schema.POSITIVE_DURATION,
        "how often the mount table is read for pod volumes that came or went",
        shown="discovery.rescan_interval (5s)",
    )
    rules: tuple[PodVolumeRule, ...] = section(
        PodVolumeRule,
        "the pod volumes that may take probes, writes included (none unless a rule says so)",
        default=(),
        many=True,
    )

    def rule_for(self, driver: str, pv: str, path: str) -> PodVolumeRule | None:
        """The first rule matching a pod volume, or None: the volume is then only checked, never written."""
        return next((rule for rule in self.rules if rule.matches(driver, pv, path)), None)


@dataclass(frozen=True)
class Config:
    defaults: Defaults = section(Defaults, "settings of the whole file, defaults of every probe and target")
    targets: tuple[TargetConfig, ...] = section(
        TargetConfig, "the devices and directories probed", default=(), many=True
    )
    diskstats: str = setting(
        "probed", schema.choice(DISKSTATS_SCOPES), "/proc/diskstats series: probed devices, or all"
    )
    throttle: ThrottleConfig = section(ThrottleConfig, "throttling plateau detection")
    mount_check: MountCheckConfig = section(MountCheckConfig, "directory targets: does their mount answer")
    discovery: DiscoveryConfig | None = section(DiscoveryConfig, "probe the devices found, as they come", default=None)
    kubernetes: KubernetesConfig = section(
        KubernetesConfig, "pod volumes: labels and mount checks; probes, writes included, only where a rule says"
    )
    state_directory: str | None = setting(None, schema.ABSOLUTE_PATH, "where offsets and warm-ups are remembered")
    window: float = Defaults.window  # defaults.window, defaults.buckets, defaults.histogram_by_touch
    buckets: tuple[float, ...] = Defaults.buckets
    histogram_by_touch: bool = Defaults.histogram_by_touch
    source: str = "<default>"

    @property
    def pod_volume_interval(self) -> float:
        """How often pod volumes are looked for: kubernetes.rescan_interval, else discovery's."""
        if self.kubernetes.rescan_interval is not None:
            return self.kubernetes.rescan_interval
        return (self.discovery or DiscoveryConfig()).rescan_interval

    @property
    def builtin(self) -> bool:
        """No configuration and no --target: volprobe probes every whole disk of the machine, read-only."""
        return self.source == BUILTIN


key_path = schema.key_path
_join = key_path


def _probe(check: Walker, raw: Any, key: str, defaults: Defaults) -> ProbeConfig | None:
    values, data = check.read(ProbeConfig, raw, key)
    if not isinstance(raw, Mapping):
        return None
    if data.get("op") is None:  # null too: a probe of no op would be dropped without a word
        check.fail(_join(key, "op"), f"is required ({' or '.join(ops.NAMES)})")
        return None
    if "op" not in values:
        return None
    if not ops.get(values["op"]).writes and data.get("sync") is True:
        check.fail(_join(key, "sync"), "only applies to write probes")
    if ops.get(values["op"]).buffered and data.get("sync") is False:
        check.fail(_join(key, "sync"), f"{values['op']} probes always sync (fdatasync, fsync): that is what they time")
    if ops.get(values["op"]).writes and data.get("hold_open") is False:
        # One descriptor, checked when it was opened (and on a raw device holding O_EXCL), serves every request.
        check.fail(_join(key, "hold_open"), f"{values['op']} probes always keep their descriptor open")
    return ProbeConfig(**{**defaults.probe(), **values, "key": key})


def _probes(check: Walker, raw: Any, key: str, defaults: Defaults) -> tuple[ProbeConfig, ...]:
    if not isinstance(raw, list) or not raw:
        check.fail(key, "must be a non-empty list of probes")
        return ()
    probes: list[ProbeConfig] = []
    for index, item in enumerate(raw):
        probe = _probe(check, item, f"{key}[{index}]", defaults)
        if probe is None:
            continue
        if any(p.op == probe.op for p in probes):
            check.fail(f"{key}[{index}].op", f"a second {probe.op} probe on the same target (their series collide)")
            continue
        probes.append(probe)
    return tuple(probes)


def default_probes(kind: str, defaults: Defaults | None = None, key: str = "") -> tuple[ProbeConfig, ...]:
    """Probes of a target that names none: reads on a device, a sync write and a read in a directory."""
    overrides = defaults.probe() if defaults else {}
    kinds = ops.DIRECTORY_DEFAULTS if kind == "directory" else ops.DEVICE_DEFAULTS
    return tuple(ProbeConfig(op.name, **overrides, key=f"{key}[{i}]") for i, op in enumerate(kinds))


def _target(check: Walker, raw: Any, key: str, defaults: Defaults) -> TargetConfig | None:
    if not isinstance(raw, Mapping):
        check.fail(key, f"must be a mapping, got {type(raw).__name__}")
        return None
    values, written = check.read(TargetConfig, raw, key)
    data = {name: value for name, value in written.items() if value is not None}  # null: as if not written
    if "device" in data and "directory" in data:
        check.fail(key, "has both device and directory; a target is one or the other")
    elif "device" not in data and "directory" not in data:
        check.fail(key, "needs a device or a directory")
    kind = "directory" if "directory" in data else "device"
    if "probes" in written:
        probes = _probes(check, written["probes"], _join(key, "probes"), defaults)
    else:
        probes = default_probes(kind, defaults, _join(key, "probes"))
    if kind == "directory" and "allow_raw_writes" in data:
        check.fail(_join(key, "allow_raw_writes"), "only applies to device targets")
    if kind == "device" and "probe_file_size" in data:
        check.fail(_join(key, "probe_file_size"), "only applies to directory targets")
    if kind == "directory" and "probe_file_size" not in values and defaults.probe_file_size:
        values["probe_file_size"] = defaults.probe_file_size
    warmup = check.build(WarmupConfig, written["warmup"], _join(key, "warmup")) if "warmup" in written else None
    target = TargetConfig(
        key=key,
        probes=probes,
        limits=check.build(Limits, data.get("limits"), _join(key, "limits")),
        warmup=warmup,
        **values,
    )
    for probe in probes:
        if kind == "device" and probe.kind.directory_only:
            check.fail(
                _join(probe.key, "op"),
                f"{probe.op} probes need a directory target: they time a filesystem's "
                f"{'commit (write + fdatasync) in a log file' if probe.kind is ops.COMMIT else 'file operations'}, "
                "and a device has none",
            )
            continue
        in_file = probe.kind.writes and probe.kind.offsets != "none"  # a metadata sequence's file is its own
        if kind == "directory" and in_file and probe.block_size > target.probe_file_size // 2:
            check.fail(
                _join(probe.key, "block_size"),
                f"{probe.block_size} leaves no room in a {target.probe_file_size}-byte probe file",
            )
        if kind == "device" and probe.kind.writes and not target.allow_raw_writes:
            check.fail(
                _join(probe.key, "op"),
                "write probes on a raw device need allow_raw_writes: true on the target "
                "(or use a directory target: writes then go to a probe file)",
            )
    if warmup is not None and kind == "directory":
        check.fail(_join(key, "warmup"), "warm-up reads a whole device; give it a device target")
    if warmup is not None and warmup.mode == "write" and not target.allow_raw_writes:
        check.fail(_join(_join(key, "warmup"), "mode"), "write warm-up needs allow_raw_writes: true on the target")
    if warmup is not None and warmup.mode == "write" and any(p.kind.writes for p in probes):
        # Both hold the device with O_EXCL: the warm-up could never open it while the write probes run.
        check.fail(
            _join(_join(key, "warmup"), "mode"),
            "a write warm-up and write probes cannot share a device (each holds it exclusively): "
            "use mode: read, or warm it with `volprobe warmup --write` before adding the write probes",
        )
    return target


def _rule(check: Walker, raw: Any, key: str, defaults: Defaults) -> PodVolumeRule | None:
    """One of kubernetes.rules: its probes checked as a directory target's are (probe._probes), against its probe
    file's size."""
    if not isinstance(raw, Mapping):
        check.fail(key, f"must be a mapping, got {type(raw).__name__}")
        return None
    values, data = check.read(PodVolumeRule, raw, key)
    if not any(data.get(name) is not None for name in ("driver", "pv", "path")):
        check.fail(key, "matches every pod volume: name a driver, pv or path")
    if "probes" in data and data["probes"] is not None:
        probes = _probes(check, data["probes"], _join(key, "probes"), defaults)
    else:
        probes = default_probes("directory", defaults, _join(key, "probes"))
    size = values.get("probe_file_size", POD_PROBE_FILE_SIZE)
    for probe in probes:
        if probe.kind.writes and probe.kind.offsets != "none" and probe.block_size > size // 2:
            check.fail(_join(probe.key, "block_size"), f"{probe.block_size} leaves no room in a {size}-byte probe file")
        if probe.interval * 2 > defaults.window:
            check.fail("defaults.window", f"{defaults.window}s holds fewer than two probes of {probe.key}")
    return PodVolumeRule(probes=probes, key=key, **values)


def _kubernetes(check: Walker, raw: Any, defaults: Defaults) -> KubernetesConfig:
    values, data = check.read(KubernetesConfig, raw, "kubernetes")
    rules: list[PodVolumeRule] = []
    if data.get("rules") is not None:
        if not isinstance(data["rules"], list):
            check.fail("kubernetes.rules", f"must be a list, got {type(data['rules']).__name__}")
        else:
            for index, item in enumerate(data["rules"]):
                rule = _rule(check, item, f"kubernetes.rules[{index}]", defaults)
                if rule is not None:
                    rules.append(rule)
    return KubernetesConfig(rules=tuple(rules), **values)


def _throttle(check: Walker, raw: Any) -> ThrottleConfig:
    result = check.build(ThrottleConfig, raw, "throttle")
    if result.backoff < 1:
        check.fail("throttle.backoff", f"{result.backoff} would speed probes up; use 1 to disable the back-off")
    if result.window < 10 * result.sample_interval:
        check.fail("throttle.window", "must hold at least 10 samples (window >= 10 x sample_interval)")
    return result


def _mount_check(check: Walker, raw: Any) -> MountCheckConfig:
    result = check.build(MountCheckConfig, raw, "mount_check")
    if result.timeout > 3600:
        check.fail("mount_check.timeout", f"{result.timeout:g}s: a mount silent for an hour is long hung; at most 1h")
    return result


def _discovery(check: Walker, raw: Any, defaults: Defaults) -> DiscoveryConfig:
    values, data = check.read(DiscoveryConfig, raw, "discovery")
    probes = (
        _probes(check, data["probes"], "discovery.probes", defaults)
        if "probes" in data
        else default_probes("device", defaults, "discovery.probes")
    )
    for probe in probes:
        if probe.kind.writes:
            check.fail(_join(probe.key, "op"), "discovered devices are only ever probed with reads")
    warmup = None
    if data.get("warmup") is not None:
        warmup = check.build(DiscoveryWarmupConfig, data["warmup"], "discovery.warmup")
        if warmup.warmup.mode != "read":
            check.fail("discovery.warmup.mode", "discovered devices are only ever read: warm-up mode must be read")
    return DiscoveryConfig(probes=probes, warmup=warmup, **values)


def parse(document: Any, source: str = "<config>") -> Config:
    """Validate a loaded YAML document; raise ConfigError with every problem found, and nothing else: an
    exception of a check that did not foresee a value is a problem too, of the key looked at when it escaped."""
    check = Walker()
    try:
        return _parse(check, document, source)
    except ConfigError:
        raise
    except Exception as err:  # the boundary: whatever the document holds, the answer is a ConfigError
        check.fail(check.at or source, schema.failure(err))
        raise ConfigError(check.problems) from None


def _parse(check: Walker, document: Any, source: str) -> Config:
    if document is None:
        document = {}
    values, top = check.read(Config, document, "", named="" if isinstance(document, Mapping) else source)
    defaults = check.build(Defaults, top.get("defaults"), "defaults")
    window = defaults.window

    targets: list[TargetConfig] = []
    raw_targets = top.get("targets", [])
    if raw_targets is None:
        raw_targets = []
    if not isinstance(raw_targets, list):
        check.fail("targets", f"must be a list, got {type(raw_targets).__name__}")
        raw_targets = []
    for index, raw in enumerate(raw_targets):
        target = _target(check, raw, f"targets[{index}]", defaults)
        if target is not None:
            targets.append(target)
    seen: dict[str, str] = {}
    for target in targets:
        for label, what in ((target.name, "name"), (target.path, "path")):
            if label and label in seen:
                check.fail(f"{target.key}.{what}", f"{label!r} is already used by {seen[label]}")
            if label:
                seen[label] = target.key
    for target in targets:
        if target.probes and any(p.interval * 2 > window for p in target.probes):
            check.fail("defaults.window", f"{window}s holds fewer than two probes of {target.key}")
            break

    result = Config(
        defaults=defaults,
        targets=tuple(targets),
        throttle=_throttle(check, top.get("throttle")),
        mount_check=_mount_check(check, top.get("mount_check")),
        discovery=_discovery(check, top["discovery"], defaults) if "discovery" in top else None,
        kubernetes=_kubernetes(check, top.get("kubernetes"), defaults),
        window=window,
        buckets=defaults.buckets,
        histogram_by_touch=defaults.histogram_by_touch,
        source=source,
        **values,
    )
    if check.problems:
        raise ConfigError(check.problems)
    return result


def load(path: str | Path) -> Config:
    """Read and validate a YAML file (yamlfile: bounded size and nesting, UTF-8). Every problem, whatever
    the file holds, is a ConfigError that names the file."""
    path = Path(path)
    try:
        text, _ = yamlfile.read(str(path))
    except OSError as err:
        raise ConfigError([f"{path}: cannot read: {err.strerror or err}"]) from None
    except ValueError as err:
        raise ConfigError([f"{path}: {err}"]) from None
    try:
        document = yaml.load(text, Loader=yamlfile.Loader)
    except yaml.YAMLError as err:
        raise ConfigError([f"{path}: {yamlfile.describe(err)}"]) from None
    except Exception as err:  # yamlfile.Loader leaves none; should one come, it is a refusal all the same
        raise ConfigError([f"{path}: {schema.failure(err)}"]) from None
    try:
        return parse(document, source=str(path))
    except ConfigError as err:
        err.source = str(path)
        raise


def from_paths(paths: list[str], is_directory: Callable[[str], bool]) -> Config:
    """A config made of `--target PATH` flags: default probes on each device or directory (as is_directory
    tells: mountcheck.is_directory, which asks with a deadline)."""
    check = Walker()
    targets = []
    for index, path in enumerate(paths):
        key = f"--target[{index}]"
        raw: dict[str, Any] = {"directory" if is_directory(path) else "device": path}
        target = _target(check, raw, key, Defaults())
        if target is not None:
            targets.append(target)
    if check.problems:
        raise ConfigError(check.problems)
    return Config(targets=tuple(targets), source="--target" if paths else BUILTIN)
