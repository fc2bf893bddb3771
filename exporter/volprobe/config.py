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

from . import ops, stats, units

WARMUP_MODES = ("read", "write")
DISKSTATS_SCOPES = ("probed", "all")
NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
PROBE_FILE_NAME = ".volprobe-probe"
BUILTIN = "<built-in default>"


class ConfigError(Exception):
    """One or more problems, each `key.path: message`."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ProbeConfig:
    """One probe. Unset fields take the op's defaults: its block size, and O_DSYNC for writes."""

    op: str
    block_size: int = 0
    interval: float = 1.0
    sync: bool | None = None
    jitter: float = 0.1  # fraction of the interval each probe is randomly delayed by
    revisit: float = 0.25  # fraction of probes sent to offsets probed before
    hold_open: bool = False  # reads: keep the device open between probes (writes always do)
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
    name: str | None = None
    device: str | None = None
    directory: str | None = None
    probe_file_size: int = 64 * 1024**2
    allow_raw_writes: bool = False
    probes: tuple[ProbeConfig, ...] = ()
    limits: Limits = field(default_factory=Limits)
    warmup: WarmupConfig | None = None

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
class ThrottleConfig:
    enabled: bool = True
    sample_interval: float = 1.0
    window: float = 60.0
    backoff: float = 10.0  # probes run this many times slower while their device is throttled; 1 disables


WARMUP_POLICIES = ("new", "all")


@dataclass(frozen=True)
class DiscoveryWarmupConfig:
    """`discovery.warmup`: read every block of discovered devices once. `policy` "new" warms the devices that
    appear after the exporter started (and resumes warm-ups a restart interrupted); "all" every matching device.
    A volume is warmed once: its state remembers it by identity."""

    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    policy: str = "new"
    max_concurrent: int = 2


@dataclass(frozen=True)
class DiscoveryConfig:
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    probes: tuple[ProbeConfig, ...] = tuple(ProbeConfig(op.name) for op in ops.DEVICE_DEFAULTS)
    rescan_interval: float = 5.0
    warmup: DiscoveryWarmupConfig | None = None


@dataclass(frozen=True)
class Config:
    targets: tuple[TargetConfig, ...] = ()
    window: float = 300.0
    buckets: tuple[float, ...] = stats.DEFAULT_BUCKETS
    histogram_by_touch: bool = False  # the touch label on the histogram too (the layout before 0.2: 2x series)
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
                self.fail(key_path(key, name), f"unknown key (expected one of: {hint})")
        return dict(value)

    def present(self, data: Mapping[str, Any], key: str, parsers: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
        """The keys of `data` that are set, parsed: what overrides a dataclass's defaults."""
        values: dict[str, Any] = {}
        for name, parse in parsers.items():
            if data.get(name) is None:
                continue
            try:
                values[name] = parse(data[name])
            except (ValueError, TypeError) as err:
                self.fail(_join(key, name), str(err))
        return values

    def convert(self, data: Mapping[str, Any], name: str, key: str, parse: Callable[[Any], Any], default: Any):
        if name not in data or data[name] is None:
            return default
        try:
            return parse(data[name])
        except (ValueError, TypeError) as err:
            self.fail(_join(key, name), str(err))
            return default


_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def key_path(key: str, name: object) -> str:
    """`key.name`; a name that is not a plain word (spaces, dots, not a string) is quoted: `key[' ']`."""
    if isinstance(name, str) and _PLAIN_KEY.fullmatch(name):
        return f"{key}.{name}" if key else name
    return f"{key}[{name!r}]"


_join = key_path


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
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
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


_PROBE_PARSERS: dict[str, Callable[[Any], Any]] = {
    "op": _choice(ops.NAMES),
    "block_size": _positive_size,
    "interval": _positive_duration,
    "sync": _bool,
    "jitter": _ratio,
    "revisit": _ratio,
    "hold_open": _bool,
}
_PROBE_DEFAULT_KEYS = ("interval", "jitter", "revisit")  # keys of `defaults:` that apply to every probe
_DEFAULT_KEYS = {*_PROBE_DEFAULT_KEYS, "window", "buckets", "histogram_by_touch", "probe_file_size"}
_TARGET_PARSERS: dict[str, Callable[[Any], Any]] = {
    "name": _name,
    "device": _path,
    "directory": _path,
    "allow_raw_writes": _bool,
    "probe_file_size": _positive_size,
}
_TARGET_KEYS = {*_TARGET_PARSERS, "probes", "limits", "warmup"}
_TOP_KEYS = {"defaults", "targets", "diskstats", "throttle", "discovery", "state_directory"}


@dataclass(frozen=True)
class _Defaults:
    """The `defaults:` section: overrides of the dataclasses' own defaults, only for the keys it sets."""

    probe: Mapping[str, Any] = field(default_factory=dict)  # interval, jitter, revisit
    probe_file_size: int | None = None


def _probe(check: _Checker, raw: Any, key: str, defaults: _Defaults) -> ProbeConfig | None:
    data = check.mapping(raw, key, set(_PROBE_PARSERS))
    if not isinstance(raw, Mapping):
        return None
    if "op" not in data:
        check.fail(_join(key, "op"), f"is required ({' or '.join(ops.NAMES)})")
        return None
    values = check.present(data, key, _PROBE_PARSERS)
    if "op" not in values:
        return None
    if not ops.get(values["op"]).writes and data.get("sync") is True:
        check.fail(_join(key, "sync"), "only applies to write probes")
    if ops.get(values["op"]).writes and data.get("hold_open") is False:
        check.fail(_join(key, "hold_open"), "write probes always keep their descriptor open (it holds O_EXCL)")
    return ProbeConfig(**{**defaults.probe, **values, "key": key})


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
    return Limits(**check.present(data, key, {"iops": _positive_number, "bandwidth": _positive_size}))


_WARMUP_PARSERS: dict[str, Callable[[Any], Any]] = {
    "mode": _choice(WARMUP_MODES),
    "rate": _positive_size,
    "jobs": _positive_int,
    "block_size": _positive_size,
    "idle_priority": _bool,
}


def _warmup(check: _Checker, raw: Any, key: str) -> WarmupConfig:
    data = check.mapping(raw, key, set(_WARMUP_PARSERS))
    return WarmupConfig(**check.present(data, key, _WARMUP_PARSERS))


def default_probes(kind: str, defaults: _Defaults | None = None, key: str = "") -> tuple[ProbeConfig, ...]:
    """Probes of a target that names none: reads on a device, a sync write and a read in a directory."""
    overrides = defaults.probe if defaults else {}
    kinds = ops.DIRECTORY_DEFAULTS if kind == "directory" else ops.DEVICE_DEFAULTS
    return tuple(ProbeConfig(op.name, **overrides, key=f"{key}[{i}]") for i, op in enumerate(kinds))


def _target(check: _Checker, raw: Any, key: str, defaults: _Defaults) -> TargetConfig | None:
    if not isinstance(raw, Mapping):
        check.fail(key, f"must be a mapping, got {type(raw).__name__}")
        return None
    data = check.mapping(raw, key, _TARGET_KEYS)
    values = check.present(data, key, _TARGET_PARSERS)
    if "device" in data and "directory" in data:
        check.fail(key, "has both device and directory; a target is one or the other")
    elif "device" not in data and "directory" not in data:
        check.fail(key, "needs a device or a directory")
    kind = "directory" if "directory" in data else "device"
    if "probes" in data:
        probes = _probes(check, data["probes"], _join(key, "probes"), defaults)
    else:
        probes = default_probes(kind, defaults, _join(key, "probes"))
    if kind == "directory" and "allow_raw_writes" in data:
        check.fail(_join(key, "allow_raw_writes"), "only applies to device targets")
    if kind == "device" and "probe_file_size" in data:
        check.fail(_join(key, "probe_file_size"), "only applies to directory targets")
    if kind == "directory" and "probe_file_size" not in values and defaults.probe_file_size:
        values["probe_file_size"] = defaults.probe_file_size
    warmup = _warmup(check, data["warmup"], _join(key, "warmup")) if "warmup" in data else None
    target = TargetConfig(
        key=key,
        probes=probes,
        limits=_limits(check, data.get("limits"), _join(key, "limits")),
        warmup=warmup,
        **values,
    )
    for probe in probes:
        if kind == "directory" and probe.kind.writes and probe.block_size > target.probe_file_size // 2:
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


def _throttle(check: _Checker, raw: Any) -> ThrottleConfig:
    parsers = {
        "enabled": _bool,
        "sample_interval": _positive_duration,
        "window": _positive_duration,
        "backoff": _positive_number,
    }
    data = check.mapping(raw, "throttle", set(parsers))
    result = ThrottleConfig(**check.present(data, "throttle", parsers))
    if result.backoff < 1:
        check.fail("throttle.backoff", f"{result.backoff} would speed probes up; use 1 to disable the back-off")
    if result.window < 10 * result.sample_interval:
        check.fail("throttle.window", "must hold at least 10 samples (window >= 10 x sample_interval)")
    return result


def _discovery_warmup(check: _Checker, raw: Any) -> DiscoveryWarmupConfig:
    key = "discovery.warmup"
    own = {"policy": _choice(WARMUP_POLICIES), "max_concurrent": _positive_int}
    data = check.mapping(raw, key, {*_WARMUP_PARSERS, *own})
    warmup = WarmupConfig(**check.present(data, key, _WARMUP_PARSERS))
    if warmup.mode != "read":
        check.fail(_join(key, "mode"), "discovered devices are only ever read: warm-up mode must be read")
    return DiscoveryWarmupConfig(warmup, **check.present(data, key, own))


def _discovery(check: _Checker, raw: Any, defaults: _Defaults) -> DiscoveryConfig:
    data = check.mapping(raw, "discovery", {"include", "exclude", "probes", "rescan_interval", "warmup"})
    probes = (
        _probes(check, data["probes"], "discovery.probes", defaults)
        if "probes" in data
        else default_probes("device", defaults, "discovery.probes")
    )
    for probe in probes:
        if probe.kind.writes:
            check.fail(_join(probe.key, "op"), "discovered devices are only ever probed with reads")
    parsers = {"include": _string_list, "exclude": _string_list, "rescan_interval": _positive_duration}
    warmup = _discovery_warmup(check, data["warmup"]) if data.get("warmup") is not None else None
    return DiscoveryConfig(probes=probes, warmup=warmup, **check.present(data, "discovery", parsers))


def _buckets(value: Any) -> tuple[float, ...]:
    if value == "legacy":
        return stats.LEGACY_BUCKETS
    if not isinstance(value, list):
        raise ValueError("must be a list of durations, e.g. [100us, 1ms, 10ms], or legacy")
    return stats.validate_buckets(units.parse_duration(v) for v in value)


def parse(document: Any, source: str = "<config>") -> Config:
    """Validate a loaded YAML document; raise ConfigError with every problem found."""
    check = _Checker()
    if document is None:
        document = {}
    top = (
        check.mapping(document, source, _TOP_KEYS)
        if not isinstance(document, Mapping)
        else check.mapping(document, "", _TOP_KEYS)
    )
    raw_defaults = check.mapping(top.get("defaults"), "defaults", _DEFAULT_KEYS)
    defaults = _Defaults(
        probe=check.present(raw_defaults, "defaults", {k: _PROBE_PARSERS[k] for k in _PROBE_DEFAULT_KEYS}),
        probe_file_size=check.present(raw_defaults, "defaults", {"probe_file_size": _positive_size}).get(
            "probe_file_size"
        ),
    )
    settings = check.present(
        raw_defaults, "defaults", {"window": _positive_duration, "buckets": _buckets, "histogram_by_touch": _bool}
    )
    settings.update(
        check.present(top, "", {"diskstats": _choice(DISKSTATS_SCOPES), "state_directory": _path}),
    )
    window = settings.get("window", Config.window)

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
        throttle=_throttle(check, top.get("throttle")),
        discovery=_discovery(check, top["discovery"], defaults) if "discovery" in top else None,
        source=source,
        **settings,
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
