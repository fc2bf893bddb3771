"""The Helm chart, deploy/chart/volprobe, as the tests render it: which helm to run, and `helm template`'s
objects, with the accessors of the pod the DaemonSet runs. test_chart checks the renders; test_image runs the
rendered pod under podman (support/kubelet.py translates it).

helm: $VOLPROBE_HELM, else helm on the PATH, else the one .ci/run builds (from Go's module proxy) into
/var/cache/volprobe-ci/helm-v3.22.0 (find_helm); without any, the tests that need it are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .harness import REPO

CHART = REPO / "deploy" / "chart" / "volprobe"
CI_HELM = Path("/var/cache/volprobe-ci/helm-v3.22.0/helm")
OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator@v0.85.0"  # as .ci/run downloads it


def find_helm() -> str:
    """The helm to run, or the test is skipped. Each test module's `helm` fixture returns it."""
    configured = os.environ.get("VOLPROBE_HELM")
    if configured:
        assert os.access(configured, os.X_OK), f"VOLPROBE_HELM={configured} is not an executable"
        return configured
    found = shutil.which("helm") or (str(CI_HELM) if os.access(CI_HELM, os.X_OK) else None)
    if found is None:
        pytest.skip(f"no helm: neither $VOLPROBE_HELM, helm on the PATH nor {CI_HELM} (.ci/run builds it)")
    return found


def template(
    helm: str, *values: Path, sets: tuple[str, ...] = (), release: str = "volprobe", namespace: str = "monitoring"
) -> list[dict[str, Any]]:
    """`helm template volprobe CHART -n monitoring` (or this release and namespace) with these values files and
    --set's: the objects."""
    command = [helm, "template", release, str(CHART), "--namespace", namespace]
    for path in values:
        command += ["--values", str(path)]
    for assignment in sets:
        command += ["--set", assignment]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = by_kind(objects, kind)
    return found


def volprobe_yml(objects: list[dict[str, Any]]) -> str:
    """The configuration file of the chart's ConfigMap (the other ConfigMaps are the dashboards)."""
    (text,) = [c["data"]["volprobe.yml"] for c in by_kind(objects, "ConfigMap") if "volprobe.yml" in c["data"]]
    return text


def daemonset_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The DaemonSet's pod template (metadata and spec)."""
    template: dict[str, Any] = one(objects, "DaemonSet")["spec"]["template"]
    return template


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod's one container, volprobe (its init container aside)."""
    (found,) = daemonset_pod(objects)["spec"]["containers"]
    return found


def operator_crd_directory() -> Path | None:
    """The Prometheus Operator's CRDs (monitoring.coreos.com_*.yaml): $VOLPROBE_OPERATOR_CRDS (.ci/run sets it),
    else its Go module's example/prometheus-operator-crd if Go's module cache holds it (nothing is downloaded
    here: GOPROXY=off); None without either. test_kube_apiserver installs them into a real API server."""
    configured = os.environ.get("VOLPROBE_OPERATOR_CRDS")
    if configured:
        assert Path(configured, "monitoring.coreos.com_servicemonitors.yaml").is_file(), configured
        return Path(configured)
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.access(go, os.X_OK):
        return None
    env = {**os.environ, "GOPROXY": "off", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    found = subprocess.run(
        [go, "mod", "download", "-json", OPERATOR_MODULE], capture_output=True, text=True, env=env, cwd="/"
    )
    if found.returncode != 0:
        return None
    return Path(json.loads(found.stdout)["Dir"]) / "example" / "prometheus-operator-crd"
