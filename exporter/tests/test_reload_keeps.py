"""A reload keeps every probe whose effective specification is unchanged, discovered ones included; a probe
whose specification changed restarts and the log names the key (issue 16, part 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import pytest

from .support.harness import MIB, parse_metrics, probes_done, sample_value, volprobe_command, wait_until

pytestmark = pytest.mark.root


def reload_and_wait(exporter, config, text: str) -> None:
    exporter.reload(config, text)


def test_reloads_of_every_section_keep_unchanged_probes(tmp_path, make_loop, start_exporter):
    explicit, found = make_loop(16 * MIB, name="explicit"), make_loop(16 * MIB, name="found")
    found_name = os.path.basename(found)
    state = tmp_path / "state"
    state.mkdir()
    base = f"""
targets:
  - {{name: explicit, device: {explicit}, probes: [{{op: read, interval: 50ms}}]}}
discovery:
  include: ['{found_name}']
  rescan_interval: 1s
  probes: [{{op: read, interval: 50ms}}]
"""
    # One reload per top-level section; none of them changes either probe's effective specification.
    variants = {
        "discovery": base.replace("rescan_interval: 1s", "rescan_interval: 1s\n  exclude: ['nothing\\d+']"),
        "throttle": base + "throttle: {window: 30s, backoff: 5}\n",
        "diskstats": base + "diskstats: all\n",
        "state_directory": base + f"state_directory: {state}\n",
        "defaults": base + "defaults: {jitter: 0.1, revisit: 0.25, interval: 1s}\n",
        "targets": base.replace("targets:\n", f"targets:\n  - {{name: extra, device: {make_loop(16 * MIB)}}}\n"),
    }
    config = tmp_path / "volprobe.yml"
    config.write_text(base)
    exporter = start_exporter("--config", str(config))
    samples = exporter.wait_for(
        lambda s: probes_done(s, "explicit") >= 20 and probes_done(s, found_name) >= 20, what="both probes running"
    )
    for section, text in variants.items():
        before = {name: probes_done(samples, name) for name in ("explicit", found_name)}
        reload_and_wait(exporter, config, text)
        samples = exporter.metrics()
        for name, value in before.items():
            # A restarted probe starts again from 0 and cannot have regrown to its old count this soon.
            assert probes_done(samples, name) >= value, (
                f"reloading {section} restarted {name}:\n{exporter.log()[-2000:]}"
            )
    assert "stopped probing" not in exporter.log()
    assert exporter.stop() == 0


def test_a_changed_discovery_probe_restarts_and_names_the_key(tmp_path, make_loop, start_exporter):
    found = make_loop(16 * MIB, name="found")
    name = os.path.basename(found)
    text = f"discovery: {{include: ['{name}'], rescan_interval: 1s, probes: [{{op: read, interval: 50ms}}]}}\n"
    config = tmp_path / "volprobe.yml"
    config.write_text(text)
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(lambda s: probes_done(s, name) >= 10, what="the discovered probe")
    reload_and_wait(exporter, config, text.replace("interval: 50ms", "interval: 40ms"))
    since_reload = lambda: exporter.log().split("configuration reloaded")[-1]  # noqa: E731
    wait_until(lambda: f"discovered {name}" in since_reload(), what=f"{name} discovered again", every=0.1)
    assert f"stopped probing {name} ({found}): probes[0].interval: 0.05 -> 0.04" in exporter.log()
    samples = exporter.wait_for(lambda s: probes_done(s, name) >= 1, what="the restarted probe")
    info = [labels for labels, _ in samples["volprobe_probe_info"] if labels["target"] == name]
    assert [labels["interval"] for labels in info] == ["0.04s"]
    assert exporter.stop() == 0


def test_reload_outcome_is_exported(tmp_path, make_loop, start_exporter):
    loop = make_loop(16 * MIB)
    good = f"targets: [{{name: a, device: {loop}, probes: [{{op: read, interval: 50ms}}]}}]\n"
    config = tmp_path / "volprobe.yml"
    config.write_text(good)
    started = time.time()
    exporter = start_exporter("--config", str(config))
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_config_last_reload_successful") == 1
    first = sample_value(samples, "volprobe_config_last_reload_success_timestamp_seconds")
    assert started - 1 <= first <= time.time()
    config.write_text(good.replace("interval", "intervall"))
    exporter.process.send_signal(signal.SIGHUP)
    samples = exporter.wait_for(
        lambda s: sample_value(s, "volprobe_config_last_reload_successful") == 0, timeout=10, what="a failed reload"
    )
    assert sample_value(samples, "volprobe_config_last_reload_success_timestamp_seconds") == first
    reload_and_wait(exporter, config, good)
    samples = exporter.metrics()
    assert sample_value(samples, "volprobe_config_last_reload_successful") == 1
    assert sample_value(samples, "volprobe_config_last_reload_success_timestamp_seconds") > first
    assert exporter.stop() == 0


def test_discovery_patterns_that_match_nothing_are_reported(tmp_path, make_loop, start_exporter):
    name = os.path.basename(make_loop(16 * MIB))
    config = tmp_path / "volprobe.yml"
    config.write_text(f"discovery: {{include: ['{name}', '^loop', 'loop'], exclude: ['nothing']}}\n")
    checked = subprocess.run(volprobe_command("check-config", str(config)), capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert f"discovery.include[0] '{name}': {name}" in checked.stdout
    assert "discovery.include[1] '^loop': no device now (patterns match whole kernel names)" in checked.stdout
    assert "discovery.exclude[0] 'nothing': no device now" in checked.stdout
    exporter = start_exporter("--config", str(config))
    exporter.wait_for(lambda s: probes_done(s, name) >= 1, what="the discovered probe")
    log = exporter.log()
    assert "discovery.include[1] '^loop' matches no device now" in log
    assert "discovery.include[2] 'loop' matches no device now" in log
    assert "discovery.include[0]" not in log
    reload_and_wait(exporter, config, config.read_text())
    assert exporter.log().count("discovery.include[1] '^loop' matches no device now") == 2, "warned again on reload"
    assert exporter.stop() == 0


def test_a_changed_web_config_restarts_no_probe(tmp_path, make_loop, start_exporter):
    loop = make_loop(16 * MIB)
    web = tmp_path / "web.yml"
    web.write_text("http_server_config: {headers: {X-Frame-Options: deny}}\n")
    config = tmp_path / "volprobe.yml"
    config.write_text(f"targets: [{{name: a, device: {loop}, probes: [{{op: read, interval: 50ms}}]}}]\n")
    exporter = start_exporter("--config", str(config), "--web.config.file", str(web))
    samples = exporter.wait_for(lambda s: probes_done(s, "a") >= 20, what="probes")
    before = probes_done(samples, "a")
    web.write_text("http_server_config: {headers: {X-Frame-Options: sameorigin}}\n")  # applies to the next request
    with urllib.request.urlopen(exporter.url + "/metrics", timeout=10) as response:
        assert response.headers["X-Frame-Options"] == "sameorigin"
        assert probes_done(parse_metrics(response.read().decode()), "a") >= before
    reload_and_wait(exporter, config, config.read_text())  # and a SIGHUP with it
    assert probes_done(exporter.metrics(), "a") >= before
    assert "stopped probing" not in exporter.log()
    assert exporter.stop() == 0


def test_a_changed_probe_of_a_directory_restarts_alone(tmp_path, make_loop, mount_fs, start_exporter):
    """Issue 41: only the commit probe's interval changes. Its read and write probes run on, their counts going on
    from where they were; the commit probe alone restarts, and the log names it probes[2], as the file does."""
    directory = mount_fs(make_loop(64 * MIB))
    probes = "[{op: read, interval: 50ms}, {op: write, interval: 50ms}, {op: commit, interval: 50ms}]"
    text = f"targets:\n  - {{name: d, directory: {directory}, probe_file_size: 8MiB, probes: {probes}}}\n"
    config = tmp_path / "volprobe.yml"
    config.write_text(text)
    exporter = start_exporter("--config", str(config))
    ops = ("read", "write", "commit")
    exporter.wait_for(lambda s: all(probes_done(s, "d", op) >= 20 for op in ops), what="the three probes")
    before = exporter.metrics()
    exporter.reload(config, text.replace("{op: commit, interval: 50ms}", "{op: commit, interval: 40ms}"))
    after = exporter.metrics()
    for op in ("read", "write"):
        assert probes_done(after, "d", op) >= probes_done(before, "d", op), f"the {op} probe restarted"
    assert sample_value(after, "volprobe_probe_interval_seconds", target="d", op="commit") == 0.04
    assert sample_value(after, "volprobe_probe_interval_seconds", target="d", op="read") == 0.05
    log = exporter.log()
    assert f"stopped probing d ({directory}) with commit: probes[2].interval: 0.05 -> 0.04" in log
    assert "1 kept, 0 added, 0 removed, 0 restarted; 1 probes of kept targets changed" in log
    assert f"stopped probing d ({directory}):" not in log and "with read:" not in log and "with write:" not in log
    # The counts go on: the read and write probes' histograms are the ones that ran before the reload.
    exporter.wait_for(
        lambda s: all(probes_done(s, "d", op) > probes_done(after, "d", op) for op in ops), what="the probes going on"
    )
    assert exporter.stop() == 0


def test_probes_added_and_removed_by_a_reload_leave_the_others_running(tmp_path, make_loop, mount_fs, start_exporter):
    """A metadata probe added to a running directory target gets its directory made and checked as at start; the
    removed write probe's series go; the read probe runs on, its count going on."""
    directory = mount_fs(make_loop(64 * MIB))
    text = (
        f"targets:\n  - {{name: d, directory: {directory}, probe_file_size: 8MiB, "
        "probes: [{op: read, interval: 50ms}, {op: write, interval: 50ms}]}\n"
    )
    config = tmp_path / "volprobe.yml"
    config.write_text(text)
    exporter = start_exporter("--config", str(config))
    before = exporter.wait_for(lambda s: probes_done(s, "d", "write") >= 20, what="the probes")
    exporter.reload(config, text.replace("{op: write, interval: 50ms}", "{op: metadata, interval: 50ms}"))
    after = exporter.wait_for(lambda s: probes_done(s, "d", "metadata") >= 5, what="the added metadata probe")
    assert probes_done(after, "d", "read") >= probes_done(before, "d", "read"), "the read probe restarted"
    assert probes_done(after, "d", "write") == 0, "the removed write probe's series remain"
    assert os.path.isdir(os.path.join(directory, ".volprobe-metadata"))
    log = exporter.log()
    assert f"stopped probing d ({directory}) with write: probes[1] (write): removed" in log
    assert "2 probes of kept targets changed" in log
    assert exporter.stop() == 0
