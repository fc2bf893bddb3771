"""The dashboards as TypeScript that Grafana's own types (npm @grafana/schema) must accept: each dashboard, and
each panel's options and custom field config, assigned as object literals, so that tsc rejects a key Grafana
does not know (excess property check) and a value of the wrong type.

`Loose<T>` makes every field optional (the JSON need not carry Grafana's defaults) and turns string enums into
their literal values (the JSON holds "table", not LegendDisplayMode.Table)."""

from __future__ import annotations

import copy
import json
from typing import Any

SCHEMA = "@grafana/schema"
TYPES = f"{SCHEMA}/dist/types/raw/composable"
# panel type -> (its module under raw/composable, the name its types use, whether it has custom field config)
PANELS = {
    "timeseries": ("timeseries", "TimeSeries", True),
    "table": ("table", "Table", True),
    "stat": ("stat", "Stat", False),
    "bargauge": ("bargauge", "BarGauge", False),
    "barchart": ("barchart", "BarChart", True),
    "heatmap": ("heatmap", "Heatmap", True),
    "state-timeline": ("statetimeline", "StateTimeline", True),
}
# Keys grafana-foundation-sdk 0.0.21 writes that no Grafana schema declares, all inert: the interval
# variable's auto settings on every variable, and the table footer Grafana 12.2 moved to the field config
# (ours is off). Only these are removed before the check; any other unknown key fails it.
SDK_EXTRAS_ON_VARIABLES = ("auto", "auto_count", "auto_min")


def without_sdk_extras(dashboard: dict[str, Any]) -> dict[str, Any]:
    dashboard = copy.deepcopy(dashboard)
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "interval":
            for key in SDK_EXTRAS_ON_VARIABLES:
                variable.pop(key, None)
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "table" and panel.get("options", {}).get("footer", {}).get("show") is False:
            del panel["options"]["footer"]
    return dashboard


def typescript(dashboards: dict[str, dict[str, Any]]) -> str:
    """One .ts file checking every dashboard (name -> JSON) and its panels. A panel type with no known types
    is an error, not a panel left unchecked."""
    lines = [
        f"import type {{ Dashboard }} from '{SCHEMA}';",
        *(
            f"import type * as {stem} from '{TYPES}/{module}/panelcfg/x/{stem}PanelCfg_types.gen';"
            for module, stem, _ in PANELS.values()
        ),
        "type Loose<T> = T extends string ? `${T}` : T extends readonly (infer U)[] ? Loose<U>[]"
        " : T extends object ? { [K in keyof T]?: Loose<T[K]> } : T;",
    ]
    for name, raw in dashboards.items():
        dashboard = without_sdk_extras(raw)
        var = "d_" + "".join(c if c.isalnum() else "_" for c in name)
        lines.append(f"export const {var}: Loose<Dashboard> = {json.dumps(dashboard, indent=1)};")
        for panel in dashboard.get("panels", []):
            if panel["type"] == "row":
                continue
            if panel["type"] not in PANELS:
                raise ValueError(f"{name}: panel {panel.get('id')} is a {panel['type']!r}; add its types to PANELS")
            _, stem, has_custom = PANELS[panel["type"]]
            where = f"{var}_panel{panel['id']}"
            options = json.dumps(panel.get("options", {}))
            lines.append(f"export const {where}_options: Loose<{stem}.Options> = {options};")
            custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom")
            if custom and not has_custom:
                raise ValueError(f"{name}: panel {panel['id']} ({panel['type']}) has custom field config it lacks")
            if custom is not None and has_custom:
                lines.append(f"export const {where}_custom: Loose<{stem}.FieldConfig> = {json.dumps(custom)};")
    return "\n".join(lines) + "\n"


TSCONFIG = {
    "compilerOptions": {
        "strict": True,
        "noEmit": True,
        "skipLibCheck": True,
        "moduleResolution": "node",
        "module": "esnext",
        "target": "es2020",
        "types": [],
    },
    "files": ["check.ts"],
}
