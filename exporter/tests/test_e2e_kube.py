"""End to end on a real Prometheus (2.42 and 3.x): a disk `discovery:` found, mounted where the kubelet mounts a
pod's CSI volume, gets its pv and pod_uid from the mount table; Prometheus scrapes it beside a stand-in for
kube-state-metrics 2.x (its PersistentVolume series, as it writes them) and records target_pvc:...:join, which
the dashboards' namespace, storageclass and pvc variables select on, and which gives the disk's latency alert its
claim's namespace and name."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

import pytest

from volprobe import mixin
from volprobe.mixin import rules
from volprobe.mixin.dashboards.variables import Scope

from .support.dashboards import SUBSTITUTIONS, substitute
from .support.harness import MIB, PROMETHEUS_VERSIONS, run, write_config

pytestmark = pytest.mark.root

POD, PV = "0f3b6a9e-5f7d-4c1e-9a77-3d2b1c0e9f11", "pvc-8d1c2a4e-1b2f-4d3e-8f9a-0c1d2e3f4a5b"
# kube-state-metrics 2.x's exposition of one bound PersistentVolume: its empty labels included, as it writes them.
KSM_PAGE = f"""\
# HELP kube_persistentvolume_claim_ref [STABLE] Information about the Persistent Volume Claim Reference.
# TYPE kube_persistentvolume_claim_ref gauge
kube_persistentvolume_claim_ref{{persistentvolume="{PV}",claim_namespace="shop",name="data-postgres-0"}} 1
# HELP kube_persistentvolume_info [STABLE] Information about persistentvolume.
# TYPE kube_persistentvolume_info gauge
kube_persistentvolume_info{{persistentvolume="{PV}",storageclass="gp3",gce_persistent_disk_name="",\
ebs_volume_id="",azure_disk_name="",fc_wwids="",fc_lun="",fc_target_wwns="",iscsi_target_portal="",iscsi_iqn="",\
iscsi_lun="",iscsi_initiator_name="",local_path="",local_fs="",host_path="",host_path_type="",nfs_server="",\
nfs_path="",csi_driver="ebs.csi.aws.com",csi_volume_handle="vol-0a1b2c3d4e5f60718"}} 1
"""


class _KubeStateMetrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = KSM_PAGE.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def kube_state_metrics():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KubeStateMetrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("version", PROMETHEUS_VERSIONS)
def test_a_discovered_pod_volume_gets_its_namespace_and_claim(
    tmp_path, make_loop, start_exporter, start_prometheus, kube_state_metrics, version
):
    loop = make_loop(32 * MIB)
    name = Path(loop).name
    point = tmp_path / "var/lib/kubelet/pods" / POD / "volumes/kubernetes.io~csi" / PV / "mount"
    point.mkdir(parents=True)
    # The kubelet's record that it is that PersistentVolume's (an inline volume's directory name is its pod's).
    record = {"driverName": "ebs.csi.aws.com", "specVolID": PV, "volumeLifecycleMode": "Persistent"}
    (point.parent / "vol_data.json").write_text(json.dumps(record))
    run("mkfs.ext4", "-q", "-F", loop)
    run("mount", loop, str(point))
    try:
        config = write_config(
            tmp_path,
            f"discovery: {{include: ['{name}'], rescan_interval: 1s, probes: [{{op: read, interval: 200ms}}]}}\n"
            f"state_directory: {tmp_path / 'state'}\n",
        )
        (tmp_path / "state").mkdir()
        exporter = start_exporter("--config", config)
        rules_path = tmp_path / "volprobe-rules.yml"
        # The latency objective at 1 us, at once: the disk's read probes are above it from their first p99.
        alerting = mixin.from_mapping({"latency_objective": {"read": "1us"}, "latency_objective_for": "0s"})
        rules_path.write_text(rules.render(alerting))
        prometheus = start_prometheus(
            f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [{rules_path}]
scrape_configs:
  - job_name: volprobe
    static_configs: [{{targets: ["127.0.0.1:{exporter.port}"]}}]
  - job_name: kube-state-metrics
    static_configs: [{{targets: ["127.0.0.1:{kube_state_metrics}"]}}]
""",
            version,
        )
        deadline = time.monotonic() + 60
        found: list = []
        while time.monotonic() < deadline and not found:
            found = prometheus.query(rules.TARGET_PVC)
            time.sleep(0.5)
        assert found, "no target_pvc series: " + str(prometheus.query(f'volprobe_target_info{{target="{name}"}}'))
        (sample,) = found
        labels = sample["metric"]
        assert labels == {
            "__name__": rules.TARGET_PVC,
            "job": "volprobe",
            "instance": f"127.0.0.1:{exporter.port}",
            "target": name,
            "device": name,
            "pv": PV,
            "namespace": "shop",
            "persistentvolumeclaim": "data-postgres-0",
            "storageclass": "gp3",
        }
        (info,) = prometheus.query(f'volprobe_target_info{{target="{name}"}}')
        assert info["metric"]["pod_uid"] == POD and info["metric"]["path"] == loop
        # The dashboards' selection: the claim's namespace keeps the disk, another namespace does not.
        for namespace, storageclass, expected in (
            ("shop", ".*", [name]),
            ("billing", ".*", []),
            (".*", ".*", [name]),
            (".*", "gp3", [name]),
            (".*", "io2", []),
        ):
            values = {**SUBSTITUTIONS, "$namespace": namespace, "$storageclass": storageclass}
            values["$instance"] = f"127.0.0.1:{exporter.port}"
            picked = prometheus.query(substitute(Scope.of(mixin.DEFAULTS).selected_targets, values))
            assert sorted(s["metric"]["target"] for s in picked) == expected, (namespace, storageclass)
        # The disk's latency alert carries its claim: one Alertmanager route per namespace reaches its owners.
        alert: dict = {}
        while time.monotonic() < deadline + 30 and not alert:
            alert = next(
                (
                    a["labels"]
                    for a in prometheus.alerts()
                    if a["labels"]["alertname"] == "VolprobeLatencyHigh" and a["state"] == "firing"
                ),
                {},
            )
            time.sleep(0.5)
        assert alert.get("target") == name, prometheus.alerts()
        assert (alert["namespace"], alert["persistentvolumeclaim"]) == ("shop", "data-postgres-0"), alert
    finally:
        run("umount", str(point))
