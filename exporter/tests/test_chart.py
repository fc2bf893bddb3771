"""The Helm chart, deploy/chart/volprobe: `helm lint --strict`; `helm template` with the defaults and with every
option (ci/full-values.yaml), each render validated (kubernetes-validate --strict, and the Prometheus Operator's
own CRD schemas for its kinds); its defaults are the kustomize base's; its rules and dashboards are the
generator's; a changed config rolls the pods; its probes answer 200 from a real volprobe with authentication on.

helm: $VOLPROBE_HELM, else helm on the PATH, else the one .ci/run builds (from Go's module proxy) into
/var/cache/volprobe-ci/helm-v3.22.0. The CRD schemas: $VOLPROBE_OPERATOR_CRDS, the example/prometheus-operator-crd
of the prometheus-operator Go module, which .ci/run downloads from Go's module proxy."""

from __future__ import annotations

import base64
import copy
import json
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import bcrypt
import jsonschema
import pytest
import yaml

import volprobe
from volprobe.mixin import __main__ as generator

from .support.chart import (
    CHART,
    OPERATOR_MODULE,
    by_kind,
    container,
    daemonset_pod,
    find_helm,
    one,
    operator_crd_directory,
    template,
    volprobe_yml,
)
from .support.harness import REPO, volprobe_command, write_config
from .support.kubelet import kubelet_get
from .support.pki import make_pki

FULL_VALUES = CHART / "ci" / "full-values.yaml"
MTLS_VALUES = CHART / "ci" / "mtls-values.yaml"
NULL_WEB_CONFIG_VALUES = CHART / "ci" / "null-web-config-values.yaml"
BASE = REPO / "deploy" / "kubernetes" / "base"
OPERATOR_KINDS = {"ServiceMonitor": "servicemonitors", "PodMonitor": "podmonitors", "PrometheusRule": "prometheusrules"}
RENDERS = {
    "defaults": (),
    "every option": (FULL_VALUES,),
    "mutual TLS": (MTLS_VALUES,),
    "webConfig null": (NULL_WEB_CONFIG_VALUES,),
}


@pytest.fixture(scope="module")
def helm() -> str:
    return find_helm()


def base_documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]


# -- the chart as a package ----------------------------------------------------------------------------------


def test_the_chart_version_and_app_version_are_volprobes():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["type"], chart["name"]) == ("v2", "application", "volprobe")
    assert chart["version"] == chart["appVersion"] == volprobe.__version__, (
        f"set version and appVersion in {CHART / 'Chart.yaml'} to volprobe.__version__ ({volprobe.__version__})"
    )


@pytest.mark.parametrize("values", RENDERS.values(), ids=RENDERS.keys())
def test_helm_lint_strict_is_clean(helm, values):
    command = [helm, "lint", "--strict", str(CHART), *(f"--values={v}" for v in values)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


def test_the_package_script_packages_the_chart_at_volprobes_version(helm, tmp_path):
    """deploy/chart/package, which .ci/package calls: dist/volprobe-VERSION.tgz, a chart helm can read."""
    result = subprocess.run(
        [str(REPO / "deploy/chart/package"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VOLPROBE_HELM": helm},
    )
    assert result.returncode == 0, result.stderr
    package = Path(result.stdout.strip())
    assert package == tmp_path / f"volprobe-{volprobe.__version__}.tgz" and package.is_file()
    shown = subprocess.run([helm, "show", "chart", str(package)], capture_output=True, text=True, check=True)
    chart = yaml.safe_load(shown.stdout)
    assert chart["version"] == chart["appVersion"] == volprobe.__version__
    listed = subprocess.run(["tar", "-tzf", str(package)], capture_output=True, text=True, check=True).stdout
    assert "volprobe/files/volprobe-rules.yml" in listed.split()


# -- each render, validated ----------------------------------------------------------------------------------


@pytest.mark.parametrize("values", RENDERS.values(), ids=RENDERS.keys())
def test_each_render_validates_strictly(helm, values, tmp_path):
    objects = template(helm, *values)
    core = [o for o in objects if not o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {o["kind"] for o in core} >= {"ServiceAccount", "ConfigMap", "DaemonSet", "Service"}
    manifest = tmp_path / "core.yaml"
    manifest.write_text(yaml.safe_dump_all(core))
    kubernetes_validate = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run([str(kubernetes_validate), "--strict", str(manifest)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout


def strict(schema: dict) -> dict:
    """An OpenAPI v3 schema of a CRD as a JSON schema that rejects unknown fields, as the API server's strict
    field validation does: additionalProperties false wherever properties are listed and nothing else is let in."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict]:
    directory = operator_crd_directory()
    if directory is None:
        pytest.skip(f"no $VOLPROBE_OPERATOR_CRDS, and {OPERATOR_MODULE} is not in Go's module cache (.ci/run has both)")
    schemas = {}
    for kind, plural in OPERATOR_KINDS.items():
        crd = yaml.safe_load((directory / f"monitoring.coreos.com_{plural}.yaml").read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schemas[kind] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


@pytest.mark.parametrize("values", RENDERS.values(), ids=RENDERS.keys())
def test_the_operators_objects_match_its_crd_schemas(helm, values, crd_schemas):
    objects = template(helm, *values)
    operators = [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")]
    pod_monitor = any((yaml.safe_load(v.read_text()).get("podMonitor") or {}).get("enabled") for v in values)
    expected = {"ServiceMonitor", "PrometheusRule"} | ({"PodMonitor"} if pod_monitor else set())
    assert {o["kind"] for o in operators} == expected
    for document in operators:
        assert document["apiVersion"] == "monitoring.coreos.com/v1"
        jsonschema.Draft4Validator(crd_schemas[document["kind"]]).validate(document)


def test_the_strict_crd_schema_rejects_an_unknown_field(helm, crd_schemas):
    """The check above can fail: a misspelt field of an endpoint is refused."""
    monitor = one(template(helm), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["scrape_timeout"] = "10s"
    with pytest.raises(jsonschema.ValidationError, match="scrape_timeout"):
        jsonschema.Draft4Validator(crd_schemas["ServiceMonitor"]).validate(monitor)


# -- what the chart renders ----------------------------------------------------------------------------------


def test_the_defaults_are_the_kustomize_bases_daemonset(helm):
    """The same configuration, pod, security contexts, init step, args, port, probes and volumes as
    deploy/kubernetes/base: the chart adds only its labels, the image, the checksum and the node placement."""
    objects = template(helm)
    (configmap,) = base_documents("configmap.yaml")
    assert yaml.safe_load(volprobe_yml(objects)) == yaml.safe_load(configmap["data"]["volprobe.yml"])
    (base,) = base_documents("daemonset.yaml")
    base_pod, pod = base["spec"]["template"]["spec"], daemonset_pod(objects)["spec"]
    assert pod["securityContext"] == base_pod["securityContext"]
    assert pod["automountServiceAccountToken"] is False and pod["hostNetwork"] is False and pod["hostPID"] is False
    assert one(objects, "DaemonSet")["spec"]["updateStrategy"] == base["spec"]["updateStrategy"]
    (base_init,), (init,) = base_pod["initContainers"], pod["initContainers"]
    for key in ("command", "securityContext", "resources", "volumeMounts"):
        assert init[key] == base_init[key], key
    (base_container,) = base_pod["containers"]
    chart_container = container(objects)
    for key in ("args", "ports", "securityContext", "volumeMounts"):
        assert chart_container[key] == base_container[key], key
    for probe in ("livenessProbe", "readinessProbe"):
        assert chart_container[probe]["httpGet"] == {**base_container[probe]["httpGet"], "scheme": "HTTP"}
    assert pod["volumes"] == [
        {**v, "configMap": {"name": "volprobe-config"}} if "configMap" in v else v for v in base_pod["volumes"]
    ]
    assert chart_container["image"] == init["image"] == f"registry.example.com/volprobe:{volprobe.__version__}"
    (service,) = base_documents("service.yaml")
    assert one(objects, "Service")["spec"]["ports"] == service["spec"]["ports"]
    assert one(objects, "Service")["spec"]["clusterIP"] == "None"
    assert by_kind(objects, "Secret") == [] and "--web.config.file" not in " ".join(chart_container["args"])


def test_the_default_configuration_passes_check_config(helm, tmp_path):
    text = volprobe_yml(template(helm))
    path = write_config(tmp_path, text.replace("/var/lib/volprobe", str(tmp_path)))
    result = subprocess.run(volprobe_command("check-config", path), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_node_placement_every_node_but_virtual_ones_and_not_evicted_first(helm):
    pod = daemonset_pod(template(helm))["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"] == [{"effect": "NoSchedule", "operator": "Exists"}]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "type", "operator": "NotIn", "values": ["virtual-kubelet"]} in term["matchExpressions"]
    # A user's affinity: the exclusion is ANDed into each of their terms, the rest passed as it is.
    full = yaml.safe_load(FULL_VALUES.read_text())["affinity"]
    pod = daemonset_pod(template(helm, FULL_VALUES))["spec"]
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms = full["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(required["nodeSelectorTerms"]) == len(terms)
    for rendered, given in zip(required["nodeSelectorTerms"], terms, strict=True):
        assert rendered["matchExpressions"][: len(given.get("matchExpressions", []))] == given.get(
            "matchExpressions", []
        )
        assert {"key": "type", "operator": "NotIn", "values": ["virtual-kubelet"]} in rendered["matchExpressions"]
        assert rendered.get("matchFields") == given.get("matchFields")
    preferred = "preferredDuringSchedulingIgnoredDuringExecution"
    assert pod["affinity"]["nodeAffinity"][preferred] == full["nodeAffinity"][preferred]
    assert pod["affinity"]["podAntiAffinity"] == full["podAntiAffinity"]


def test_every_option_reaches_the_objects(helm):
    """A few of ci/full-values.yaml's settings, where each lands."""
    values = yaml.safe_load(FULL_VALUES.read_text())
    objects = template(helm, FULL_VALUES)
    pod = daemonset_pod(objects)
    spec, main = pod["spec"], container(objects)
    image = values["image"]
    assert main["image"] == f"{image['repository']}@{image['digest']}" and main["imagePullPolicy"] == "Always"
    assert spec["imagePullSecrets"] == values["imagePullSecrets"] and spec["priorityClassName"] == "storage-critical"
    assert spec["hostNetwork"] is True and spec["hostPID"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert main["args"][-2:] == ["--web.config.file=/etc/volprobe-web/web-config.yml", "--log.level=debug"]
    assert "--web.listen-address=:10131" in main["args"] and main["ports"][0]["containerPort"] == 10131
    assert (
        main["resources"] == values["resources"] and spec["initContainers"][0]["resources"] == values["initResources"]
    )
    assert (
        pod["metadata"]["labels"]["team"] == "storage"
        and pod["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "true"
    )
    assert {"name": "pgdata", "hostPath": {"path": "/var/lib/postgresql", "type": "Directory"}} in spec["volumes"]
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["pgdata"]["mountPropagation"] == "HostToContainer" and mounts["tls"]["readOnly"] is True
    assert main["livenessProbe"]["periodSeconds"] == 60 and main["readinessProbe"]["failureThreshold"] == 5
    account = one(objects, "ServiceAccount")
    assert account["metadata"]["name"] == spec["serviceAccountName"] == "volprobe-sa"
    web = yaml.safe_load(base64.b64decode(one(objects, "Secret")["data"]["web-config.yml"]))
    assert web == values["webConfig"]
    for kind, key in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        monitor = one(objects, kind)
        lower = kind[0].lower() + kind[1:]
        (endpoint,) = monitor["spec"][key]
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert endpoint["port"] == "http-metrics" and endpoint["scheme"] == "https"
        assert endpoint["relabelings"][2:] == values[lower]["relabelings"]
        for field in ("interval", "scrapeTimeout", "metricRelabelings", "basicAuth", "tlsConfig"):
            assert endpoint[field] == values[lower][field], (kind, field)
    assert one(objects, "PrometheusRule")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for dashboard in [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]:
        assert dashboard["metadata"]["namespace"] == "grafana"
        assert dashboard["metadata"]["annotations"] == {"grafana_folder": "Storage"}


def test_the_kubelets_directory_is_mounted_where_the_node_has_it_and_volprobe_looks_there(helm):
    """kubeletDirectory: mounted read-only at the node's own path, HostToContainer (the pod volumes' mounts come
    and go with the kubelet's); elsewhere than /var/lib/kubelet, config.kubernetes.kubelet_directory follows it,
    unless config names one; "" mounts nothing."""

    def rendered(*sets: str) -> tuple[dict | None, dict | None, dict]:
        objects = template(helm, sets=sets)
        mounts = {m["name"]: m for m in container(objects)["volumeMounts"]}
        volumes = {v["name"]: v for v in daemonset_pod(objects)["spec"]["volumes"]}
        return mounts.get("kubelet"), volumes.get("kubelet"), yaml.safe_load(volprobe_yml(objects))

    mount, volume, config = rendered()
    assert mount == {
        "name": "kubelet",
        "mountPath": "/var/lib/kubelet",
        "readOnly": True,
        "mountPropagation": "HostToContainer",
    }
    assert volume == {"name": "kubelet", "hostPath": {"path": "/var/lib/kubelet", "type": "Directory"}}
    assert "kubernetes" not in config  # volprobe's default is /var/lib/kubelet
    mount, volume, config = rendered("kubeletDirectory=/var/lib/k0s/kubelet")
    assert mount is not None and volume is not None
    assert mount["mountPath"] == volume["hostPath"]["path"] == "/var/lib/k0s/kubelet"
    assert config["kubernetes"] == {"kubelet_directory": "/var/lib/k0s/kubelet"}
    _, _, config = rendered(
        "kubeletDirectory=/var/lib/k0s/kubelet",
        "config.kubernetes.kubelet_directory=/srv/kubelet",
        "config.kubernetes.rescan_interval=10s",
    )
    assert config["kubernetes"] == {"kubelet_directory": "/srv/kubelet", "rescan_interval": "10s"}
    mount, volume, _ = rendered("kubeletDirectory=")
    assert mount is None and volume is None


def test_the_monitors_set_instance_to_the_node_and_select_the_pods(helm):
    objects = template(helm, sets=("podMonitor.enabled=true",))
    pod_labels = daemonset_pod(objects)["metadata"]["labels"]
    service = one(objects, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    for kind, key in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        monitor = one(objects, kind)
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/name" and pod_labels[monitor["spec"]["jobLabel"]] == (
            "volprobe"
        ), "the rules and dashboards select job=volprobe"
        (endpoint,) = monitor["spec"][key]
        assert endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["scheme"] == "http"
        by_target = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        assert by_target["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
        assert by_target["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]


def test_aws_nvme_stats_is_the_kustomize_components_patch(helm):
    component = yaml.safe_load((REPO / "deploy/kubernetes/components/aws-nvme-stats/kustomization.yaml").read_text())
    (patch,) = component["patches"]
    prefix = "/spec/template/spec/containers/0/securityContext/"
    ops = {op["path"]: op["value"] for op in yaml.safe_load(patch["patch"])}
    patched = {path.removeprefix(prefix): value for path, value in ops.items() if path.startswith(prefix)}
    objects = template(helm, sets=("awsNvmeStats=true",))
    context = container(objects)["securityContext"]
    assert {key: context[key] for key in patched} == patched
    # The state directory is root's too: root without CAP_DAC_OVERRIDE may not write in 65534's.
    (init,) = daemonset_pod(objects)["spec"]["initContainers"]
    assert (
        ops.pop("/spec/template/spec/initContainers/0/command")
        == init["command"]
        == [
            "chown",
            "-h",
            "0:65534",
            "/var/lib/volprobe",
        ]
    )
    # volprobe keeps CAP_SYS_ADMIN only when told it reads the statistics: both pass the flag.
    arg = ops.pop("/spec/template/spec/containers/0/args/-")
    assert arg == "--nvme.provider-statistics" and container(objects)["args"].count(arg) == 1
    assert arg not in container(template(helm))["args"]
    assert len(ops) == len(patched)
    assert context["readOnlyRootFilesystem"] is True
    assert "runAsUser" not in container(template(helm))["securityContext"]


def test_a_pod_volume_rule_runs_the_container_as_the_aws_nvme_stats_one(helm, tmp_path):
    """kubernetes.rules write into pod volumes, root's, through private copies of their mounts (CAP_SYS_ADMIN):
    the container then runs as root with SYS_ADMIN alone, as with awsNvmeStats; without a rule, as before."""
    values = tmp_path / "rules.yaml"
    values.write_text(
        yaml.safe_dump(
            {"config": {"kubernetes": {"rules": [{"driver": "efs.csi.aws.com", "probes": [{"op": "write"}]}]}}}
        )
    )
    main = container(template(helm, values))
    context = main["securityContext"]
    assert context == container(template(helm, sets=("awsNvmeStats=true",)))["securityContext"]
    assert (context["runAsUser"], context["capabilities"]["add"]) == (0, ["SYS_ADMIN"])
    assert "--nvme.provider-statistics" not in main["args"]  # rules keep CAP_SYS_ADMIN by themselves


@pytest.mark.parametrize(
    ("config", "privileged"),
    [
        ({}, True),  # the default: discovery reads every whole disk of the node
        ({"kubernetes": {"rules": [{"driver": "efs.csi.aws.com"}]}}, True),  # and discovery still
        ({"discovery": None, "kubernetes": {"rules": [{"driver": "efs.csi.aws.com"}]}}, False),
        ({"discovery": None, "targets": [{"directory": "/data"}]}, True),  # its reads go to its disk
        ({"discovery": None}, False),  # pod volumes' mount checks alone
    ],
)
def test_the_container_is_privileged_only_where_the_configuration_opens_host_block_devices(
    helm, tmp_path, config, privileged
):
    """privileged is what lets a container open the host's block devices (and what makes the runtime ignore the
    capability list, seccomp and no_new_privs); a configuration that opens none (pod volumes alone: files, not
    devices) is not privileged, so its capability list (SYS_ADMIN with rules), seccomp and no_new_privs apply."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"config": config}))
    context = container(template(helm, values))["securityContext"]
    assert (context["privileged"], context["allowPrivilegeEscalation"]) == (privileged, privileged)
    assert context["capabilities"]["drop"] == ["ALL"] and context["readOnlyRootFilesystem"] is True
    if config.get("kubernetes"):
        assert (context["runAsUser"], context["capabilities"]["add"]) == (0, ["SYS_ADMIN"])
    # awsNvmeStats opens the NVMe devices whatever the configuration
    values.write_text(yaml.safe_dump({"config": config, "awsNvmeStats": True}))
    assert container(template(helm, values))["securityContext"]["privileged"] is True


def probe_actions(main: dict) -> dict[str, tuple[str, dict]]:
    """livenessProbe and readinessProbe: each one's handler (httpGet, tcpSocket...) and its settings."""
    actions = {}
    for probe in ("livenessProbe", "readinessProbe"):
        (handler,) = [key for key in main[probe] if key in ("httpGet", "tcpSocket", "exec", "grpc")]
        actions[probe] = (handler, main[probe][handler])
    return actions


@pytest.mark.parametrize(
    ("client_auth_type", "handler"),
    [
        (None, "httpGet"),
        ("NoClientCert", "httpGet"),
        ("RequestClientCert", "httpGet"),
        ("VerifyClientCertIfGiven", "httpGet"),  # the kubelet gives none: it is let through
        ("RequireAnyClientCert", "tcpSocket"),
        ("RequireAndVerifyClientCert", "tcpSocket"),
    ],
)
def test_the_probes_connect_over_tcp_where_client_certificates_are_required(helm, tmp_path, client_auth_type, handler):
    """The kubelet's probes show no client certificate: where the web configuration requires one, no httpGet
    probe could complete the TLS handshake (the pods would restart forever), so the probes open a TCP connection to
    the metrics port; elsewhere they GET /-/healthy and /-/ready, over HTTPS since TLS is on."""
    tls = {"cert_file": "/etc/volprobe-tls/tls.crt", "key_file": "/etc/volprobe-tls/tls.key"}
    if client_auth_type is not None:
        tls |= {"client_auth_type": client_auth_type, "client_ca_file": "/etc/volprobe-tls/ca.crt"}
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"webConfig": {"tls_server_config": tls}}))
    main = container(template(helm, values))
    for probe, (found, action) in probe_actions(main).items():
        assert found == handler, (probe, main[probe])
        assert action["port"] == main["ports"][0]["name"]
        if handler == "httpGet":
            assert action["scheme"] == "HTTPS" and action["path"] in ("/-/healthy", "/-/ready")
    # The probes' timing (values' livenessProbe, readinessProbe) whatever their handler.
    assert main["livenessProbe"]["periodSeconds"] == 30 and main["readinessProbe"]["periodSeconds"] == 10


def test_the_mutual_tls_example_has_tcp_probes_and_https_monitors(helm):
    """ci/mtls-values.yaml (also linted and validated above, with the other renders)."""
    objects = template(helm, MTLS_VALUES)
    main = container(objects)
    assert {handler for handler, _ in probe_actions(main).values()} == {"tcpSocket"}
    (endpoint,) = one(objects, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["keySecret"]["name"] == "volprobe-scrape-tls"
    web = yaml.safe_load(base64.b64decode(one(objects, "Secret")["data"]["web-config.yml"]))
    assert web["tls_server_config"]["client_auth_type"] == "RequireAndVerifyClientCert"


def test_web_config_null_is_no_web_configuration(helm):
    """webConfig: null (a values file that empties it, `--set webConfig=null`) renders as the default {} does: no
    Secret, no --web.config.file, HTTP probes and monitors."""
    assert template(helm, NULL_WEB_CONFIG_VALUES) == template(helm)
    assert template(helm, sets=("webConfig=null",)) == template(helm)


@pytest.mark.parametrize(
    ("sets", "owner"),
    [
        ((), "65534:65534"),
        (("securityContext.runAsUser=1000", "securityContext.runAsGroup=2000"), "1000:2000"),
        (("securityContext.runAsUser=1000", "containerSecurityContext.runAsUser=3000"), "3000:65534"),
        (("containerSecurityContext.runAsUser=4000000", "containerSecurityContext.runAsGroup=0"), "4000000:0"),
        (("securityContext=null", "containerSecurityContext=null"), "65534:65534"),
        # Root then, with SYS_ADMIN alone: without CAP_DAC_OVERRIDE it could not write in 65534's directory.
        (("awsNvmeStats=true",), "0:65534"),
        (("config.kubernetes.rules[0].driver=efs.csi.aws.com",), "0:65534"),
    ],
)
def test_the_init_step_gives_the_state_directory_to_the_user_volprobe_runs_as(helm, sets, owner):
    """chown to runAsUser and runAsGroup of containerSecurityContext, else of securityContext, else 65534."""
    (init,) = daemonset_pod(template(helm, sets=sets))["spec"]["initContainers"]
    assert init["command"] == ["chown", "-h", owner, "/var/lib/volprobe"]


def test_the_chart_carries_the_generators_rules_and_dashboards(helm):
    """Generated into files/ by `python -m volprobe.mixin`, as the kustomize base's are: the committed copies
    are the generator's, and the rendered PrometheusRule and dashboard ConfigMaps are theirs."""
    outputs = generator.outputs(None)
    chart_files = {k: v for k, v in outputs.items() if k.startswith("deploy/chart/volprobe/")}
    assert "deploy/chart/volprobe/files/volprobe-rules.yml" in chart_files
    for relative, text in chart_files.items():
        assert (REPO / relative).read_text() == text, f"{relative} is stale: run `python -m volprobe.mixin --out .`"
    on_disk = {p.relative_to(REPO).as_posix() for p in (CHART / "files").rglob("*") if p.is_file()}
    assert on_disk == set(chart_files), "files/ holds only the generator's files"
    objects = template(helm)
    rule = one(objects, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((REPO / "alerts/volprobe-rules.yml").read_text())
    (base_rule,) = base_documents("prometheusrule.yaml")
    assert rule["spec"] == base_rule["spec"] and rule["metadata"]["labels"]["role"] == "alert-rules"
    dashboards = [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert (
        len(dashboards)
        == len(list((REPO / "dashboards").glob("*.json")))
        == len(base_documents("grafana-dashboards.yaml"))
    )
    for configmap in dashboards:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = configmap["data"].items()
        assert json.loads(text) == json.loads((REPO / "dashboards" / name).read_text())
    names = {c["metadata"]["name"] for c in dashboards}
    assert names == {d["metadata"]["name"] for d in base_documents("grafana-dashboards.yaml")}


def checksum(objects: list[dict]) -> str:
    return daemonset_pod(objects)["metadata"]["annotations"]["checksum/config"]


def test_a_changed_config_or_web_config_rolls_the_pods(helm):
    """helm upgrade changes the pod template, so the DaemonSet replaces every pod, when (and only when) the
    configuration or the web configuration changed."""
    default = template(helm)
    assert len(checksum(default)) == 64
    changed_config = template(helm, sets=("config.defaults.interval=2s",))
    changed_web = template(helm, sets=("webConfig.http_server_config.http2=false",))
    unrelated = template(helm, sets=("serviceMonitor.interval=15s",))
    assert checksum(changed_config) != checksum(default)
    assert daemonset_pod(changed_config) != daemonset_pod(default)
    assert checksum(changed_web) not in (checksum(default), checksum(changed_config))
    assert checksum(unrelated) == checksum(default)
    assert checksum(template(helm)) == checksum(default), "the same values, the same checksum"


# -- the probes against a real volprobe, authentication on ----------------------------------------------------


def probes_against_the_exporter(helm, tmp_path, start_exporter, web_config: dict, tls: bool) -> str:
    """The chart rendered with this webConfig, its web configuration given to a real volprobe, and its probes run
    against it as the kubelet runs them: each must pass. The exporter's base URL."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"webConfig": web_config}))
    objects = template(helm, values)
    main = container(objects)
    assert "--web.config.file=/etc/volprobe-web/web-config.yml" in main["args"]
    secret = one(objects, "Secret")
    web = write_config(tmp_path, base64.b64decode(secret["data"]["web-config.yml"]).decode(), "web-config.yml")
    config = write_config(tmp_path, "targets: []\n")
    exporter = start_exporter("--config", config, "--web.config.file", web, tls=True)
    base = f"{'https' if tls else 'http'}://127.0.0.1:{exporter.port}"
    port_names = {p["name"] for p in main["ports"]}
    for probe, (handler, action) in probe_actions(main).items():
        assert action["port"] in port_names
        if handler == "tcpSocket":  # the kubelet's: the connection is accepted, then closed
            socket.create_connection(("127.0.0.1", exporter.port), timeout=10).close()
        else:
            assert handler == "httpGet" and action["scheme"] == ("HTTPS" if tls else "HTTP")
            assert kubelet_get(base, action["path"]) == 200, (probe, exporter.log()[-2000:])
    assert exporter.process.poll() is None, exporter.log()[-2000:]
    return base


def test_the_probes_pass_with_basic_auth_on(helm, tmp_path, start_exporter):
    hashed = bcrypt.hashpw(b"x", bcrypt.gensalt(rounds=4)).decode()
    base = probes_against_the_exporter(
        helm, tmp_path, start_exporter, {"basic_auth_users": {"prometheus": hashed}}, False
    )
    assert kubelet_get(base, "/metrics") == 401, "authentication is on: /metrics without credentials is refused"


def test_the_probes_pass_over_https_with_basic_auth_on(helm, tmp_path, start_exporter):
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    hashed = bcrypt.hashpw(b"x", bcrypt.gensalt(rounds=4)).decode()
    web_config = {
        "tls_server_config": {"cert": (pki / "server.crt").read_text(), "key": (pki / "server.key").read_text()},
        "basic_auth_users": {"prometheus": hashed},
    }
    base = probes_against_the_exporter(helm, tmp_path, start_exporter, web_config, True)
    assert kubelet_get(base, "/metrics") == 401, "authentication is on: /metrics without credentials is refused"


def test_the_probes_pass_with_client_certificates_required(helm, tmp_path, start_exporter):
    """client_auth_type RequireAndVerifyClientCert: a GET without a client certificate, as the kubelet's httpGet
    would be, fails its handshake; the chart's tcpSocket probes pass, and a client with a certificate is served."""
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    web_config = {
        "tls_server_config": {
            "cert_file": str(pki / "server.crt"),
            "key_file": str(pki / "server.key"),
            "client_ca_file": str(pki / "ca.crt"),
            "client_auth_type": "RequireAndVerifyClientCert",
        }
    }
    base = probes_against_the_exporter(helm, tmp_path, start_exporter, web_config, True)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        kubelet_get(base, "/-/healthy")  # what an httpGet probe would meet
    assert kubelet_get(base, "/-/healthy", client_cert=(pki / "client.crt", pki / "client.key")) == 200
