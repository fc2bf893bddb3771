"""Exporter conventions an SRE expects from a Prometheus exporter: flags, log formats, packaging."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import urllib.error
import urllib.request

import pytest

from volprobe import app
from volprobe.command import EXIT_CONFIG, report
from volprobe.config import ConfigError

from .support.harness import REPO, free_port, write_config


@pytest.fixture
def no_targets(tmp_path) -> tuple[str, str]:
    """--config of a file with no targets: these tests touch no device."""
    return "--config", write_config(tmp_path, "targets: []\n")


@pytest.fixture
def serve_in_process():
    """Run the exporter in this process (app.App) on a free loopback port: for what the wiring does, where a
    process of its own adds nothing (signals, logs and imports are tested with one)."""
    started: list[app.App] = []

    def serve(*args: str) -> tuple[app.App, str]:
        port = free_port()
        running = app.App.build(app.parser().parse_args(["--web.listen-address", f"127.0.0.1:{port}", *args]))
        running.start()
        started.append(running)
        running.serve()
        return running, f"http://127.0.0.1:{port}"

    yield serve
    for running in started:
        assert running.stop() == []


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def test_json_logs_carry_the_logfmt_keys(start_exporter, no_targets):
    exporter = start_exporter("--log.format", "json", *no_targets)
    exporter.stop()
    lines = [json.loads(line) for line in exporter.log().splitlines() if line.strip()]
    assert lines, "the exporter logged something"
    for line in lines:
        assert {"ts", "level", "logger", "msg"} <= line.keys() and line["ts"].endswith("Z")
    assert any("listening on" in line["msg"] for line in lines)


def test_an_unknown_log_format_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        app.parser().parse_args(["--log.format", "xml"])
    assert refused.value.code == 2 and "--log.format" in capsys.readouterr().err


def test_the_telemetry_path_moves_the_metrics(serve_in_process, no_targets):
    _, url = serve_in_process("--web.telemetry-path", "/probe/metrics", *no_targets)
    assert "volprobe_build_info" in get(url + "/probe/metrics")
    with pytest.raises(urllib.error.HTTPError) as missing:
        get(url + "/metrics")
    assert missing.value.code == 404
    assert 'href="/probe/metrics"' in get(url + "/")


@pytest.mark.parametrize("path", ["metrics", "/-/healthy"])
def test_a_telemetry_path_that_cannot_work_is_refused(path, no_targets, capsys):
    with pytest.raises(ConfigError) as refused:
        app.App.build(app.parser().parse_args(["--web.telemetry-path", path, *no_targets]))
    assert report(refused.value) == EXIT_CONFIG == 2 and "--web.telemetry-path" in capsys.readouterr().err


def test_several_listen_addresses_serve_the_same_metrics(serve_in_process, no_targets):
    other = free_port()
    running, url = serve_in_process("--web.listen-address", f"127.0.0.1:{other}", *no_targets)
    assert len(running.servers) == 2
    first, second = get(url + "/metrics"), get(f"http://127.0.0.1:{other}/metrics")
    assert "volprobe_build_info" in first and "volprobe_build_info" in second


def test_the_daemon_runs_without_rich(start_exporter, tmp_path, no_targets):
    """rich draws the terminal tools' tables and progress bars; the daemon must not need it."""
    blocked = tmp_path / "blocked"
    (blocked / "rich").mkdir(parents=True)
    (blocked / "rich" / "__init__.py").write_text("raise ImportError('rich is blocked for this test')\n")
    exporter = start_exporter(*no_targets, env={"PYTHONPATH": f"{blocked}:{REPO / 'exporter'}"})
    assert "volprobe_build_info" in exporter.get("/metrics")
    assert exporter.stop() == 0 and "Traceback" not in exporter.log()


def test_the_installed_package_states_the_license_of_its_license_file():
    """The metadata the build wrote (an SPDX expression needs setuptools 77, PEP 639: an older one would have
    failed the install, or written no License-Expression) names the license the LICENSE file holds."""
    installed = importlib.metadata.metadata("volprobe")
    assert installed["License-Expression"] == "Apache-2.0"
    assert installed.get_all("License-File") == ["LICENSE"]
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text


def test_the_readmes_promql_parses_and_names_only_declared_metrics(tmp_path):
    """Every ```promql block of the README is valid PromQL for promtool 2.42, and every volprobe_* series it
    names is one volprobe exports."""
    import re

    import yaml

    from volprobe import metrics

    blocks = re.findall(r"```promql\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    assert len(blocks) >= 3
    expressions = ["\n".join(line for line in block.splitlines() if not line.startswith("#")) for block in blocks]
    rules = [{"record": f"readme:block:{i}", "expr": expr} for i, expr in enumerate(expressions)]
    path = tmp_path / "readme-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "readme", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    named = {name for expr in expressions for name in re.findall(r"\bvolprobe_[a-z0-9_]+", expr)}
    assert named <= metrics.series_names(), named - metrics.series_names()


def test_tests_import_helpers_from_the_support_package_only():
    """No test module imports another test module (their helpers live in tests/support), and nothing in the
    suite puts a directory on sys.path (pyproject.toml's pytest `pythonpath` does)."""
    suite = [*(REPO / "exporter" / "tests").rglob("*.py"), *(REPO / "deploy" / "lab").glob("*.py")]
    for path in suite:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(alias.name for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                names = []
            assert not any(name.split(".")[-1].startswith("test_") for name in names), f"{path}:{node.lineno}"
            if isinstance(node, ast.Attribute) and node.attr == "path":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "sys"), f"{path}:{node.lineno}"
