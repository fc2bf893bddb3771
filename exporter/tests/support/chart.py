"""The Helm chart, deploy/chart/volprobe, as the tests render it: which helm to run, and `helm template`'s
objects, with the accessors of the pod the DaemonSet runs. test_chart checks the renders; test_image runs the
rendered pod under podman (support/kubelet.py translates it).

helm: $VOLPROBE_HELM, else helm on the PATH, else the one .ci/run builds (from Go's module proxy) into
/var/cache/volprobe-ci/helm-v3.22.0 (find_helm); without any, the tests that need it are skipped.
"""

from __future__ import annotations

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


def template(helm: str, *values: Path, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """`helm template volprobe CHART -n monitoring` with these values files and --set's: the objects."""
    command = [helm, "template", "volprobe", str(CHART), "--namespace", "monitoring"]
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
