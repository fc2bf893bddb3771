"""The dashboards' template variables, and the label matchers every query starts with (Scope): the mixin's
selector, then the cluster, job and instance variables, with the cluster label named as the mixin says."""

from __future__ import annotations

from dataclasses import dataclass

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.models.dashboard import VariableHide, VariableModel, VariableRefresh

from ... import metrics
from .. import MixinConfig
from ..rules import TARGET_PVC
from .panels import DS

BUILD_INFO = metrics.BUILD_INFO.name
TARGET_INFO = metrics.TARGET_INFO.name
Variable = Builder[VariableModel]


def matchers(*parts: str) -> str:
    """Label matchers joined, the empty ones left out (an empty selector selects by the variables alone)."""
    return ", ".join(part for part in parts if part)


@dataclass(frozen=True)
class Scope:
    """Which series a dashboard's queries read: the mixin's selector (which series are volprobe's), then the
    cluster, job and instance variables. `cluster` is the name of the cluster label."""

    selector: str
    cluster: str

    @classmethod
    def of(cls, c: MixinConfig) -> Scope:
        return cls(c.selector, c.cluster_label)

    def hosts(self, cluster: str = "$cluster", instance: str = '=~"$instance"') -> str:
        """The selector, the cluster (a regex: its All is .*), the job, and the instance matched as given."""
        return matchers(self.selector, f'{self.cluster}=~"{cluster}"', 'job=~"$job"', f"instance{instance}")

    @property
    def base(self) -> str:
        return self.hosts()

    @property
    def target(self) -> str:
        return f'{self.base}, target="$target"'

    def by(self, labels: str) -> str:
        """A `by` list led by the cluster label: node names (instance on Kubernetes) repeat across clusters."""
        return f"{self.cluster}, {labels}"

    @property
    def selected_targets(self) -> str:
        """The targets the namespace, storageclass and pvc variables select (All is .*): those whose claim
        matches, from the recorded join with kube-state-metrics; and, while all three are All, every other target
        too (a disk no claim is on). That second term asks whether "" matches the three regexes, through labels
        volprobe_target_info never has: a matcher on a missing label compares ""."""
        by = self.by("job, instance, target")
        claim = 'storageclass=~"$storageclass", persistentvolumeclaim=~"$pvc"'
        return (
            f'(max by ({by}) ({TARGET_PVC}{{{self.base}, namespace=~"$namespace", {claim}}})'
            f" or max by ({by}) "
            f'({TARGET_INFO}{{{self.base}, claim_namespace=~"$namespace", {claim}}}))'
        )

    def selected(self, expr: str) -> str:
        """expr (with cluster, instance and target labels) for the targets the namespace and pvc variables
        select."""
        return f"{expr} and on ({self.by('instance, target')}) {self.selected_targets}"


def with_variables(
    d: dashboard.Dashboard,
    scope: Scope,
    *extra: Variable,
    one_instance: bool = False,
    shared: bool = True,
) -> dashboard.Dashboard:
    """datasource, cluster, job and instance, then `extra`. one_instance: a single instance, no "All" (the
    Volume dashboard: a target name can repeat on several hosts, whose buckets must never be summed).
    shared=False: datasource and job only (the Migration dashboard picks a cluster and an instance per side)."""
    d = d.with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    if shared:
        d = d.with_variable(cluster_variable(scope, "cluster", "cluster"))
    where = matchers(scope.selector, f'{scope.cluster}=~"$cluster"' if shared else "")
    d = d.with_variable(
        dashboard.QueryVariable("job")
        .label("job")
        .datasource(DS)
        .query(f"label_values({BUILD_INFO}{{{where}}}, job)" if where else f"label_values({BUILD_INFO}, job)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
    )
    if shared:
        d = d.with_variable(instance_variable(scope, "instance", "instance", many=not one_instance))
    for variable in extra:
        d = d.with_variable(variable)
    return d


def cluster_variable(scope: Scope, name: str, label: str, many: bool = True) -> dashboard.QueryVariable:
    # Optional: where Prometheus adds a cluster label (external or target labels), pick one; where it does
    # not, the only choice is All (.*), which also matches series without the label.
    series = f"{BUILD_INFO}{{{scope.selector}}}" if scope.selector else BUILD_INFO
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(f"label_values({series}, {scope.cluster})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(many)
        .include_all(True)
        .all_value(".*")
    )


def instance_variable(
    scope: Scope, name: str, label: str, many: bool, cluster: str = "$cluster"
) -> dashboard.QueryVariable:
    where = matchers(scope.selector, f'{scope.cluster}=~"{cluster}"', 'job=~"$job"')
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(f"label_values({BUILD_INFO}{{{where}}}, instance)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(many)
        .include_all(many)
    )


def target_variable(name: str, label: str, where: str) -> dashboard.QueryVariable:
    return query_variable(name, label, f"label_values({TARGET_INFO}{{{where}}}, target)")


def claim_variables(scope: Scope) -> list[dashboard.QueryVariable]:
    """namespace, storageclass and pvc (each narrowed by those before it), from the recorded join
    (rules.target_pvc_rule); All (.*) also keeps the targets no claim is on (Scope.selected_targets)."""
    return [
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(f"label_values({TARGET_PVC}{{{where}}}, {source})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        for name, label, where, source in (
            ("namespace", "namespace", scope.base, "namespace"),
            ("storageclass", "storage class", f'{scope.base}, namespace=~"$namespace"', "storageclass"),
            (
                "pvc",
                "PVC",
                f'{scope.base}, namespace=~"$namespace", storageclass=~"$storageclass"',
                "persistentvolumeclaim",
            ),
        )
    ]


def host_variable(scope: Scope) -> dashboard.QueryVariable:
    """The host of the instance picked (hidden): $instance without its :port, which node_exporter's series are
    selected by (diskstats: node_exporter; rules.HOST_OF_INSTANCE matches them so in the rules)."""
    return (
        query_variable("host", "host", f"label_values({BUILD_INFO}{{{scope.base}}}, instance)")
        .regex("/^(.+?)(?::[0-9]+)?$/")
        .hide(VariableHide.HIDE_VARIABLE)
    )


def selected_target_variable(scope: Scope) -> dashboard.QueryVariable:
    """The Volume dashboard's target, among those the namespace and pvc variables select: a query's result,
    since label_values takes one selector and the selection is two."""
    return (
        dashboard.QueryVariable("target")
        .label("target")
        .datasource(DS)
        .query(f"query_result({scope.selected_targets})")
        .regex('/target="([^"]+)"/')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
    )


def query_variable(name: str, label: str, expr: str, many: bool = False) -> dashboard.QueryVariable:
    """A variable of label values, refreshed with the time range; many: several at once, or All."""
    variable = (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(expr)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
    )
    return variable.multi(True).include_all(True) if many else variable
