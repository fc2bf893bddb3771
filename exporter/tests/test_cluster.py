"""The Helm chart on a real node (issue 56): a single-node cluster (support/cluster.py: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, containerd and a kubelet, all on loopback) runs volprobe's image, built
from deploy/Dockerfile as test_image builds it, and the chart is installed with `helm install`, every value its
default but the image (never pulled: imported into containerd), hostNetwork (the node has no pod network), the
port (a free one: the node's network is the machine's), the kubelet's directory (the test node's) and, in the
first test, basic auth (webConfig). What test_image runs through a translation to podman, a kubelet and
containerd run here as on a cluster's node.

- The DaemonSet controller makes the pod, the scheduler binds it to the node, the init container ends, volprobe's
  container turns Ready (the readiness probe, without credentials, with basic auth on), and a scrape with the
  credentials shows volprobe's metrics (none without); `helm upgrade` with another config replaces the pod.
  This is also what proves that the container starts at all under the read-only host /dev (the termination
  message path out of it).
- In each of the chart's modes (the defaults; a `config.kubernetes.rules` rule; `awsNvmeStats`) every thread of
  volprobe's process, found through containerd, has the capabilities README's "Privileges" says (none by default;
  CAP_SYS_ADMIN alone otherwise) and no_new_privs, and the metric volprobe_capabilities_kept_info says so.

Needs root, the binaries .ci/run builds into $VOLPROBE_KUBE_DIR (else skipped), containerd, podman, gcc. The
module's tests share one cluster (xdist_group "cluster"): about 16 s to start once built, 5 s to stop. The
chart's state directory is a hostPath in the cluster's own directory (stateHostPath), never the machine's
/var/lib/volprobe: an exporter that another test runs as root beside this one takes that one where it exists.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml

from .support.chart import CHART, find_helm, operator_crd_directory
from .support.cluster import Cluster, cluster, missing_tools, mounts_under, pause_archive, save, wait_until
from .support.harness import free_port, parse_metrics
from .support.image import SYS_ADMIN, Built, built_image, task_privileges
from .support.kubeapi import install_crds

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.xdist_group("cluster")]

POD_TIMEOUT = 180.0  # seconds: scheduled, init container run, Ready; about 10 s on an idle machine
USER, PASSWORD = "prometheus", "volprobe-test-password"
SELECTOR = "app.kubernetes.io/name=volprobe"


@pytest.fixture(scope="module")
def helm() -> str:
    return find_helm()


@dataclass
class Node:
    cluster: Cluster
    image: Built  # volprobe's, imported into its containerd


@pytest.fixture(scope="module")
def running(helm: str) -> Iterator[Node]:
    if os.geteuid() != 0:
        pytest.skip("needs root (containerd, the kubelet)")
    missing = missing_tools()
    if missing:
        pytest.skip(f"not there: {' '.join(missing)} (.ci/run builds and installs them)")
    crds = operator_crd_directory()
    if crds is None:
        pytest.skip("no $VOLPROBE_OPERATOR_CRDS, and prometheus-operator is not in Go's module cache (.ci/run)")
    directory = Path(tempfile.mkdtemp(prefix="vp-node-", dir="/tmp"))  # short: containerd's socket paths
    try:
        (directory / "podman").mkdir()
        with built_image(directory / "podman") as image:
            archives = [pause_archive(directory, image.conf), save(image.conf, image.image)]
        (directory / "c").mkdir()
        with cluster(directory / "c", helm, archives) as node:
            install_crds(node.api, crds)
            yield Node(node, image)
    finally:
        if not mounts_under(directory):  # else kept, and the fixture's own check has failed
            shutil.rmtree(directory, ignore_errors=True)


def values(node: Cluster, image: Built, port: int, **more: Any) -> dict[str, Any]:
    """The chart's values: its defaults, but for this image, this node and its network."""
    repository, tag = image.image.rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "hostNetwork": True,
        "service": {"port": port},
        "kubeletDirectory": str(node.kubelet_root),
        # Not the machine's /var/lib/volprobe: an exporter another test runs as root takes that one if it exists.
        "stateHostPath": str(node.directory / "state"),
        **more,
    }


def helm_run(node: Cluster, *args: str) -> None:
    result = node.api.run_helm(*args)
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"


def install(node: Cluster, release: str, namespace: str, chart_values: dict[str, Any], upgrade: bool = False) -> None:
    path = node.directory / f"{release}-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(chart_values))
    verb = ("upgrade",) if upgrade else ("install", "--create-namespace")
    helm_run(node, *verb, release, str(CHART), "--namespace", namespace, "--values", str(path))


def conditions(pod: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}


def ready_pod(node: Cluster, namespace: str, not_uid: str = "") -> dict[str, Any] | None:
    """The release's one pod, once it is Ready (and is not the pod `not_uid`, which must be gone)."""
    node.check_running()
    pods = node.pods(namespace, SELECTOR)
    if len(pods) != 1:
        return None
    (pod,) = pods
    if pod["metadata"]["uid"] == not_uid or "deletionTimestamp" in pod["metadata"]:
        return None
    return pod if conditions(pod).get("Ready") == "True" else None


def wait_ready(node: Cluster, namespace: str, not_uid: str = "") -> dict[str, Any]:
    def logs() -> str:
        pods = node.pods(namespace)
        return yaml.safe_dump([p.get("status") for p in pods]) + node.logs()

    pod: dict[str, Any] = wait_until(
        lambda: ready_pod(node, namespace, not_uid), f"a Ready pod in {namespace}", POD_TIMEOUT, logs
    )
    return pod


def uninstall(node: Cluster, release: str, namespace: str) -> None:
    """The release gone, and its pods with it (their containers stopped)."""
    helm_run(node, "uninstall", release, "--namespace", namespace)
    wait_until(lambda: not node.pods(namespace), f"the pods of {namespace} gone", POD_TIMEOUT, node.logs)


def scrape(port: int, path: str = "/metrics", user: str = "", password: str = "") -> tuple[int, str]:
    headers = {}
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


def test_the_chart_runs_on_a_node_with_basic_auth_and_rolls_on_upgrade(running: Node) -> None:
    node, built = running.cluster, running.image
    namespace, release, port = "monitoring", "volprobe", free_port()
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    chart_values = values(node, built, port, webConfig={"basic_auth_users": {USER: hashed}})
    install(node, release, namespace, chart_values)
    try:
        pod = wait_ready(node, namespace)
        # Made by the DaemonSet controller, bound to the node by the scheduler.
        (owner,) = pod["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["controller"]) == ("DaemonSet", True), owner
        assert pod["spec"]["nodeName"] == node.node
        events = node.api.get(f"/api/v1/namespaces/{namespace}/events")["items"]
        scheduled = [
            e for e in events if e["involvedObject"].get("uid") == pod["metadata"]["uid"] and e["reason"] == "Scheduled"
        ]
        assert scheduled and node.node in scheduled[0]["message"], events
        (init,) = pod["status"]["initContainerStatuses"]
        assert init["state"]["terminated"]["exitCode"] == 0, init
        (main,) = pod["status"]["containerStatuses"]
        assert main["ready"] and main["restartCount"] == 0, main
        assert pod["spec"]["containers"][0]["terminationMessagePath"] == "/tmp/termination-log"

        assert scrape(port)[0] == 401
        assert scrape(port, user=USER, password="wrong")[0] == 401
        _, text = wait_until(
            lambda: (lambda reply: reply if reply[0] == 200 else None)(scrape(port, user=USER, password=PASSWORD)),
            "a scrape with the credentials",
            60,
        )
        samples = parse_metrics(text)
        assert samples["volprobe_capabilities_kept_info"] == [({"capabilities": "none"}, 1.0)], text[:2000]
        assert any(name.startswith("volprobe_") for name in samples if name != "volprobe_capabilities_kept_info")

        # Another config: a new pod template (checksum/config), so the DaemonSet replaces the pod.
        changed = {**chart_values, "config": {**yaml.safe_load((CHART / "values.yaml").read_text())["config"]}}
        changed["config"]["defaults"] = {"interval": "2s", "window": "5m"}
        install(node, release, namespace, changed, upgrade=True)
        replaced = wait_ready(node, namespace, not_uid=pod["metadata"]["uid"])
        assert replaced["metadata"]["annotations"] != pod["metadata"]["annotations"]
        assert wait_until(lambda: scrape(port, user=USER, password=PASSWORD)[0] == 200, "a scrape after upgrade", 60)
    finally:
        uninstall(node, release, namespace)


# What README's "Privileges" says each of the chart's modes runs volprobe with: its values, the uid, the
# capabilities left (in every set but the bounding one, which only root can narrow).
MODES = {
    "default": ({}, 65534, 0),
    "a rule": ({"config": {"kubernetes": {"rules": [{"driver": "efs.csi.aws.com"}]}}}, 0, SYS_ADMIN),
    "awsNvmeStats": ({"awsNvmeStats": True}, 0, SYS_ADMIN),
}


@pytest.mark.parametrize("mode", MODES)
def test_the_charts_pod_keeps_only_its_modes_capabilities_on_a_node(running: Node, mode: str) -> None:
    node, built = running.cluster, running.image
    extra, uid, kept = MODES[mode]
    namespace = release = f"caps-{list(MODES).index(mode)}"
    port = free_port()
    chart_values = values(node, built, port, **extra)
    if "config" in extra:  # the rule's pod volumes are the test node's kubelet's
        config = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
        kubernetes = {**extra["config"]["kubernetes"], "kubelet_directory": str(node.kubelet_root)}
        chart_values["config"] = {**config, "kubernetes": kubernetes}
    install(node, release, namespace, chart_values)
    try:
        pod = wait_ready(node, namespace)
        pid = node.container_pid(pod, "volprobe")
        threads = task_privileges(str(pid))
        print(f"\n{mode}: {len(threads)} threads; {next(iter(threads.values()))}")
        assert len(threads) >= 2, threads
        expected = {"CapInh": 0, "CapPrm": kept, "CapEff": kept, "CapAmb": 0, "NoNewPrivs": 1, "Uid": uid}
        wrong = {name: found for name, found in threads.items() if {**found, "CapBnd": 0} != {**expected, "CapBnd": 0}}
        assert wrong == {}, threads
        if uid == 0:
            assert {found["CapBnd"] for found in threads.values()} == {kept}, threads
        status, text = scrape(port)
        assert status == 200, status
        text_kept = "CAP_SYS_ADMIN" if kept else "none"
        assert parse_metrics(text)["volprobe_capabilities_kept_info"] == [({"capabilities": text_kept}, 1.0)]
    finally:
        uninstall(node, release, namespace)
    assert not any(p == pid for p in node.tasks().values()), "the pod's container is still running"


def test_helm_is_the_clusters(running: Node) -> None:
    node = running.cluster
    """The fixture's helm talks to this cluster: the node is listed by its API (a sanity check of the kubeconfig
    helm and the tests share)."""
    nodes = node.api.get("/api/v1/nodes")["items"]
    assert [n["metadata"]["name"] for n in nodes] == [node.node]
    result = subprocess.run(
        [node.api.helm, "list", "--all-namespaces", "--output=json"], env=node.api.helm_env, capture_output=True
    )
    assert result.returncode == 0, result.stderr
