"""First touch and zero reads on a lazily allocated lab volume: the penalty of fresh blocks, made visible."""

from __future__ import annotations

import pytest

from .support.harness import MIB, recent_probes, sample_value

pytestmark = pytest.mark.root


def test_first_touch_writes_pay_the_allocation_and_never_written_blocks_read_as_zeros(
    tmp_path, lab_volume, start_exporter
):
    volume = lab_volume(
        size=256 * MIB,
        alloc_unit=8 * 1024,
        read_latency=0.005,  # a read that touched media would take 5 ms
        write_latency=0.001,
        lazy=True,
        first_write_latency=0.03,
    )
    config = tmp_path / "volprobe.yml"
    config.write_text(f"""
defaults: {{window: 5m, revisit: 0.5}}
targets:
  - name: thin
    device: {volume.device}
    allow_raw_writes: true
    probes:
      - {{op: write, block_size: 8KiB, interval: 50ms}}
      - {{op: read, block_size: 8KiB, interval: 37ms}}  # not in step with the writes: a read queued behind
                                                          # a 30 ms first write would not be a zero read's latency
""")
    exporter = start_exporter("--config", str(config))

    def counts(s):
        return [recent_probes(s, "thin", touch, "write") for touch in ("first", "repeat")]

    samples = exporter.wait_for(lambda s: min(counts(s)) >= 40, timeout=60, what="40 first and 40 repeat writes")
    first = sample_value(
        samples, "volprobe_probe_latency_recent_seconds", target="thin", op="write", touch="first", quantile="0.5"
    )
    repeat = sample_value(
        samples, "volprobe_probe_latency_recent_seconds", target="thin", op="write", touch="repeat", quantile="0.5"
    )
    # A repeat write costs the configured 1 ms plus the O_DSYNC flush through loop -> FUSE -> NBD: 1.6-4.5 ms seen.
    assert first > 4 * repeat, (first, repeat)
    assert first >= 0.028 and repeat < 0.008, (first, repeat)
    # Reads: nothing but probes ever wrote this volume, and reads go to their own offsets: all zeros, all fast.
    reads = sample_value(samples, "volprobe_probe_latency_seconds_count", target="thin", op="read")
    zero = sample_value(samples, "volprobe_probe_zero_reads_total", target="thin")
    assert reads >= 40 and zero >= 0.9 * reads
    read_p50 = sample_value(
        samples, "volprobe_probe_latency_recent_seconds", target="thin", op="read", touch="first", quantile="0.5"
    )
    assert read_p50 < 0.0025, "reads of never-written blocks are answered without touching media"
    assert exporter.stop() == 0
