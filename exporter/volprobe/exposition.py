"""The Prometheus text format (0.0.4), byte for byte as prometheus_client's generate_latest writes it, faster.

generate_latest validates and escapes every label name of every sample; with 64 targets that is most of a
scrape's CPU (about 17,000 samples, 380,000 label names). Here names are checked once per name (they are
declared, so always valid), and a label value is escaped only when it holds a character that needs it. A
family whose names are not in the legacy character set is left to generate_latest, so the output never
differs (a test compares the two on the real exporter's registry).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LEGACY_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_NEEDS_ESCAPE = re.compile(r'[\\\n"]')
_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")


class _One(Collector):
    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self.metric]


def _value(text: str) -> str:
    if _NEEDS_ESCAPE.search(text):
        return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return text


def _legacy(metric: Metric) -> bool:
    if not _LEGACY_NAME.fullmatch(metric.name):
        return False
    names = {sample.name for sample in metric.samples}
    labels = {label for sample in metric.samples for label in sample.labels}
    return all(_LEGACY_NAME.fullmatch(n) for n in names) and all(_LEGACY_LABEL.fullmatch(label) for label in labels)


def _family(metric: Metric) -> list[str]:
    name = metric.name + ("_total" if metric.type == "counter" else "_info" if metric.type == "info" else "")
    help_text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
    out = [f"# HELP {name} {help_text}\n", f"# TYPE {name} {_TYPES.get(metric.type, metric.type)}\n"]
    om: dict[str, list[str]] = {}
    for sample in metric.samples:
        if sample.labels:
            labels = ",".join(f'{k}="{_value(v)}"' for k, v in sorted(sample.labels.items()))
            line = f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}"
        else:
            line = f"{sample.name} {floatToGoString(sample.value)}"
        if sample.timestamp is not None:
            line += f" {int(float(sample.timestamp) * 1000):d}"
        line += "\n"
        suffix = next((s for s in _OM_SUFFIXES if sample.name == metric.name + s), None)
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
    """What generate_latest(registry) returns, for the default (underscores) escaping."""
    output: list[str] = []
    for metric in registry.collect():
        if _legacy(metric):
            output.extend(_family(metric))
        else:
            output.append(generate_latest(_One(metric)).decode("utf-8"))
    return "".join(output).encode("utf-8")
