"""node_exporter's flags and log fields, on a real exporter (issue 42): --collector.disable-defaults,
--web.disable-exporter-metrics, --web.max-requests, --web.systemd-socket, and probe errors logged with their
target, device, op and errno as fields in logfmt and JSON."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from volprobe import collectors

from .support.harness import MIB, REPO, probes_done, sample_value, wait_until, write_config


def test_help_lists_node_exporters_flags():
    result = subprocess.run([sys.executable, "-m", "volprobe", "--help"], capture_output=True, text=True, check=True)
    for flag in (
        "--collector.disable-defaults",
        "--web.disable-exporter-metrics",
        "--web.max-requests",
        "--web.systemd-socket",
    ):
        assert flag in result.stdout, flag


def test_disable_defaults_keeps_only_the_collectors_turned_on_by_name(tmp_path, start_exporter):
    (tmp_path / "data").mkdir()
    exporter = start_exporter("--target", str(tmp_path / "data"), "--collector.disable-defaults", "--collector.target")
    samples = exporter.metrics()
    ran = {labels["collector"] for labels, _ in samples["volprobe_scrape_collector_success"]}
    assert ran == {"target"}
    assert "volprobe_target_info" in samples and "volprobe_probe_latency_seconds_count" not in samples
    # Without it, every collector enabled by default runs.
    everything = start_exporter("--target", str(tmp_path / "data")).metrics()
    ran = {labels["collector"] for labels, _ in everything["volprobe_scrape_collector_success"]}
    assert ran == {name for name, reg in collectors.REGISTRY.items() if reg.enabled_by_default}


def test_disable_exporter_metrics_leaves_out_the_process_and_python_metrics(tmp_path, start_exporter):
    (tmp_path / "data").mkdir()
    with_them = start_exporter("--target", str(tmp_path / "data")).metrics()
    assert "process_resident_memory_bytes" in with_them and "python_info" in with_them
    without = start_exporter("--target", str(tmp_path / "data"), "--web.disable-exporter-metrics").metrics()
    assert not [name for name in without if name.startswith(("process_", "python_"))]
    assert "volprobe_build_info" in without


def _scrapes_released_at_once(exporter, count: int) -> list[tuple[int, bytes]]:
    """`count` scrapes sent while the exporter is stopped (SIGSTOP), so that all are in when it goes on: the
    event loop reads every one before the first render is done. (status, body) of each."""
    clients = []
    exporter.process.send_signal(signal.SIGSTOP)
    try:
        for _ in range(count):
            client = socket.create_connection(("127.0.0.1", exporter.port), timeout=30)
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            clients.append(client)
    finally:
        exporter.process.send_signal(signal.SIGCONT)
    answers = []
    for client in clients:
        data = b""
        while chunk := client.recv(65536):
            data += chunk
        client.close()
        head, _, body = data.partition(b"\r\n\r\n")
        answers.append((int(head.split(b" ", 2)[1]), body))
    return answers


@pytest.mark.parametrize("limit", [1, 0])
def test_max_requests_answers_503_beyond_the_limit_as_promhttp(tmp_path, start_exporter, limit):
    (tmp_path / "data").mkdir()
    exporter = start_exporter("--target", str(tmp_path / "data"), f"--web.max-requests={limit}")
    answers = _scrapes_released_at_once(exporter, 30)
    statuses = [status for status, _ in answers]
    assert 200 in statuses
    if limit:
        assert 503 in statuses, statuses
        assert set(statuses) == {200, 503}
        refused = {body for status, body in answers if status == 503}
        assert refused == {b"Limit of concurrent requests reached (1), try again later.\n"}
    else:  # 0: no limit
        assert set(statuses) == {200}, statuses
    assert urllib.request.urlopen(exporter.url + "/metrics", timeout=5).status == 200  # none left counted


def _activated(listener: socket.socket, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """volprobe ARGS as systemd starts a socket-activated service: the listening socket as fd 3, LISTEN_FDS=1 and
    LISTEN_PID its own pid (set by a shell that then execs it, keeping its pid)."""
    wrapper = 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$@"'
    return subprocess.Popen(
        ["sh", "-c", wrapper, "sh", sys.executable, "-m", "volprobe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        pass_fds=(3,),
        preexec_fn=lambda: os.dup2(listener.fileno(), 3),
    )


def test_systemd_socket_serves_on_the_socket_passed_as_fd_3(tmp_path):
    (tmp_path / "data").mkdir()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    process = _activated(listener, "--web.systemd-socket", "--target", str(tmp_path / "data"))
    listener.close()  # the exporter holds it now
    try:

        def metrics() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    return response.read().decode()
            except OSError:
                assert process.poll() is None, process.stdout.read().decode()  # type: ignore[union-attr]
                return None

        wait_until(lambda: metrics() is not None, timeout=30, what="the exporter on the passed socket")
        assert "volprobe_build_info" in (metrics() or "")
    finally:
        process.terminate()
        output = process.communicate(timeout=20)[0].decode()
    assert process.returncode == 0, output
    assert f"listening on systemd socket 127.0.0.1:{port}" in output
    assert ":10130" not in output  # the default listen address was not bound


def test_systemd_socket_without_a_socket_passed_exits_1():
    result = subprocess.run(
        [sys.executable, "-m", "volprobe", "--web.systemd-socket"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")},
    )
    assert result.returncode == 1 and "systemd passed no socket" in result.stderr, result.stderr


@pytest.mark.root
@pytest.mark.lab
@pytest.mark.parametrize("log_format", ["logfmt", "json"])
def test_a_probe_error_is_logged_with_its_target_device_op_and_errno_as_fields(
    tmp_path, lab_volume, start_exporter, log_format
):
    volume = lab_volume(size=64 * MIB, read_latency=0.0005)
    config = write_config(
        tmp_path, f"targets: [{{name: flaky, device: {volume.device}, probes: [{{op: read, interval: 100ms}}]}}]\n"
    )
    exporter = start_exporter("--config", config, f"--log.format={log_format}")
    exporter.wait_for(lambda s: probes_done(s, "flaky") >= 3, what="first samples")
    volume.set(fail_reads=1.0)
    exporter.wait_for(
        lambda s: (sample_value(s, "volprobe_probe_errors_total", target="flaky", errno="EIO") or 0) >= 1,
        what="EIO errors",
    )
    device = os.path.basename(os.path.realpath(volume.device))
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in exporter.log().splitlines() if "probe flaky read" in line]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lines, exporter.log()[-3000:]
    if log_format == "json":
        record = json.loads(lines[0])
    else:
        record = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', lines[0]))
        record = {key: value.strip('"') for key, value in record.items()}
    assert record["level"] == "warning"
    assert record["target"] == "flaky" and record["op"] == "read" and record["errno"] == "EIO"
    assert record["device"] == device and record["path"] == volume.device
    assert "Input/output error" in record["msg"]  # the message stays readable
