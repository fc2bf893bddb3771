"""exporter-toolkit itself, as the reference for the web configuration: webconfig_oracle/main.go, built with
the Go toolchain from the module proxy (go.sum pins every module), validates files with web.Validate and
serves behind a configuration as node_exporter does."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from .harness import free_port

SOURCE = Path(__file__).resolve().parents[1] / "webconfig_oracle"
BINARY = "webconfig-oracle"


def build(directory: Path) -> Path:
    go = shutil.which("go") or "/usr/local/go/bin/go"
    binary = directory / BINARY
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-buildvcs=false -mod=readonly"}
    result = subprocess.run(
        [go, "build", "-o", str(binary), "."], cwd=SOURCE, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"building the exporter-toolkit reference failed:\n{result.stderr}"
    return binary


def validate(binary: Path, paths: list[Path]) -> dict[str, tuple[str, str]]:
    """path -> ("accept" | "reject" | "reject-at-listen", exporter-toolkit's message)."""
    result = subprocess.run(
        [str(binary), "validate", *map(str, paths)], capture_output=True, text=True, timeout=120, check=True
    )
    decisions = {}
    for line in result.stdout.splitlines():
        path, outcome = line.split("\t")
        decision, _, message = outcome.partition(" ")
        decisions[path] = (decision, message)
    return decisions


class Server:
    """exporter-toolkit serving "ok" behind a web config on a free loopback port."""

    def __init__(self, binary: Path, config: Path, log: Path) -> None:
        self.port = free_port()
        self._log = open(log, "wb")  # noqa: SIM115 - kept open for the process's life
        self._process = subprocess.Popen(
            [str(binary), "serve", str(config), f"127.0.0.1:{self.port}"], stdout=self._log, stderr=self._log
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self._process.poll() is None, f"exporter-toolkit exited: {log.read_text()}"
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            time.sleep(0.05)
        self.stop()
        raise AssertionError("exporter-toolkit did not listen")

    def stop(self) -> None:
        self._process.kill()
        self._process.wait()
        self._log.close()
