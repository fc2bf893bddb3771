"""What a reload changes: which targets keep running, which stop, which start, and why. Pure: no I/O.

A target is kept when its probes' configuration and its device are unchanged; a kept target keeps its
workers, histograms, counters and warm-up (its limits and warm-up settings may change without a restart).
Otherwise it restarts, and the log names the keys that changed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import Limits, TargetConfig
from ..discovery import BlockDevice
from ..state import VolumeIdentity
from ..targets import ResolvedTarget


def fingerprint(target: TargetConfig) -> TargetConfig:
    """What decides whether a target's probes restart on reload: its configuration without where it sits in
    the file, the order of its probes, its limits or its warm-up (those two change without a restart)."""
    probes = tuple(sorted((replace(p, key="") for p in target.probes), key=lambda p: p.op))
    return replace(target, key="", probes=probes, limits=Limits(), warmup=None)


def device_identity(device: BlockDevice | None) -> tuple[int, int, int, str]:
    """The same device: same numbers, size and volume (a re-attached volume may get the old numbers). A
    directory without a block device is known by its configuration alone."""
    if device is None:
        return 0, 0, 0, ""
    return device.major, device.minor, device.size_bytes, VolumeIdentity.of(device).key


def _identity(target: ResolvedTarget) -> tuple[TargetConfig, str, tuple[int, int, int, str]]:
    return fingerprint(target.config), target.name, device_identity(target.device)


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


@dataclass
class Plan:
    keep: list[tuple[ResolvedTarget, ResolvedTarget]] = field(default_factory=list)  # (running, as reloaded)
    start: list[ResolvedTarget] = field(default_factory=list)
    stop: list[ResolvedTarget] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)  # target name -> why it stops or restarts


def plan(running: list[ResolvedTarget], wanted: list[ResolvedTarget], restart_all: str = "") -> Plan:
    """Match the running targets against the reloaded ones. `restart_all` names a change that affects every
    probe (the histogram buckets, the window), in which case nothing is kept."""
    result = Plan()
    by_identity = {_identity(t): t for t in running}
    for target in wanted:
        current = None if restart_all else by_identity.pop(_identity(target), None)
        if current is not None:
            result.keep.append((current, target))
        else:
            result.start.append(target)
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
            changed = changes(fingerprint(target.config), fingerprint(new.config))
            result.why[target.name] = "; ".join(changed + moved) or "changed"
    return result
