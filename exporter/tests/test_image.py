"""The container image, built from deploy/Dockerfile and run as the Helm chart's DaemonSet runs it (issues 25, 42).

The chart (deploy/chart/volprobe) is rendered with `helm template` for the image just built and a configuration
that probes a loop device, every other value its default. Its DaemonSet's pod becomes podman commands
(support/kubelet.py's pod_to_podman, which refuses any field it does not translate, so a field added to the
chart cannot go unrun), run as a kubelet would run them: the volumes' host side made, the init container to its
end, then volprobe's container, whose readiness and liveness probes are checked as the kubelet checks them. Then
the device's probes on /metrics, and a clean exit on SIGTERM that leaves the state written, nobody's. The chart's
defaults are the kustomize base's DaemonSet (test_chart holds them equal), so this runs that pod too. The
translation itself is tested here without podman, on a small pod.

No registry can be reached here, so the base image is a local stand-in for python:3.11-slim-bookworm, made with
mmdebstrap from the machine's Debian mirror (/work/shared/containers.md has the recipe and why each step is
there). That base is slow to make and changes only with its recipe: it is cached outside the checkout as a
tarball keyed by the recipe's hash, and kept in podman's storage under its own tag (never the official name).
So are the build's apt-get steps (tagged beside it, gone with it); the steps that copy the checkout, the volprobe
image and the pod's containers are removed at the end. Warm (the base and the apt-get steps cached) about 30 s:
15 to 20 s of pip in the build, 4 s for the pod; cold, about 50 s more for the base.
"""

from __future__ import annotations

import base64
import copy
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .support.chart import CHART, container, daemonset_pod, find_helm, template, volprobe_yml
from .support.harness import free_port, parse_metrics, probes_done
from .support.image import SYS_ADMIN, Built, built_image, task_privileges
from .support.kubelet import HostDirectory, HostFile, PodmanPod, Probe, UnsupportedField, pod_to_podman, prepare, probe
from .support.podman import as_udev_would, needs, podman

needs_podman = needs("podman", "mmdebstrap")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def wait_for(predicate, what: str, logs, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def helm() -> str:
    return find_helm()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Iterator[Built]:
    """deploy/Dockerfile built with podman on the local base, for this module's pods; removed at its end (the
    unchanging build steps kept for the next run)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (podman's storage)")
    with built_image(tmp_path_factory.mktemp("podman")) as image:
        yield image


@pytest.mark.root
@pytest.mark.slow
@needs_podman
def test_the_image_builds_and_serves_a_devices_probes_as_the_charts_daemonset_runs_it(helm, built, tmp_path, make_loop):
    started = time.monotonic()
    with as_udev_would(make_loop(16 * 1024 * 1024)) as device:
        _run_the_charts_pod(built.conf, tmp_path, helm, built.image, built.name, device)
    print(f"pod {time.monotonic() - started:.1f} s")


def _run_the_charts_pod(conf: Path, tmp_path: Path, helm: str, image: str, name: str, device: str) -> None:
    """The chart rendered for this image, with a configuration that probes `device` and every other value its
    default; its DaemonSet's pod run as a kubelet runs it: the host side of its volumes, its init container to its
    end, then its container, whose readiness and liveness probes pass as the kubelet checks them. Then the
    device's read probes on /metrics, and a clean stop that leaves the state written, nobody's."""
    repository, tag = image.rsplit(":", 1)
    config = {"state_directory": "/var/lib/volprobe", "targets": [{"name": "vol", "device": device}]}
    # Helm merges a values file's maps into the chart's: its other config keys (its discovery of every disk of
    # the node, which would read this machine's disks) are set to null, which takes them out.
    chart_config = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {"image": {"repository": repository, "tag": tag}, "config": {**dict.fromkeys(chart_config), **config}}
        )
    )
    objects = template(helm, values)
    assert yaml.safe_load(volprobe_yml(objects)) == config
    pod, main = daemonset_pod(objects), container(objects)
    # The pod's own network, as the chart's default (hostNetwork: false) gives it: the container listens on its
    # port (service.port, 10130) in a network namespace of its own, podman's bridge, as in a pod; that port is
    # published on a free port of the host's 127.0.0.1, where the probes and the scrapes reach it (the kubelet's
    # go to the pod's IP). So no value changes for this run. On the host's network the port would be the host's,
    # chosen free through service.port: pod_to_podman refuses to publish it elsewhere.
    published = {port["containerPort"]: free_port() for port in main["ports"]}
    # The node's /var/lib/volprobe is a directory of this test's, which the kubelet's part (prepare) makes, root's
    # 0755 (hostPath DirectoryOrCreate), for the init container to give to nobody. /dev and /proc are the real
    # ones: every container mounts them read-only (checked here), the loop device is opened through /dev.
    # The node's kubelet directory is an empty one of the test's (a node without pods): the chart mounts it
    # read-only with HostToContainer propagation, and volprobe finds no pod volume in the mount table there.
    state = tmp_path / "node" / "var-lib-volprobe"
    kubelet = tmp_path / "node" / "var-lib-kubelet"
    kubelet.mkdir(parents=True)
    host_paths = {"/var/lib/volprobe": state, "/var/lib/kubelet": kubelet, "/dev": Path("/dev"), "/proc": Path("/proc")}
    real = {
        volume["name"]
        for volume in pod["spec"]["volumes"]
        if "hostPath" in volume and host_paths.get(volume["hostPath"]["path"]) == Path(volume["hostPath"]["path"])
    }
    for each in [*pod["spec"].get("initContainers", ()), *pod["spec"]["containers"]]:
        for mount in each.get("volumeMounts", ()):
            assert mount["name"] not in real or mount.get("readOnly"), f"{each['name']} may write the host's {mount}"
    run = pod_to_podman(pod, objects, prefix=name, host_paths=host_paths, scratch=tmp_path / "pod", published=published)
    prepare(run)
    assert (state.stat().st_uid, state.stat().st_gid) == (0, 0)
    for init in run.init_containers:  # each to its end, in order, before the containers start: as the kubelet
        podman(conf, "run", "--rm", f"--name={init.name}", *init.arguments, timeout=120)
    assert (state.stat().st_uid, state.stat().st_gid) == (65534, 65534), "the init step gives it to nobody"
    (volprobe,) = run.containers
    podman(conf, "run", "--detach", f"--name={volprobe.name}", *volprobe.arguments)

    def logs() -> str:
        result = podman(conf, "logs", volprobe.name, check=False)
        return result.stdout + result.stderr

    assert set(volprobe.probes) == {"readinessProbe", "livenessProbe"}, volprobe.probes
    wait_for(lambda: probe(volprobe.probes["readinessProbe"]), "the readiness probe", logs)
    assert probe(volprobe.probes["livenessProbe"]), logs()
    # What the process is: nobody, in group disk (supplementalGroups), with no capability at all.
    pid = podman(conf, "inspect", "--format={{.State.Pid}}", volprobe.name).stdout.strip()
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert status["Uid"].split()[:2] == ["65534", "65534"] and status["Gid"].split()[:2] == ["65534", "65534"]
    assert "6" in status["Groups"].split() and int(status["CapEff"], 16) == 0, status
    (port,) = main["ports"]
    url = f"http://127.0.0.1:{published[port['containerPort']]}"
    first = wait_for(lambda: probes_done(parse_metrics(get(f"{url}/metrics")), "vol"), "a read probe", logs)
    wait_for(lambda: probes_done(parse_metrics(get(f"{url}/metrics")), "vol") > first, "more read probes", logs)
    assert probe(volprobe.probes["livenessProbe"]), logs()
    # SIGTERM, as the kubelet stops a pod (SIGKILL after terminationGracePeriodSeconds, the container's stop
    # timeout): volprobe saves its state and exits 0.
    podman(conf, "stop", volprobe.name, timeout=run.stop_timeout + 30)
    exit_code = podman(conf, "inspect", "--format={{.State.ExitCode}}", volprobe.name).stdout.strip()
    assert exit_code == "0", logs()
    saved = list(state.glob("volume-*.json"))
    assert saved and all(f.stat().st_uid == 65534 for f in saved), logs()


# What each of the chart's modes runs volprobe with: its values beside a configuration (the state directory, and a
# loop device's target where `device`), the uid, the capabilities left in every set, whether the container is
# privileged (every capability and device given, whatever the chart asks: volprobe drops what it does not use).
POD_MODES = {
    "default": ({}, True, 65534, 0, True),
    "a rule": ({"config": {"kubernetes": {"rules": [{"driver": "efs.csi.aws.com"}]}}}, True, 0, SYS_ADMIN, True),
    "awsNvmeStats": ({"awsNvmeStats": True}, True, 0, SYS_ADMIN, True),
    # Pod volumes alone: no host device to open, so not privileged; the runtime's list is then the one applied.
    "a rule, pod volumes only": (
        {"config": {"kubernetes": {"rules": [{"driver": "efs.csi.aws.com"}]}}},
        False,
        0,
        SYS_ADMIN,
        False,
    ),
}


@pytest.mark.root
@pytest.mark.slow
@needs_podman
@pytest.mark.parametrize("mode", POD_MODES)
def test_the_charts_pod_keeps_only_the_capabilities_of_its_mode(helm, built, tmp_path, make_loop, mode):
    """The chart's pod in each mode, run as the kubelet would (a privileged container under podman, as under
    containerd, has every capability in every set whatever its list says): every thread of volprobe has exactly
    its mode's capabilities left (none by default; CAP_SYS_ADMIN with a rule or awsNvmeStats), nothing inheritable
    or ambient, and no_new_privs; as root, its bounding set is that too. (Nobody, without CAP_SETPCAP, cannot
    narrow its bounding set; with no_new_privs and no capability, nothing in it can be had.)"""
    extra, device_target, uid, kept, privileged = POD_MODES[mode]
    with as_udev_would(make_loop(16 * 1024 * 1024)) as device:
        config = {"state_directory": "/var/lib/volprobe"}
        if device_target:
            config["targets"] = [{"name": "vol", "device": device}]
        repository, tag = built.image.rsplit(":", 1)
        chart_config = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
        values = tmp_path / "values.yaml"
        merged = {**dict.fromkeys(chart_config), **config, **extra.get("config", {})}
        values.write_text(yaml.safe_dump({**extra, "image": {"repository": repository, "tag": tag}, "config": merged}))
        objects = template(helm, values)
        pod, main = daemonset_pod(objects), container(objects)
        assert main["securityContext"]["privileged"] is privileged
        published = {port["containerPort"]: free_port() for port in main["ports"]}
        state, kubelet = tmp_path / "node" / "var-lib-volprobe", tmp_path / "node" / "var-lib-kubelet"
        kubelet.mkdir(parents=True)
        host_paths = {
            "/var/lib/volprobe": state,
            "/var/lib/kubelet": kubelet,
            "/dev": Path("/dev"),
            "/proc": Path("/proc"),
        }
        prefix = f"{built.name}-{uuid.uuid4().hex[:6]}"
        run = pod_to_podman(
            pod, objects, prefix=prefix, host_paths=host_paths, scratch=tmp_path / "pod", published=published
        )
        assert ("--privileged" in run.containers[0].arguments) is privileged
        prepare(run)
        for init in run.init_containers:
            podman(built.conf, "run", "--rm", f"--name={init.name}", *init.arguments, timeout=120)
        (volprobe,) = run.containers
        podman(built.conf, "run", "--detach", f"--name={volprobe.name}", *volprobe.arguments)
        try:

            def logs() -> str:
                result = podman(built.conf, "logs", volprobe.name, check=False)
                return result.stdout + result.stderr

            wait_for(lambda: probe(volprobe.probes["readinessProbe"]), "the readiness probe", logs)
            url = f"http://127.0.0.1:{published[main['ports'][0]['containerPort']]}"
            if device_target:  # the probes' threads and the C engine's are running
                wait_for(lambda: probes_done(parse_metrics(get(f"{url}/metrics")), "vol"), "a read probe", logs)
            samples = parse_metrics(get(f"{url}/metrics"))
            pid = podman(built.conf, "inspect", "--format={{.State.Pid}}", volprobe.name).stdout.strip()
            threads = task_privileges(pid)
            print(f"\n{mode}: {len(threads)} threads; {next(iter(threads.values()))}")
            assert len(threads) >= 5, threads
            expected = {"CapInh": 0, "CapPrm": kept, "CapEff": kept, "CapAmb": 0, "NoNewPrivs": 1, "Uid": uid}
            wrong = {
                name: found for name, found in threads.items() if {**found, "CapBnd": 0} != {**expected, "CapBnd": 0}
            }
            assert wrong == {}, logs()
            if uid == 0:
                assert {found["CapBnd"] for found in threads.values()} == {kept}, threads
            text = "CAP_SYS_ADMIN" if kept else "none"
            assert samples["volprobe_capabilities_kept_info"] == [({"capabilities": text}, 1.0)], logs()
            if "rule" in mode:
                private = [
                    v
                    for labels, v in samples["volprobe_capability_available"]
                    if labels["capability"] == "private_mount"
                ]
                print(f"{mode}: private_mount {private}")
            podman(built.conf, "stop", volprobe.name, timeout=run.stop_timeout + 30)
            assert podman(built.conf, "inspect", "--format={{.State.ExitCode}}", volprobe.name).stdout.strip() == "0"
        finally:
            podman(built.conf, "rm", "--force", "--ignore", volprobe.name, check=False)


# -- the translation, without podman ------------------------------------------------------------------------

SMALL_POD = {
    "metadata": {"labels": {"app": "probe"}},
    "spec": {
        "automountServiceAccountToken": False,
        "nodeSelector": {"kubernetes.io/os": "linux"},  # scheduling: no effect here
        "securityContext": {
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "runAsNonRoot": True,
            "supplementalGroups": [6],
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [
            {
                "name": "own",
                "image": "example/app:1",
                "command": ["chown", "1000:1000", "/state"],
                "securityContext": {
                    "runAsUser": 0,
                    "runAsGroup": 0,
                    "runAsNonRoot": False,
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
                },
                "volumeMounts": [{"name": "state", "mountPath": "/state"}],
            }
        ],
        "containers": [
            {
                "name": "app",
                "image": "example/app:1",
                "imagePullPolicy": "IfNotPresent",
                "args": ["--listen=:8080"],
                "env": [{"name": "MODE", "value": "test"}],
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                "securityContext": {
                    "privileged": True,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "resources": {"requests": {"cpu": "250m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
                "readinessProbe": {"httpGet": {"path": "/ready", "port": "http", "scheme": "HTTP"}, "periodSeconds": 5},
                "livenessProbe": {"tcpSocket": {"port": 8080}, "timeoutSeconds": 3},
                "volumeMounts": [
                    {"name": "config", "mountPath": "/etc/app", "readOnly": True},
                    {"name": "tls", "mountPath": "/etc/tls"},
                    {"name": "dev", "mountPath": "/dev", "readOnly": True},
                    {"name": "data", "mountPath": "/data", "mountPropagation": "HostToContainer"},
                    {"name": "state", "mountPath": "/state"},
                    {"name": "scratch", "mountPath": "/scratch"},
                ],
            }
        ],
        "volumes": [
            {"name": "config", "configMap": {"name": "app-config"}},
            {
                "name": "tls",
                "secret": {
                    "secretName": "app-tls",
                    "defaultMode": 0o400,
                    "items": [{"key": "tls.key", "path": "key.pem"}],
                },
            },
            {"name": "dev", "hostPath": {"path": "/dev", "type": "Directory"}},
            {"name": "data", "hostPath": {"path": "/srv/data"}},
            {"name": "state", "hostPath": {"path": "/var/lib/app", "type": "DirectoryOrCreate"}},
            {"name": "scratch", "emptyDir": {}},
        ],
    },
}
SMALL_POD_OBJECTS = [
    {"kind": "ConfigMap", "metadata": {"name": "app-config"}, "data": {"app.yml": "a: 1\n"}},
    {
        "kind": "Secret",
        "metadata": {"name": "app-tls"},
        "data": {"tls.key": base64.b64encode(b"KEY").decode(), "tls.crt": base64.b64encode(b"CRT").decode()},
    },
]
SMALL_POD_HOST_PATHS = {"/dev": Path("/dev"), "/srv/data": Path("/h/data"), "/var/lib/app": Path("/h/state")}


def small_pod_to_podman(pod: dict, host_paths: dict[str, Path] = SMALL_POD_HOST_PATHS) -> PodmanPod:
    return pod_to_podman(
        pod, SMALL_POD_OBJECTS, prefix="p", host_paths=host_paths, scratch=Path("/s"), published={8080: 18080}
    )


def test_a_pod_spec_becomes_podman_runs():
    """pod_to_podman on a small pod: each field's option, the volumes' host side, the probes aimed at the host."""
    run = small_pod_to_podman(SMALL_POD)
    (init,) = run.init_containers
    assert init.name == "p-own" and init.probes == {}
    assert init.arguments == (
        "--pull=missing",  # no imagePullPolicy, a tag other than latest: IfNotPresent
        "--user=0:0",  # the container's runAsUser and runAsGroup over the pod's
        "--group-add=6",  # the pod's supplementalGroups, for every container
        "--cap-drop=ALL",
        "--cap-add=CHOWN",
        "--security-opt=unmask=/sys/dev/block",
        "--security-opt=no-new-privileges",  # allowPrivilegeEscalation: false
        "--read-only",
        "--read-only-tmpfs=false",
        "--network=bridge",
        "--hostname=p",
        "--cpu-shares=2",  # no CPU request: the kubelet's minimum
        "--volume=/h/state:/state:rw,rprivate",
        # The kubelet's file for the termination message, last: /dev/termination-log by default.
        "--volume=/s/termination-logs/own:/dev/termination-log:rw,rprivate",
        '--entrypoint=["chown", "1000:1000", "/state"]',
        "example/app:1",
    )
    (app,) = run.containers
    assert app.name == "p-app"
    assert app.arguments == (
        "--pull=missing",
        "--user=1000:1000",
        "--group-add=6",
        "--privileged",  # its capabilities' drop not applied, as containerd does
        "--read-only",
        "--read-only-tmpfs=false",
        "--network=bridge",
        "--hostname=p",
        "--memory=134217728",
        "--cpu-shares=256",  # 250m
        "--env=MODE=test",
        "--volume=/s/volumes/config:/etc/app:ro,rprivate",
        "--volume=/s/volumes/tls:/etc/tls:ro,rprivate",  # a secret: read-only whatever readOnly says
        "--volume=/dev:/dev:ro,rprivate",
        "--volume=/h/data:/data:rw,rslave",  # HostToContainer
        "--volume=/h/state:/state:rw,rprivate",
        "--volume=/s/volumes/scratch:/scratch:rw,rprivate",
        "--volume=/s/termination-logs/app:/dev/termination-log:rw,rprivate",
        "--publish=127.0.0.1:18080:8080/tcp",
        "--stop-timeout=30",  # terminationGracePeriodSeconds' default
        "example/app:1",
        "--listen=:8080",  # args after the image's ENTRYPOINT
    )
    assert app.probes == {
        "readinessProbe": Probe("httpGet", 18080, "/ready", "HTTP", period=5),
        "livenessProbe": Probe("tcpSocket", 18080, timeout=3),
    }
    assert run.host_paths == (
        (Path("/dev"), "Directory"),
        (Path("/h/data"), ""),
        (Path("/h/state"), "DirectoryOrCreate"),
    )
    assert run.directories == (
        HostDirectory(Path("/s/volumes/config"), 0o755),
        HostDirectory(Path("/s/volumes/tls"), 0o755),
        HostDirectory(Path("/s/volumes/scratch"), 0o777),
    )
    assert run.files == (
        HostFile(Path("/s/volumes/config/app.yml"), b"a: 1\n", 0o644),
        HostFile(Path("/s/volumes/tls/key.pem"), b"KEY", 0o400),  # only the items, with defaultMode
        HostFile(Path("/s/termination-logs/own"), b"", 0o644),
        HostFile(Path("/s/termination-logs/app"), b"", 0o644),
    )
    assert run.stop_timeout == 30


def _set(path: str, value):
    """A change to the small pod: `value` set at a dotted path (list indexes as numbers)."""

    def change(pod: dict) -> None:
        *parents, last = path.split(".")
        node = pod
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node.append(value)
        else:
            node[last] = value

    return change


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_set("spec.hostAliases", [{"ip": "10.0.0.1", "hostnames": ["a"]}]), "hostAliases"),
        (_set("spec.containers.0.lifecycle", {"preStop": {"exec": {"command": ["true"]}}}), "lifecycle"),
        (_set("spec.containers.0.securityContext.seLinuxOptions", {"level": "s0"}), "seLinuxOptions"),
        (_set("spec.securityContext.windowsOptions", {}), "windowsOptions"),
        (_set("spec.containers.0.readinessProbe.httpGet.httpHeaders", [{"name": "A", "value": "b"}]), "httpHeaders"),
        (_set("spec.containers.0.env.0.valueFrom", {"fieldRef": {"fieldPath": "spec.nodeName"}}), "valueFrom"),
        (_set("spec.containers.0.ports.0.hostPort", 8080), "hostPort"),
        (_set("spec.initContainers.0.volumeMounts.0.subPathExpr", "$(POD)"), "subPathExpr"),
        (
            _set("spec.volumes.-", {"name": "claim", "persistentVolumeClaim": {"claimName": "c"}}),
            "persistentVolumeClaim",
        ),
        (_set("spec.volumes.0.configMap.items", [{"key": "app.yml", "path": "a", "extra": 1}]), "extra"),
        (_set("spec.automountServiceAccountToken", True), "automountServiceAccountToken"),
        (_set("spec.containers.0.args", ["--node=$(NODE)"]), r"\$\(VAR\)"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_field_not_translated_is_refused(change, named):
    pod = copy.deepcopy(SMALL_POD)
    change(pod)
    with pytest.raises(UnsupportedField, match=named):
        small_pod_to_podman(pod)


def test_a_host_path_not_given_is_refused():
    """Every hostPath is given its host path by the caller, the real one included: none is mounted unasked."""
    with pytest.raises(UnsupportedField, match="/srv/data"):
        small_pod_to_podman(SMALL_POD, {k: v for k, v in SMALL_POD_HOST_PATHS.items() if k != "/srv/data"})
