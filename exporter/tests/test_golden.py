"""The golden exposition: a fixed runtime view (fakeview.golden_view) gives, byte for byte, the committed
fixtures/e2e-output.txt: every family, its help, type, labels and values, as /metrics serves them. No root,
no device, no process: a rename, a new label or a changed help text shows up as a diff of that file.

After a deliberate change to what is exported, regenerate the file and review its diff:

    PYTHONPATH=exporter python -m exporter.tests.support.golden --update
"""

from __future__ import annotations

import difflib
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from volprobe import metrics
from volprobe.collectors import VolprobeCollector
from volprobe.exposition import generate_text
from volprobe.view import RuntimeView

from .support import golden
from .support.fakeview import FakeView, golden_view
from .support.harness import have

REGENERATE = "PYTHONPATH=exporter python -m exporter.tests.support.golden --update"


def golden_text() -> str:
    return golden.GOLDEN.read_text()


def test_the_exposition_is_the_golden_file():
    rendered, committed = golden.render().decode(), golden_text()
    if rendered != committed:
        diff = "".join(difflib.unified_diff(committed.splitlines(True), rendered.splitlines(True), "golden", "now"))
        pytest.fail(f"the exposition differs from {golden.GOLDEN.name} (if intended: {REGENERATE}):\n{diff}")


def test_every_declared_series_is_in_the_golden_file():
    """Each sample name of the metric catalogue (volprobe.metrics.ALL) appears with at least one series, so that
    no family escapes the golden comparison; and every volprobe_* series in it is declared there."""
    exported = {s.name for family in text_string_to_metric_families(golden_text()) for s in family.samples}
    declared = metrics.series_names()
    assert declared - exported == set(), f"declared, absent from the golden view: {sorted(declared - exported)}"
    own = {name for name in exported if name.startswith("volprobe_")}
    assert own <= declared, sorted(own - declared)
    assert {"process_cpu_seconds_total", "python_info"} <= exported  # the whole registry, as /metrics serves it


@pytest.mark.skipif(not have("promtool"), reason="promtool not installed")
def test_promtool_accepts_the_golden_file():
    result = subprocess.run(["promtool", "check", "metrics"], input=golden_text(), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_touch_split_labels_the_histogram_by_touch():
    """defaults.histogram_by_touch, which the golden view leaves off: the same family, a touch label added."""
    view = golden_view()
    view.by_touch = True
    text = generate_text(VolprobeCollector(view, ["probe"])).decode()
    buckets = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name.endswith("_bucket")]
    assert buckets and {s.labels.get("touch") for s in buckets} == {"first", "repeat"}
    assert {s.name for s in buckets} == {metrics.PROBE_LATENCY_BY_TOUCH.bucket}


def test_an_empty_runtime_exports_the_always_present_families():
    """Nothing probed: build info, reload outcome, thread restarts at 0, and each collector's success."""
    view: RuntimeView = FakeView()
    samples = {
        s.name: s for f in VolprobeCollector(view).collect() for s in f.samples if not s.name.endswith("_seconds")
    }
    assert samples[metrics.BUILD_INFO.name].value == 1
    assert samples[metrics.CONFIG_RELOAD_SUCCESSFUL.name].value == 1
    assert metrics.WEB_CONFIG_RELOAD_SUCCESSFUL.name not in samples  # no web config watcher
    assert metrics.PROBE_LATENCY.bucket not in samples
