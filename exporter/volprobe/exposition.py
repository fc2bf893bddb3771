"""The Prometheus text format (0.0.4), byte for byte as prometheus_client's generate_latest writes it, faster.

generate_latest validates, sorts and escapes every label of every sample on every scrape; with 64 targets that
was most of a scrape's CPU. Here a series' `name{labels}` text is rendered once and remembered: collectors
whose series live as long as a probe or a disk (probe, diskstats, throttle) hold them as Series and fill a
SeriesFamily, whose lines are written as they are; other families' series texts are remembered by the
TextExposition that writes them (the server keeps one). A family whose names are not in the legacy character
set is left to generate_latest, so the output never differs (a test compares the two on the real exporter's
registry).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LEGACY_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_NEEDS_ESCAPE = re.compile(r'[\\\n"]')
_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
_CACHE_LIMIT = 65536


class _One(Collector):
    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self.metric]


def _value(text: str) -> str:
    if _NEEDS_ESCAPE.search(text):
        return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return text


def _series_text(name: str, labels: dict[str, str]) -> str:
    pairs = ",".join(f'{k}="{_value(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{pairs}}}" if labels else name


@dataclass(frozen=True, slots=True)
class Series:
    """One series: its sample name, its labels, and its text in the exposition, rendered once."""

    name: str
    labels: dict[str, str]
    text: str


def series(name: str, labels: dict[str, str]) -> Series:
    """A Series for a declared name and labels (legacy names only: volprobe.metrics declares no other)."""
    if not _LEGACY_NAME.fullmatch(name) or not all(_LEGACY_LABEL.fullmatch(k) for k in labels):
        raise ValueError(f"{name} {sorted(labels)}: not a legacy metric or label name")
    return Series(name, labels, _series_text(name, labels))


class SeriesFamily(Metric):
    """A family filled from Series, written by generate_text without looking at a label again. Its samples
    are made when something else reads them (generate_latest, the OpenMetrics encoder), so it reads as any
    other family."""

    def __init__(self, name: str, documentation: str, typ: str) -> None:
        # Two flat lists, not a list of pairs: a scrape then allocates no container per sample (less for the
        # garbage collector to walk, which showed in the scrape's tail latency).
        self.series: list[Series] = []
        self.values: list[float] = []
        super().__init__(name, documentation, typ)

    def add(self, one: Series, value: float) -> None:
        self.series.append(one)
        self.values.append(value)

    def extend(self, several: Sequence[Series], values: Sequence[float]) -> None:
        """Several series at once (a histogram's, a summary's): one call, not one per sample."""
        if len(several) != len(values):
            raise ValueError(f"{len(several)} series, {len(values)} values")
        self.series.extend(several)
        self.values.extend(values)

    @property
    def samples(self) -> list[Sample]:
        return [Sample(s.name, s.labels, v, None, None) for s, v in zip(self.series, self.values, strict=True)]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:  # Metric.__init__ sets it to []; anything else would be lost
            raise AttributeError("a SeriesFamily is filled with add()")

    def lines(self, numbers: Mapping[float, str], number: Callable[[float], str]) -> list[str]:
        """Its sample lines, each value's text from `numbers` or else `number`."""
        return [f"{s.text} {numbers.get(v) or number(v)}\n" for s, v in zip(self.series, self.values, strict=True)]


def _legacy(metric: Metric) -> bool:
    if not _LEGACY_NAME.fullmatch(metric.name):
        return False
    names = {sample.name for sample in metric.samples}
    labels = {label for sample in metric.samples for label in sample.labels}
    return all(_LEGACY_NAME.fullmatch(n) for n in names) and all(_LEGACY_LABEL.fullmatch(label) for label in labels)


class TextExposition:
    """Writes the text format, remembering the text of series and numbers from one scrape to the next: a
    series keeps its labels from scrape to scrape, and counts and bounds repeat. Caches, not state: a fresh
    one writes the same bytes, only slower."""

    def __init__(self) -> None:
        self._series: dict[tuple[str | tuple[str, str], ...], str] = {}
        self._numbers: dict[float, str] = {}
        self._earlier: dict[float, str] = {}  # what _numbers held before it was last full

    def generate(self, registry: Collector) -> bytes:
        """What generate_latest(registry) returns, for the default (underscores) escaping."""
        output: list[str] = []
        for metric in registry.collect():
            if isinstance(metric, SeriesFamily) or _legacy(metric):
                output.extend(self._family(metric))
            else:
                output.append(generate_latest(_One(metric)).decode("utf-8"))
        return "".join(output).encode("utf-8")

    def _series_of(self, name: str, labels: dict[str, str]) -> str:
        """`name{a="x",b="y"}`, labels sorted."""
        key: tuple[str | tuple[str, str], ...] = (name, *labels.items())
        text = self._series.get(key)
        if text is None:
            if len(self._series) >= _CACHE_LIMIT:  # series come and go (targets, errnos): start afresh
                self._series.clear()
            text = self._series[key] = _series_text(name, labels)
        return text

    def _number(self, value: float) -> str:
        text = self._numbers.get(value)
        if text is not None:
            return text
        if value == 0:  # the commonest value: not kept, as -0.0 == 0.0 would share its text
            return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
        if value != value:  # NaN (an empty window's quantiles): never equal, so never found in a dict
            return "NaN"
        text = self._earlier.get(value)
        if text is None:
            text = floatToGoString(value)
        if len(self._numbers) >= _CACHE_LIMIT // 8:
            # One-off floats (sums, ages) filled it: it becomes the earlier generation, from which the numbers
            # still in use (counts, bounds) come back at their next use; the rest is forgotten with it.
            self._earlier, self._numbers = self._numbers, {}
        self._numbers[value] = text
        return text

    def _family(self, metric: Metric) -> list[str]:
        name = metric.name + ("_total" if metric.type == "counter" else "_info" if metric.type == "info" else "")
        help_text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out = [f"# HELP {name} {help_text}\n", f"# TYPE {name} {_TYPES.get(metric.type, metric.type)}\n"]
        if isinstance(metric, SeriesFamily):
            out.extend(metric.lines(self._numbers, self._number))
            return out
        om: dict[str, list[str]] = {}
        om_names = {metric.name + suffix: suffix for suffix in _OM_SUFFIXES}
        for sample in metric.samples:
            if sample.labels:
                line = f"{self._series_of(sample.name, sample.labels)} {self._number(sample.value)}"
            else:
                line = f"{sample.name} {self._number(sample.value)}"
            if sample.timestamp is not None:
                line += f" {int(float(sample.timestamp) * 1000):d}"
            line += "\n"
            suffix = om_names.get(sample.name)
            if suffix is None:
                out.append(line)
            else:
                om.setdefault(suffix, []).append(line)
        for suffix, lines in sorted(om.items()):
            out.append(f"# HELP {metric.name}{suffix} {help_text}\n")
            out.append(f"# TYPE {metric.name}{suffix} gauge\n")
            out.extend(lines)
        return out


def generate_text(registry: Collector) -> bytes:
    """What generate_latest(registry) returns, for the default (underscores) escaping; with no cache kept (the
    server keeps a TextExposition)."""
    return TextExposition().generate(registry)
