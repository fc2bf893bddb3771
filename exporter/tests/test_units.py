import contextlib
import time

import pytest

from volprobe import units, webconfig


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("50ms", 0.05), ("1s", 1), ("5m", 300), ("1h30m", 5400), ("250us", 250e-6), ("1.5s", 1.5), ("2d", 172800)],
)
def test_durations(text, seconds):
    assert units.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "5", 5, "1x", "ms", "1s2", True, None, "-1s"])
def test_bad_durations(bad):
    with pytest.raises(ValueError):
        units.parse_duration(bad)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4KiB", 4096),
        ("64MiB", 64 << 20),
        ("1G", 1 << 30),
        ("1GB", 10**9),
        (512, 512),
        ("512", 512),
        ("50MiB/s", 50 << 20),
    ],
)
def test_sizes(text, size):
    assert units.parse_size(text) == size


@pytest.mark.parametrize("bad", ["4 KiBs", "lots", -1, True, "1.5B", 3.5])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        units.parse_size(bad)


def test_formatting():
    assert units.format_size(8192) == "8KiB"
    assert units.format_size(1.5 * 1024**2) == "1.5MiB"
    assert units.format_duration(0.00234) == "2.34ms"
    assert units.format_duration(812e-6) == "812us"


@pytest.mark.parametrize("parse", [units.parse_duration, webconfig.parse_go_duration], ids=["volprobe", "go"])
def test_a_long_number_is_told_from_a_duration_in_linear_time(parse):
    """A unitless number of 20,000 digits takes about 10 times what one of 2,000 does, not 100 times (each part
    of a duration was searched for from every digit on: a MiB of digits took hours). A ratio within each round
    (best of three), never an absolute time."""

    def timed(digits: int) -> float:
        started = time.perf_counter()
        with contextlib.suppress(ValueError):
            assert parse("9" * digits) is None
        return time.perf_counter() - started

    ratios = [timed(20_000) / max(timed(2_000), 1e-6) for _ in range(3)]
    assert min(ratios) < 30, ratios
