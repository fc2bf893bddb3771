"""Deployment artefacts, validated offline: Kubernetes objects, the PrometheusRule, the ServiceMonitor, the
Prometheus and Grafana examples, the Dockerfile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from volprobe import __version__

from .support.harness import REPO, volprobe_command

BASE = REPO / "deploy" / "kubernetes" / "base"
CORE = ["serviceaccount.yaml", "configmap.yaml", "daemonset.yaml", "service.yaml", "grafana-dashboards.yaml"]


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


@pytest.mark.parametrize("name", CORE)
def test_core_objects_validate_strictly(name):
    kubernetes_validate = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run([str(kubernetes_validate), "--strict", str(BASE / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout and "ERROR" not in result.stdout


def test_prometheusrule_spec_passes_promtool(tmp_path):
    (rule,) = documents("prometheusrule.yaml")
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert rule["spec"] == yaml.safe_load((REPO / "alerts" / "volprobe-rules.yml").read_text())


def test_servicemonitor_selects_the_service_and_its_port():
    (monitor,) = documents("servicemonitor.yaml")
    (service,) = documents("service.yaml")
    (daemonset,) = documents("daemonset.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert set(monitor["spec"]) <= {"jobLabel", "selector", "endpoints", "namespaceSelector"}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "interval", "scrapeTimeout", "relabelings", "scheme", "tlsConfig", "basicAuth"}
        assert endpoint["port"] in ports
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"] for p in container["ports"]} >= {s["targetPort"] for s in service["spec"]["ports"]}


def test_daemonset_security_context_is_as_narrow_as_block_devices_allow():
    (daemonset,) = documents("daemonset.yaml")
    pod = daemonset["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert 6 in pod["securityContext"]["supplementalGroups"]  # disk
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/dev"]["readOnly"] is True


def test_dashboard_configmaps_carry_the_dashboards():
    maps = documents("grafana-dashboards.yaml")
    assert len(maps) == len(list((REPO / "dashboards").glob("*.json")))
    for configmap in maps:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = configmap["data"].items()
        assert json.loads(text) == json.loads((REPO / "dashboards" / name).read_text())


def test_configmap_config_is_valid(tmp_path):
    (configmap,) = documents("configmap.yaml")
    path = tmp_path / "volprobe.yml"
    path.write_text(configmap["data"]["volprobe.yml"].replace("/var/lib/volprobe", str(tmp_path)))
    result = subprocess.run(volprobe_command("check-config", str(path)), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "discovery:" in result.stdout


def test_prometheus_example_passes_promtool(tmp_path):
    config = (REPO / "deploy" / "prometheus" / "prometheus.yml").read_text()
    config = config.replace("/etc/prometheus/volprobe-ca.crt", str(tmp_path / "ca.crt"))
    config = config.replace("/etc/prometheus/volprobe.password", str(tmp_path / "password"))
    config = config.replace("../../alerts/volprobe-rules.yml", str(REPO / "alerts" / "volprobe-rules.yml"))
    (tmp_path / "ca.crt").write_text("")
    (tmp_path / "password").write_text("secret\n")
    path = tmp_path / "prometheus.yml"
    path.write_text(config)
    result = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_files():
    datasources = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1 and datasources["datasources"][0]["type"] == "prometheus"
    providers = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/volprobe.yml").read_text())
    assert providers["providers"][0]["type"] == "file" and providers["providers"][0]["options"]["path"]


def test_dockerfile_is_small_and_conventional():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert text.count("FROM ") == 2 and "USER 65534" in text and 'ENTRYPOINT ["volprobe"]' in text
    assert "EXPOSE 10130" in text


def test_instance_is_the_node_name_so_rollouts_keep_the_series():
    (monitor,) = documents("servicemonitor.yaml")
    for endpoint in monitor["spec"]["endpoints"]:
        by_target = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        instance = by_target["instance"]
        assert instance["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
        assert instance.get("action", "replace") == "replace" and "regex" not in instance


def test_the_release_label_is_set_in_one_place_for_kube_prometheus_stack():
    component = yaml.safe_load(
        (REPO / "deploy/kubernetes/components/kube-prometheus-stack/kustomization.yaml").read_text()
    )
    assert component["kind"] == "Component"
    patched = {}
    for patch in component["patches"]:
        (operation,) = yaml.safe_load(patch["patch"])
        assert operation["op"] == "add" and operation["path"] == "/metadata/labels/release"
        patched[patch["target"]["kind"]] = operation["value"]
    assert patched == {"ServiceMonitor": "kube-prometheus-stack", "PrometheusRule": "kube-prometheus-stack"}
    for name in ("servicemonitor.yaml", "prometheusrule.yaml"):
        (document,) = documents(name)
        assert isinstance(document["metadata"].get("labels"), dict), f"{name}: the patch adds to its labels"


def test_no_unpublished_image_is_referenced():
    (daemonset,) = documents("daemonset.yaml")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    assert container["image"] == image["name"] == "volprobe", "the user's image replaces this name"
    for path in (REPO / "deploy").rglob("*.yaml"):
        assert "ghcr.io" not in path.read_text(), path


def build_overlay(tmp_path: Path, component: str) -> dict[str, dict]:
    """`kubectl kustomize` of an overlay of the base with one component: the objects built, by kind."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    base = os.path.relpath(BASE, overlay)
    path = os.path.relpath(REPO / "deploy/kubernetes/components" / component, overlay)
    (overlay / "kustomization.yaml").write_text(f"resources: [{base}]\ncomponents: [{path}]\n")
    built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    return {d["kind"]: d for d in yaml.safe_load_all(built.stdout) if d}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed")
def test_an_overlay_with_the_component_builds_with_the_release_label_and_your_image(tmp_path):
    objects = build_overlay(tmp_path, "kube-prometheus-stack")
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert objects[kind]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (container,) = objects["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"registry.example.com/volprobe:{__version__}"  # the tag is the version


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed")
def test_the_aws_nvme_stats_component_runs_the_container_as_root_with_sys_admin_only(tmp_path):
    daemonset = build_overlay(tmp_path, "aws-nvme-stats")["DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    context = container["securityContext"]
    assert context["runAsUser"] == 0 and context["runAsNonRoot"] is False
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    manifest = tmp_path / "daemonset.yaml"
    manifest.write_text(yaml.safe_dump(daemonset))
    kubernetes_validate = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run([str(kubernetes_validate), "--strict", str(manifest)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# What the DaemonSet's processes may do, as setpriv says it: the init step is root with CAP_CHOWN alone; the
# exporter is nobody in group disk. The exporter keeps CAP_DAC_READ_SEARCH only so that it can reach this
# machine's interpreter and test files (under /root and pytest's 0700 directories): it can read, never write,
# where nobody could not, so the state directory it writes must really be nobody's.
INIT_STEP = ("setpriv", "--inh-caps=-all,+chown", "--ambient-caps=-all,+chown", "--bounding-set=-all,+chown", "--")
NOBODY_IN_DISK = (
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--groups=6",
    "--inh-caps=-all,+dac_read_search",
    "--ambient-caps=-all,+dac_read_search",
    "--bounding-set=-all,+dac_read_search",
    "--",
)


def _state_status(samples) -> set[str]:
    return {labels["status"] for labels, value in samples.get("volprobe_state_status", []) if value == 1}


@pytest.mark.root
def test_state_survives_a_pod_restart_on_the_kubelets_layout(tmp_path, make_loop, start_exporter):
    """As the kubelet does: the hostPath state directory created root-owned, 0755; then the init container's own
    command; then the exporter as 65534:6, twice (a pod restart). Its state is written, then found again."""
    (daemonset,) = documents("daemonset.yaml")
    pod = daemonset["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["runAsUser"] == 0 and init["securityContext"]["readOnlyRootFilesystem"]
    (mount,) = [m for m in init["volumeMounts"] if m["name"] == "state"]
    (exporter_container,) = pod["containers"]
    assert mount["mountPath"] in [m["mountPath"] for m in exporter_container["volumeMounts"] if m["name"] == "state"]
    node_dir = tmp_path / "var-lib-volprobe"  # the hostPath on the node
    node_dir.mkdir(mode=0o755)
    os.chown(node_dir, 0, 0)
    device = make_loop(16 * 1024 * 1024)
    mode = os.stat(device)
    os.chown(device, 0, 6)  # as udev makes disks on a node: root:disk 0660
    os.chmod(device, 0o660)
    try:
        _restart_as_the_kubelet_would(tmp_path, node_dir, device, init, mount, start_exporter)
    finally:  # the node outlives the loop device: as it was
        os.chown(device, mode.st_uid, mode.st_gid)
        os.chmod(device, mode.st_mode & 0o7777)


def _restart_as_the_kubelet_would(tmp_path, node_dir, device, init, mount, start_exporter) -> None:
    config = tmp_path / "volprobe.yml"
    config.write_text(f"state_directory: {node_dir}\ntargets: [{{name: vol, device: {device}}}]\n")

    def serve():
        # volprobe would drop CAP_DAC_READ_SEARCH at start, and then fail to import the rest of its interpreter's
        # modules under /root as it goes: the test hook keeps it (volprobe.privileges).
        return start_exporter(
            "--config",
            str(config),
            prefix=NOBODY_IN_DISK,
            env={"VOLPROBE_TEST_KEEP_CAPABILITIES": "CAP_DAC_READ_SEARCH"},
        )

    # Without the init step the directory is root's: nothing can be remembered (what the issue found).
    before = serve()
    before.wait_for(lambda s: _state_status(s) == {"unwritable"}, what="the state to be unwritable")
    assert before.stop() == 0
    # The init container's command, its container path bound to the node's directory, with CAP_CHOWN alone.
    command = [str(node_dir) if arg == mount["mountPath"] else arg for arg in init["command"]]
    subprocess.run([*INIT_STEP, *command], check=True)
    assert (node_dir.stat().st_uid, node_dir.stat().st_gid) == (65534, 65534)
    first = serve()
    first.wait_for(lambda s: _state_status(s) == {"ok"}, what="the state to be written")
    assert first.stop() == 0
    files = list(node_dir.glob("volume-*.json"))
    assert files and all(f.stat().st_uid == 65534 for f in files)
    second = serve()  # the pod restarted: what the first one saved is found again
    samples = second.metrics()
    assert _state_status(samples) == {"ok"}, second.log()
    assert "starting afresh" not in second.log()
    assert second.stop() == 0


ROOT_SYS_ADMIN = ("setpriv", "--inh-caps=-all,+sys_admin", "--bounding-set=-all,+sys_admin", "--")


@pytest.mark.root
def test_the_aws_nvme_stats_component_gives_the_state_directory_to_its_root(tmp_path, make_loop, start_exporter):
    """The component runs the exporter as root with SYS_ADMIN alone: without CAP_DAC_OVERRIDE, root may not write
    in 65534's directory (0.2.0's init step gave it that, and nothing was remembered). Its init step's command,
    then the exporter as that root: the state is written."""
    component = yaml.safe_load((REPO / "deploy/kubernetes/components/aws-nvme-stats/kustomization.yaml").read_text())
    (patch,) = component["patches"]
    ops = {op["path"]: op["value"] for op in yaml.safe_load(patch["patch"])}
    command = ops["/spec/template/spec/initContainers/0/command"]
    node_dir = tmp_path / "var-lib-volprobe"
    node_dir.mkdir(mode=0o755)
    device = make_loop(16 * 1024 * 1024)
    subprocess.run([*INIT_STEP, *[str(node_dir) if arg == "/var/lib/volprobe" else arg for arg in command]], check=True)
    config = tmp_path / "volprobe.yml"
    config.write_text(f"state_directory: {node_dir}\ntargets: [{{name: vol, device: {device}}}]\n")
    exporter = start_exporter("--config", str(config), prefix=ROOT_SYS_ADMIN)
    exporter.wait_for(lambda s: _state_status(s) == {"ok"}, what="the state to be written")
    assert exporter.stop() == 0
    assert list(node_dir.glob("volume-*.json"))
