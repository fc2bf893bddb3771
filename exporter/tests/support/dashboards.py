"""Reading the generated dashboards: their panels, and their queries with the variables given values."""

from __future__ import annotations

import re
from typing import Any

from volprobe import metrics, ops

# What each variable becomes when a query is checked for syntax or run against a test Prometheus.
SUBSTITUTIONS = {
    "${datasource}": "prometheus",
    "$__rate_interval": "1m",
    "$__range": "1d",
    "$__interval": "1m",
    "$cluster": ".*",
    "$job": "volprobe",
    "$instance": "host:10130",
    "$target": "pgdata",
    "$baseline_cluster": ".*",
    "$candidate_cluster": ".*",
    "$baseline_instance": "ebs-host:10130",
    "$candidate_instance": "azure-host:10130",
    "$baseline": "aws",
    "$candidate": "azure",
    "$device": "nvme1n1",
    "$disk": "nvme1n1",
    "$host": "host",  # $instance without its :port (diskstats: node_exporter)
    "$op": "write",
    "$namespace": ".*",
    "$storageclass": ".*",
    "$pvc": ".*",
}


# A query of the filesystem probes' panels (the Volume dashboard's commit and metadata latency, the metadata
# steps, the mount check): empty on a volume without those opt-in probes, or that is a device. Tests of read and
# write probes of devices leave them to test_e2e_fsops.py, whose directory target has them.
FILESYSTEM_PROBES = re.compile(
    r'op="(' + "|".join(op.name for op in ops.OPS.values() if op.buffered) + r')"'
    rf"|\b{metrics.PROBE_STEP_SECONDS.name}_total\b"
    rf"|\b({metrics.MOUNT_RESPONSIVE.name}|{metrics.MOUNT_LAST_RESPONSE_TIME.name})\b"
)


def reads_filesystem_probes(expr: str) -> bool:
    return FILESYSTEM_PROBES.search(expr) is not None


def substitute(expr: str, values: dict[str, str] = SUBSTITUTIONS) -> str:
    """`expr` with each dashboard variable replaced by its value (the longest names first: $baseline_cluster
    before $baseline)."""
    for variable in sorted(values, key=len, reverse=True):
        expr = expr.replace(variable, values[variable])
    return expr


def panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of a dashboard, those inside collapsed rows included."""
    found = []
    for panel in model.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found
