"""Grafana dashboards, built with grafana-foundation-sdk (pinned 0.0.21) from a MixinConfig: one module per
dashboard, on a panel library (panels.py) and the shared variables and label matchers (variables.py).

Fleet (every volume, worst first), Volume (one volume in depth), Warm-up, and Migration (two volumes side by
side over days). Every panel and query uses the `datasource` variable and the mixin's selector; rates use
$__rate_interval; panel ids and refIds are set explicitly; legends are shown.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from .. import MixinConfig
from . import fleet, migration, volume, warmup

BUILDERS: dict[str, Callable[[MixinConfig], dashboard.Dashboard]] = {
    "fleet": fleet.build,
    "volume": volume.build,
    "warmup": warmup.build,
    "migration": migration.build,
}


def render_all(c: MixinConfig) -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    result = {}
    for name, build in BUILDERS.items():
        model = build(c).build()
        result[f"volprobe-{name}.json"] = json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
    return result
