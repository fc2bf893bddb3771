"""Prometheus recording and alerting rules, generated from a MixinConfig. Written for Prometheus 2.42+:
no 3.x-only functions, no query_offset."""

from __future__ import annotations

from typing import Any

import yaml

from .. import metrics, ops, supervise, units
from . import MixinConfig

# Every exported name comes from its declaration in volprobe.metrics, so a rename there reaches the rules.
LATENCY = metrics.PROBE_LATENCY
READS, WRITES = metrics.DISK_READS.spec, metrics.DISK_WRITES.spec
READ_BYTES, WRITTEN_BYTES = metrics.DISK_READ_BYTES.spec, metrics.DISK_WRITTEN_BYTES.spec
# The labels of each level, after the cluster label (MixinConfig.cluster_label, by()). The cluster label is kept
# where Prometheus adds one (where it does not, it is empty on every side and changes nothing). Every join and
# sum names it: node names repeat across clusters (instance is the node on Kubernetes).
PROBE = "job, instance, target, device, op"
TARGET = "job, instance, target, device"
DEVICE = "job, instance, device"
INSTANCE = "job, instance"
# Each target's PersistentVolumeClaim, namespace and StorageClass, from kube-state-metrics: level (the labels it
# is keyed by: a target, with its PVC's), the series it is built from, and the operation (a join), as
# kubernetes-mixin names namespace_workload_pod:kube_pod_owner:relabel.
TARGET_PVC = f"target_pvc:{metrics.TARGET_INFO.name}:join"
# The labels that name a volume's claim on an alert: kube-state-metrics' own, as TARGET_PVC records them, so that
# one Alertmanager route per namespace (or claim) sends a slow volume to its owners.
CLAIM = "namespace, persistentvolumeclaim"
# A target in a join: its name is unique on an instance (volprobe_probe_inflight_seconds has no device label).
TARGET_KEY = "job, instance, target"
# How far back from baseline_min_history the baseline is looked for (present_over_time's window): it is recorded
# every long_interval (5m), so an hour finds it whatever that interval and across a missed evaluation or two.
BASELINE_SEEN_WITHIN = "1h"
QUANTILES = (("p50", 0.5), ("p99", 0.99), ("p999", 0.999))
# diskstats: node_exporter. A node_exporter series is matched to volprobe's on device and the cluster label, and on
# the host of their instance labels: instance with its :port dropped, in a label of its own (HOST). On Kubernetes
# both carry the node's name as instance (this chart's ServiceMonitor and kube-prometheus's node-exporter set it);
# on a host, each its own host:port (host:10130, host:9100). Where the two name a host differently (an IP and a
# name), relabel one of them to the other's form.
HOST = "host"
HOST_OF_INSTANCE = "(.+?)(?::[0-9]+)?"


def by(c: MixinConfig, labels: str) -> str:
    """A `by` or `on` list: the cluster label, then labels."""
    return f"{c.cluster_label}, {labels}"


# Recorded names are level:metric:operations (Prometheus's naming practice, as kubernetes-mixin names its
# rules): the labels kept, the metric, then what was applied to it, newest first, each window in its operation.


def bucket_rate(c: MixinConfig) -> str:
    """The per-probe bucket rates every latency quantile is built from: target_op_le:..._bucket:rate5m, or with
    native histograms the rate of each probe's histogram, target_op:volprobe_probe_latency_seconds:rate5m."""
    if c.histograms == "native":
        return f"target_op:{LATENCY.name}:rate{c.rate_window}"
    return f"target_op_le:{LATENCY.bucket}:rate{c.rate_window}"


def probe_count(c: MixinConfig, offset: str) -> str:
    """The probes completed up to `offset` ago, per series: the classic _count, or the native histogram's."""
    if c.histograms == "native":
        return f"histogram_count({LATENCY.name}{{{c.selector}}} offset {offset})"
    return f"{LATENCY.count}{{{c.selector}}} offset {offset}"


def quantile(c: MixinConfig, name: str) -> str:
    """A latency quantile (p50, p99, p999) over rate_window: target_op:volprobe_probe_latency_seconds:p99_rate5m."""
    return f"target_op:{LATENCY.name}:{name}_rate{c.rate_window}"


def commit_p99(c: MixinConfig) -> str:
    """The commit probes' p99 over rate_window: the per-op p99 record, op="commit". That record already holds
    every op's (commit's included, in either build); a copy under a name of its own would be the same series
    twice. This names it once, for the commit alert:
    target_op:volprobe_probe_latency_seconds:p99_rate5m{op="commit"}."""
    return f'{quantile(c, "p99")}{{{c.selector}, op="{ops.COMMIT.name}"}}'


def daily_quantile(c: MixinConfig, name: str) -> str:
    """A latency quantile over daily_window, from the day's average of the recorded bucket rates (a rate over
    the day): target_op:volprobe_probe_latency_seconds:p99_rate1d."""
    return f"target_op:{LATENCY.name}:{name}_rate{c.daily_window}"


def baseline(c: MixinConfig) -> str:
    """The regression baseline, the median over baseline_window of the p99 over rate_window:
    target_op:volprobe_probe_latency_seconds:median7d_p99_rate5m."""
    return f"target_op:{LATENCY.name}:median{c.baseline_window}_p99_rate{c.rate_window}"


def probe_rate(c: MixinConfig) -> str:
    """Probes completed per second: target_op:volprobe_probe_latency_seconds_count:rate5m."""
    return f"target_op:{LATENCY.count}:rate{c.rate_window}"


def disk_ops_rate(c: MixinConfig) -> str:
    """A device's reads and writes per second (all its I/O, from diskstats): device:volprobe_disk_ops:rate5m."""
    return f"device:volprobe_disk_ops:rate{c.rate_window}"


def disk_bytes_rate(c: MixinConfig) -> str:
    """A device's bytes read and written per second: device:volprobe_disk_bytes:rate5m."""
    return f"device:volprobe_disk_bytes:rate{c.rate_window}"


def node_disk(name: str) -> str:
    """node_exporter's name of a volprobe_disk_* series (volprobe_disk_reads_completed_total ->
    node_disk_reads_completed_total): volprobe names its diskstats as node_exporter does."""
    if not name.startswith("volprobe_disk_"):
        raise ValueError(f"{name} is not one of volprobe's diskstats")
    return "node_" + name.removeprefix("volprobe_")


def with_host(expr: str) -> str:
    """expr with the host of its instance in HOST (the instance without its :port)."""
    return f'label_replace({expr}, "{HOST}", "$1", "instance", "{HOST_OF_INSTANCE}")'


def probed_devices(c: MixinConfig) -> str:
    """One series per device whose diskstats volprobe's own collector exports (each target's device and the
    disks under it), with volprobe's job and instance, and HOST: what node_exporter's series are matched to."""
    return with_host(
        f"max by ({by(c, DEVICE)}) (\n"
        f'    {metrics.TARGET_INFO.name}{{{c.selector}, device!=""}}\n'
        "  or\n"
        f'    label_replace({metrics.TARGET_DISK_INFO.name}{{{c.selector}}}, "device", "$1", "disk", "(.+)")\n'
        "  )"
    )


def disk_rate(c: MixinConfig, read: metrics.MetricSpec[Any], write: metrics.MetricSpec[Any]) -> str:
    """A device's reads and writes (or bytes) per second over rate_window, by device on volprobe's job and
    instance: from volprobe_disk_*, or with diskstats: node_exporter from node_exporter's node_disk_* of the
    devices volprobe probes (probed_devices), with volprobe's job and instance, so that what reads the recorded
    rate (the limit alert, on volprobe's limits) is the same either way."""
    window = c.rate_window
    if c.diskstats == "node_exporter":
        node = c.node_exporter_selector
        rates = (
            f"rate({node_disk(read.total)}{{{node}}}[{window}]) + rate({node_disk(write.total)}{{{node}}}[{window}])"
        )
        return (
            f"sum by ({by(c, DEVICE)}) (\n"
            f"    {with_host(rates)}\n"
            f"  * on ({by(c, HOST)}, device) group_left (job, instance)\n"
            f"{_indent(probed_devices(c), '    ')}\n"
            ")"
        )
    sel = c.selector
    return f"sum by ({by(c, DEVICE)}) (rate({read.total}{{{sel}}}[{window}]) + rate({write.total}{{{sel}}}[{window}]))"


def renamed(c: MixinConfig) -> dict[str, str]:
    """Each name 0.1.0 recorded that was renamed -> its name now. The old names are a public contract, written
    out as they were: the deprecated groups (deprecated_rules) record them for one more release."""
    old = "target_op:volprobe_probe_latency_seconds"
    names = {f"{old}:{name}": quantile(c, name) for name, _ in QUANTILES}
    names[f"{old}:rate"] = probe_rate(c)
    names["device:volprobe_disk_ops:rate"] = disk_ops_rate(c)
    names["device:volprobe_disk_bytes:rate"] = disk_bytes_rate(c)
    names.update({f"{old}:{name}_daily": daily_quantile(c, name) for name, _ in QUANTILES})
    names[f"{old}:p99_baseline"] = baseline(c)
    return names


def _increase_of_count(c: MixinConfig) -> str:
    """The probes completed over missing_window, per series."""
    if c.histograms == "native":
        return f"histogram_count(increase({LATENCY.name}{{{c.selector}}}[{c.missing_window}]))"
    return f"increase({LATENCY.count}{{{c.selector}}}[{c.missing_window}])"


def _seconds_text(value: str) -> str:
    return f"{units.parse_duration(value):g}"


def _labels_copied(expr: str, renames: tuple[tuple[str, str], ...]) -> str:
    """expr with each (new, old) label copied to its new name, by label_replace."""
    for new, old in renames:
        expr = f'label_replace({expr}, "{new}", "$1", "{old}", "(.+)")'
    return expr


def target_pvc_rule(c: MixinConfig) -> dict[str, Any]:
    """volprobe_target_info{pv} joined with kube-state-metrics 2.x's kube_persistentvolume_claim_ref (the PVC
    bound to each PV: name, claim_namespace) and kube_persistentvolume_info (its storageclass), on cluster and
    PV. Each side is aggregated first: that drops the labels a scrape adds (the namespace and pod of the
    exporter's and of kube-state-metrics' own pods, the instance of a kube-state-metrics replica), so the
    claim's namespace is the one recorded and two replicas of kube-state-metrics give one match, not two."""
    ksm, cluster = c.kube_state_metrics_selector, c.cluster_label
    claims = _labels_copied(
        f"max by ({cluster}, persistentvolume, claim_namespace, name) (kube_persistentvolume_claim_ref{{{ksm}}})",
        (("pv", "persistentvolume"), ("namespace", "claim_namespace"), ("persistentvolumeclaim", "name")),
    )
    classes = _labels_copied(
        f"max by ({cluster}, persistentvolume, storageclass) (kube_persistentvolume_info{{{ksm}}})",
        (("pv", "persistentvolume"),),
    )
    return {
        "record": TARGET_PVC,
        "expr": (
            f'max by ({by(c, TARGET)}, pv) ({metrics.TARGET_INFO.name}{{{c.selector}, pv!=""}})\n'
            f"* on ({cluster}, pv) group_left (namespace, persistentvolumeclaim)\n  {claims}\n"
            f"* on ({cluster}, pv) group_left (storageclass)\n  {classes}"
        ),
    }


def _indent(expr: str, by: str = "  ") -> str:
    return "\n".join(by + line for line in expr.split("\n"))


def claim_of(c: MixinConfig, keys: str, base: str) -> str:
    """One series per `keys` (TARGET_KEY: a target; DEVICE: a disk) that `base` has: with the namespace and
    persistentvolumeclaim of the claim on it (TARGET_PVC, from kube-state-metrics), where exactly one claim is on
    it; else without them (a volume no claim is on, a disk under claims of its own (LVM), kube-state-metrics not
    scraped). Built from `base` too, not from volprobe_target_info alone, so that the join below keeps every
    series of an alert whatever collectors run."""
    k = by(c, keys)
    claims = f"max by ({k}, {CLAIM}) ({TARGET_PVC}{{{c.selector}}})"
    return (
        f"  {claims}\nand on ({k})\n  count by ({k}) (\n    {claims}\n  ) == 1\nor on ({k})\n  group by ({k}) ({base})"
    )


def with_claim(c: MixinConfig, expr: str, keys: str, base: str) -> str:
    """An alert's expression with its volume's claim (claim_of) as labels: namespace and persistentvolumeclaim,
    set where one claim is on the volume and dropped where none is. Dropped too is the namespace a scrape gives
    the raw series (the exporter pod's, with the Prometheus Operator): a volume's alert is routed by its claim's
    namespace, never by the namespace volprobe runs in. The value is expr's (times 1)."""
    k = by(c, keys)
    return f"(\n{_indent(expr)}\n)\n* on ({k}) group_left ({CLAIM}) (\n{_indent(claim_of(c, keys, base))}\n)"


def warming(c: MixinConfig) -> str:
    """The targets volprobe is warming up (reading end to end), or was within rate_window (their p99 over it still
    holds the warm-up's load), and every target on one of their disks (a directory target on a partition of a disk
    being warmed): one series per target. Their latency is volprobe's own load, not the volume's: the Warm-up
    dashboard shows it, and no latency alert is pending or firing on them."""
    sel, disks = c.selector, metrics.TARGET_DISK_INFO.name
    running = f'max_over_time({metrics.WARMUP_STATE.name}{{{sel}, state="running"}}[{c.rate_window}]) == 1'
    return (
        f"  max by ({by(c, TARGET_KEY)}) (\n"
        f"      {running}\n"
        "    or\n"
        f"      {disks}{{{sel}}}\n"
        f"      and on ({by(c, 'job, instance, disk')})\n"
        f"        ({disks}{{{sel}}} and on ({by(c, TARGET_KEY)}) {running})\n"
        "  )"
    )


def recording_rules(c: MixinConfig) -> list[dict[str, Any]]:
    """Short windows, evaluated at the global interval: the bucket rates first, then what is built from them."""
    rates = bucket_rate(c)
    if c.histograms == "native":
        rate = f"sum by ({by(c, PROBE)}) (rate({LATENCY.name}{{{c.selector}}}[{c.rate_window}]))"
        count_rate = f"histogram_count({rates})"
    else:
        rate = f"sum by ({by(c, PROBE)}, le) (rate({LATENCY.bucket}{{{c.selector}}}[{c.rate_window}]))"
        count_rate = f"sum by ({by(c, PROBE)}) (rate({LATENCY.count}{{{c.selector}}}[{c.rate_window}]))"
    rules: list[dict[str, Any]] = [{"record": rates, "expr": rate}]
    for name, q in QUANTILES:
        rules.append({"record": quantile(c, name), "expr": f"histogram_quantile({q}, {rates})"})
    rules.append({"record": probe_rate(c), "expr": count_rate})
    for record, read, write in (
        (disk_ops_rate(c), READS, WRITES),
        (disk_bytes_rate(c), READ_BYTES, WRITTEN_BYTES),
    ):
        rules.append({"record": record, "expr": disk_rate(c, read, write)})
    rules.append(target_pvc_rule(c))
    return rules


def long_window_rules(c: MixinConfig) -> list[dict[str, Any]]:
    """Days, in a group of their own evaluated every long_interval, from the recorded short-window series: the
    daily quantiles average the recorded bucket rates over the day (in proportion to the day's bucket
    increases, which is all a quantile needs), rather than re-reading a day of raw buckets every evaluation."""
    rules: list[dict[str, Any]] = []
    for name, q in QUANTILES:
        rules.append(
            {
                "record": daily_quantile(c, name),
                "expr": f"histogram_quantile({q}, avg_over_time({bucket_rate(c)}[{c.daily_window}]))",
            }
        )
    rules.append(
        {
            "record": baseline(c),
            "expr": f"quantile_over_time(0.5, {quantile(c, 'p99')}[{c.baseline_window}])",
        }
    )
    return rules


def _alert(
    c: MixinConfig, name: str, expr: str, duration: str, severity: str, summary: str, description: str
) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": c.runbook_url.format(anchor=name.lower()),
        },
    }


# The claim a volume's alert carries (with_claim), in its description: nothing where none is on the volume.
CLAIMED = "{{ with $labels.persistentvolumeclaim }} (claim {{ $labels.namespace }}/{{ . }}){{ end }}"
WHERE = "{{ $labels.target }} ({{ $labels.device }}) on {{ $labels.instance }}" + CLAIMED
ON_DISK = "{{ $labels.device }} on {{ $labels.instance }}" + CLAIMED  # a disk's (throttling, limits)


def alerting_rules(c: MixinConfig) -> list[dict[str, Any]]:
    sel = c.selector
    p99 = quantile(c, "p99")
    rules = []
    objectives = sorted(c.latency_objective.items())
    shown = (
        "".join(
            f'{{{{ {"if" if i == 0 else "else if"} eq $labels.op "{op}" }}}}{objective}'
            for i, (op, objective) in enumerate(objectives)
        )
        + "{{ end }}"
    )
    rules.append(
        _alert(
            c,
            "VolprobeLatencyHigh",
            with_claim(
                c,
                "(\n"
                + "\nor\n".join(
                    f'  {p99}{{{sel}, op="{op}"}} > {_seconds_text(objective)}' for op, objective in objectives
                )
                + f"\n)\nunless on ({by(c, TARGET_KEY)})\n{warming(c)}",
                TARGET_KEY,
                f"{p99}{{{sel}}}",
            ),
            c.latency_objective_for,
            "warning",
            "Volume latency above its objective.",
            f"The p99 of queue-depth-1 {{{{ $labels.op }}}} probes of {WHERE} is {{{{ $value | humanizeDuration }}}} over "
            f"the last {c.rate_window}, above the {shown} objective.",
        )
    )
    factor, increase, base = c.regression_factor, _seconds_text(c.regression_min_increase), baseline(c)
    regressed = f"{p99}{{{sel}}} > {factor:g} * {base}{{{sel}}}\nand {p99}{{{sel}}} - {base}{{{sel}}} > {increase}"
    if c.seconds("baseline_min_history") > 0:
        # Against a baseline of enough history only: one recorded baseline_min_history ago already (a day), so
        # at least a day of p99 in the median. A fresh one is the median of a few minutes (of a fresh start,
        # of a warm-up): 2x above it is no regression. Its age, not a count of samples: present_over_time on
        # the recorded baseline, a dozen samples a series, where counting the p99's would read as many as the
        # median does, and a count would depend on the evaluation interval.
        regressed += (
            f"\nand on ({by(c, PROBE)})\n"
            f"  present_over_time({base}{{{sel}}}[{BASELINE_SEEN_WITHIN}] offset {c.baseline_min_history})"
        )
    rules.append(
        _alert(
            c,
            "VolprobeLatencyRegression",
            with_claim(
                c,
                f"{regressed}\nunless on ({by(c, TARGET_KEY)})\n{warming(c)}",
                TARGET_KEY,
                f"{p99}{{{sel}}}",
            ),
            c.regression_for,
            "warning",
            "Volume latency regressed against its own baseline.",
            f"The p99 of {{{{ $labels.op }}}} probes of {WHERE} is {{{{ $value | humanizeDuration }}}}, more than "
            f"{factor:g}x its baseline (the median p99 of the last {c.baseline_window}, recorded for "
            f"{c.baseline_min_history} at least) and at least "
            f"{c.regression_min_increase} above it.",
        )
    )
    # etcd's disk check, run continuously: commit probes are its fio recipe (a 2300-byte write and fdatasync), and
    # etcd wants the p99 under 10 ms. Only targets with a commit probe (opt-in) have the series.
    rules.append(
        _alert(
            c,
            "VolprobeCommitLatencyHigh",
            with_claim(
                c,
                f"{commit_p99(c)} > {_seconds_text(c.commit_latency_threshold)}\n"
                f"unless on ({by(c, TARGET_KEY)})\n{warming(c)}",
                TARGET_KEY,
                commit_p99(c),
            ),
            c.commit_latency_for,
            "warning",
            "Commits (write + fdatasync) slower than etcd's disk guidance.",
            f"The p99 of commit probes (a buffered write and fdatasync, as etcd's WAL commits) of {WHERE} is "
            f"{{{{ $value | humanizeDuration }}}} over the last {c.rate_window}, above "
            f"{c.commit_latency_threshold}: etcd on this volume would warn of slow fdatasync and may miss "
            "heartbeats.",
        )
    )
    # Inferred (a plateau, judged from diskstats, valued at its ceiling), or counted by the provider itself (AWS
    # NVMe statistics). `source!="provider"` also matches exporters older than the source label.
    active = metrics.THROTTLE_ACTIVE.name
    plateau = " or\n".join(
        f"({metric}{{{sel}}}\n  * on ({by(c, DEVICE)}, dir) group_left (limit, source)\n"
        f'  ({active}{{{sel}, limit="{limit}", source!="provider"}} == 1))'
        for limit, metric in (
            ("iops", metrics.THROTTLE_CEILING_OPS.name),
            ("bandwidth", metrics.THROTTLE_CEILING_BYTES.name),
        )
    )
    plateau += f'\nor\n({active}{{{sel}, source="provider"}} == 1)'
    rules.append(
        _alert(
            c,
            "VolprobeThrottled",
            with_claim(c, plateau, DEVICE, f"{active}{{{sel}}}"),
            c.throttle_for,
            "warning",
            "Volume throttled at a provider cap.",
            '{{ if eq $labels.source "provider" }}'
            f"{ON_DISK}: the device's own statistics count demand over its "
            f"{{{{ $labels.limit }}}} limit most of the time, for {c.throttle_for}: it is throttled, and its "
            "latency includes the queue.{{ else }}"
            f"{ON_DISK} has been flat at "
            '{{ if eq $labels.limit "iops" }}{{ $value | humanize }} IOPS{{ else }}{{ $value | humanize1024 }}B/s{{ end }}'
            f" ({{{{ $labels.dir }}}}) with requests queueing for {c.throttle_for}: it is throttled at its "
            "{{ $labels.limit }} limit, and its latency includes the queue.{{ end }}",
        )
    )
    near = " or\n".join(
        f"label_replace(\n  {recorded_rate}{{{sel}}}\n  / on ({by(c, DEVICE)})\n  max by ({by(c, DEVICE)}) "
        f'({metric}{{{sel}}})\n  > {c.limit_ratio:g},\n  "limit", "{limit}", "", "")'
        for limit, recorded_rate, metric in (
            ("iops", disk_ops_rate(c), metrics.LIMIT_OPS.name),
            ("bandwidth", disk_bytes_rate(c), metrics.LIMIT_BYTES.name),
        )
    )
    rules.append(
        _alert(
            c,
            "VolprobeNearProvisionedLimit",
            with_claim(c, near, DEVICE, f"{disk_ops_rate(c)}{{{sel}}}"),
            c.limit_for,
            "warning",
            "Volume near its provisioned limit.",
            f"{ON_DISK} runs at {{{{ $value | humanizePercentage }}}} of its provisioned "
            f"{{{{ $labels.limit }}}} limit over {c.rate_window}.",
        )
    )
    rules.append(
        _alert(
            c,
            "VolprobeProbeStalled",
            with_claim(
                c,
                f"{metrics.PROBE_INFLIGHT.name}{{{sel}}} > {_seconds_text(c.stall_threshold)}",
                TARGET_KEY,
                f"{metrics.PROBE_INFLIGHT.name}{{{sel}}}",
            ),
            c.stall_for,
            "critical",
            "A probe has been stuck in the kernel: the volume does not answer.",
            f"A {{{{ $labels.op }}}} probe of {{{{ $labels.target }}}} on {{{{ $labels.instance }}}}{CLAIMED} has been in flight "
            "for {{ $value | humanizeDuration }}: I/O to this volume hangs.",
        )
    )
    rules.append(
        _alert(
            c,
            "VolprobeMountHung",
            # The value: how long since the mount last answered (the start of the epoch if it never did).
            with_claim(
                c,
                f"time() - {metrics.MOUNT_LAST_RESPONSE_TIME.name}{{{sel}}}\n"
                f"and on ({by(c, TARGET)}) {metrics.MOUNT_RESPONSIVE.name}{{{sel}}} == 0",
                TARGET_KEY,
                f"{metrics.MOUNT_LAST_RESPONSE_TIME.name}{{{sel}}}",
            ),
            c.mount_hung_for,
            "critical",
            "A directory target's mount does not answer: every process touching it hangs.",
            f"The filesystem of {{{{ $labels.target }}}} on {{{{ $labels.instance }}}}{CLAIMED} last answered a statfs and a stat of "
            "its directory {{ $value | humanizeDuration }} ago: the mount hangs (an NFS, CephFS or SMB server gone, "
            "a FUSE daemon stuck) or fails.",
        )
    )
    rules.append(
        _alert(
            c,
            "VolprobeProbeErrors",
            # The failures counter exists at 0 from a probe's start, so the very first failure is an increase
            # (an errno series would appear at 1, which increase() cannot see).
            with_claim(
                c,
                f"sum by ({by(c, PROBE)}) (increase({metrics.PROBE_FAILURES.total}{{{sel}}}[{c.rate_window}])) > 0",
                TARGET_KEY,
                f"{metrics.PROBE_FAILURES.total}{{{sel}}}",
            ),
            c.errors_for,
            "warning",
            "Probes of a volume fail.",
            f"{{{{ $value | humanize }}}} {{{{ $labels.op }}}} probes of {WHERE} failed in the last {c.rate_window} "
            f"(volprobe_probe_errors_total gives the errno).",
        )
    )
    rules.append(
        _alert(
            c,
            "VolprobeProbesMissing",
            with_claim(
                c,
                f"sum by ({by(c, PROBE)}) ({_increase_of_count(c)}) == 0\n"
                f"and on ({by(c, INSTANCE)}) up{{{sel}}} == 1\n"
                # only probes that already existed a whole window ago: a fresh start is not "missing"
                f"and on ({by(c, PROBE)})\n"
                f"  sum by ({by(c, PROBE)}) ({probe_count(c, c.missing_window)})",
                TARGET_KEY,
                # what the alert is made of: a probe whose series went is missing too
                _increase_of_count(c),
            ),
            c.missing_for,
            "warning",
            "The exporter is up but a probe produced no sample.",
            f"The {{{{ $labels.op }}}} probe of {WHERE} completed no request in {c.missing_window} while the "
            f"exporter is up.",
        )
    )
    rules.append(
        _alert(
            c,
            "VolprobeExporterDown",
            f"up{{{sel}}} == 0",
            c.exporter_down_for,
            "critical",
            "volprobe is down: its volumes are not watched.",
            f"volprobe on {{{{ $labels.instance }}}} has not been scraped successfully for {c.exporter_down_for}.",
        )
    )
    rules.append(
        _alert(
            c,
            "VolprobeConfigReloadFailed",
            f"{metrics.CONFIG_RELOAD_SUCCESSFUL.name}{{{sel}}} == 0",
            c.reload_failed_for,
            "warning",
            "volprobe's configuration reload failed.",
            f"The last configuration reload of volprobe on {{{{ $labels.instance }}}} failed (for {c.reload_failed_for} "
            f"or more): it runs the previous configuration, and a restart would fail to start.",
        )
    )
    # The web config is re-read when it or a file it names changes, at the next connection. A renewal caught
    # half way (a certificate before its key) fails once and loads at the next: reload_failed_for rides it out.
    rules.append(
        _alert(
            c,
            "VolprobeWebConfigReloadFailed",
            f"{metrics.WEB_CONFIG_RELOAD_SUCCESSFUL.name}{{{sel}}} == 0",
            c.reload_failed_for,
            "warning",
            "volprobe's web config changed on disk but did not load.",
            f"The web config of volprobe on {{{{ $labels.instance }}}} (TLS certificate, key, CA, basic auth users) "
            f"changed on disk but has not loaded (for {c.reload_failed_for} or more): the previous one serves on, so "
            f"a renewed certificate that fails to load goes unseen until the old one expires.",
        )
    )
    # One crash is a fact, not a noisy reading: the counter steps once, its increase is > 0 for the whole window,
    # and a `for` (thread_restart_for, 0s) would only delay it. The window (thread_restart_window, 1h) is what
    # keeps the alert from flapping: a thread failing again within it keeps the one alert firing, whether it
    # fails at once (a restart every 60 s, the back-off's cap) or only when its work comes round (a probe with a
    # long interval, a rescan after a udev event); a single crash resolves an hour later. Every thread's series
    # is at 0 from the start, so the first crash is an increase; volprobe's own restart (a reset to 0) is not.
    # Summed by thread as the other alerts sum: it carries the cluster label, job, instance and thread, not what else a
    # scrape adds (a pod's name).
    rules.append(
        _alert(
            c,
            "VolprobeThreadRestarting",
            f"sum by ({by(c, INSTANCE)}, thread) "
            f"(increase({metrics.THREAD_RESTARTS.total}{{{sel}}}[{c.thread_restart_window}])) > 0",
            c.thread_restart_for,
            "warning",
            "An internal thread of volprobe raised and was restarted.",
            "volprobe's {{ $labels.thread }} thread on {{ $labels.instance }} raised and was restarted "
            f'(restarts in the last {c.thread_restart_window}: {{{{ $value | printf "%.0f" }}}}): a bug, or an '
            "environment volprobe did not expect. Its work stops until it restarts (after "
            f"{supervise.FIRST_BACKOFF_S:g} s, doubling to {supervise.MAX_BACKOFF_S:g} s); "
            'the exporter\'s log has the traceback (search for "failed; restarting").',
        )
    )
    done = metrics.WARMUP_DONE.name
    rules.append(
        _alert(
            c,
            "VolprobeWarmupStalled",
            with_claim(
                c,
                f'{metrics.WARMUP_STATE.name}{{{sel}, state="running"}} == 1\n'
                f"and on ({by(c, TARGET)}) changes({done}{{{sel}}}[{c.warmup_stall_window}]) == 0\n"
                f"and on ({by(c, TARGET)}) {done}{{{sel}}} offset {c.warmup_stall_window}",
                TARGET_KEY,
                f"{metrics.WARMUP_STATE.name}{{{sel}}}",
            ),
            c.warmup_stall_for,
            "warning",
            "A volume warm-up makes no progress.",
            f"The warm-up of {WHERE} is running but has read nothing for {c.warmup_stall_window}.",
        )
    )
    rules.append(
        _alert(
            c,
            "VolprobeWarmupFailed",
            with_claim(
                c,
                f'{metrics.WARMUP_STATE.name}{{{sel}, state="failed"}} == 1',
                TARGET_KEY,
                f"{metrics.WARMUP_STATE.name}{{{sel}}}",
            ),
            "1m",
            "warning",
            "A volume warm-up failed: the volume is not fully initialized.",
            f"The warm-up of {WHERE} failed (a read error, or its device went mid-way); volprobe's log says why.",
        )
    )
    return rules


def deprecated_rules(c: MixinConfig, group: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The previous release's name of each rule of `group` that was renamed, recorded from the new name: a
    copy, at most one evaluation behind. Deprecated: removed in the next release (README, "Renamed recording
    rules")."""
    new_names = {rule["record"] for rule in group if "record" in rule}
    return [{"record": old, "expr": new} for old, new in renamed(c).items() if new in new_names]


LONG = "volprobe.rules.long"


def document(c: MixinConfig) -> dict[str, Any]:
    short, long = recording_rules(c), long_window_rules(c)
    groups: list[dict[str, Any]] = [
        {"name": "volprobe.rules", "rules": short},
        {"name": LONG, "interval": c.long_interval, "rules": long},
        {"name": "volprobe.alerts", "rules": alerting_rules(c)},
        # Each after its source group, at its interval: promtool evaluates the groups in this order.
        {"name": "volprobe.rules.deprecated", "rules": deprecated_rules(c, short)},
        {"name": f"{LONG}.deprecated", "interval": c.long_interval, "rules": deprecated_rules(c, long)},
    ]
    if c.interval:
        for group in groups:
            if not group["name"].startswith(LONG):
                group["interval"] = c.interval
            group.update({"rules": group.pop("rules")})
    return {"groups": groups}


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(c: MixinConfig) -> str:
    header = "# Generated by `python -m volprobe.mixin`: edit the mixin configuration, not this file.\n"
    return header + yaml.dump(document(c), Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)
