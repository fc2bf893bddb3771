"""A single-node Kubernetes cluster on loopback, for the tests that need a real node (issue 56): etcd,
kube-apiserver, kube-controller-manager, kube-scheduler, containerd and a kubelet, each with its files, sockets
and state under one directory of the test's. /work/shared/kubernetes-node.md has the recipe and why each setting
is there; in short: containerd's CRI with `restrict_oom_score_adj` and `disable_apparmor` (runc fails every
sandbox without them here), a pause image made of a static C program (no registry can be reached), a kubelet on
cgroupfs without per-QoS cgroups (the cgroups are a v1/v2 hybrid), and no loopback node IP: hostNetwork pods
only.

Binaries: $VOLPROBE_KUBE_DIR, else /var/cache/volprobe-ci/kube, where .ci/run builds all five (Kubernetes v1.37.2,
etcd v3.7.3); containerd, ctr and runc from Debian. Images are imported into containerd's `k8s.io` namespace from
podman (`podman save --format docker-archive`), so pods use `imagePullPolicy: Never`.

Teardown, whatever failed: the kubelet stopped first (so that it restarts nothing), then every task and container
of containerd's `k8s.io` namespace killed and removed, containerd stopped, the control plane stopped, and every
mount under the cluster's directory unmounted, deepest first. Then the teardown checks that nothing is left: no
mount under the directory, none of the processes it started (nor their process groups), no containerd shim of
its socket, no cgroup of its containers; and what the kubelet and containerd make on the host whatever their
directories (HOST_PATHS, the `k8s.io` cgroups) removed if the cluster made it, and the kernel settings the
kubelet changes (KERNEL_TUNABLES) restored.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .harness import free_port
from .kubeapi import ApiServer, PortTaken, answers, control_plane, start, stop, tail, write_kubeconfig
from .podman import podman

KUBE_DIR = Path(os.environ.get("VOLPROBE_KUBE_DIR") or "/var/cache/volprobe-ci/kube")
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")
NAMESPACE = "k8s.io"  # containerd's namespace of the CRI's images and containers
PAUSE_IMAGE = f"localhost/volprobe-test-pause:{os.getpid()}-{secrets.token_hex(4)}"  # each run's own tag
PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void done(int signal) { (void)signal; _exit(0); }
int main(void) {
    signal(SIGTERM, done);
    signal(SIGINT, done);
    for (;;) pause();
}
"""
UNVERIFIED = ssl._create_unverified_context()  # the components' own self-signed certificates
NODE_READY_TIMEOUT = 120.0  # seconds: the node registered and Ready; about 10 s on an idle machine


def missing_tools() -> list[str]:
    """What this machine lacks to run a cluster (.ci/run provides all of it)."""
    missing = [str(KUBE_DIR / name) for name in BINARIES if not os.access(KUBE_DIR / name, os.X_OK)]
    missing += [tool for tool in ("containerd", "ctr", "runc", "podman", "gcc") if not shutil.which(tool)]
    return missing


@dataclass
class Cluster:
    api: ApiServer
    node: str  # the node's name
    directory: Path
    socket: Path  # containerd's
    kubelet_root: Path  # the kubelet's --root-dir
    container_ids: set[str] = field(default_factory=set)  # every container seen, for the clean-up's check
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)  # the node's (not the API server's)

    def ctr(self, *args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        result = subprocess.run(
            ["ctr", f"--address={self.socket}", f"--namespace={NAMESPACE}", *args],
            input=input,
            capture_output=True,
            timeout=300,
        )
        assert not check or result.returncode == 0, (args, result.stderr.decode(errors="replace"))
        return result

    def import_image(self, archive: bytes) -> None:
        """A docker-archive (`podman save --format docker-archive`) into the CRI's image store."""
        self.ctr("images", "import", "-", input=archive)

    def tasks(self) -> dict[str, int]:
        """containerd's running tasks of the namespace: container ID -> host pid."""
        found = {}
        for line in self.ctr("tasks", "list").stdout.decode().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                found[fields[0]] = int(fields[1])
        self.container_ids |= set(found)
        return found

    def container_pid(self, pod: dict[str, Any], name: str) -> int:
        """The host pid of a pod's running container (its status's containerID, containerd://ID)."""
        (status,) = [s for s in pod["status"].get("containerStatuses", []) if s["name"] == name]
        container_id = status["containerID"].removeprefix("containerd://")
        return self.tasks()[container_id]

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        query = f"?labelSelector={selector}" if selector else ""
        return list(self.api.get(f"/api/v1/namespaces/{namespace}/pods{query}")["items"])

    def check_running(self) -> None:
        """Fail at once, with the logs, if a component of the node has ended."""
        assert all(p.poll() is None for p in self.processes), self.logs()

    def logs(self) -> str:
        """The end of each component's log, for a failure's message."""
        ended = [f"{p.args[0]} exited with {p.returncode}\n" for p in self.processes if p.poll() is not None]
        files = sorted([*self.directory.glob("run-*/*.log"), *self.directory.glob("*.log")])  # control plane, node
        logs = [f"--- {log.name}\n{tail(log, 3000)}" for log in files]
        return "".join(ended) + "\n".join(logs)


def wait_until(condition: Callable[[], Any], what: str, timeout: float, logs: Callable[[], str] = lambda: "") -> Any:
    """Poll `condition` until it returns something true (which is returned); fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s\n{logs()}")
        time.sleep(0.2)


# -- images ----------------------------------------------------------------------------------------------------


def pause_archive(directory: Path, conf: Path) -> bytes:
    """The sandbox image: a static C program that pauses until SIGTERM, FROM scratch, as a docker-archive."""
    build = directory / "pause"
    build.mkdir()
    (build / "pause.c").write_text(PAUSE_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(build / "pause"), str(build / "pause.c")], check=True)
    (build / "Containerfile").write_text('FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n')
    podman(conf, "build", "--pull=never", "--tag", PAUSE_IMAGE, str(build))
    try:
        return save(conf, PAUSE_IMAGE)
    finally:
        podman(conf, "rmi", "--force", "--ignore", PAUSE_IMAGE, check=False)


def save(conf: Path, image: str) -> bytes:
    """`podman save --format docker-archive`: what `ctr images import` reads."""
    result = subprocess.run(
        ["podman", "save", "--format", "docker-archive", image],
        capture_output=True,
        env={**os.environ, "CONTAINERS_CONF": str(conf)},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    return result.stdout


# -- the components --------------------------------------------------------------------------------------------

CONTAINERD_CONFIG = """\
version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d}/containerd/runc"

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d}/cni"
"""


def kubelet_configuration(d: Path, socket: Path, port: int, healthz: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,  # the cgroups here are a v1/v2 hybrid
        "failSwapOn": False,
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "containerRuntimeEndpoint": f"unix://{socket}",
        "address": "127.0.0.1",
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "podLogsDir": str(d / "pod-logs"),
        "imageGCHighThresholdPercent": 100,  # never remove an image: they cannot be pulled again
        "imageGCLowThresholdPercent": 99,
        # A shared CI disk and memory are not this node's to protect: no eviction of the test's pods.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "0%", "imagefs.available": "0%"},
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "nodeStatusReportFrequency": "10s",
        "serializeImagePulls": False,
        "registerNode": True,
    }


# What the kubelet and containerd make on the host whatever their directories: the device plugins' socket
# (/var/lib/kubelet/device-plugins, fixed in the kubelet), the containers' log links (/var/log/containers), the
# shims' sockets (/run/containerd/s, fixed in containerd 1.6), and the cgroup `k8s.io` (the CRI namespace) in every
# hierarchy, whose children are the containers' (no cgroupsPerQOS, so no kubepods). Each is removed afterwards if
# the cluster made it, and only if nothing but directories and sockets is left in it.
# The kernel's settings the kubelet sets at start to what it wants (its container manager's kernel tunables: no
# flag turns that off, and protectKernelDefaults only makes it refuse to start): restored when it has stopped, so
# that a test's node does not leave the machine rebooting 10 s after an oops.
KERNEL_TUNABLES = tuple(
    Path("/proc/sys", name)
    for name in (
        "vm/overcommit_memory",
        "vm/panic_on_oom",
        "kernel/panic",
        "kernel/panic_on_oops",
        "kernel/keys/root_maxkeys",
        "kernel/keys/root_maxbytes",
    )
)
HOST_PATHS = (Path("/var/lib/kubelet"), Path("/var/log/containers"), Path("/run/containerd"))


def namespace_cgroups() -> list[Path]:
    return [hierarchy / NAMESPACE for hierarchy in Path("/sys/fs/cgroup").iterdir() if hierarchy.is_dir()]


def remove_made(path: Path) -> str | None:
    """`path` removed, bottom up, if it holds only directories, sockets and symbolic links; else what is left."""
    if not path.exists():
        return None
    for root, directories, files in os.walk(path, topdown=False):
        for name in files:
            entry = Path(root, name)
            if entry.is_socket() or entry.is_symlink():
                entry.unlink(missing_ok=True)
        for name in directories:
            with contextlib.suppress(OSError):
                os.rmdir(Path(root, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)
    return str(path) if path.exists() else None


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or under `directory`, from this process's mount table, deepest (then latest) first."""
    found = []
    prefix = str(directory).rstrip("/") + "/"
    for index, line in enumerate(Path("/proc/self/mountinfo").read_text().splitlines()):
        point = line.split()[4].encode().decode("unicode_escape")
        if point == str(directory) or point.startswith(prefix):
            found.append((point.count("/"), index, point))
    return [point for _, _, point in sorted(found, reverse=True)]


def unmount_all(directory: Path) -> None:
    for _ in range(10):
        points = mounts_under(directory)
        if not points:
            return
        for point in points:
            if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                subprocess.run(["umount", "--lazy", point], capture_output=True)


def own_shims(socket: Path) -> list[int]:
    """containerd shims started for this containerd (their command line names its socket)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if command and command[0].endswith(b"containerd-shim-runc-v2") and str(socket).encode() in command:
            found.append(int(entry.name))
    return found


def own_cgroups(container_ids: set[str]) -> list[str]:
    """Cgroup directories named after one of these containers, in every hierarchy."""
    found = []
    if not container_ids:
        return found
    for root, directories, _ in os.walk("/sys/fs/cgroup"):
        for name in directories:
            if any(container_id in name for container_id in container_ids):
                found.append(os.path.join(root, name))
    return found


def remove_containers(cluster: Cluster) -> None:
    """Every task of the namespace killed and deleted, then every container (the pods' and their sandboxes')."""
    listed = cluster.ctr("containers", "list", "--quiet", check=False).stdout.decode().split()
    cluster.container_ids |= set(listed)
    tasks = {}
    with contextlib.suppress(AssertionError):  # containerd not answering: the shims are killed afterwards
        tasks = cluster.tasks() if listed else {}
    for container_id in tasks:
        cluster.ctr("tasks", "kill", "--signal=SIGKILL", container_id, check=False)
    for container_id in listed:
        for _ in range(50):
            deleted = cluster.ctr("tasks", "delete", "--force", container_id, check=False)
            if deleted.returncode == 0 or b"not found" in deleted.stderr:
                break
            time.sleep(0.1)
        cluster.ctr("containers", "delete", container_id, check=False)


@contextlib.contextmanager
def cluster(directory: Path, helm: str, images: list[bytes]) -> Iterator[Cluster]:
    """The cluster, its files in `directory` (kept short: containerd's socket path must fit a sockaddr_un), with
    these docker-archives imported, its node Ready, until the block ends; then everything torn down and checked."""
    assert len(str(directory)) < 60, f"{directory}: too long a path for containerd's sockets"
    missing = missing_tools()
    assert not missing, f"not there: {missing}"
    started_at = time.monotonic()
    admin_token, node_token = secrets.token_hex(24), secrets.token_hex(24)
    node = f"volprobe-test-{secrets.token_hex(4)}"
    tokens = directory / "tokens.csv"
    tokens.write_text(
        f'{admin_token},admin,admin-uid,"system:masters"\n{node_token},system:node:{node},node-uid,"system:nodes"\n'
    )
    tokens.chmod(0o600)
    key = directory / "service-account.key"
    subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
    subprocess.run(
        ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(key.with_suffix(".pub"))],
        check=True,
        capture_output=True,
    )
    home = directory / "home"
    home.mkdir()
    socket = directory / "containerd.sock"
    kubelet_root = directory / "kubelet"
    started: list[subprocess.Popen[bytes]] = []
    the_cluster: Cluster | None = None
    made = [path for path in (*HOST_PATHS, *namespace_cgroups()) if not path.exists()]
    tunables = {path: path.read_text() for path in KERNEL_TUNABLES if path.exists()}
    try:
        with contextlib.ExitStack() as running:
            for attempt in range(1, 4):
                try:
                    url, ca = control_plane(
                        KUBE_DIR, directory / f"run-{attempt}", tokens, key, running, started, "Node,RBAC"
                    )
                    break
                except PortTaken:
                    running.close()
                    if attempt == 3:
                        raise
            kubeconfig = directory / "kubeconfig"
            write_kubeconfig(kubeconfig, url, ca, admin_token)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
            env |= {
                "HOME": str(home),
                "KUBECONFIG": str(kubeconfig),
                "HELM_CACHE_HOME": str(home / "helm-cache"),
                "HELM_CONFIG_HOME": str(home / "helm-config"),
                "HELM_DATA_HOME": str(home / "helm-data"),
            }
            api = ApiServer(url, admin_token, ca, kubeconfig, helm, env, directory)
            the_cluster = running_cluster = Cluster(api, node, directory, socket, kubelet_root)
            for name, extra in (
                (
                    "kube-controller-manager",
                    [
                        f"--service-account-private-key-file={key}",
                        f"--root-ca-file={ca}",
                        "--use-service-account-credentials=false",
                    ],
                ),
                ("kube-scheduler", []),
            ):
                port = free_port()
                process = start(
                    [
                        str(KUBE_DIR / name),
                        f"--kubeconfig={kubeconfig}",
                        "--leader-elect=false",
                        "--bind-address=127.0.0.1",
                        f"--secure-port={port}",
                        f"--cert-dir={directory / (name + '-pki')}",  # not /var/run/kubernetes
                        *extra,
                    ],
                    directory / f"{name}.log",
                    # /healthz needs no credentials; the certificate is the component's own, self-signed
                    lambda port=port: answers(f"https://127.0.0.1:{port}/healthz", b"ok".__eq__, UNVERIFIED),
                    name,
                )
                started.append(process)
                running_cluster.processes.append(process)
                running.callback(stop, process)

            # containerd, then the images
            for sub in ("containerd", "cni", "pod-logs"):
                (directory / sub).mkdir()
            # No pod network: hostNetwork pods only. A loopback-only network keeps the CRI's network status ready
            # (else the node is not Ready).
            (directory / "cni" / "10-loopback.conflist").write_text(
                json.dumps({"cniVersion": "1.0.0", "name": "volprobe-test", "plugins": [{"type": "loopback"}]})
            )
            config = directory / "containerd.toml"
            config.write_text(CONTAINERD_CONFIG.format(d=directory, socket=socket, pause=PAUSE_IMAGE))
            containerd = start(
                ["containerd", f"--config={config}"],
                directory / "containerd.log",
                lambda: socket.exists() and running_cluster.ctr("version", check=False).returncode == 0,
                "containerd",
            )
            started.append(containerd)
            running_cluster.processes.append(containerd)

            def stop_containerd() -> None:
                try:
                    remove_containers(running_cluster)
                finally:
                    stop(containerd)

            running.callback(stop_containerd)
            for archive in images:
                running_cluster.import_image(archive)

            # the kubelet
            kubelet_root.mkdir()
            node_kubeconfig = directory / "node.kubeconfig"
            write_kubeconfig(node_kubeconfig, url, ca, node_token)
            kubelet_config = directory / "kubelet.yaml"
            healthz = free_port()
            kubelet_config.write_text(yaml.safe_dump(kubelet_configuration(directory, socket, free_port(), healthz)))
            kubelet = start(
                [
                    str(KUBE_DIR / "kubelet"),
                    f"--config={kubelet_config}",
                    f"--kubeconfig={node_kubeconfig}",
                    f"--root-dir={kubelet_root}",
                    f"--cert-dir={directory / 'kubelet-pki'}",
                    f"--hostname-override={node}",
                    "--v=2",
                ],
                directory / "kubelet.log",
                lambda: answers(f"http://127.0.0.1:{healthz}/healthz", b"ok".__eq__),
                "kubelet",
            )
            started.append(kubelet)
            running_cluster.processes.append(kubelet)
            running.callback(stop, kubelet)  # first of all: nothing restarted while the rest goes

            def ready() -> bool:
                status, _, raw = api.request("GET", f"/api/v1/nodes/{node}")
                if status != 200:
                    return False
                conditions = {c["type"]: c["status"] for c in json.loads(raw)["status"].get("conditions", [])}
                return conditions.get("Ready") == "True"

            wait_until(ready, f"node {node} Ready", NODE_READY_TIMEOUT, running_cluster.logs)
            print(f"\ncluster {node}: up in {time.monotonic() - started_at:.1f} s")
            yield running_cluster
            stopping = time.monotonic()
        print(f"cluster {node}: down in {time.monotonic() - stopping:.1f} s")
    finally:
        for path, value in tunables.items():
            with contextlib.suppress(OSError):
                path.write_text(value)
        unmount_all(directory)
        left: list[str] = []
        changed = [str(path) for path, value in tunables.items() if path.read_text() != value]
        if changed:
            left.append(f"kernel settings not restored: {changed}")
        for process in started:
            if process.poll() is None:
                left.append(f"{process.args[0]} (pid {process.pid}) still running")
                process.kill()
            try:
                os.killpg(process.pid, 0)
                left.append(f"process group of {process.args[0]} ({process.pid}) not empty")
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shims = own_shims(socket)
        for pid in shims:
            left.append(f"containerd shim {pid}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        unmount_all(directory)
        mounts = mounts_under(directory)
        if mounts:
            left.append(f"mounts: {mounts}")
        if the_cluster is not None:
            cgroups = own_cgroups(the_cluster.container_ids)
            for path in cgroups:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            if cgroups:
                left.append(f"cgroups: {cgroups}")
        for path in made:  # the host's, made by the node: removed (cgroups: only when empty)
            if path.is_relative_to("/sys/fs/cgroup"):
                with contextlib.suppress(OSError):
                    path.rmdir()
                if path.exists():
                    left.append(f"cgroup {path}")
            elif (kept := remove_made(path)) is not None:
                left.append(f"{kept} (made by the node, not empty)")
        assert not left, f"the cluster left behind: {left}"
