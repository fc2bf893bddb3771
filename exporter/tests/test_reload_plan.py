"""What a reload keeps, restarts and why: the pure planning step (runtime/reload.py)."""

from __future__ import annotations

from dataclasses import replace

from volprobe import config
from volprobe.discovery import BlockDevice
from volprobe.runtime import reload
from volprobe.targets import ResolvedTarget

DISK = BlockDevice("loop7", 7, 7, "loop", "/dev/loop7", 64 << 20, 512, 512)


def resolved(document: dict, device: BlockDevice = DISK) -> list[ResolvedTarget]:
    parsed = config.parse(document)
    return [ResolvedTarget(t, t.name or device.name, t.kind, t.path, device, [device.name]) for t in parsed.targets]


def test_a_target_moved_in_the_file_is_kept():
    a = {"name": "a", "device": "/dev/loop7", "probes": [{"op": "read", "interval": "50ms"}]}
    b = {"name": "b", "device": "/dev/loop8"}
    running = resolved({"targets": [a]})
    plan = reload.plan(running, resolved({"targets": [b, a]}))
    assert [(old.name, new.name) for old, new in plan.keep] == [("a", "a")]
    assert plan.keep[0][0] is running[0] and plan.keep[0][1].config.key == "targets[1]"
    assert [t.name for t in plan.start] == ["b"] and plan.stop == []


def test_defaults_that_do_not_change_a_probe_keep_it():
    # Setting a default to the value the probe already has is no change.
    explicit = {"name": "a", "device": "/dev/loop7", "probes": [{"op": "read", "interval": "2s"}]}
    running = resolved({"targets": [explicit]})
    plan = reload.plan(running, resolved({"defaults": {"interval": "2s", "jitter": 0.1}, "targets": [explicit]}))
    assert len(plan.keep) == 1 and not plan.start and not plan.stop


def test_a_changed_probe_restarts_alone_and_says_which_key_changed():
    before = {"name": "a", "device": "/dev/loop7", "probes": [{"op": "read", "interval": "1s"}]}
    after = {"name": "a", "device": "/dev/loop7", "probes": [{"op": "read", "interval": "2s"}]}
    running = resolved({"targets": [before]})
    plan = reload.plan(running, resolved({"targets": [after]}))
    assert [old for old, _ in plan.keep] == running and not plan.start and not plan.stop
    (probes,) = plan.probes
    assert probes.running is running[0] and probes.why == {"read": "probes[0].interval: 1.0 -> 2.0"}
    assert probes.stopping == {"read"} and [p.interval for p in probes.starting] == [2.0]


def test_a_default_that_changes_a_probe_restarts_it():
    target = {"name": "a", "device": "/dev/loop7"}
    plan = reload.plan(resolved({"targets": [target]}), resolved({"defaults": {"revisit": 0.5}, "targets": [target]}))
    assert [p.why for p in plan.probes] == [{"read": "probes[0].revisit: 0.25 -> 0.5"}]


def test_one_changed_probe_of_a_directory_restarts_alone_named_by_its_index_in_the_file():
    # Issue 41: only the commit probe's interval changes. The read and write probes are kept, and the commit probe
    # is named as the file writes it (probes[2]), not by its place among the probes sorted by op (probes[0]).
    probes = [{"op": "read"}, {"op": "write"}, {"op": "commit", "interval": "1s"}]
    before = {"name": "d", "directory": "/srv/d", "probes": probes}
    after = {**before, "probes": [*probes[:2], {"op": "commit", "interval": "2s"}]}
    plan = reload.plan(resolved({"targets": [before]}), resolved({"targets": [after]}))
    assert len(plan.keep) == 1 and not plan.start and not plan.stop
    (changed,) = plan.probes
    assert changed.why == {"commit": "probes[2].interval: 1.0 -> 2.0"}
    assert changed.stopping == {"commit"} and [p.key for p in changed.starting] == ["targets[0].probes[2]"]


def test_added_and_removed_probes_start_and_stop_alone():
    before = {"name": "d", "directory": "/srv/d", "probes": [{"op": "read"}, {"op": "write"}]}
    after = {**before, "probes": [{"op": "write"}, {"op": "metadata"}]}
    plan = reload.plan(resolved({"targets": [before]}), resolved({"targets": [after]}))
    assert len(plan.keep) == 1 and not plan.start and not plan.stop
    (changed,) = plan.probes
    assert changed.why == {"metadata": "probes[1] (metadata): added", "read": "probes[0] (read): removed"}
    assert changed.stopping == {"read"} and [p.op for p in changed.starting] == ["metadata"]


def test_a_restarted_target_names_its_probes_by_their_index_in_the_file():
    probes = [{"op": "read"}, {"op": "write"}, {"op": "commit", "interval": "1s"}]
    before = {"name": "d", "directory": "/srv/d", "probes": probes}
    after = {**before, "probe_file_size": "32MiB", "probes": [*probes[:2], {"op": "commit", "interval": "2s"}]}
    plan = reload.plan(resolved({"targets": [before]}), resolved({"targets": [after]}))
    assert not plan.keep and not plan.probes
    assert plan.why["d"] == "probe_file_size: 67108864 -> 33554432; probes[2].interval: 1.0 -> 2.0"


def test_a_raw_write_probe_change_restarts_its_device_target():
    # A raw device's write probe holds it with O_EXCL: its successor opens the device once the target let go.
    before = {
        "name": "a",
        "device": "/dev/loop7",
        "allow_raw_writes": True,
        "probes": [{"op": "write"}, {"op": "read"}],
    }
    after = {**before, "probes": [{"op": "write", "interval": "2s"}, {"op": "read"}]}
    plan = reload.plan(resolved({"targets": [before]}), resolved({"targets": [after]}))
    assert not plan.keep and plan.why == {"a": "probes[0].interval: 1.0 -> 2.0"}
    read_only = {**before, "probes": [{"op": "write"}, {"op": "read", "interval": "2s"}]}
    plan = reload.plan(resolved({"targets": [before]}), resolved({"targets": [read_only]}))
    assert len(plan.keep) == 1 and [p.why for p in plan.probes] == [{"read": "probes[1].interval: 1.0 -> 2.0"}]


def test_a_replaced_device_restarts_the_target():
    target = {"name": "a", "device": "/dev/loop7"}
    replaced = replace(DISK, minor=9)
    plan = reload.plan(resolved({"targets": [target]}), resolved({"targets": [target]}, replaced))
    assert plan.why["a"] == "device replaced"


def test_removed_targets_and_restart_all():
    a = {"name": "a", "device": "/dev/loop7"}
    running = resolved({"targets": [a]})
    assert reload.plan(running, []).why == {"a": "removed from the configuration"}
    plan = reload.plan(running, resolved({"targets": [a]}), restart_all="defaults.window changed")
    assert not plan.keep and plan.why == {"a": "defaults.window changed"}


def test_changes_walks_nested_configuration():
    old = config.TargetConfig("k", name="a", device="/dev/x", limits=config.Limits(iops=100))
    new = replace(old, key="other", limits=config.Limits(iops=200), warmup=config.WarmupConfig())
    assert reload.changes(old, new) == ["limits.iops: 100 -> 200", f"warmup: None -> {config.WarmupConfig()!r}"]
    assert reload.changes(old, replace(old, key="moved")) == []


def test_limits_warmup_and_probe_order_change_without_restarting_probes():
    probes = [{"op": "write"}, {"op": "read", "interval": "2s"}]
    before = {"name": "a", "device": "/dev/loop7", "allow_raw_writes": True, "probes": probes}
    after = {**before, "probes": probes[::-1], "limits": {"iops": 3000}, "warmup": {"rate": "50MiB"}}
    plan = reload.plan(resolved({"targets": [before]}), resolved({"targets": [after]}))
    assert len(plan.keep) == 1 and not plan.start and not plan.stop
    assert plan.keep[0][1].config.limits.iops == 3000  # what the kept target takes on


def test_another_volume_behind_the_same_numbers_restarts_the_target():
    target = {"name": "a", "device": "/dev/loop7"}
    reattached = replace(DISK, serial="other-volume")  # same major, minor and size; another volume
    plan = reload.plan(resolved({"targets": [target]}), resolved({"targets": [target]}, reattached))
    assert plan.why["a"] == "device replaced"
