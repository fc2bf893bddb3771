"""The Helm chart installed into a real Kubernetes API server (issue 42): kube-apiserver and etcd, started here for
this module, with the Prometheus Operator's CRDs (ServiceMonitor, PodMonitor, PrometheusRule) installed through
the API. What test_chart checks offline, the API server checks here as a cluster would: every object of every
values file (the defaults and each of the chart's ci/*.yaml) accepted by its server-side validation with unknown
fields refused, the objects stored as rendered; Pod Security admission at the level the chart's pod needs, which
is `privileged` (its container is privileged and it mounts host paths): its pod is admitted in a namespace that
enforces that level and refused under `baseline`; `helm upgrade` with a changed config or webConfig changes the
stored pod template, so the pods roll, and `helm uninstall` leaves nothing of the chart's.

No kubelet, scheduler or controller-manager runs: nothing is scheduled, and nothing makes a namespace's `default`
ServiceAccount (the ServiceAccount admission wants it before a pod may be posted), so each namespace here gets
one by hand. Pod Security admission enforces on pods only (for a DaemonSet it only warns), so the DaemonSet's pod
template is posted as a pod, on a node that does not exist.

The binaries: $VOLPROBE_KUBE_DIR, else /var/cache/volprobe-ci/kube, where .ci/run builds kube-apiserver v1.37.2
and etcd v3.7.3 from Go's module proxy; without them the tests are skipped. helm and the CRDs as test_chart finds
them (support/chart.py). The tests run one after another on one xdist worker (xdist_group "kube-apiserver"), all
against one API server: about 4 s to start it, 20 s in all.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .support.chart import CHART, by_kind, daemonset_pod, find_helm, one, operator_crd_directory, template
from .support.harness import REPO
from .support.kubeapi import (
    API_VERSIONS,
    COLLECTIONS,
    ApiServer,
    PortTaken,
    control_plane,
    helm_warnings,
    install_crds,
    write_kubeconfig,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("kube-apiserver")]

KUBE_DIR = Path(os.environ.get("VOLPROBE_KUBE_DIR") or "/var/cache/volprobe-ci/kube")
# Every values file of the chart's ci/ directory (helm's chart-testing convention), and the defaults.
VALUES = {"defaults": ()} | {path.stem: (path,) for path in sorted((CHART / "ci").glob("*.yaml"))}
# The Pod Security level the chart's pod needs, as README.md documents it.
DOCUMENTED_LEVEL = "privileged"
LEVEL_LABEL = "pod-security.kubernetes.io/enforce"


# -- etcd and kube-apiserver -----------------------------------------------------------------------------------


@contextlib.contextmanager
def kube_apiserver(binaries: Path, directory: Path, helm: str) -> Iterator[ApiServer]:
    """etcd and kube-apiserver on free loopback ports, their files in `directory`, until the block ends; then both
    stopped, and neither (nor anything they started) left running."""
    token = secrets.token_hex(24)
    tokens = directory / "tokens.csv"  # the admin's token, in group system:masters
    tokens.write_text(f'{token},admin,admin-uid,"system:masters"\n')
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
    started: list[subprocess.Popen[bytes]] = []
    try:
        with contextlib.ExitStack() as running:
            for attempt in range(1, 4):
                try:
                    url, ca = control_plane(binaries, directory / f"run-{attempt}", tokens, key, running, started)
                    break
                except PortTaken:
                    running.close()  # stops what this attempt started, then on other ports
                    if attempt == 3:
                        raise
            kubeconfig = directory / "kubeconfig"
            write_kubeconfig(kubeconfig, url, ca, token)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
            env |= {
                "HOME": str(home),  # client-go's discovery cache, ~/.kube/cache
                "KUBECONFIG": str(kubeconfig),
                "HELM_CACHE_HOME": str(home / "helm-cache"),
                "HELM_CONFIG_HOME": str(home / "helm-config"),
                "HELM_DATA_HOME": str(home / "helm-data"),
            }
            yield ApiServer(url, token, ca, kubeconfig, helm, env, directory)
    finally:
        for process in started:
            assert process.returncode is not None, f"{process.args!r} (pid {process.pid}) still running"
            with pytest.raises(ProcessLookupError):  # its process group is empty: nothing it started lives on
                os.killpg(process.pid, 0)


@pytest.fixture(scope="module")
def helm() -> str:
    return find_helm()


@pytest.fixture(scope="module")
def api(helm: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    missing = [name for name in ("etcd", "kube-apiserver") if not os.access(KUBE_DIR / name, os.X_OK)]
    if missing:
        pytest.skip(
            f"no {' and '.join(missing)} in {KUBE_DIR} ($VOLPROBE_KUBE_DIR): .ci/run builds kube-apiserver and "
            "etcd there from Go's module proxy"
        )
    crds = operator_crd_directory()
    if crds is None:
        pytest.skip(
            "no $VOLPROBE_OPERATOR_CRDS, and prometheus-operator is not in Go's module cache (.ci/run has both)"
        )
    with kube_apiserver(KUBE_DIR, tmp_path_factory.mktemp("kube-apiserver"), helm) as server:
        install_crds(server, crds)
        yield server


# -- the chart's objects in the API ----------------------------------------------------------------------------


def collection(kind: str, namespace: str) -> str:
    assert kind in COLLECTIONS, f"the chart makes a {kind}: add it to COLLECTIONS"
    api_version = API_VERSIONS.get(kind, "v1")
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{COLLECTIONS[kind]}"


def path_of(document: dict[str, Any]) -> str:
    return f"{collection(document['kind'], document['metadata']['namespace'])}/{document['metadata']['name']}"


def differences(rendered: Any, stored: Any, where: str = "") -> list[str]:
    """Where the stored object is not what was rendered: each rendered field must be stored as it was (the API
    server may add defaults, and drops false, empty and null values, which it omits)."""
    if isinstance(rendered, dict) and isinstance(stored, dict):
        found = []
        for key, value in rendered.items():
            if key not in stored:
                if value not in (None, False, "", 0, {}, []):
                    found.append(f"{where}.{key}: missing (dropped or pruned)")
            else:
                found += differences(value, stored[key], f"{where}.{key}")
        return found
    if isinstance(rendered, list) and isinstance(stored, list) and len(rendered) == len(stored):
        return [
            d for i, (r, s) in enumerate(zip(rendered, stored, strict=True)) for d in differences(r, s, f"{where}[{i}]")
        ]
    return [] if rendered == stored else [f"{where}: rendered {rendered!r}, stored {stored!r}"]


def listed(api: ApiServer, namespaces: set[str], selector: str) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of every object of the chart's kinds in these namespaces with these labels."""
    found = set()
    for namespace in namespaces:
        for kind in COLLECTIONS:
            for item in api.get(f"{collection(kind, namespace)}?labelSelector={selector}")["items"]:
                found.add((kind, namespace, item["metadata"]["name"]))
    return found


def identities(objects: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects}


def user_supplied(api: ApiServer, objects: list[dict[str, Any]], namespace: str) -> None:
    """What a values file names that the user makes: the namespaces the objects go to (the dashboards'), and the
    Secrets the pod mounts (ci/full-values.yaml's volprobe-tls; the API server would take the DaemonSet without
    them, the kubelet would not start its pods)."""
    for other in {o["metadata"]["namespace"] for o in objects} - {namespace}:
        reply = api.call("POST", "/api/v1/namespaces", {"metadata": {"name": other}})
        assert reply.status in (201, 409), reply.body
    for volume in daemonset_pod(objects)["spec"]["volumes"]:
        name = (volume.get("secret") or {}).get("secretName", "")
        if name and name not in {s["metadata"]["name"] for s in by_kind(objects, "Secret")}:
            placeholder = base64.b64encode(b"nothing reads it: no kubelet runs here").decode()
            secret = {"metadata": {"name": name}, "data": dict.fromkeys(("tls.crt", "tls.key", "ca.crt"), placeholder)}
            api.create(f"/api/v1/namespaces/{namespace}/secrets", secret)


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_helm_install_is_accepted_strictly_and_stores_every_object_as_rendered(
    api: ApiServer, helm: str, values: tuple[Path, ...]
) -> None:
    """Each object strictly validated by the API server first (a dry run with fieldValidation=Strict: helm's
    install only gets a warning for an unknown field, and the API server prunes one from a custom resource
    without a word), then `helm install` with no error and no warning, in a namespace that enforces the
    documented Pod Security level; each object stored as rendered, and the chart's label finds them all."""
    namespace = api.namespace(f"install-{'-'.join(v.stem for v in values) or 'defaults'}", enforce=DOCUMENTED_LEVEL)
    objects = template(helm, *values, release="volprobe", namespace=namespace)
    assert {o["kind"] for o in objects} >= {
        "ServiceAccount",
        "ConfigMap",
        "DaemonSet",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
    }
    user_supplied(api, objects, namespace)
    for document in objects:
        reply = api.call(
            "POST",
            f"{collection(document['kind'], document['metadata']['namespace'])}?dryRun=All&fieldValidation=Strict",
            document,
        )
        assert reply.status == 201, (document["kind"], document["metadata"]["name"], reply.body)
        assert reply.warnings == [], (document["kind"], reply.warnings)

    result = api.run_helm(
        "install", "volprobe", str(CHART), "--namespace", namespace, *(f"--values={v}" for v in values)
    )
    assert result.returncode == 0, result.stderr
    assert helm_warnings(result.stderr) == [] and "Warning" not in result.stderr, result.stderr

    for document in objects:
        stored = api.get(path_of(document))
        found = differences(document, stored)
        assert found == [], (document["kind"], document["metadata"]["name"], found)
        assert stored["metadata"]["annotations"]["meta.helm.sh/release-name"] == "volprobe"
    namespaces = {o["metadata"]["namespace"] for o in objects}
    assert listed(api, namespaces, "app.kubernetes.io/instance=volprobe") == identities(objects)


def test_strict_validation_refuses_an_unknown_field(api: ApiServer, helm: str) -> None:
    """The check above can fail: a misspelt field of a ServiceMonitor's endpoint, and one of the DaemonSet's
    container, are refused by the strict dry run (where a plain create would prune or keep them with a warning)."""
    namespace = api.namespace("strict", enforce=DOCUMENTED_LEVEL)
    objects = template(helm, release="volprobe", namespace=namespace)
    monitor = one(objects, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["scrape_timeout"] = "10s"
    daemonset = one(objects, "DaemonSet")
    daemonset["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    for document, field in ((monitor, "spec.endpoints[0].scrape_timeout"), (daemonset, "securityContxt")):
        query = "?dryRun=All&fieldValidation=Strict"
        reply = api.call("POST", collection(document["kind"], namespace) + query, document)
        assert reply.status in (400, 422) and "unknown field" in reply.body["message"], reply.body
        assert field in reply.body["message"], reply.body
        lax = api.call("POST", collection(document["kind"], namespace) + "?dryRun=All", document)
        assert lax.status == 201 and any("unknown field" in w for w in lax.warnings), (lax.status, lax.warnings)


# -- Pod Security ----------------------------------------------------------------------------------------------


def pod_of(api: ApiServer, namespace: str, daemonset: str, node: str = "node-that-does-not-exist") -> dict[str, Any]:
    """The pod the DaemonSet controller would make from the stored DaemonSet's template, bound to `node`."""
    template_ = api.get(f"{collection('DaemonSet', namespace)}/{daemonset}")["spec"]["template"]
    metadata = {key: template_["metadata"][key] for key in ("labels", "annotations") if key in template_["metadata"]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{daemonset}-on-{node}"[:63], **metadata},
        "spec": {**template_["spec"], "nodeName": node},
    }


def priority_class(api: ApiServer, name: str | None) -> None:
    """The pod's priority class, which the Priority admission wants to exist (system-node-critical always does)."""
    if name and not name.startswith("system-"):
        body = {"metadata": {"name": name}, "value": 1000000}
        api.create("/apis/scheduling.k8s.io/v1/priorityclasses", body, exist_ok=True)


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_the_pod_is_admitted_at_the_documented_level_and_refused_below_it(
    api: ApiServer, helm: str, values: tuple[Path, ...]
) -> None:
    """Pod Security admission: the chart's pod (privileged, hostPath volumes) is admitted where the namespace
    enforces `privileged`, and where it has no label at all (the API server's default level is privileged, as
    on a cluster whose admission configuration sets none); it is refused where the namespace enforces `baseline`.
    helm installs into both, the DaemonSet with only a warning under `baseline`: no pod of it would ever start."""
    name = "-".join(v.stem for v in values) or "defaults"
    admitting = api.namespace(f"psa-{name}-{DOCUMENTED_LEVEL}", enforce=DOCUMENTED_LEVEL, warn="restricted")
    refusing = api.namespace(f"psa-{name}-baseline", enforce="baseline")
    unlabelled = api.namespace(f"psa-{name}-unlabelled")
    # Without dashboards: ci/full-values.yaml puts them in the namespace "grafana", where the release of
    # test_helm_install... has them already (the pod is the same either way).
    sets = ("dashboards.enabled=false",)
    values_args = [f"--values={v}" for v in values] + ["--set", sets[0]]
    objects = template(helm, *values, sets=sets, release="volprobe", namespace=admitting)
    daemonset = one(objects, "DaemonSet")["metadata"]["name"]
    warnings = {}
    for namespace in (admitting, refusing, unlabelled):
        rendered = template(helm, *values, sets=sets, release="volprobe", namespace=namespace)
        user_supplied(api, rendered, namespace)
        priority_class(api, daemonset_pod(rendered)["spec"].get("priorityClassName"))
        result = api.run_helm("install", "volprobe", str(CHART), "--namespace", namespace, *values_args)
        assert result.returncode == 0, result.stderr
        warnings[namespace] = helm_warnings(result.stderr)

    # The DaemonSet: a warning for the level the namespace enforces (baseline), or warns at (restricted).
    (restricted,) = warnings[admitting]
    assert restricted.startswith('would violate PodSecurity "restricted:latest"'), restricted
    for violation in ('privileged (container "volprobe"', 'type "hostPath"', "allowPrivilegeEscalation != false"):
        assert violation in restricted, restricted
    (baseline,) = warnings[refusing]
    assert baseline.startswith('would violate PodSecurity "baseline:latest"'), baseline
    assert 'privileged (container "volprobe"' in baseline and "hostPath volumes" in baseline, baseline
    assert warnings[unlabelled] == []
    print(f"\n{name}: helm install's warnings under warn=restricted: {restricted}\nunder enforce=baseline: {baseline}")

    # The pod the DaemonSet would make.
    for namespace in (admitting, unlabelled):
        reply = api.call("POST", f"/api/v1/namespaces/{namespace}/pods", pod_of(api, namespace, daemonset))
        assert reply.status == 201, (namespace, reply.body)
    reply = api.call("POST", f"/api/v1/namespaces/{admitting}/pods", pod_of(api, admitting, daemonset, "node-2"))
    assert (
        reply.status == 201
        and reply.warnings
        and reply.warnings[0].startswith('would violate PodSecurity "restricted:latest"')
    ), (reply.status, reply.warnings)
    reply = api.call("POST", f"/api/v1/namespaces/{refusing}/pods", pod_of(api, refusing, daemonset))
    assert reply.status == 403 and reply.body["reason"] == "Forbidden", reply.body
    message = reply.body["message"]
    assert 'violates PodSecurity "baseline:latest"' in message, message
    assert 'privileged (container "volprobe" must not set securityContext.privileged=true)' in message, message
    host_paths = re.search(r"hostPath volumes \(volumes ([^)]*)\)", message)
    assert host_paths and {'"dev"', '"proc"', '"state"'} <= set(host_paths.group(1).split(", ")), message
    print(f"under enforce=baseline the pod is refused: {message}")


def test_the_readme_documents_the_pod_security_level() -> None:
    """The level the tests above install at, as README.md tells users to label the namespace."""
    readme = (REPO / "README.md").read_text()
    assert f"{LEVEL_LABEL}={DOCUMENTED_LEVEL}" in readme, (
        f"README.md does not say to label the namespace {LEVEL_LABEL}={DOCUMENTED_LEVEL}, the Pod Security level "
        "the chart's pod needs (test_the_pod_is_admitted_at_the_documented_level_and_refused_below_it)"
    )


# -- upgrade and uninstall -------------------------------------------------------------------------------------


def test_helm_upgrade_rolls_the_pods_on_a_changed_config_and_uninstall_removes_everything(
    api: ApiServer, helm: str
) -> None:
    """helm upgrade: a changed `config`, then a changed `webConfig`, each change the stored DaemonSet's pod
    template (its checksum/config annotation, so its generation: the DaemonSet controller would roll every pod);
    a change elsewhere (the ServiceMonitor's interval) leaves the template as it was. helm uninstall then leaves
    none of the chart's objects, nor helm's record of the release."""
    namespace = api.namespace("upgrade", enforce=DOCUMENTED_LEVEL)
    path = f"{collection('DaemonSet', namespace)}/volprobe"

    def install(command: str, *sets: str) -> tuple[str, int, dict[str, Any]]:
        args = [arg for s in sets for arg in ("--set", s)]
        result = api.run_helm(command, "volprobe", str(CHART), "--namespace", namespace, *args)
        assert result.returncode == 0, result.stderr
        assert helm_warnings(result.stderr) == [], result.stderr
        stored = api.get(path)
        return (
            stored["spec"]["template"]["metadata"]["annotations"]["checksum/config"],
            stored["metadata"]["generation"],
            stored["spec"]["template"],
        )

    config = "config.defaults.interval=2s"
    web = "webConfig.http_server_config.http2=false"
    first, generation, pod = install("install")
    assert len(first) == 64
    changed_config, generation_2, pod_2 = install("upgrade", config)
    assert changed_config != first and generation_2 == generation + 1 and pod_2 != pod
    settings = yaml.safe_load(api.get(f"{collection('ConfigMap', namespace)}/volprobe-config")["data"]["volprobe.yml"])
    assert settings["defaults"]["interval"] == "2s"
    changed_web, generation_3, pod_3 = install("upgrade", config, web)
    assert changed_web not in (first, changed_config) and generation_3 == generation_2 + 1
    assert "--web.config.file=/etc/volprobe-web/web-config.yml" in pod_3["spec"]["containers"][0]["args"]
    stored_web = api.get(f"{collection('Secret', namespace)}/volprobe-web-config")["data"]["web-config.yml"]
    assert yaml.safe_load(base64.b64decode(stored_web)) == {"http_server_config": {"http2": False}}
    unrelated, generation_4, pod_4 = install("upgrade", config, web, "serviceMonitor.interval=15s")
    assert (unrelated, generation_4, pod_4) == (changed_web, generation_3, pod_3), "no rollout for a monitor's change"
    (endpoint,) = api.get(f"{collection('ServiceMonitor', namespace)}/volprobe")["spec"]["endpoints"]
    assert endpoint["interval"] == "15s"

    selector = "app.kubernetes.io/instance=volprobe"
    assert ("DaemonSet", namespace, "volprobe") in listed(api, {namespace}, selector)
    result = api.run_helm("uninstall", "volprobe", "--namespace", namespace)
    assert result.returncode == 0, result.stderr
    assert listed(api, {namespace}, selector) == set()
    assert api.get(f"/api/v1/namespaces/{namespace}/secrets?labelSelector=owner=helm")["items"] == []
    assert api.run_helm("list", "--namespace", namespace, "--short").stdout.strip() == ""
