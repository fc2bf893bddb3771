"""No tenant reaches the node (issue 52): a root tenant of a volume a rule probes with write, commit and metadata
probes plants, at every name volprobe uses there, each kind of file it can make (support/tenant.py): before
volprobe starts, between probes and during a sequence. The node's disk and a file outside the volume never
change, no special file planted is ever opened (inotify watches every one), volprobe counts each refusal and
keeps probing, and the kubelet's plain umount of every volume succeeds at the first try. The same attacks against
host directory targets owned by someone else (uid 1000), held open as host targets are.

Before this, the metadata sequence opened `volprobe.new` with O_CREAT|O_TRUNC and no O_EXCL: a block device node
planted there had its first 4 KiB overwritten, a hard link's file was truncated and overwritten."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from volprobe import metadata, ops, probefile
from volprobe.config import PROBE_FILE_NAME
from volprobe.safety import Refused

from .support.harness import MIB, probes_done, run, sample_value, volprobe_command, write_config
from .support.tenant import KINDS, Victims

pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.slow]

DRIVER = "tenant.csi.example"
OWNER = 1000  # a host directory target's owner, as postgres owns /var/lib/postgresql
COMMIT = ops.COMMIT.file
META = metadata.NAME
ID = metadata.ID_NAME
# Names that refuse the whole target when something not volprobe's is there before it starts: the probe file, the
# commit log, the metadata directory and its id.
REFUSING = (PROBE_FILE_NAME, COMMIT, META, f"{META}/{ID}")
# Names volprobe looks at but goes on beside: leftovers of an interrupted creation, an earlier version's sequence
# names. What is there and not volprobe's is left as it is.
BESIDE = (
    f"{PROBE_FILE_NAME}.tmp.1.planted",
    f"{COMMIT}.tmp.1.planted",
    f"{META}/{metadata.OUR_NAMES[0]}",
    f"{META}/{metadata.OUR_NAMES[1]}",
)
PROBES = "[{op: write, interval: 1s}, {op: commit, interval: 1s}, {op: metadata, interval: 500ms}]"
OPS = ("write", "commit", "metadata")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


@contextlib.contextmanager
def _bound(source: Path, point: Path) -> Iterator[None]:
    run("mount", "--bind", str(source), str(point))
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


class Node:
    """A kubelet tree whose CSI volumes are directories of one ext4, bind-mounted at their mount/ as the kubelet
    publishes them; and host directory targets on the same filesystem, owned by OWNER."""

    def __init__(self, root: Path, filesystem: Path, stack: contextlib.ExitStack) -> None:
        self.kubelet, self.filesystem, self.stack = root / "kubelet", filesystem, stack
        self.volumes: dict[str, tuple[Path, Path]] = {}  # key -> (the volume's own directory, its mount point)
        self.hosts: dict[str, Path] = {}

    def volume(self, key: str, filesystem: Path | None = None) -> Path:
        """A pod volume: the directory the tenant sees (on the filesystem, not through the bind)."""
        number = len(self.volumes)
        pod, pv = f"00000000-0000-4000-8000-{number:012d}", f"pvc-{number:08d}-{_slug(key)[:40]}"
        directory = self.kubelet / "pods" / pod / "volumes" / "kubernetes.io~csi" / pv
        point = directory / "mount"
        point.mkdir(parents=True)
        data = {"driverName": DRIVER, "specVolID": pv, "volumeHandle": pv, "volumeLifecycleMode": "Persistent"}
        (directory / "vol_data.json").write_text(json.dumps(data))
        own = (filesystem or self.filesystem) / "volumes" / str(number)
        own.mkdir(parents=True)
        self.stack.enter_context(_bound(own, point))
        self.volumes[key] = (own, point)
        return own

    def host(self, key: str) -> Path:
        directory = self.filesystem / "hosts" / _slug(key)
        directory.mkdir(parents=True)
        os.chown(directory, OWNER, OWNER)
        self.hosts[key] = directory
        return directory

    def point(self, key: str) -> str:
        return str(self.volumes[key][1])

    def config(self, hosts: bool = True) -> str:
        lines = [
            "discovery: {exclude: ['.*']}\n",
            "mount_check: {interval: 500ms, timeout: 5s}\n",
            f"kubernetes: {{kubelet_directory: {self.kubelet}, rescan_interval: 1s,\n",
            f"  rules: [{{driver: {DRIVER}, probe_file_size: 1MiB, probes: {PROBES}}}]}}\n",
        ]
        if hosts and self.hosts:
            lines.append("targets:\n")
            for key, directory in self.hosts.items():
                lines.append(
                    f"  - {{name: {_slug(key)}, directory: {directory}, probe_file_size: 1MiB, probes: {PROBES}}}\n"
                )
        return "".join(lines)


def _plant_at(victims: Victims, directory: Path, name: str, kind: str) -> None:
    """`kind` at `name` (a path relative to the volume) in `directory`; a name in the metadata directory gets that
    directory first, as a run of volprobe (root's, mode 0700) would have left it."""
    path = directory / name
    if path.parent != directory and not path.parent.exists():
        path.parent.mkdir(mode=0o700)
    victims.plant(path, kind)


def _kind_at(path: Path) -> str:
    st = os.lstat(path)
    return {
        0o060000: "block device",
        0o020000: "character device",
        0o120000: "symlink",
        0o010000: "FIFO",
        0o140000: "socket",
        0o040000: "directory",
    }.get(st.st_mode & 0o170000, "hard link" if st.st_nlink > 1 else "regular file")


def _swap(victims: Victims, directory: Path, name: str, kind: str) -> None:
    """Between probes: volprobe's file at `name` moved aside (kept, as a tenant could), `kind` planted there."""
    path = directory / name
    os.rename(path, path.with_name(path.name + ".moved"))
    victims.plant(path, kind)


def _errors(samples, target: str, op: str) -> float:
    return sample_value(samples, "volprobe_probe_errors_total", target=target, op=op, errno="REFUSED") or 0


class Planter:
    """During sequences: inotify on metadata directories; each time volprobe creates a sequence's first name, the
    tenant plants the next kind at the name the sequence renames it to, racing the rename, in one sequence of
    `every`. `planted`: the plants
    made, by directory (a plant that lost the race finds the name taken, or lands after the sequence ended)."""

    def __init__(self, victims: Victims, directories: list[Path], every: int = 3) -> None:
        self.victims, self.tried, self.failure, self.seen, self.every = victims, 0, "", 0, every
        self.planted = dict.fromkeys(directories, 0)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
        self._dirs = {self._libc.inotify_add_watch(self._fd, os.fsencode(str(d)), 0x100): d for d in directories}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._guarded, name="tenant planter", daemon=True)
        self._thread.start()

    def _guarded(self) -> None:
        try:
            self._run()
        except Exception as err:  # said by stop(), which the test asserts on
            self.failure = repr(err)

    def _run(self) -> None:
        prefix = metadata.OUR_NAMES[0] + "."
        while not self._stop.is_set():
            if not select.select([self._fd], [], [], 0.2)[0]:
                continue
            data = os.read(self._fd, 65536)
            at = 0
            while at < len(data):
                wd, _, _, length = struct.unpack_from("iIII", data, at)
                name = data[at + 16 : at + 16 + length].rstrip(b"\0").decode()
                at += 16 + length
                if wd in self._dirs and name.startswith(prefix):
                    self.seen += 1
                    if self.seen % self.every:
                        continue  # this one left to run: a probe refused every time backs off for longer
                    directory = self._dirs[wd]
                    target = directory / (metadata.OUR_NAMES[1] + name[len(prefix) - 1 :])
                    kind = KINDS[self.tried % len(KINDS)]
                    self.tried += 1
                    if self.victims.try_plant(target, kind):
                        self.planted[directory] += 1

    def stop(self) -> str:
        """Stop planting; what went wrong in the planter, if anything."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(5)
            os.close(self._fd)
        return self.failure


def test_a_root_tenant_plants_every_kind_at_every_name_and_reaches_nothing(
    tmp_path, make_loop, mount_fs, lab_volume, start_exporter
) -> None:
    victim = make_loop(4 * MIB, name="victim")
    with open(victim, "wb") as disk:
        disk.write(os.urandom(4 * MIB))
    filesystem = Path(mount_fs(make_loop(512 * MIB, name="volumes")))
    (filesystem / "outside").mkdir()
    (filesystem / "outside" / "victim.dat").write_bytes(os.urandom(64 * 1024))
    (tmp_path / "elsewhere.dat").write_bytes(os.urandom(64 * 1024))
    victims = Victims(victim, filesystem / "outside" / "victim.dat", tmp_path / "elsewhere.dat")
    with contextlib.ExitStack() as stack:
        stack.callback(victims.close)
        node = Node(tmp_path, filesystem, stack)
        # Before start: one volume for each kind at each name that refuses its target; one volume for each kind at
        # every name volprobe goes on beside; the same on host directories for the latter (the former refuse a host
        # target's configuration: test_host_directory_plants_refuse_the_configuration_and_open_nothing).
        for name in REFUSING:
            for kind in KINDS:
                _plant_at(victims, node.volume(f"before {name} {kind}"), name, kind)
        for kind in KINDS:
            for where in (node.volume(f"beside {kind}"), node.host(f"host {kind}")):
                for name in BESIDE:
                    _plant_at(victims, where, name, kind)
                    if where in node.hosts.values() and name.startswith(META):
                        os.chown(where / META, 0, 0)  # volprobe's (root's), as a run of it would have left it
        for kind in KINDS:
            node.volume(f"between {kind}")
        # Its sequences on a lab volume whose writes take 100 ms: each fsync leaves the tenant time to win its race,
        # even on a busy machine.
        slow = Path(mount_fs(lab_volume(size=128 * MIB, write_latency=0.1).device))
        (slow / "outside.dat").write_bytes(os.urandom(64 * 1024))
        victims.add_outside(slow / "outside.dat")
        node.volume("during", slow)

        exporter = start_exporter("--config", write_config(tmp_path, node.config()))
        log_of = exporter.log

        def running(samples, target: str) -> bool:
            return all(probes_done(samples, target, op) >= 2 for op in OPS)

        probing = [node.point(f"beside {k}") for k in KINDS] + [node.point(f"between {k}") for k in KINDS]
        probing += [node.point("during")] + [_slug(f"host {k}") for k in KINDS]
        try:
            exporter.wait_for(
                lambda s: all(running(s, t) for t in probing), timeout=90, what="every volume volprobe may probe probed"
            )
        except AssertionError:
            victims.assert_untouched()  # the worse failure first, if it is one
            raise
        # Each refusing plant refused its volume, said once, and nothing of it is probed.
        log = log_of()
        for name in REFUSING:
            for kind in KINDS:
                key = f"before {name} {kind}"
                own, point = node.volumes[key][0], node.point(key)
                if name == META and kind == "directory":
                    # A directory at that name, root's and 0700, is one volprobe could have made: used as its own.
                    assert running(exporter.metrics(), point), key
                    continue
                pv = point.split("/")[-2]
                said = [line for line in log.splitlines() if f"pod volume {pv} " in line and "cannot be probed" in line]
                assert len(said) == 1, f"{key}: its refusal logged {len(said)} times"
                assert probes_done(exporter.metrics(), point, "write") == 0, key
                assert _kind_at(own / name) == kind, f"{key}: the planted file was touched"
        for kind in KINDS:
            for where in (node.volumes[f"beside {kind}"][0], node.hosts[f"host {kind}"]):
                for name in BESIDE:
                    assert _kind_at(where / name) == kind, f"{where / name}: the planted {kind} was touched"
        victims.assert_untouched()

        # Between probes: volprobe's probe file, commit log and metadata id swapped for each kind; then the metadata
        # directory itself. Each probe counts its refusals and keeps trying (more than one refusal each).
        for kind in KINDS:
            own = node.volumes[f"between {kind}"][0]
            for name in (PROBE_FILE_NAME, COMMIT, f"{META}/{ID}"):
                _swap(victims, own, name, kind)
        exporter.wait_for(
            lambda s: all(_errors(s, node.point(f"between {k}"), op) >= 2 for k in KINDS for op in OPS),
            timeout=60,
            what="every swapped name refused, and tried again",
        )
        for kind in KINDS:
            own = node.volumes[f"between {kind}"][0]
            os.rename(own / META, own / (META + ".moved"))
            victims.plant(own / META, kind)
        refused = {k: _errors(exporter.metrics(), node.point(f"between {k}"), "metadata") for k in KINDS}
        exporter.wait_for(
            lambda s: all(_errors(s, node.point(f"between {k}"), "metadata") > refused[k] for k in KINDS),
            timeout=60,
            what="the swapped metadata directories refused",
        )
        victims.assert_untouched()

        # During sequences: the tenant races each sequence's rename, on a pod volume and on every host target.
        directories = [node.volumes["during"][0] / META] + [node.hosts[f"host {k}"] / META for k in KINDS]
        planter = Planter(victims, directories)
        stack.callback(planter.stop)
        during = node.point("during")
        done = probes_done(exporter.metrics(), during, "metadata")
        try:
            samples = exporter.wait_for(
                lambda s: _errors(s, during, "metadata") >= 3 and probes_done(s, during, "metadata") >= done + 10,
                timeout=180,
                what="sequences refused where the tenant won the race, and sequences going on",
            )
        except AssertionError as err:
            raise AssertionError(
                f"{err}\nplanter: {planter.tried} tried, {planter.planted}, {planter.failure}"
            ) from None
        assert planter.stop() == ""
        # Each refusal is a plant that won its race (one that lost found the name taken, or came too late).
        assert planter.planted[node.volumes["during"][0] / META] >= _errors(samples, during, "metadata")
        for host in (_slug(f"host {k}") for k in KINDS):
            assert running(samples, host)
        victims.assert_untouched()
        assert "Traceback" not in log_of()

        # The kubelet unmounts every volume at the first try, while probes run.
        for key, (_, point) in node.volumes.items():
            result = subprocess.run(["umount", point], capture_output=True, text=True)
            assert result.returncode == 0, f"{key}: {result.stderr}"
        assert exporter.stop() == 0
        victims.assert_untouched()


def test_host_directory_plants_refuse_the_configuration_and_open_nothing(tmp_path, make_loop, mount_fs) -> None:
    """Each kind at each name that refuses a host directory target: `check-config` exits 2 naming every target,
    and opens no special file (nor does a start, which refuses the same way)."""
    victim = make_loop(4 * MIB, name="victim")
    filesystem = Path(mount_fs(make_loop(64 * MIB, name="hosts")))
    (filesystem / "outside.dat").write_bytes(os.urandom(64 * 1024))
    (tmp_path / "elsewhere.dat").write_bytes(os.urandom(64 * 1024))
    victims = Victims(victim, filesystem / "outside.dat", tmp_path / "elsewhere.dat")
    try:
        node = Node(tmp_path, filesystem, contextlib.ExitStack())
        for name in REFUSING:
            for kind in KINDS:
                where = node.host(f"{name} {kind}")
                _plant_at(victims, where, name, kind)
                if name.startswith(f"{META}/"):
                    os.chown(where / META, 0, 0)
        config = write_config(tmp_path, node.config())
        for command in (
            ["check-config", config],
            ["--config", config, "--web.listen-address", "127.0.0.1:0"],
        ):
            result = subprocess.run(volprobe_command(*command), capture_output=True, text=True, timeout=120)
            assert result.returncode == 2, result.stderr
            assert "Traceback" not in result.stderr
            for index, key in enumerate(node.hosts):
                if key == f"{META} directory":  # root's, 0700: one volprobe could have made, used as its own
                    continue
                assert f"targets[{index}]" in result.stderr, f"{key}: not refused: {result.stderr}"
        for key, where in node.hosts.items():
            name = next(n for n in REFUSING if key.startswith(f"{n} "))
            assert _kind_at(where / name) == key[len(name) + 1 :], f"{key}: the planted file was touched"
        victims.assert_untouched()
    finally:
        victims.close()


@pytest.mark.parametrize("kind", ["character device", "FIFO", "socket", "symlink", "directory"])
def test_what_is_not_a_regular_file_is_refused_unopened(tmp_path, kind: str) -> None:
    """open_no_link looks through O_PATH first: what is not a regular file is refused, whatever the open asks for,
    and never opened (the watch sees no open of the special files)."""
    (tmp_path / "outside.dat").write_bytes(b"x")
    victims = Victims(os.devnull, tmp_path / "outside.dat", tmp_path / "outside.dat")
    try:
        victims.plant(tmp_path / "name", kind)
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_DIRECT):
                with pytest.raises(Refused):
                    os.close(probefile.open_no_link("name", flags, fd))
        finally:
            os.close(fd)
        assert victims.watch.opened() == []
    finally:
        victims.close()
