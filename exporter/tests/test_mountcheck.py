"""Calls with a deadline into filesystems that may hang (volprobe.mountcheck), and the mount_check key."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from volprobe import mountcheck
from volprobe.config import ConfigError, parse

from .support.harness import volprobe_command, wait_until, write_config


def test_a_call_answers_or_is_hung_and_at_most_one_is_outstanding_per_key() -> None:
    checks = mountcheck.Checks()
    assert checks.call("/a", lambda: 42, 1.0) == 42
    with pytest.raises(FileNotFoundError):
        checks.call("/a", lambda: os.stat("/nonexistent/x"), 1.0)

    release = threading.Event()
    started = threading.Event()

    def hang() -> None:
        started.set()
        release.wait()

    with pytest.raises(mountcheck.Hung):
        checks.call("/a", hang, 0.05)
    assert started.is_set() and checks.outstanding() == 1
    # While it hangs: no second thread for the key; other keys are not held up.
    calls = []
    assert not checks.submit("/a", lambda: calls.append(1), lambda error: None)
    with pytest.raises(mountcheck.Hung, match="has not returned"):
        checks.call("/a", lambda: calls.append(2), 0.05)
    assert calls == []
    assert checks.call("/b", lambda: "b", 1.0) == "b"
    before = threading.active_count()
    for _ in range(20):
        checks.submit("/a", hang, lambda error: None)
    assert threading.active_count() == before

    release.set()
    wait_until(lambda: checks.outstanding() == 0, 5)
    assert checks.call("/a", lambda: "again", 1.0) == "again"


def test_a_caller_waits_for_the_outstanding_call_then_makes_its_own() -> None:
    checks = mountcheck.Checks()
    release = threading.Event()
    checks.submit("/a", release.wait, lambda error: None)
    threading.Timer(0.05, release.set).start()
    assert checks.call("/a", lambda: "mine", 5.0) == "mine"


def test_directories_shared_with_their_mount_wait_on_its_outstanding_call() -> None:
    """Once the mount of /nfs/a and /nfs/b is known, a call for either is a call for /nfs: while the mount's call
    hangs past the deadline they give up at once, with no thread of their own; other directories are not held."""
    checks = mountcheck.Checks()
    checks.share({"/nfs/a": "/nfs", "/nfs/b": "/nfs"})
    release = threading.Event()
    assert checks.submit("/nfs", release.wait, lambda error: None)

    def nfs_threads() -> int:
        return sum(t.name.startswith("mount check /nfs") for t in threading.enumerate())

    assert nfs_threads() == 1
    with pytest.raises(mountcheck.Hung):
        checks.call("/nfs/a", lambda: "a", 0.05)
    for key in ("/nfs/a", "/nfs/b"):
        assert checks.outstanding_since(key) == checks.outstanding_since("/nfs") is not None
        with pytest.raises(mountcheck.Hung, match="has not returned"):
            checks.call(key, lambda: "b", 0.05)
        assert not checks.submit(key, lambda: None, lambda error: None)
    assert nfs_threads() == 1
    assert checks.call("/local", lambda: "local", 1.0) == "local"
    release.set()
    wait_until(lambda: checks.outstanding() == 0, 5)
    assert checks.call("/nfs/b", lambda: "b", 1.0) == "b"


def test_a_call_renewed_is_late_from_its_last_progress_and_nothing_else_is_renewed() -> None:
    now = [100.0]
    checks = mountcheck.Checks(clock=lambda: now[0])
    release = threading.Event()
    checks.submit("/m", release.wait, lambda error: None)
    now[0] = 105.0
    checks.renew("/m")  # one directory of the mount answered at 105: the next one's deadline counts from there
    checks.renew("/other")
    assert checks.outstanding_since("/m") == 105.0 and checks.outstanding_since("/other") is None
    release.set()
    wait_until(lambda: checks.outstanding() == 0, 5)


def test_mount_check_is_validated_and_named() -> None:
    assert parse({}).mount_check.timeout == 10.0 and parse({}).mount_check.interval == 5.0
    assert parse({"mount_check": {"timeout": "2s", "interval": "500ms"}}).mount_check.timeout == 2.0
    for raw, named in (
        ({"timeout": "0s"}, "mount_check.timeout"),
        ({"timeout": "2h"}, "mount_check.timeout"),
        ({"interval": -1}, "mount_check.interval"),
        ({"timout": "1s"}, "mount_check.timout"),
        ("10s", "mount_check"),
    ):
        with pytest.raises(ConfigError) as raised:
            parse({"mount_check": raw})
        assert any(problem.startswith(f"{named}:") for problem in raised.value.problems), raised.value.problems


def test_the_exporter_exits_2_naming_a_bad_mount_check(tmp_path) -> None:
    config = write_config(tmp_path, "mount_check: {timeout: 0s}\n")
    done = subprocess.run(volprobe_command("--config", config), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "mount_check.timeout" in done.stderr + done.stdout
