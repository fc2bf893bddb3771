"""The exporter's wiring (volprobe.app) and the tools' table, in this process: no device, no root."""

from __future__ import annotations

import logging
import socket

import pytest

from volprobe import app, cli, tools
from volprobe.command import EXIT_CONFIG

from .support.harness import free_port, write_config


def build(*args: str) -> app.App:
    return app.App.build(app.parser().parse_args(["--web.listen-address", f"127.0.0.1:{free_port()}", *args]))


def test_every_tool_is_registered_by_its_subcommand():
    assert list(tools.TOOLS) == ["check-config", "compare", "devices", "ping", "warmup"]
    assert all(name in app.parser().description for name in tools.TOOLS)  # `volprobe --help` names them


def test_a_tool_is_dispatched_with_its_arguments(tmp_path, capsys):
    bad = write_config(tmp_path, "targets: [{device: /dev/a, probes: [{op: read, block_size: 4kb8}]}]")
    assert cli.main(["check-config", bad]) == EXIT_CONFIG
    assert "targets[0].probes[0].block_size" in capsys.readouterr().err


def test_a_reload_applies_a_good_file_and_keeps_the_running_one_on_a_bad(tmp_path, caplog):
    config = tmp_path / "volprobe.yml"
    config.write_text("targets: []\n")
    running = build("--config", str(config))
    running.start()
    try:
        started = running.exporter.config_reload()
        assert started.successful
        config.write_text("targets: [{device: /dev/a, probes: [{op: read, intervall: 1s}]}]\n")
        with caplog.at_level(logging.ERROR):
            running.reload()
        assert not running.exporter.config_reload().successful
        assert "targets[0].probes[0].intervall: unknown key" in caplog.text
        assert running.exporter.config.discovery is None  # the running configuration, unchanged
        config.write_text("discovery: {include: ['nonesuch\\d+']}\n")
        running.reload()
        now = running.exporter.config_reload()
        assert now.successful and now.success_time >= started.success_time
        assert running.exporter.config.discovery is not None
    finally:
        assert running.stop() == []


def test_a_reload_without_a_config_file_changes_nothing(tmp_path, caplog):
    running = build("--target", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        running.reload()
    assert "no --config file to reload" in caplog.text
    assert running.exporter.config_reload().successful


def test_an_address_in_use_is_refused_and_nothing_is_left_listening(tmp_path):
    config = write_config(tmp_path, "targets: []\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free = free_port()
        args = ["--config", config, "--web.listen-address", f"127.0.0.1:{free}"]
        running = app.App.build(app.parser().parse_args([*args, "--web.listen-address", f"127.0.0.1:{port}"]))
        with pytest.raises(app.ListenError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            running.start()
    assert running.servers == []
    with socket.socket() as again:
        again.bind(("127.0.0.1", free))  # the first listener was closed
