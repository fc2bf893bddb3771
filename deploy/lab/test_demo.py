"""deploy/lab/demo brings up volumes, volprobe and a real Prometheus scraping it, and tears it all down."""

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from tests.support.harness import free_port

from . import lab

DEMO = Path(__file__).resolve().parent / "demo"

pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.slow]


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


def test_demo_up_shows_all_three_volumes_in_prometheus_and_down_cleans_up():
    volprobe_port, prometheus_port = free_port(), free_port()
    up = subprocess.run(
        [sys.executable, str(DEMO), "--volprobe-port", str(volprobe_port), "--prometheus-port", str(prometheus_port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert up.returncode == 0, up.stderr
        assert f"http://127.0.0.1:{prometheus_port}/graph" in up.stdout
        deadline = time.monotonic() + 60
        targets: set[str] = set()
        while time.monotonic() < deadline and targets != {"pgdata", "gp2", "thin"}:
            time.sleep(1)
            result = query(prometheus_port, "volprobe_probe_latency_seconds_count > 0")
            targets = {r["metric"]["target"] for r in result}
        assert targets == {"pgdata", "gp2", "thin"}
        assert query(prometheus_port, 'up{job="volprobe"}')[0]["value"][1] == "1"
    finally:
        down = subprocess.run([sys.executable, str(DEMO), "--down"], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not any(name.startswith("demo") for name in lab.names())
    leftover = subprocess.run(["pgrep", "-af", "/run/volprobe-lab/demo"], capture_output=True, text=True).stdout
    assert [line for line in leftover.splitlines() if "pgrep" not in line] == []
