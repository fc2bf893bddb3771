"""`kubernetes.rules` (issue 43): which pod volumes may take probes, writes included, and how a probe that holds
nothing open between probes (`hold: false`, a pod volume's) runs. Pure parsing on fixtures, the follower on a
kubelet tree and mount table built here, and the worker on a directory of the test's: no mounts, no root."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from volprobe import config, kubelet, ops, probefile, targets
from volprobe.config import PROBE_FILE_NAME
from volprobe.discovery import Host, parse_mountinfo
from volprobe.probe import ProbeWorker
from volprobe.runtime.pods import PodVolumeFollower
from volprobe.stats import ProbeStats

from .support.harness import OpenFiles, probes_done, sample_value, start_with_kept_target, volprobe_command, wait_until

POD = "6f1c2b3a-4d5e-4f60-8a7b-9c0d1e2f3a4b"
PV_DB = "pvc-1d2e3f4a-5b6c-4d7e-8f90-a1b2c3d4e5f6"
PV_WEB = "pvc-7e8f9a0b-1c2d-4e3f-9a4b-5c6d7e8f9a0b"


def rules(*items: dict) -> config.KubernetesConfig:
    return config.parse({"kubernetes": {"rules": list(items)}}).kubernetes


def test_a_rule_matches_on_driver_exactly_pv_whole_and_path_by_glob() -> None:
    rule = rules({"driver": "efs.csi.aws.com", "pv": "pvc-7e.*", "path": "/k/pods/*/volumes/*/pvc-*/mount"}).rules[0]
    path = f"/k/pods/{POD}/volumes/kubernetes.io~csi/{PV_WEB}/mount"
    assert rule.matches("efs.csi.aws.com", PV_WEB, path)
    assert not rule.matches("efs.csi.aws.com.evil", PV_WEB, path)  # exact
    assert not rule.matches("efs.csi.aws.com", "x" + PV_WEB, path)  # the whole name
    assert not rule.matches("efs.csi.aws.com", PV_WEB, "/elsewhere" + path)
    # Every criterion written must hold; one alone is enough to write.
    assert rules({"pv": PV_DB}).rules[0].matches("", PV_DB, "/anywhere")
    # The first rule that matches is the volume's; none: nothing is written.
    two = rules({"driver": "a", "probes": [{"op": "commit"}]}, {"pv": ".*", "probes": [{"op": "write"}]})
    assert [p.op for p in (two.rule_for("a", "pv", "/p") or config.PodVolumeRule()).probes] == ["commit"]
    assert [p.op for p in (two.rule_for("b", "pv", "/p") or config.PodVolumeRule()).probes] == ["write"]
    assert rules().rule_for("a", "pv", "/p") is None and config.parse(None).kubernetes.rules == ()


def test_a_rule_takes_probes_as_a_directory_target_does_with_a_small_probe_file() -> None:
    parsed = config.parse(
        {
            "defaults": {"interval": "2s"},
            "kubernetes": {"rules": [{"driver": "d", "probes": [{"op": "write"}, {"op": "commit", "interval": "1s"}]}]},
        }
    )
    rule = parsed.kubernetes.rules[0]
    assert rule.probe_file_size == 4 * 1024**2 == config.POD_PROBE_FILE_SIZE
    assert [(p.op, p.interval, p.sync, p.key) for p in rule.probes] == [
        ("write", 2.0, True, "kubernetes.rules[0].probes[0]"),
        ("commit", 1.0, True, "kubernetes.rules[0].probes[1]"),
    ]
    # Unset: a directory target's defaults (a sync write and a read).
    assert [p.op for p in rules({"driver": "d"}).rules[0].probes] == [p.op for p in config.default_probes("directory")]


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ({"driver": "d", "probe_size": "1MiB"}, "kubernetes.rules[0].probe_size: unknown key"),
        ({"driver": "d", "probes": [{"op": "write", "hold_open": False}]}, "kubernetes.rules[0].probes[0].hold_open"),
        ({"driver": "d", "probes": [{"op": "write", "blocksize": 1}]}, "kubernetes.rules[0].probes[0].blocksize"),
        ({"driver": "d", "probes": [{"op": "write"}, {"op": "write"}]}, "kubernetes.rules[0].probes[1].op"),
        ({"driver": "d", "probes": [{"op": "write", "block_size": "4MiB"}]}, "leaves no room in a 4194304-byte"),
        ({"probes": [{"op": "write"}]}, "kubernetes.rules[0]: matches every pod volume"),
        ({"pv": "pvc-["}, "kubernetes.rules[0].pv: 'pvc-[' is not a regular expression"),
        ({"path": "pods/*"}, "kubernetes.rules[0].path"),
        ({"driver": ""}, "kubernetes.rules[0].driver"),
        ({"driver": "d", "probe_file_size": 0}, "kubernetes.rules[0].probe_file_size"),
        ("efs", "kubernetes.rules[0]: must be a mapping"),
    ],
)
def test_a_bad_rule_is_refused_naming_its_key(rule: object, problem: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.parse({"kubernetes": {"rules": [rule]}})
    assert problem in "\n".join(err.value.problems)


def test_rules_that_are_not_a_list_are_refused() -> None:
    with pytest.raises(config.ConfigError, match=r"kubernetes\.rules: must be a list"):
        config.parse({"kubernetes": {"rules": {"driver": "d"}}})


def _node(tmp_path: Path) -> tuple[Path, Host]:
    """A kubelet tree with two CSI volumes (their mount/ directories on the test's filesystem, as its device number
    says) and a node's mount table that has them mounted: an nfs4 one (web) and an ext4 one (db)."""
    root = tmp_path / "kubelet"
    lines = []
    st = os.stat(tmp_path)
    for pv, fstype, number in (
        (PV_WEB, "nfs4", "0:61"),
        (PV_DB, "ext4", f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"),
    ):
        volume = root / "pods" / POD / "volumes" / "kubernetes.io~csi" / pv
        (volume / "mount").mkdir(parents=True)
        driver = "efs.csi.aws.com" if fstype == "nfs4" else "ebs.csi.aws.com"
        (volume / "vol_data.json").write_text(f'{{"driverName": "{driver}", "specVolID": "{pv}"}}')
        source = "127.0.0.1:/" if fstype == "nfs4" else "/dev/nvme1n1"
        lines.append(f"{len(lines) + 100} 1 {number} / {volume}/mount rw - {fstype} {source} rw\n")
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "mountinfo").write_text("".join(lines))
    return root, Host(str(tmp_path / "sys"), str(proc))


class _Targets:
    """A ProbeSet stand-in: what the follower starts and stops."""

    def __init__(self) -> None:
        self.running: list[targets.ResolvedTarget] = []

    def targets(self) -> list[targets.ResolvedTarget]:
        return list(self.running)


def test_the_follower_gives_a_rule_its_volume_and_writes_nowhere_else(tmp_path: Path, monkeypatch) -> None:
    root, host = _node(tmp_path)
    db = root / "pods" / POD / "volumes" / "kubernetes.io~csi" / PV_DB / "mount"
    web = root / "pods" / POD / "volumes" / "kubernetes.io~csi" / PV_WEB / "mount"
    # The tree is on the test's filesystem: resolve() asks the real machine's mount table and devices.
    monkeypatch.setattr(Host, "mount_for_path", lambda self, path: None)
    monkeypatch.setattr(Host, "device_for_path", lambda self, path: None)
    opened = OpenFiles(tmp_path)
    running = _Targets()
    stopped: list[tuple[str, str]] = []

    def start(new: list[targets.ResolvedTarget]) -> None:
        running.running += new

    def stop(gone: list[targets.ResolvedTarget], _timeout: float, why: str) -> None:
        stopped.extend((t.path, why) for t in gone)
        running.running = [t for t in running.running if t not in gone]
        targets.close(gone)

    follower = PodVolumeFollower(host, running, threading.Lock(), start, stop)  # type: ignore[arg-type]
    kube = {"kubelet_directory": str(root), "rules": [{"pv": PV_DB, "probes": [{"op": "write"}, {"op": "commit"}]}]}
    follower.config = config.parse({"kubernetes": kube})
    follower.rescan()
    by_path = {t.path: t for t in running.running}
    assert set(by_path) == {str(db), str(web)}
    ours, theirs = by_path[str(db)], by_path[str(web)]
    assert [p.op for p in ours.probes] == ["write", "commit"] and theirs.probes == ()
    assert ours.name == str(db) and ours.pod_volume is not None and ours.pod_volume.pv == PV_DB
    assert ours.config.hold is False and ours.probe_dir is not None and ours.probe_dir.keep is False
    assert ours.config.probe_file_size == 4 * 1024**2 and not ours.fds  # nothing kept from prepare()
    assert sorted(os.listdir(db)) == sorted([PROBE_FILE_NAME, ops.COMMIT.file])
    assert os.path.getsize(db / PROBE_FILE_NAME) == 4 * 1024**2
    assert os.listdir(web) == []  # matched by no rule: never written
    assert opened.new() == []  # nothing held
    first = list(running.running)
    follower.rescan()
    assert running.running == first and not stopped
    # The rule changes: its target starts again with the new probes; the other one is left alone.
    kube["rules"] = [{"pv": PV_DB, "probes": [{"op": "write", "interval": "2s"}]}]
    follower.config = config.parse({"kubernetes": kube})
    follower.rescan()
    assert stopped == [(str(db), "its kubernetes rule changed")]
    assert [p.interval for p in next(t for t in running.running if t.path == str(db)).probes] == [2.0]
    assert next(t for t in running.running if t.path == str(web)) is theirs
    # No rule: back to the mount check of a filesystem volume; a block-backed one is its disk's alone.
    del kube["rules"]
    follower.config = config.parse({"kubernetes": kube})
    follower.rescan()
    assert [t.path for t in running.running] == [str(web)]


def test_a_rule_whose_volume_is_refused_starts_nothing_and_says_why_once(tmp_path: Path, monkeypatch, caplog) -> None:
    root, host = _node(tmp_path)
    db = root / "pods" / POD / "volumes" / "kubernetes.io~csi" / PV_DB / "mount"
    monkeypatch.setattr(Host, "mount_for_path", lambda self, path: None)
    monkeypatch.setattr(Host, "device_for_path", lambda self, path: None)
    (db / PROBE_FILE_NAME).write_bytes(b"someone's data")  # not a probe file of ours: never touched
    running = _Targets()
    follower = PodVolumeFollower(host, running, threading.Lock(), lambda new: running.running.extend(new), None)  # type: ignore[arg-type]
    follower.config = config.parse({"kubernetes": {"kubelet_directory": str(root), "rules": [{"pv": PV_DB}]}})
    follower.rescan()
    follower.rescan()
    assert str(db) not in [t.path for t in running.running]  # the nfs4 volume's mount check alone
    assert (db / PROBE_FILE_NAME).read_bytes() == b"someone's data"
    refusals = [r for r in caplog.records if "cannot be probed" in r.getMessage()]
    assert len(refusals) == 1 and "refusing to overwrite it" in refusals[0].getMessage()


def _unheld(tmp_path: Path, op: str, hold: bool) -> tuple[Host, targets.ResolvedTarget]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    parsed = config.parse({"targets": [{"directory": str(data), "probe_file_size": "1MiB", "probes": [{"op": op}]}]})
    target = dataclasses.replace(parsed.targets[0], hold=hold)
    host = Host()
    resolved = targets.resolve(parsed, host, [target])
    targets.prepare(host, resolved)
    return host, resolved[0]


@pytest.mark.parametrize("op", ["write", "commit", "metadata"])
def test_a_probe_that_holds_nothing_opens_checks_probes_and_closes_each_time(tmp_path: Path, op: str) -> None:
    opened = OpenFiles(tmp_path)
    host, target = _unheld(tmp_path, op, hold=False)
    assert not target.fds  # prepare() checked the descriptor and closed it
    spec = target.probes[0]
    io = targets.io_target(host, target, dataclasses.replace(spec, interval=0.05, jitter=0.5))
    assert io.keep is False
    worker = ProbeWorker(dataclasses.replace(spec, interval=0.05, jitter=0.5), io, ProbeStats(60, (0.001, 1.0)))
    root = tmp_path / "data"
    worker.start()
    try:
        # A loaded disk may take hundreds of milliseconds a sync (the metadata probe syncs twice): the bound is loose.
        deadline = time.monotonic() + 60
        closed_after: set[int] = set()  # the probes after which a sample found nothing held
        # Between probes nothing is held: samples find nothing held after 10 probes at least (a probe that keeps
        # its file or its directory leaves no gap), within 200 probes however long each takes on a loaded disk,
        # and a sampler slowed by the load misses some gaps.
        while worker.completed < 20 or len(closed_after) < 10:
            assert time.monotonic() < deadline and worker.completed < 200, (
                worker.completed,
                sorted(closed_after),
                worker.error_counts(),
            )
            before = worker.completed
            if not opened.new() and worker.completed == before:
                closed_after.add(before)
            time.sleep(0.003)
        assert worker.error_counts() == {}
        if op == "metadata":
            return
        # The probe file replaced (a new inode under its name, same content): every open is refused, and the
        # newcomer never written.
        name = PROBE_FILE_NAME if op == "write" else ops.COMMIT.file
        shutil.copyfile(root / name, root / "copy")
        os.rename(root / "copy", root / name)
        content = (root / name).read_bytes()
        deadline = time.monotonic() + 10
        while not worker.error_counts().get("REFUSED"):
            assert time.monotonic() < deadline, worker.error_counts()
            time.sleep(0.01)
        assert (root / name).read_bytes() == content
    finally:
        worker.stop()
        assert worker.join(5)
        worker.close()
        targets.close([target])
    assert opened.new() == []


def test_a_probe_that_holds_nothing_never_keeps_its_directory(tmp_path: Path) -> None:
    """ProbeDirectory(keep=False): held() opens and recognises it for its block alone, the first time too."""
    data = tmp_path / "d"
    data.mkdir()
    directory = probefile.ProbeDirectory(str(data), keep=False)
    again = directory.again()
    assert again.keep is False
    with again.held() as fd:
        assert os.fstat(fd).st_ino == data.stat().st_ino
    assert again._fd is None and directory._fd is None
    probefile.ensure(again, PROBE_FILE_NAME, 1024**2)
    assert again._fd is None
    fd = again.open_file(PROBE_FILE_NAME, os.O_RDWR, 1024**2)
    os.close(fd)
    assert again._fd is None
    # Another directory at the path is refused, as a held one's would be.
    os.rename(data, tmp_path / "moved")
    data.mkdir()
    with pytest.raises(OSError, match="no longer the directory"), again.held():
        pass


def test_a_held_probe_keeps_its_descriptor_as_before(tmp_path: Path) -> None:
    """Directory targets are unchanged: hold (the default) keeps the write's descriptor and the directory."""
    host, target = _unheld(tmp_path, "write", hold=True)
    try:
        assert "write" in target.fds and target.probe_dir is not None and target.probe_dir.keep
        io = targets.io_target(host, target, target.probes[0])
        assert io.keep is True
    finally:
        targets.close([target])


def test_a_rule_volume_is_resolved_without_a_lookup_of_its_path_but_open_trees(tmp_path: Path, monkeypatch) -> None:
    """Resolving and preparing a rule's volume asks nothing of the kubelet's path, in it or below it, by name: no
    stat, lstat, access nor realpath (which would each walk into the kubelet's mount, where a hung server would
    hold it), only the open_tree of its private copy; the rest is asked of descriptors."""
    root, host = _node(tmp_path)
    db = root / "pods" / POD / "volumes" / "kubernetes.io~csi" / PV_DB / "mount"
    asked: list[tuple[str, str]] = []

    def guard(name: str, real):
        def call(path, *args, **kwargs):
            if kwargs.get("dir_fd") is None and os.fsdecode(os.fspath(path)).startswith(str(db)):
                asked.append((name, os.fsdecode(os.fspath(path))))
            return real(path, *args, **kwargs)

        return call

    for name in ("stat", "lstat", "access"):
        monkeypatch.setattr(os, name, guard(f"os.{name}", getattr(os, name)))
    monkeypatch.setattr(os.path, "realpath", guard("os.path.realpath", os.path.realpath))
    running = _Targets()
    follower = PodVolumeFollower(host, running, threading.Lock(), lambda new: running.running.extend(new), None)  # type: ignore[arg-type]
    kube = {"kubelet_directory": str(root), "rules": [{"pv": PV_DB, "probes": [{"op": "write"}, {"op": "commit"}]}]}
    follower.config = config.parse({"kubernetes": kube})
    try:
        follower.rescan()
        ours = next(t for t in running.running if t.path == str(db))
        assert [p.op for p in ours.probes] == ["write", "commit"]
        assert sorted(os.listdir(db)) == sorted([PROBE_FILE_NAME, ops.COMMIT.file])
        assert asked == []
    finally:
        targets.close(running.running)


TENANT_POD = "2b3c4d5e-6f70-4812-9a3b-4c5d6e7f8091"


def test_an_inline_volume_named_after_a_persistent_volume_takes_neither_its_rule_nor_its_pv(
    tmp_path: Path, monkeypatch
) -> None:
    """Another pod's inline ephemeral CSI volume, which its tenant named PV_DB after pod POD's claim, an nfs4 share
    (its server the tenant's): the kubelet records it as Ephemeral. The rule `pv: PV_DB` probes the claim alone,
    never writes into the inline volume (which has the mount check a filesystem has without a rule), and
    target_info gives it its pod but no pv nor driver: neither is a PersistentVolume's."""
    from volprobe.collectors.target import TargetCollector
    from volprobe.view import TargetReading

    from .support.fakeview import FakeView

    root, host = _node(tmp_path)
    monkeypatch.setattr(Host, "mount_for_path", lambda self, path: None)
    monkeypatch.setattr(Host, "device_for_path", lambda self, path: None)
    db = root / "pods" / POD / "volumes" / "kubernetes.io~csi" / PV_DB / "mount"
    inline = root / "pods" / TENANT_POD / "volumes" / "kubernetes.io~csi" / PV_DB
    (inline / "mount").mkdir(parents=True)
    record = {"driverName": "ebs.csi.aws.com", "specVolID": PV_DB, "volumeHandle": "csi-0a1b", "nodeName": "n1"}
    (inline / "vol_data.json").write_text(json.dumps({**record, "volumeLifecycleMode": "Ephemeral"}))
    mountinfo = tmp_path / "proc" / "1" / "mountinfo"
    with mountinfo.open("a") as lines:
        lines.write(f"300 1 0:62 / {inline}/mount rw - nfs4 10.9.9.9:/ rw\n")
    running = _Targets()
    follower = PodVolumeFollower(host, running, threading.Lock(), lambda new: running.running.extend(new), None)  # type: ignore[arg-type]
    kube = {"kubelet_directory": str(root), "rules": [{"pv": PV_DB, "probes": [{"op": "write"}]}]}
    follower.config = config.parse({"kubernetes": kube})
    try:
        follower.rescan()
        by_path = {t.path: t for t in running.running}
        assert [p.op for p in by_path[str(db)].probes] == ["write"]
        assert by_path[f"{inline}/mount"].probes == ()  # its mount check alone
        assert os.listdir(inline / "mount") == []
        assert by_path[f"{inline}/mount"].pod_volume.pv == ""  # type: ignore[union-attr]
        readings = [TargetReading(t.name, t.path, None, t.mount, (), t.config.limits) for t in running.running]
        view = FakeView(targets=readings, drivers=follower.drivers())
        info = {s.labels["target"]: s.labels for s in TargetCollector(view).collect()[0].samples}
        assert (info[str(db)]["pv"], info[str(db)]["pod_uid"], info[str(db)]["driver"]) == (
            PV_DB,
            POD,
            "ebs.csi.aws.com",
        )
        theirs = info[f"{inline}/mount"]
        assert (theirs["pv"], theirs["pod_uid"], theirs["driver"]) == ("", TENANT_POD, "")
    finally:
        targets.close(running.running)


def test_volumes_parse_for_the_fixture(tmp_path: Path) -> None:
    root, _ = _node(tmp_path)
    found = kubelet.pod_volumes(str(root), parse_mountinfo((tmp_path / "proc" / "1" / "mountinfo").read_text()))
    assert {(v.pv, v.backing, v.driver) for v in found} == {
        (PV_WEB, kubelet.FILESYSTEM, "efs.csi.aws.com"),
        (PV_DB, kubelet.BLOCK, "ebs.csi.aws.com"),
    }


BAD_RULE = "kubernetes: {rules: [{driver: efs.csi.aws.com, probe_size: 1MiB}]}\n"


def test_the_exporter_exits_2_on_an_unknown_key_of_a_rule_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "volprobe.yml"
    path.write_text(BAD_RULE)
    result = subprocess.run(
        volprobe_command("--config", str(path), "--web.listen-address", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert "kubernetes.rules[0].probe_size: unknown key" in result.stderr


def test_a_reload_with_a_bad_rule_keeps_the_running_configuration(tmp_path: Path, start_exporter) -> None:
    exporter, path, good = start_with_kept_target(tmp_path, start_exporter)
    refused = "rejected, keeping the running one"
    path.write_text(good + BAD_RULE)
    exporter.process.send_signal(signal.SIGHUP)
    wait_until(lambda: refused in exporter.log() or exporter.process.poll(), what="the rejection", every=0.05)
    assert exporter.process.poll() is None
    assert "kubernetes.rules[0].probe_size: unknown key" in exporter.log()
    before = probes_done(exporter.metrics(), "kept", "write")
    samples = exporter.wait_for(lambda s: probes_done(s, "kept", "write") > before, what="the probe to go on")
    assert sample_value(samples, "volprobe_config_last_reload_successful") == 0
    assert exporter.stop() == 0
