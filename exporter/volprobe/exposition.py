"""The Prometheus text format (0.0.4) and OpenMetrics 1.0.0, byte for byte as prometheus_client's encoders
(exposition.generate_latest, openmetrics.exposition.generate_latest) write them, faster.

Those encoders validate, sort and escape every label of every sample on every scrape; with 64 targets that was
most of a scrape's CPU. Here a series' `name{labels}` text is rendered once and remembered: collectors whose
series live as long as a probe or a disk (probe, diskstats, throttle) hold them as Series and fill a
SeriesFamily, whose lines are written as they are; other families' series texts are remembered by the
TextExposition that writes them (the server keeps one). Both formats write a sample's line alike (labels
sorted, values escaped the same way, numbers as Go writes them; only timestamps differ), so they share these
texts; they differ in the families' headers. A family whose names are not in the legacy character set (or,
in OpenMetrics, that has colons, exemplars or native histograms) is left to prometheus_client's encoder, so the
output never differs (tests compare them on the real exporter's registry).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .native import NativeBuckets

_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LEGACY_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# A metric name without colons: colons are for recording rules, not exporters; and in OpenMetrics
# prometheus_client's underscores escaping turns them into underscores in sample names (not in # HELP).
_PLAIN_NAME = _LEGACY_LABEL
_NEEDS_ESCAPE = re.compile(r'[\\\n"]')
_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
_CACHE_LIMIT = 65536
_EOF = "# EOF\n"

OPENMETRICS_ESCAPINGS = (openmetrics.UNDERSCORES, openmetrics.ALLOWUTF8)
"""The escapings (of an Accept header's `escaping=`) TextExposition writes OpenMetrics in: both leave names
of the legacy character set without colons as they are (the other families are left to prometheus_client)."""


class _One(Collector):
    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self.metric]


def utf8_text(text: str) -> str:
    """`text` as UTF-8 can carry it, which every exposition needs: a byte of a path that was not UTF-8 (which
    os.fsdecode made a lone surrogate) is written `\\xff`, as the logs write it; any other text is as it is."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no path decodes to (U+D800, from a \\u escape in YAML)
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _value(text: str) -> str:
    text = utf8_text(text)
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
    """A Series for a declared name and labels (legacy names without colons only: volprobe.metrics declares no
    other, and its text is then the same in both formats)."""
    if not _PLAIN_NAME.fullmatch(name) or not all(_LEGACY_LABEL.fullmatch(k) for k in labels):
        raise ValueError(f"{name} {sorted(labels)}: not a legacy metric or label name, or has a colon")
    return Series(name, labels, _series_text(name, labels))


class SeriesFamily(Metric):
    """A family filled from Series, written by TextExposition without looking at a label again. Its samples
    are made when something else reads them (prometheus_client's encoders), so it reads as any
    other family."""

    def __init__(self, name: str, documentation: str, typ: str) -> None:
        # Two flat lists, not a list of pairs: a scrape then allocates no container per sample (less for the
        # garbage collector to walk, which showed in the scrape's tail latency).
        self.series: list[Series] = []
        self.values: list[float] = []
        # A histogram's native buckets, by its labels (sorted pairs, without le), made only if the protobuf
        # exposition asks: the text formats never carry them.
        self.native: dict[tuple[tuple[str, str], ...], Callable[[], NativeBuckets]] = {}
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
        """Its sample lines (the same in both formats), each value's text from `numbers` or else `number`."""
        return [f"{s.text} {numbers.get(v) or number(v)}\n" for s, v in zip(self.series, self.values, strict=True)]


def _legacy(metric: Metric, names: re.Pattern[str] = _LEGACY_NAME) -> bool:
    """Its name and sample names match `names`, its label names are legacy ones."""
    if not names.fullmatch(metric.name):
        return False
    samples = {sample.name for sample in metric.samples}
    labels = {label for sample in metric.samples for label in sample.labels}
    return all(names.fullmatch(n) for n in samples) and all(_LEGACY_LABEL.fullmatch(label) for label in labels)


def _plain_openmetrics(metric: Metric) -> bool:
    """Names TextExposition writes in OpenMetrics as they are, and samples with a value and nothing more (an
    exemplar, a native histogram)."""
    if isinstance(metric, SeriesFamily):  # its series were checked by series()
        return bool(_PLAIN_NAME.fullmatch(metric.name))
    return _legacy(metric, _PLAIN_NAME) and all(
        s.value is not None and s.exemplar is None and s.native_histogram is None for s in metric.samples
    )


class TextExposition:
    """Writes the text format and OpenMetrics, remembering the text of series and numbers from one scrape to the
    next: a series keeps its labels from scrape to scrape, and counts and bounds repeat. Both formats share these
    caches (two scrapes in different formats may run at once: at worst a text is rendered twice). Caches, not
    state: a fresh one writes the same bytes, only slower."""

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

    def generate_openmetrics(self, registry: Collector, escaping: str = openmetrics.UNDERSCORES) -> bytes:
        """What prometheus_client.openmetrics.exposition.generate_latest(registry, escaping) returns, OpenMetrics
        1.0.0, for an escaping of OPENMETRICS_ESCAPINGS."""
        if escaping not in OPENMETRICS_ESCAPINGS:
            raise ValueError(f"escaping={escaping}: only {', '.join(OPENMETRICS_ESCAPINGS)} are written here")
        output: list[str] = []
        for metric in registry.collect():
            if _plain_openmetrics(metric):
                output.extend(self._openmetrics_family(metric))
            else:
                generic = openmetrics.generate_latest(_One(metric), escaping=escaping, version="1.0.0")
                output.append(generic.decode("utf-8").removesuffix(_EOF))
        output.append(_EOF)
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

    def _line(self, sample: Sample, seconds: bool) -> str:
        """A sample's line; its timestamp, if any, in seconds as given (OpenMetrics) or else in milliseconds."""
        text = self._series_of(sample.name, sample.labels) if sample.labels else sample.name
        if sample.timestamp is None:
            return f"{text} {self._number(sample.value)}\n"
        timestamp = sample.timestamp if seconds else int(float(sample.timestamp) * 1000)
        return f"{text} {self._number(sample.value)} {timestamp}\n"

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
            line = self._line(sample, seconds=False)
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

    def _openmetrics_family(self, metric: Metric) -> list[str]:
        """Its name as it is (a counter's without _total, an info's without _info), its help with quotes escaped
        too, its unit if any; samples in the order given, _created ones among them."""
        out = [f"# HELP {metric.name} {_value(metric.documentation)}\n", f"# TYPE {metric.name} {metric.type}\n"]
        if metric.unit:
            out.append(f"# UNIT {metric.name} {metric.unit}\n")
        if isinstance(metric, SeriesFamily):
            out.extend(metric.lines(self._numbers, self._number))
        else:
            out.extend(self._line(sample, seconds=True) for sample in metric.samples)
        return out


def generate_text(registry: Collector) -> bytes:
    """What generate_latest(registry) returns, for the default (underscores) escaping; with no cache kept (the
    server keeps a TextExposition)."""
    return TextExposition().generate(registry)


def generate_openmetrics(registry: Collector, escaping: str = openmetrics.UNDERSCORES) -> bytes:
    """What prometheus_client.openmetrics.exposition.generate_latest(registry, escaping) returns, for an escaping
    of OPENMETRICS_ESCAPINGS; with no cache kept."""
    return TextExposition().generate_openmetrics(registry, escaping)
