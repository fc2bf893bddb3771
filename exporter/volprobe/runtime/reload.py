"""What a reload changes: which targets keep running, which stop, which start, and why. Pure: no I/O.

Targets and their probes are matched apart. A target is kept when everything but its probes is unchanged (its
configuration, less its place in the file, its limits and its warm-up, which change without a restart) and so is
its device; a kept target keeps its warm-up and every probe whose settings are unchanged, with its worker,
histograms and counters. Each of its other probes stops, starts or restarts alone (ProbeChanges). One exception:
a raw device's write probes, which hold the device with O_EXCL, are part of the target (a new one can only open
the device once the old one let go), so changing them restarts the target. Otherwise a target restarts as a
whole. Either way the log names what changed by the keys the file has now (`probes[2].interval: ...`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import Limits, ProbeConfig, TargetConfig
from ..discovery import BlockDevice
from ..state import VolumeIdentity
from ..targets import ResolvedTarget


def fingerprint(target: TargetConfig) -> TargetConfig:
    """What decides whether a (discovered) target's probes restart on reload: its configuration without where it
    sits in the file, the order of its probes, its limits or its warm-up (those two change without a restart)."""
    probes = tuple(sorted((replace(p, key="") for p in target.probes), key=lambda p: p.op))
    return replace(target, key="", probes=probes, limits=Limits(), warmup=None)


def frame(target: ResolvedTarget) -> TargetConfig:
    """What decides whether a target restarts as a whole: its configuration less its place in the file, its
    limits, its warm-up and its probes, which are matched one by one; but with a raw device's write probes."""
    raw = target.kind == "device"
    raw_writes = tuple(_bare(p) for p in sorted(target.probes, key=lambda p: p.op) if raw and p.kind.writes)
    return replace(_without_probes(target.config), probes=raw_writes)


def _without_probes(target: TargetConfig) -> TargetConfig:
    return replace(target, key="", probes=(), limits=Limits(), warmup=None)


def device_identity(device: BlockDevice | None) -> tuple[int, int, int, str]:
    """The same device: same numbers, size and volume (a re-attached volume may get the old numbers). A
    directory without a block device is known by its configuration alone."""
    if device is None:
        return 0, 0, 0, ""
    return device.major, device.minor, device.size_bytes, VolumeIdentity.of(device).key


def _identity(target: ResolvedTarget) -> tuple[TargetConfig, str, tuple[int, int, int, str]]:
    return frame(target), target.name, device_identity(target.device)


def _bare(probe: ProbeConfig) -> ProbeConfig:
    """A probe's settings, without where it sits in the file."""
    return replace(probe, key="")


def _local(probe: ProbeConfig, target: TargetConfig) -> str:
    """A probe's key as the file has it, within its target: `probes[2]` of `targets[0].probes[2]`."""
    return probe.key.removeprefix(f"{target.key}.") or f"probes ({probe.op})"


def changes(old: Any, new: Any, where: str = "") -> list[str]:
    """The keys whose values differ between two configurations, as `key: old -> new` (keys ignored)."""
    if dataclasses.is_dataclass(old) and type(old) is type(new):
        found = []
        for f in dataclasses.fields(old):
            if f.name != "key":
                found += changes(getattr(old, f.name), getattr(new, f.name), f"{where}.{f.name}".lstrip("."))
        return found
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return [c for i, (a, b) in enumerate(zip(old, new, strict=True)) for c in changes(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where or 'value'}: {old!r} -> {new!r}"]


def probe_changes(old: TargetConfig, new: TargetConfig) -> dict[str, str]:
    """The probes that differ between two configurations of a target, matched by op: op -> what changed, each
    named by its key in the file it comes from (`probes[2].interval: 1.0 -> 2.0`, `probes[1] (write): added`)."""
    before = {p.op: p for p in old.probes}
    after = {p.op: p for p in new.probes}
    found: dict[str, str] = {}
    for op, probe in after.items():
        was = before.get(op)
        if was is None:
            found[op] = f"{_local(probe, new)} ({op}): added"
        elif _bare(was) != _bare(probe):
            found[op] = "; ".join(changes(_bare(was), _bare(probe), _local(probe, new)))
    for op, probe in before.items():
        if op not in after:
            found[op] = f"{_local(probe, old)} ({op}): removed"
    return found


@dataclass
class ProbeChanges:
    """A kept target's probes that stop (changed or removed), start (changed or added), or both: the rest of the
    target runs on."""

    running: ResolvedTarget
    reloaded: ResolvedTarget
    why: dict[str, str]  # op -> what changed

    @property
    def stopping(self) -> set[str]:
        """The ops whose running probes stop."""
        return {p.op for p in self.running.probes if p.op in self.why}

    @property
    def starting(self) -> list[ProbeConfig]:
        """The probes that start (with their keys in the new file)."""
        return [p for p in self.reloaded.probes if p.op in self.why]


@dataclass
class Plan:
    keep: list[tuple[ResolvedTarget, ResolvedTarget]] = field(default_factory=list)  # (running, as reloaded)
    start: list[ResolvedTarget] = field(default_factory=list)
    stop: list[ResolvedTarget] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)  # target name -> why it stops or restarts
    probes: list[ProbeChanges] = field(default_factory=list)  # kept targets whose probes change, one by one


def plan(running: list[ResolvedTarget], wanted: list[ResolvedTarget], restart_all: str = "") -> Plan:
    """Match the running targets against the reloaded ones. `restart_all` names a change that affects every
    probe (the histogram buckets, the window), in which case nothing is kept."""
    result = Plan()
    by_identity = {_identity(t): t for t in running}
    for target in wanted:
        current = None if restart_all else by_identity.pop(_identity(target), None)
        if current is None:
            result.start.append(target)
            continue
        result.keep.append((current, target))
        probes = probe_changes(current.config, target.config)
        if probes:
            result.probes.append(ProbeChanges(current, target, probes))
    result.stop = list(by_identity.values()) if not restart_all else list(running)
    started = {t.name: t for t in result.start}
    for target in result.stop:
        new = started.get(target.name)
        if restart_all:
            result.why[target.name] = restart_all
        elif new is None:
            result.why[target.name] = "removed from the configuration"
        else:
            moved = [] if device_identity(target.device) == device_identity(new.device) else ["device replaced"]
            changed = changes(_without_probes(target.config), _without_probes(new.config))
            changed += probe_changes(target.config, new.config).values()
            result.why[target.name] = "; ".join(changed + moved) or "changed"
    return result
