"""Collectors are registered by name and switched with --collector.NAME / --no-collector.NAME."""

from __future__ import annotations

import gc
import weakref

import pytest

from volprobe import app, collectors, config, metrics
from volprobe.collectors import probe as probe_collector
from volprobe.exposition import Series

from .support import fakeview
from .support.harness import MIB


def test_every_collector_is_registered_with_its_flag():
    assert list(collectors.REGISTRY) == ["diskstats", "nvme", "probe", "state", "target", "throttle", "warmup"]
    usage = app.parser().format_help()
    for name in collectors.REGISTRY:
        assert f"--collector.{name}, --no-collector.{name}" in usage
    args = app.parser().parse_args(["--no-collector.diskstats", "--collector.nvme"])
    assert collectors.enabled_from_args(args) == ["nvme", "probe", "state", "target", "throttle", "warmup"]


def test_an_unknown_collector_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as refused:
        app.parser().parse_args(["--no-collector.nonesuch"])
    assert refused.value.code == 2 and "--no-collector.nonesuch" in capsys.readouterr().err


@pytest.mark.root
def test_a_disabled_collector_is_neither_run_nor_reported(make_loop, start_exporter):
    loop = make_loop(16 * MIB)
    exporter = start_exporter("--target", loop, "--no-collector.diskstats")
    samples = exporter.wait_for(lambda s: "volprobe_probe_latency_seconds_count" in s, what="probes")
    exported = {name for name in samples if name.startswith("volprobe_")}
    assert not {d.spec.total for d in metrics.DISK_METRICS if d.spec.kind == "counter"} & exported
    assert metrics.DISK_IO_NOW.spec.name not in exported
    reported = {labels["collector"] for labels, _ in samples["volprobe_scrape_collector_success"]}
    assert reported == {"nvme", "probe", "state", "target", "throttle", "warmup"}
    # Everything exported is declared once in volprobe.metrics.
    assert exported <= metrics.series_names()
    assert exporter.stop() == 0


def histogram_layout(samples) -> dict[tuple[str, ...], int]:
    """{(op, touch or '') : number of buckets} of the latency histogram."""
    layout: dict[tuple[str, ...], int] = {}
    for labels, _ in samples["volprobe_probe_latency_seconds_bucket"]:
        key = (labels["op"], labels.get("touch", ""))
        layout[key] = layout.get(key, 0) + 1
    return layout


@pytest.mark.root
def test_the_legacy_histogram_layout_is_one_reload_away(tmp_path, make_loop, start_exporter):
    """The default histogram has 26 buckets and no touch label; `buckets: legacy` and `histogram_by_touch`
    bring back the first layout (45 buckets per touch) for queries written against it. Turning the touch split
    on restarts no probe (the counts go on); changing the buckets restarts them all, by design."""
    loop = make_loop(16 * MIB)
    config = tmp_path / "volprobe.yml"
    probes = "[{op: read, interval: 50ms}, {op: write, interval: 50ms}]"
    targets = f"targets: [{{name: t, device: {loop}, allow_raw_writes: true, probes: {probes}}}]\n"
    config.write_text(targets)
    exporter = start_exporter("--config", str(config))
    samples = exporter.wait_for(lambda s: "volprobe_probe_latency_seconds_count" in s, what="probes")
    assert histogram_layout(samples) == {("read", ""): 27, ("write", ""): 27}

    before = exporter.metrics()["volprobe_probe_latency_seconds_count"]
    exporter.reload(config, "defaults: {histogram_by_touch: true}\n" + targets)
    samples = exporter.wait_for(lambda s: ("read", "first") in histogram_layout(s), what="the touch split")
    assert histogram_layout(samples) == {(op, t): 27 for op in ("read", "write") for t in ("first", "repeat")}
    # Same probes: the per-touch counts add up to at least what the combined histogram had counted.
    counts = samples["volprobe_probe_latency_seconds_count"]
    for op in ("read", "write"):
        combined = next(v for labels, v in before if labels["op"] == op)
        assert sum(v for labels, v in counts if labels["op"] == op) >= combined

    exporter.reload(config, "defaults: {histogram_by_touch: true, buckets: legacy}\n" + targets)
    samples = exporter.wait_for(lambda s: max(histogram_layout(s).values()) == 46, what="the legacy buckets")
    assert set(histogram_layout(samples).values()) == {46}
    assert exporter.stop() == 0


class Running:
    """Stands for a running probe: the identity a reading carries."""


def test_a_probes_series_go_with_it():
    """Rendered series are kept by the probe's own entry only: a probe stopped by a reload or a detach is freed
    (an errno's series was once memoised on the class, which kept every probe ever scraped)."""
    running = Running()
    rendered = probe_collector.ProbeSeries(fakeview.probe_reading("t", "loop9", config.ProbeConfig("read"), running))
    assert rendered.error("EIO") is rendered.error("EIO")
    assert 'errno="EIO"' in rendered.error("EIO").text
    gone = weakref.ref(running)
    del running, rendered
    gc.collect()
    assert gone() is None


@pytest.mark.root
def test_each_disk_under_a_target_has_its_own_series(make_loop, start_exporter):
    """volprobe_target_disk_info: one series per whole disk (the Volume dashboard's disk variable lists them, so
    a target on an md or dm device shows each member's diskstats and throttling)."""
    loop = make_loop(16 * MIB)
    exporter = start_exporter("--target", loop)
    samples = exporter.metrics()
    (info,) = [labels for labels, _ in samples["volprobe_target_info"]]
    disks = {(labels["target"], labels["disk"]) for labels, v in samples["volprobe_target_disk_info"] if v == 1}
    assert disks == {(info["target"], disk) for disk in info["disks"].split(",")} == {(info["target"], loop[5:])}


@pytest.mark.parametrize("name", ["diskstats", "throttle"])
def test_a_disks_series_are_rendered_once_and_go_with_it(name):
    """The diskstats and throttle collectors keep each disk's rendered series from one scrape to the next (a
    scrape then only writes values), and forget a disk's when it is no longer exported: it comes back with new
    ones, and a collector holds no more series than its disks have."""
    view = fakeview.golden_view()
    collector = collectors.REGISTRY[name].factory(view)

    def series() -> dict[str, Series]:
        return {one.text: one for family in collector.collect() for one in family.series}

    first = series()
    assert first and all(later is first[text] for text, later in series().items())
    disks, throttle = view.disks, view.throttle
    kept = "nvme1n1"
    view.disks = {kept: disks[kept]}
    view.throttle = {kept: throttle[kept]} if throttle else None
    alone = series()
    assert alone.keys() < first.keys() and all(one is first[text] for text, one in alone.items())
    view.disks, view.throttle = disks, throttle
    back = series()
    assert back.keys() == first.keys()
    assert all((back[text] is first[text]) == (text in alone) for text in back)
