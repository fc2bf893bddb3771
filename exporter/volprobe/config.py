"""The YAML configuration: schema, defaults and validation. Pure: nothing here touches a device.

Every error names the key path it is about (`targets[1].probes[0].block_size: ...`), and all errors of a
file are reported together. Checks that need the machine (does the device exist, what is its logical block
size, is it blank) live in targets.py and report with the same key paths.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import stats, units

OPS = ("read", "write")
WARMUP_MODES = ("read", "write")
DISKSTATS_SCOPES = ("probed", "all")
NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

DEFAULT_INTERVAL = 1.0
DEFAULT_WINDOW = 300.0
DEFAULT_JITTER = 0.1
DEFAULT_REVISIT = 0.25
DEFAULT_PROBE_FILE_SIZE = 64 * 1024**2
DEFAULT_BLOCK_SIZE = {"read": 4096, "write": 8192}
PROBE_FILE_NAME = ".volprobe-probe"
BUILTIN = "<built-in default>"


class ConfigError(Exception):
    """One or more problems, each `key.path: message`."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ProbeConfig:
    op: str
    block_size: int
    interval: float
    sync: bool
    jitter: float
    revisit: float
    key: str = ""


@dataclass(frozen=True)
class Limits:
    iops: float | None = None
    bandwidth: float | None = None


@dataclass(frozen=True)
class WarmupConfig:
    mode: str = "read"
    rate: float | None = None  # bytes per second; None is unlimited
    jobs: int = 4
    block_size: int = 1024**2
    idle_priority: bool = True


@dataclass(frozen=True)
class TargetConfig:
    key: str
    name: str | None
    device: str | None
    directory: str | None
    probe_file_size: int
    allow_raw_writes: bool
    probes: tuple[ProbeConfig, ...]
    limits: Limits = field(default_factory=Limits)
    warmup: WarmupConfig | None = None

    @property
    def path(self) -> str:
        return self.device or self.directory or ""


@dataclass(frozen=True)
class ThrottleConfig:
    enabled: bool = True
    sample_interval: float = 1.0
    window: float = 60.0
    backoff: float = 10.0  # probes run this many times slower while their device is throttled; 1 disables


@dataclass(frozen=True)
class DiscoveryConfig:
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    probes: tuple[ProbeConfig, ...] = ()
    rescan_interval: float = 5.0


@dataclass(frozen=True)
class Config:
    targets: tuple[TargetConfig, ...]
    window: float = DEFAULT_WINDOW
    buckets: tuple[float, ...] = stats.DEFAULT_BUCKETS
    diskstats: str = "probed"
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    discovery: DiscoveryConfig | None = None
    state_directory: str | None = None
    source: str = "<default>"

    @property
    def builtin(self) -> bool:
        """No configuration and no --target: volprobe probes every whole disk of the machine, read-only."""
        return self.source == BUILTIN


class _Checker:
    """Collects problems while walking the YAML tree."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, key: str, message: str) -> None:
        self.problems.append(f"{key}: {message}" if key else message)

    def mapping(self, value: Any, key: str, allowed: set[str]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.fail(key, f"must be a mapping, got {type(value).__name__}")
            return {}
        for name in value:
            if name not in allowed:
                hint = ", ".join(sorted(allowed))
                self.fail(_join(key, str(name)), f"unknown key (expected one of: {hint})")
        return dict(value)

    def convert(self, data: Mapping[str, Any], name: str, key: str, parse: Callable[[Any], Any], default: Any):
        if name not in data or data[name] is None:
            return default
        try:
            return parse(data[name])
        except (ValueError, TypeError) as err:
            self.fail(_join(key, name), str(err))
            return default


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _positive_duration(value: Any) -> float:
    seconds = units.parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"{value!r} must be longer than zero")
    return seconds


def _positive_size(value: Any) -> int:
    size = units.parse_size(value)
    if size <= 0:
        raise ValueError(f"{value!r} must be larger than zero")
    return size


def _ratio(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{value!r} is not a number between 0 and 1")
    if not 0 <= value <= 1:
        raise ValueError(f"{value} is outside 0..1")
    return float(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in options:
            raise ValueError(f"{value!r} is not one of {', '.join(options)}")
        return value

    return parse


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{value!r} is not a positive integer")
    return value


def _positive_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{value!r} is not a positive number")
    return float(value)


def _name(value: Any) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ValueError(f"{value!r} is not a valid name (letters, digits, '_', '.', ':', '-'; at most 64)")
    return value


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path")
    return value


def _string_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("must be a list of regular expressions")
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"{pattern!r} is not a regular expression: {err}") from None
    return tuple(value)


_PROBE_KEYS = {"op", "block_size", "interval", "sync", "jitter", "revisit"}
_DEFAULT_KEYS = {"interval", "window", "jitter", "revisit", "buckets", "probe_file_size"}
_TARGET_KEYS = {
    "name",
    "device",
    "directory",
    "probe_file_size",
    "allow_raw_writes",
    "probes",
    "limits",
    "warmup",
}
_TOP_KEYS = {"defaults", "targets", "diskstats", "throttle", "discovery", "state_directory"}


@dataclass(frozen=True)
class _Defaults:
    interval: float = DEFAULT_INTERVAL
    jitter: float = DEFAULT_JITTER
    revisit: float = DEFAULT_REVISIT
    probe_file_size: int = DEFAULT_PROBE_FILE_SIZE


def _probe(check: _Checker, raw: Any, key: str, defaults: _Defaults) -> ProbeConfig | None:
    data = check.mapping(raw, key, _PROBE_KEYS)
    if not isinstance(raw, Mapping):
        return None
    if "op" not in data:
        check.fail(_join(key, "op"), "is required (read or write)")
        return None
    op = check.convert(data, "op", key, _choice(OPS), None)
    if op is None:
        return None
    sync_default = op == "write"
    sync = check.convert(data, "sync", key, _bool, sync_default)
    if op == "read" and data.get("sync") is True:
        check.fail(_join(key, "sync"), "only applies to write probes")
    return ProbeConfig(
        op=op,
        block_size=check.convert(data, "block_size", key, _positive_size, DEFAULT_BLOCK_SIZE[op]),
        interval=check.convert(data, "interval", key, _positive_duration, defaults.interval),
        sync=sync,
        jitter=check.convert(data, "jitter", key, _ratio, defaults.jitter),
        revisit=check.convert(data, "revisit", key, _ratio, defaults.revisit),
        key=key,
    )


def _probes(check: _Checker, raw: Any, key: str, defaults: _Defaults) -> tuple[ProbeConfig, ...]:
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


def _limits(check: _Checker, raw: Any, key: str) -> Limits:
    data = check.mapping(raw, key, {"iops", "bandwidth"})
    return Limits(
        iops=check.convert(data, "iops", key, _positive_number, None),
        bandwidth=check.convert(data, "bandwidth", key, _positive_size, None),
    )


def _warmup(check: _Checker, raw: Any, key: str) -> WarmupConfig:
    data = check.mapping(raw, key, {"mode", "rate", "jobs", "block_size", "idle_priority"})
    return WarmupConfig(
        mode=check.convert(data, "mode", key, _choice(WARMUP_MODES), "read"),
        rate=check.convert(data, "rate", key, _positive_size, None),
        jobs=check.convert(data, "jobs", key, _positive_int, 4),
        block_size=check.convert(data, "block_size", key, _positive_size, 1024**2),
        idle_priority=check.convert(data, "idle_priority", key, _bool, True),
    )


def default_probes(kind: str, defaults: _Defaults | None = None, key: str = "") -> tuple[ProbeConfig, ...]:
    """Probes of a target that names none: reads on a device, a sync write and a read in a directory."""
    d = defaults or _Defaults()
    ops = ("write", "read") if kind == "directory" else ("read",)
    return tuple(
        ProbeConfig(op, DEFAULT_BLOCK_SIZE[op], d.interval, op == "write", d.jitter, d.revisit, f"{key}[{i}]")
        for i, op in enumerate(ops)
    )


def _target(check: _Checker, raw: Any, key: str, defaults: _Defaults) -> TargetConfig | None:
    if not isinstance(raw, Mapping):
        check.fail(key, f"must be a mapping, got {type(raw).__name__}")
        return None
    data = check.mapping(raw, key, _TARGET_KEYS)
    device = check.convert(data, "device", key, _path, None)
    directory = check.convert(data, "directory", key, _path, None)
    if "device" in data and "directory" in data:
        check.fail(key, "has both device and directory; a target is one or the other")
    elif "device" not in data and "directory" not in data:
        check.fail(key, "needs a device or a directory")
    kind = "directory" if "directory" in data else "device"
    if "probes" in data:
        probes = _probes(check, data["probes"], _join(key, "probes"), defaults)
    else:
        probes = default_probes(kind, defaults, _join(key, "probes"))
    allow_raw = check.convert(data, "allow_raw_writes", key, _bool, False)
    if kind == "directory" and "allow_raw_writes" in data:
        check.fail(_join(key, "allow_raw_writes"), "only applies to device targets")
    size = check.convert(data, "probe_file_size", key, _positive_size, defaults.probe_file_size)
    if kind == "device" and "probe_file_size" in data:
        check.fail(_join(key, "probe_file_size"), "only applies to directory targets")
    for probe in probes:
        if kind == "directory" and probe.op == "write" and probe.block_size > size // 2:
            check.fail(
                _join(probe.key, "block_size"),
                f"{probe.block_size} leaves no room in a {size}-byte probe file",
            )
        if kind == "device" and probe.op == "write" and not allow_raw:
            check.fail(
                _join(probe.key, "op"),
                "write probes on a raw device need allow_raw_writes: true on the target "
                "(or use a directory target: writes then go to a probe file)",
            )
    warmup = _warmup(check, data["warmup"], _join(key, "warmup")) if "warmup" in data else None
    if warmup is not None and kind == "directory":
        check.fail(_join(key, "warmup"), "warm-up reads a whole device; give it a device target")
    if warmup is not None and warmup.mode == "write" and not allow_raw:
        check.fail(_join(key, "warmup.mode"), "write warm-up needs allow_raw_writes: true on the target")
    return TargetConfig(
        key=key,
        name=check.convert(data, "name", key, _name, None),
        device=device,
        directory=directory,
        probe_file_size=size,
        allow_raw_writes=allow_raw,
        probes=probes,
        limits=_limits(check, data.get("limits"), _join(key, "limits")),
        warmup=warmup,
    )


def _throttle(check: _Checker, raw: Any) -> ThrottleConfig:
    data = check.mapping(raw, "throttle", {"enabled", "sample_interval", "window", "backoff"})
    result = ThrottleConfig(
        enabled=check.convert(data, "enabled", "throttle", _bool, True),
        sample_interval=check.convert(data, "sample_interval", "throttle", _positive_duration, 1.0),
        window=check.convert(data, "window", "throttle", _positive_duration, 60.0),
        backoff=check.convert(data, "backoff", "throttle", _positive_number, 10.0),
    )
    if result.backoff < 1:
        check.fail("throttle.backoff", f"{result.backoff} would speed probes up; use 1 to disable the back-off")
    if result.window < 10 * result.sample_interval:
        check.fail("throttle.window", "must hold at least 10 samples (window >= 10 x sample_interval)")
    return result


def _discovery(check: _Checker, raw: Any, defaults: _Defaults) -> DiscoveryConfig:
    data = check.mapping(raw, "discovery", {"include", "exclude", "probes", "rescan_interval"})
    probes = (
        _probes(check, data["probes"], "discovery.probes", defaults)
        if "probes" in data
        else default_probes("device", defaults, "discovery.probes")
    )
    for probe in probes:
        if probe.op == "write":
            check.fail(_join(probe.key, "op"), "discovered devices are only ever probed with reads")
    return DiscoveryConfig(
        include=check.convert(data, "include", "discovery", _string_list, ()),
        exclude=check.convert(data, "exclude", "discovery", _string_list, ()),
        probes=probes,
        rescan_interval=check.convert(data, "rescan_interval", "discovery", _positive_duration, 5.0),
    )


def _buckets(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise ValueError("must be a list of durations, e.g. [100us, 1ms, 10ms]")
    return stats.validate_buckets(units.parse_duration(v) for v in value)


def parse(document: Any, source: str = "<config>") -> Config:
    """Validate a loaded YAML document; raise ConfigError with every problem found."""
    check = _Checker()
    if document is None:
        document = {}
    top = check.mapping(document, "", _TOP_KEYS)
    raw_defaults = check.mapping(top.get("defaults"), "defaults", _DEFAULT_KEYS)
    defaults = _Defaults(
        interval=check.convert(raw_defaults, "interval", "defaults", _positive_duration, DEFAULT_INTERVAL),
        jitter=check.convert(raw_defaults, "jitter", "defaults", _ratio, DEFAULT_JITTER),
        revisit=check.convert(raw_defaults, "revisit", "defaults", _ratio, DEFAULT_REVISIT),
        probe_file_size=check.convert(
            raw_defaults, "probe_file_size", "defaults", _positive_size, DEFAULT_PROBE_FILE_SIZE
        ),
    )
    window = check.convert(raw_defaults, "window", "defaults", _positive_duration, DEFAULT_WINDOW)
    buckets = check.convert(raw_defaults, "buckets", "defaults", _buckets, stats.DEFAULT_BUCKETS)

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
        targets=tuple(targets),
        window=window,
        buckets=buckets,
        diskstats=check.convert(top, "diskstats", "", _choice(DISKSTATS_SCOPES), "probed"),
        throttle=_throttle(check, top.get("throttle")),
        discovery=_discovery(check, top["discovery"], defaults) if "discovery" in top else None,
        state_directory=check.convert(top, "state_directory", "", _path, None),
        source=source,
    )
    if check.problems:
        raise ConfigError(check.problems)
    return result


def load(path: str | Path) -> Config:
    """Read and validate a YAML file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError([f"{path}: cannot read: {err.strerror}"]) from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError([f"{path}: not valid YAML{where}: {problem}"]) from None
    return parse(document, source=str(path))


def from_paths(paths: list[str]) -> Config:
    """A config made of `--target PATH` flags: default probes on each device or directory."""
    check = _Checker()
    targets = []
    for index, path in enumerate(paths):
        key = f"--target[{index}]"
        raw: dict[str, Any] = {"directory" if Path(path).is_dir() else "device": path}
        target = _target(check, raw, key, _Defaults())
        if target is not None:
            targets.append(target)
    if check.problems:
        raise ConfigError(check.problems)
    return Config(targets=tuple(targets), source="--target" if paths else BUILTIN)
