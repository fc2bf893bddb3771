"""The dashboards are valid for the oldest Grafana the README states (12.2): they type-check against that
release's own dashboard and panel types (npm @grafana/schema, pinned in grafana_schema/package-lock.json) with
the TypeScript compiler. No Grafana server runs here; its schema does."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .support import grafana_types
from .support.harness import REPO, locked, shared_directory

PACKAGE = Path(__file__).parent / "grafana_schema"
STATED = "12.2"  # README: "Grafana 12.2 or newer"


@pytest.fixture(scope="module")
def node_modules(tmp_path_factory) -> Path:
    """@grafana/schema and typescript as the lock file pins them (.ci/run installs them; done here if not, by
    one xdist worker at a time)."""
    modules = PACKAGE / "node_modules"
    with locked(shared_directory(tmp_path_factory, "grafana-schema") / "npm-ci.lock"):
        if not (modules / ".bin" / "tsc").exists():
            npm = shutil.which("npm")
            assert npm, "npm is needed (Node.js 18+) to check the dashboards against Grafana's types"
            subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--silent"], cwd=PACKAGE, check=True, timeout=600)
    return modules


def tsc(node_modules: Path, directory: Path, dashboards: dict[str, dict]) -> subprocess.CompletedProcess:
    directory.mkdir(exist_ok=True)
    (directory / "node_modules").symlink_to(node_modules)
    (directory / "check.ts").write_text(grafana_types.typescript(dashboards))
    (directory / "tsconfig.json").write_text(json.dumps(grafana_types.TSCONFIG))
    return subprocess.run(
        [str(node_modules / ".bin" / "tsc"), "-p", "tsconfig.json"],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_COLOR": "1"},
    )


def committed() -> dict[str, dict]:
    """Every committed build: dashboards/ (classic) by name, dashboards/native/ as native/name,
    dashboards/node_exporter/ as node_exporter/name."""
    return {
        str(path.relative_to(REPO / "dashboards").with_suffix("")): json.loads(path.read_text())
        for build in (REPO / "dashboards", REPO / "dashboards" / "native", REPO / "dashboards" / "node_exporter")
        for path in sorted(build.glob("*.json"))
    }


def test_the_pinned_schema_is_the_stated_grafana(node_modules):
    version = json.loads((node_modules / "@grafana" / "schema" / "package.json").read_text())["version"]
    assert version.startswith(STATED + "."), version
    readme = (REPO / "README.md").read_text()
    assert f"Grafana {STATED} or newer" in readme
    # Grafana's default schemaVersion for new dashboards in that release: ours must not be newer.
    default = subprocess.run(
        ["node", "-p", "require('@grafana/schema').defaultDashboard.schemaVersion"],
        cwd=PACKAGE, capture_output=True, text=True, check=True,
    )  # fmt: skip
    for name, dashboard in committed().items():
        assert dashboard["schemaVersion"] <= int(default.stdout), name


def test_dashboards_type_check_against_grafana_types(node_modules, tmp_path):
    dashboards = committed()
    assert len(dashboards) == 12
    result = tsc(node_modules, tmp_path / "check", dashboards)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_rejects_what_grafana_does_not_know(node_modules, tmp_path):
    """The check can fail: a misspelt heatmap option, a numeric refresh, a legend mode that does not exist and
    the link placement Grafana 12.2 lacks are each reported."""
    dashboards = committed()
    volume = dashboards["volprobe-volume"]
    volume["refresh"] = 30
    volume["links"][0]["placement"] = "inControlsMenu"
    heatmap = next(p for p in volume["panels"] if p["type"] == "heatmap")
    heatmap["options"]["yAxis"]["unitt"] = heatmap["options"]["yAxis"].pop("unit")
    series = next(p for p in volume["panels"] if p["type"] == "timeseries")
    series["options"]["legend"]["displayMode"] = "tabel"
    result = tsc(node_modules, tmp_path / "broken", {"volprobe-volume": volume})
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if re.search(r"error TS\d+", line)]
    report = "\n".join(errors)
    assert len(errors) == 4, report
    for mark in ("placement", "unitt", "tabel", "number"):
        assert mark in report, (mark, report)
