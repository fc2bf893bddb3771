"""python -m volprobe.mixin [--config FILE] [--out DIR]: write alerts/volprobe-rules.yml, dashboards/*.json
and their Kubernetes forms (a PrometheusRule and ConfigMaps for the Grafana sidecar) in deploy/kubernetes/base,
copies of the rules and dashboards for the Helm chart in deploy/chart/volprobe/files, with classic histograms
(the default), the same dashboards built for native histograms in dashboards/native/, and with volprobe's
diskstats (the default), the same dashboards on node_exporter's in dashboards/node_exporter/."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ..config import ConfigError
from . import kubernetes, load, rules

CHART = "deploy/chart/volprobe"


def outputs(config_path: str | None) -> dict[str, str]:
    """Relative path -> content of every generated file."""
    from . import dashboards  # needs grafana-foundation-sdk (the "mixin" extra)

    config = load(config_path)
    files = {"alerts/volprobe-rules.yml": rules.render(config)}
    rendered = dashboards.render_all(config)
    for name, text in rendered.items():
        files[f"dashboards/{name}"] = text
    if config.histograms == "classic":
        # For Prometheus 3 scraping native histograms, ready to import in place of dashboards/*.json: the same
        # dashboards and uids (one build or the other), which read the recorded names either rule build records.
        for name, text in dashboards.render_all(replace(config, histograms="native")).items():
            files[f"dashboards/native/{name}"] = text
    if config.diskstats == "volprobe":
        # For volprobe run with --no-collector.diskstats beside node_exporter: the same dashboards and uids, the
        # Volume dashboard's diskstats panels on node_disk_*. Its rules are generated with `diskstats:
        # node_exporter` (and the node_exporter_selector of your setup): not committed, as the native ones.
        for name, text in dashboards.render_all(replace(config, diskstats="node_exporter")).items():
            files[f"dashboards/node_exporter/{name}"] = text
    files["deploy/kubernetes/base/prometheusrule.yaml"] = kubernetes.prometheus_rule(config)
    files["deploy/kubernetes/base/grafana-dashboards.yaml"] = kubernetes.dashboard_configmaps(rendered)
    # The Helm chart's copies, which its templates read with .Files.Get (a chart cannot reach outside its directory).
    files[f"{CHART}/files/volprobe-rules.yml"] = files["alerts/volprobe-rules.yml"]
    for name, text in rendered.items():
        files[f"{CHART}/files/dashboards/{name}"] = text
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m volprobe.mixin", description=__doc__)
    parser.add_argument("--config", help="YAML with the mixin keys to change (see volprobe/mixin/__init__.py)")
    parser.add_argument("--out", default=".", help="directory holding alerts/ and dashboards/ (default .)")
    args = parser.parse_args(argv)
    try:
        files = outputs(args.config)
    except ConfigError as err:
        for problem in err.problems:
            print(f"volprobe.mixin: {problem}", file=sys.stderr)
        return 2
    for relative, text in files.items():
        path = Path(args.out) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
