"""What a kubelet does with a pod, done on one machine without Kubernetes: the pod's containers as `podman run`
arguments (pod_to_podman), the host side of its volumes (prepare), and its probes (probe, kubelet_get).

pod_to_podman is pure: it reads a pod template (a DaemonSet's `spec.template`, as `helm template` renders it)
and the ConfigMaps and Secrets its volumes name, and returns what to make on the host and what to run; it
touches nothing. Every field is translated, or named below as one that has no effect on one pod run once on one
machine (scheduling, pulling from a registry, Services), or refused: a field it does not know raises
UnsupportedField, so a field added to a chart is never silently left out of what is run.

Where Kubernetes leaves a choice to the container runtime, this follows containerd (the runtime of most
clusters, EKS's, GKE's and kubeadm's defaults): its default capabilities, its masked paths, its handling of
privileged containers. Each mapping says so where podman's own default differs.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import re
import socket
import ssl
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

# containerd's default capabilities (its oci.defaultUnixCaps), which a container has unless it drops them.
# podman's own default lacks AUDIT_WRITE, MKNOD and NET_RAW: the translation always says which it wants.
CONTAINERD_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "NET_RAW",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# The kubelet's defaults where the API server would have filled a field in (the rendered YAML has not been
# through it).
DEFAULT_GRACE_SECONDS = 30
DEFAULT_VOLUME_MODE = 0o644  # configMap and secret volumes' defaultMode (420)
PROBE_DEFAULTS = {"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1, "failureThreshold": 3}

# Fields with no effect on one pod run once on one machine. Anything else not translated below is refused.
IGNORED_POD_FIELDS = frozenset(
    {
        "affinity",  # scheduling: which nodes
        "nodeSelector",
        "nodeName",
        "tolerations",
        "topologySpreadConstraints",
        "schedulerName",
        "priorityClassName",  # which pods the scheduler and the kubelet evict first
        "priority",
        "preemptionPolicy",
        "serviceAccountName",  # whom the API server knows the pod as (its token: automountServiceAccountToken)
        "serviceAccount",
        "imagePullSecrets",  # the image is pulled by podman as configured here, or is local
        "enableServiceLinks",  # no Services here
        "dnsPolicy",  # no cluster DNS here: podman's resolv.conf
        "restartPolicy",  # Always, for a DaemonSet: here each container runs once, so a crash shows
        "readinessGates",
    }
)
IGNORED_CONTAINER_FIELDS = frozenset(
    {
        "terminationMessagePolicy",  # where the kubelet reads the last words from: nobody reads them here
    }
)
# The kubelet bind-mounts a file of its own at each container's terminationMessagePath (this by default), read-write,
# after the volumes (containerd orders mounts by depth): under a read-only volume mounted at /dev the runtime
# cannot make it, and the container never starts (issue 56).
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"


class UnsupportedField(ValueError):
    """A field of the pod that pod_to_podman cannot run under podman, or does not know."""


@dataclass(frozen=True)
class Probe:
    """A container's probe, aimed at the host side of its port: the kubelet's connection to the pod's IP is, under
    podman, one to 127.0.0.1 on the port published for it (or the port itself, on the host's network)."""

    handler: str  # httpGet or tcpSocket
    port: int
    path: str = "/"
    scheme: str = "HTTP"
    initial_delay: float = 0
    timeout: float = 1
    period: float = 10
    success_threshold: int = 1
    failure_threshold: int = 3


@dataclass(frozen=True)
class PodmanContainer:
    name: str  # podman's: the prefix and the container's name
    arguments: tuple[str, ...]  # what follows `podman run` (and its --name, --rm or --detach): options, image, args
    probes: Mapping[str, Probe]  # livenessProbe, readinessProbe, startupProbe: those the container has


@dataclass(frozen=True)
class HostFile:
    path: Path
    content: bytes
    mode: int
    gid: int | None = None  # fsGroup's, else root's


@dataclass(frozen=True)
class HostDirectory:
    path: Path
    mode: int
    gid: int | None = None


@dataclass(frozen=True)
class PodmanPod:
    """Made on the host first (prepare): hostPath checks (and DirectoryOrCreate's directory), then the
    directories and files of the configMap, secret and emptyDir volumes. Then the init containers, each to its
    end, in order; then the containers."""

    host_paths: tuple[tuple[Path, str], ...]  # (the host's path, the hostPath's type)
    directories: tuple[HostDirectory, ...]
    files: tuple[HostFile, ...]
    init_containers: tuple[PodmanContainer, ...]
    containers: tuple[PodmanContainer, ...]
    stop_timeout: int  # terminationGracePeriodSeconds: SIGTERM, then SIGKILL after this long (podman stop)


def _known(obj: Mapping[str, Any], where: str, handled: Iterable[str], ignored: Iterable[str] = ()) -> None:
    unknown = set(obj) - set(handled) - set(ignored)
    if unknown:
        raise UnsupportedField(f"{where}: {', '.join(sorted(unknown))}: not translated to podman")


def _refuse(where: str, why: str) -> UnsupportedField:
    return UnsupportedField(f"{where}: {why}")


def _option_path(path: str | Path, where: str) -> str:
    """A path in podman's --volume syntax, which has no escape for its separators."""
    text = str(path)
    if ":" in text or "," in text:
        raise _refuse(where, f"{text!r}: podman's --volume cannot say a path with ':' or ','")
    return text


def _relative(path: str, where: str) -> PurePosixPath:
    relative = PurePosixPath(path)
    if not path or relative.is_absolute() or ".." in relative.parts:
        raise _refuse(where, f"{path!r} is not a path inside the volume")
    return relative


def quantity(value: str | int | float, where: str) -> float:
    """A Kubernetes resource quantity (128Mi, 20m, 0.5, 1G) as a number."""
    suffixes = {"": 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    suffixes |= {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60}
    match = re.fullmatch(r"(\+?[0-9]+(?:\.[0-9]*)?|\+?\.[0-9]+)([a-zA-Z]*)", str(value))
    if match is None or match[2] not in suffixes:
        raise _refuse(where, f"{value!r}: not a quantity this reads")
    return float(match[1]) * suffixes[match[2]]


def _resources(resources: Mapping[str, Any], where: str) -> list[str]:
    """As the kubelet sets a container's cgroup: the memory limit, CPU shares from the CPU request (from the limit
    when only that is set, as the API server defaults it; 2 without either), a CFS quota from the CPU limit. The
    memory request only schedules (on cgroup v1, as here)."""
    _known(resources, where, ("requests", "limits"))
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    _known(requests, f"{where}.requests", ("cpu", "memory"))
    _known(limits, f"{where}.limits", ("cpu", "memory"))
    options = []
    if "memory" in limits:
        options.append(f"--memory={math.ceil(quantity(limits['memory'], f'{where}.limits.memory'))}")
    cpu_request = requests.get("cpu", limits.get("cpu"))
    millicpu = math.ceil(quantity(cpu_request, f"{where}.requests.cpu") * 1000) if cpu_request is not None else 0
    options.append(f"--cpu-shares={min(max(millicpu * 1024 // 1000, 2), 262144)}")  # the kubelet's MilliCPUToShares
    if "cpu" in limits:
        millicpu_limit = math.ceil(quantity(limits["cpu"], f"{where}.limits.cpu") * 1000)
        options.append(f"--cpus={millicpu_limit / 1000}")
    return options


def _capabilities(capabilities: Mapping[str, Any], where: str) -> list[str]:
    """containerd's: its default set, with add's added, then drop's dropped (ALL in drop: none but add's)."""
    _known(capabilities, where, ("add", "drop"))
    add = {c.upper().removeprefix("CAP_") for c in capabilities.get("add") or ()}
    drop = {c.upper().removeprefix("CAP_") for c in capabilities.get("drop") or ()}
    if "ALL" in add:
        raise _refuse(f"{where}.add", "ALL: not translated (privileged: true is the way to every capability)")
    base = set() if "ALL" in drop else set(CONTAINERD_CAPABILITIES)
    return ["--cap-drop=ALL", *(f"--cap-add={c}" for c in sorted((base | add) - drop))]


def _profile(profile: Mapping[str, Any] | None, where: str, option: str) -> list[str]:
    """seccompProfile and appArmorProfile: the runtime's default, or none."""
    if profile is None:
        return []
    _known(profile, where, ("type",))
    if profile["type"] == "RuntimeDefault":
        return []  # podman's default profile, as containerd's
    if profile["type"] == "Unconfined":
        return [f"--security-opt={option}=unconfined"]
    raise _refuse(where, f"type {profile['type']}: not translated")


def _security(pod_context: Mapping[str, Any], context: Mapping[str, Any], where: str) -> tuple[list[str], bool]:
    """The podman options of a container's security: the pod's securityContext, which its own overrides field by
    field; and whether it is privileged."""
    _known(
        pod_context,
        "spec.securityContext",
        (
            "runAsUser",
            "runAsGroup",
            "runAsNonRoot",
            "supplementalGroups",
            "supplementalGroupsPolicy",
            "fsGroup",
            "fsGroupChangePolicy",
            "seccompProfile",
            "appArmorProfile",
            "sysctls",
        ),
    )
    _known(
        context,
        f"{where}.securityContext",
        (
            "runAsUser",
            "runAsGroup",
            "runAsNonRoot",
            "seccompProfile",
            "appArmorProfile",
            "privileged",
            "allowPrivilegeEscalation",
            "readOnlyRootFilesystem",
            "capabilities",
            "procMount",
        ),
    )
    merged = {**pod_context, **context}
    options = []
    user, group = merged.get("runAsUser"), merged.get("runAsGroup")
    if user is not None:
        options.append(f"--user={user}" if group is None else f"--user={user}:{group}")
    elif group is not None:
        raise _refuse(where, "runAsGroup without runAsUser: podman's --user names the user")
    if merged.get("runAsNonRoot"):
        # The kubelet refuses to start it as root; it would check the image's user, which a spec does not say.
        if user is None:
            raise _refuse(where, "runAsNonRoot without runAsUser: the image's user is not in the spec")
        if user == 0:
            raise _refuse(where, "runAsNonRoot with runAsUser 0: the kubelet would not start it")
    groups = list(pod_context.get("supplementalGroups") or ())
    if "fsGroup" in pod_context:  # the kubelet adds it to every container's groups
        groups.append(pod_context["fsGroup"])
    options += [f"--group-add={g}" for g in groups]
    if pod_context.get("supplementalGroupsPolicy", "Merge") != "Merge":
        raise _refuse("spec.securityContext.supplementalGroupsPolicy", "only Merge (podman's, and the default)")
    options += [f"--sysctl={s['name']}={s['value']}" for s in pod_context.get("sysctls") or ()]
    privileged = bool(context.get("privileged"))
    capabilities = context.get("capabilities") or {}
    if privileged:
        _known(capabilities, f"{where}.securityContext.capabilities", ("add", "drop"))
        # As containerd: every capability in the bounding set, every host device, no seccomp, nothing masked;
        # capabilities' add and drop are not applied (the user's own ids decide what it may do: nothing, unless
        # root). podman's --privileged is the same, its --cap-drop not reaching the bounding set either.
        options.append("--privileged")
        if context.get("allowPrivilegeEscalation") is False:
            raise _refuse(where, "privileged with allowPrivilegeEscalation false (the API server refuses it)")
    else:
        options += _capabilities(capabilities, f"{where}.securityContext.capabilities")
        # podman hides /sys/dev/block, which containerd's masked paths leave; their other masks are alike.
        options.append("--security-opt=unmask=/sys/dev/block")
    # Without a seccompProfile the kubelet asks for none (its --seccomp-default is off unless set); with
    # privileged, neither containerd nor podman applies one.
    options += _profile(merged.get("seccompProfile") or {"type": "Unconfined"}, f"{where} seccompProfile", "seccomp")
    options += _profile(merged.get("appArmorProfile"), f"{where} appArmorProfile", "apparmor")
    if context.get("allowPrivilegeEscalation") is False:
        options.append("--security-opt=no-new-privileges")
    if context.get("readOnlyRootFilesystem"):
        # Without --read-only-tmpfs=false podman would mount tmpfs's on /tmp, /var/tmp and /run: no kubelet does.
        options += ["--read-only", "--read-only-tmpfs=false"]
    if context.get("procMount", "Default") != "Default":
        raise _refuse(where, f"procMount {context['procMount']}: not translated")
    return options, privileged


def _pull(container: Mapping[str, Any]) -> str:
    policy = container.get("imagePullPolicy")
    if policy is None:  # the API server's default: Always for :latest or no tag, else IfNotPresent
        last = container["image"].rsplit("/", 1)[-1]
        policy = "Always" if "@" not in last and (":" not in last or last.endswith(":latest")) else "IfNotPresent"
    pulls = {"Always": "always", "IfNotPresent": "missing", "Never": "never"}
    if policy not in pulls:
        raise _refuse(f"container {container['name']}", f"imagePullPolicy {policy}")
    return f"--pull={pulls[policy]}"


def _no_expansion(values: Iterable[str], where: str) -> None:
    """The kubelet expands $(VAR) in command, args and env values; nothing here does, so none may be there."""
    for value in values:
        if "$(" in value or "$$" in value:
            raise _refuse(where, f"{value!r}: $(VAR) references are not expanded here")


def _env(env: Sequence[Mapping[str, Any]], where: str) -> list[str]:
    options = []
    for variable in env:
        _known(variable, f"{where}.env", ("name", "value"))  # valueFrom (the downward API, Secrets...): refused
        value = str(variable.get("value", ""))
        _no_expansion([value], f"{where}.env {variable['name']}")
        options.append(f"--env={variable['name']}={value}")
    return options


def _port_number(port: int | str, container: Mapping[str, Any], where: str) -> int:
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports") or ()}
    if port not in named:
        raise _refuse(where, f"port {port!r} is not a named port of the container")
    number: int = named[port]
    return number


def _probe(probe: Mapping[str, Any], container: Mapping[str, Any], where: str, host_port: Mapping[int, int]) -> Probe:
    timing = ("initialDelaySeconds", "timeoutSeconds", "periodSeconds", "successThreshold", "failureThreshold")
    handlers = [h for h in ("httpGet", "tcpSocket", "exec", "grpc") if h in probe]
    # terminationGracePeriodSeconds: the grace of a restart that a failed probe causes; nothing restarts here.
    _known(probe, where, (*timing, "httpGet", "tcpSocket", "terminationGracePeriodSeconds"))
    if len(handlers) != 1:
        raise _refuse(where, f"{len(handlers)} handlers")
    (handler,) = handlers
    action = probe[handler]
    settings = {**PROBE_DEFAULTS, **{k: probe[k] for k in timing if k in probe}}
    if handler == "httpGet":
        _known(action, f"{where}.httpGet", ("path", "port", "scheme"))  # host, httpHeaders: refused
        extra = {"path": action.get("path", "/"), "scheme": action.get("scheme", "HTTP")}
        if extra["scheme"] not in ("HTTP", "HTTPS"):
            raise _refuse(f"{where}.httpGet", f"scheme {extra['scheme']}")
    else:
        _known(action, f"{where}.tcpSocket", ("port",))
        extra = {}
    number = _port_number(action["port"], container, where)
    if number not in host_port:
        raise _refuse(where, f"port {number} is not one of the container's published ports")
    return Probe(
        handler=handler,
        port=host_port[number],
        initial_delay=settings.get("initialDelaySeconds", 0),
        timeout=settings["timeoutSeconds"],
        period=settings["periodSeconds"],
        success_threshold=settings["successThreshold"],
        failure_threshold=settings["failureThreshold"],
        **extra,
    )


def _object(objects: Sequence[Mapping[str, Any]], kind: str, name: str) -> Mapping[str, Any] | None:
    found = [o for o in objects if o.get("kind") == kind and o.get("metadata", {}).get("name") == name]
    return found[0] if found else None


def _projected_files(
    volume: Mapping[str, Any], source_kind: str, data: Mapping[str, bytes], directory: Path, fs_group: int | None
) -> list[HostFile]:
    """A configMap or secret volume's files: every key, or the items' (key, path, mode), with defaultMode; with
    fsGroup, group-readable and the group's, as the kubelet's SetVolumeOwnership leaves a read-only volume."""
    where = f"volume {volume['name']}.{source_kind}"
    source = volume[source_kind]
    mode = source.get("defaultMode", DEFAULT_VOLUME_MODE)
    items = source.get("items")
    if items is None:
        items = [{"key": key, "path": key} for key in data]
    files = []
    for item in items:
        _known(item, f"{where}.items", ("key", "path", "mode"))
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise _refuse(where, f"no key {item['key']!r}")
        file_mode = item.get("mode", mode) | (0o440 if fs_group is not None else 0)
        path = directory / _relative(item["path"], where)
        files.append(HostFile(path, data[item["key"]], file_mode, fs_group))
    return files


def _volumes(
    spec: Mapping[str, Any],
    objects: Sequence[Mapping[str, Any]],
    host_paths: Mapping[str, Path],
    scratch: Path,
) -> tuple[dict[str, tuple[Path, bool]], list[tuple[Path, str]], list[HostDirectory], list[HostFile]]:
    """Each volume's host directory and whether it is always mounted read-only (configMap, secret: the
    kubelet mounts them so, whatever readOnly says); the hostPath checks, the directories and files to make."""
    fs_group = (spec.get("securityContext") or {}).get("fsGroup")
    sources: dict[str, tuple[Path, bool]] = {}
    checks: list[tuple[Path, str]] = []
    directories: list[HostDirectory] = []
    files: list[HostFile] = []
    for volume in spec.get("volumes") or ():
        name = volume["name"]
        kinds = set(volume) - {"name"}
        if len(kinds) != 1:
            raise _refuse(f"volume {name}", f"{', '.join(sorted(kinds)) or 'no kind'}: not one volume kind")
        (kind,) = kinds
        where = f"volume {name}.{kind}"
        directory = scratch / "volumes" / name
        if kind == "hostPath":
            _known(volume[kind], where, ("path", "type"))
            path = volume[kind]["path"]
            if path not in host_paths:
                raise _refuse(where, f"{path}: say which host path stands for the node's (host_paths)")
            checks.append((host_paths[path], volume[kind].get("type", "")))
            sources[name] = (host_paths[path], False)
        elif kind == "emptyDir":
            _known(volume[kind], where, ("sizeLimit",))  # medium Memory (a tmpfs shared by the pod's containers)
            mode = 0o777 if fs_group is None else 0o2777  # the kubelet's; setgid for fsGroup
            directories.append(HostDirectory(directory, mode, fs_group))
            sources[name] = (directory, False)
        elif kind in ("configMap", "secret"):
            key = "name" if kind == "configMap" else "secretName"
            _known(volume[kind], where, (key, "items", "defaultMode", "optional"))
            found = _object(objects, "ConfigMap" if kind == "configMap" else "Secret", volume[kind][key])
            if found is None and not volume[kind].get("optional"):
                raise _refuse(where, f"no {kind} {volume[kind][key]} among the objects")
            data = _object_data(found or {}, where)
            directories.append(HostDirectory(directory, 0o755 if fs_group is None else 0o2755, fs_group))
            files += _projected_files(volume, kind, data, directory, fs_group)
            sources[name] = (directory, True)
        else:
            raise _refuse(where, "this kind of volume is not translated")
    return sources, checks, directories, files


def _object_data(found: Mapping[str, Any], where: str) -> dict[str, bytes]:
    """A ConfigMap's data and binaryData, a Secret's data (base64) and stringData, as bytes."""
    text = {**(found.get("data") or {})} if found.get("kind") == "ConfigMap" else {**(found.get("stringData") or {})}
    encoded = found.get("binaryData") if found.get("kind") == "ConfigMap" else found.get("data")
    data = {key: value.encode() for key, value in text.items()}
    data |= {key: base64.b64decode(value) for key, value in (encoded or {}).items()}
    for key in data:
        _relative(key, where)
    return data


def _mounts(
    container: Mapping[str, Any],
    sources: Mapping[str, tuple[Path, bool]],
    privileged: bool,
    where: str,
) -> list[str]:
    propagations = {None: "rprivate", "None": "rprivate", "HostToContainer": "rslave", "Bidirectional": "rshared"}
    options = []
    for mount in container.get("volumeMounts") or ():
        at = f"{where}.volumeMounts {mount.get('name')}"
        _known(mount, at, ("name", "mountPath", "readOnly", "mountPropagation", "subPath"))
        if mount["name"] not in sources:
            raise _refuse(at, "no such volume")
        source, always_read_only = sources[mount["name"]]
        if mount.get("subPath"):
            source = source / _relative(mount["subPath"], at)
        propagation = mount.get("mountPropagation")
        if propagation not in propagations:
            raise _refuse(at, f"mountPropagation {propagation}")
        if propagation == "Bidirectional" and not privileged:
            raise _refuse(at, "Bidirectional propagation without privileged (the API server refuses it)")
        read_only = "ro" if always_read_only or mount.get("readOnly") else "rw"
        destination = _option_path(mount["mountPath"], at)
        options.append(f"--volume={_option_path(source, at)}:{destination}:{read_only},{propagations[propagation]}")
    return options


def termination_log(scratch: Path, container: Mapping[str, Any]) -> HostFile:
    """The file the kubelet makes for a container's termination message (mounted at terminationMessagePath)."""
    return HostFile(scratch / "termination-logs" / str(container.get("name")), b"", 0o644)


def _container(
    container: Mapping[str, Any],
    spec: Mapping[str, Any],
    sources: Mapping[str, tuple[Path, bool]],
    prefix: str,
    published: Mapping[int, int] | None,
    init: bool,
    scratch: Path,
) -> PodmanContainer:
    """A container as podman's options, image and arguments. `published`: the container's ports on the host
    (None for an init container, whose ports and probes the API server refuses anyway)."""
    where = f"{'initContainers' if init else 'containers'} {container.get('name')}"
    handled = ["name", "image", "imagePullPolicy", "command", "args", "env", "workingDir", "securityContext"]
    handled += ["resources", "volumeMounts", "terminationMessagePath"]
    if not init:
        handled += ["ports", "livenessProbe", "readinessProbe", "startupProbe"]
    _known(container, where, handled, IGNORED_CONTAINER_FIELDS)
    security, privileged = _security(spec.get("securityContext") or {}, container.get("securityContext") or {}, where)
    options = [_pull(container), *security]
    if spec.get("hostNetwork"):
        options.append("--network=host")
    else:
        options += ["--network=bridge", f"--hostname={prefix}"]  # the pod's own network; its name as hostname
    if spec.get("hostPID"):
        options.append("--pid=host")
    if spec.get("hostIPC"):
        options.append("--ipc=host")
    options += _resources(container.get("resources") or {}, f"{where}.resources")
    options += _env(container.get("env") or (), where)
    if "workingDir" in container:
        options.append(f"--workdir={container['workingDir']}")
    options += _mounts(container, sources, privileged, where)
    at = container.get("terminationMessagePath", DEFAULT_TERMINATION_MESSAGE_PATH)
    log_file = termination_log(scratch, container).path
    options.append(f"--volume={_option_path(log_file, where)}:{_option_path(at, where)}:rw,rprivate")
    host_port: dict[int, int] = {}
    for port in container.get("ports") or ():
        _known(port, f"{where}.ports", ("name", "containerPort", "protocol"))  # hostPort, hostIP: refused
        number, protocol = port["containerPort"], port.get("protocol", "TCP")
        if protocol not in ("TCP", "UDP"):
            raise _refuse(f"{where}.ports", f"protocol {protocol}")
        if spec.get("hostNetwork"):  # the container's port is the host's
            if (published or {}).get(number, number) != number:
                raise _refuse(f"{where}.ports", f"{number}: on the host's network it cannot be published elsewhere")
            host_port[number] = number
        else:
            if published is None or number not in published:
                raise _refuse(f"{where}.ports", f"{number}: say which host port to publish it on (published)")
            host_port[number] = published[number]
            options.append(f"--publish=127.0.0.1:{published[number]}:{number}/{protocol.lower()}")
    if not init:
        options.append(f"--stop-timeout={spec.get('terminationGracePeriodSeconds', DEFAULT_GRACE_SECONDS)}")
    command, args = container.get("command") or [], container.get("args") or []
    _no_expansion([*command, *args], where)
    if command:  # the image's ENTRYPOINT replaced; its CMD then unused, as Kubernetes does
        options.append(f"--entrypoint={json.dumps(command)}")
    probes = {
        kind: _probe(container[kind], container, f"{where}.{kind}", host_port)
        for kind in ("livenessProbe", "readinessProbe", "startupProbe")
        if kind in container
    }
    return PodmanContainer(f"{prefix}-{container['name']}", (*options, container["image"], *args), probes)


def pod_to_podman(
    template: Mapping[str, Any],
    objects: Sequence[Mapping[str, Any]],
    *,
    prefix: str,
    host_paths: Mapping[str, Path],
    scratch: Path,
    published: Mapping[int, int],
) -> PodmanPod:
    """The pod `template` ({metadata, spec}) under podman. `objects`: where its configMap and secret volumes' data
    are found. `prefix`: the podman containers' names begin with it. `host_paths`: the host's path for each
    hostPath volume's (the node's) path, itself where the real one is meant; a hostPath not given raises.
    `scratch`: where the other volumes' directories are made (by prepare). `published`: the host port (on
    127.0.0.1) each container port is published on, the pod having its own network (podman's bridge)."""
    _known(template, "template", ("metadata", "spec"))
    _known(template.get("metadata") or {}, "metadata", ("labels", "annotations"))
    spec = template["spec"]
    handled = ["initContainers", "containers", "volumes", "securityContext", "hostNetwork", "hostPID", "hostIPC"]
    handled += ["automountServiceAccountToken", "terminationGracePeriodSeconds", "shareProcessNamespace", "os"]
    _known(spec, "spec", handled, IGNORED_POD_FIELDS)
    if spec.get("automountServiceAccountToken", True) is not False:
        raise _refuse("spec.automountServiceAccountToken", "a token is mounted, and there is no API server here")
    if spec.get("shareProcessNamespace"):
        raise _refuse("spec.shareProcessNamespace", "podman containers apart share no process namespace")
    if (spec.get("os") or {"name": "linux"}) != {"name": "linux"}:
        raise _refuse("spec.os", f"{spec['os']}")
    if len(spec["containers"]) != 1:
        raise _refuse("spec.containers", "more than one: separate podman containers would not share a network")
    sources, checks, directories, files = _volumes(spec, objects, host_paths, scratch)
    files += [termination_log(scratch, c) for c in [*(spec.get("initContainers") or ()), *spec["containers"]]]
    return PodmanPod(
        host_paths=tuple(checks),
        directories=tuple(directories),
        files=tuple(files),
        init_containers=tuple(
            _container(c, spec, sources, prefix, None, init=True, scratch=scratch)
            for c in spec.get("initContainers") or ()
        ),
        containers=tuple(
            _container(c, spec, sources, prefix, published, init=False, scratch=scratch) for c in spec["containers"]
        ),
        stop_timeout=spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS),
    )


# -- the host side ---------------------------------------------------------------------------------------------

HOST_PATH_TYPES = {
    "Directory": stat.S_ISDIR,
    "File": stat.S_ISREG,
    "Socket": stat.S_ISSOCK,
    "CharDevice": stat.S_ISCHR,
    "BlockDevice": stat.S_ISBLK,
}


def prepare(pod: PodmanPod) -> None:
    """What the kubelet makes and checks before the containers start (root, for the fsGroup's ownership):
    hostPath types (DirectoryOrCreate: made 0755, root's, if missing; FileOrCreate: an empty 0644 file), then the
    volumes' directories and files."""
    for path, kind in pod.host_paths:
        if kind == "DirectoryOrCreate" and not path.exists():
            path.mkdir(parents=True)
            path.chmod(0o755)
        elif kind == "FileOrCreate" and not path.exists():
            path.touch()
            path.chmod(0o644)
        wanted = HOST_PATH_TYPES.get(kind.removesuffix("OrCreate"))
        if kind and (wanted is None or not wanted(path.stat().st_mode)):
            raise AssertionError(f"hostPath {path}: not a {kind}")
    for directory in pod.directories:
        directory.path.mkdir(parents=True)
        _own(directory.path, directory.mode, directory.gid)
    for file in pod.files:
        file.path.parent.mkdir(parents=True, exist_ok=True)
        file.path.write_bytes(file.content)
        _own(file.path, file.mode, file.gid)


def _own(path: Path, mode: int, gid: int | None) -> None:
    if gid is not None:
        os.chown(path, -1, gid)
    path.chmod(mode)  # after chown, which clears setgid


# -- probes ----------------------------------------------------------------------------------------------------


def kubelet_get(url: str, path: str, client_cert: tuple[Path, Path] | None = None, timeout: float = 10) -> int:
    """GET as the kubelet's httpGet probe does: its User-Agent, no credentials, and over HTTPS no certificate
    verification (nor a client certificate, unless given one here). The status."""
    scheme, address = url.split("://")
    host, port = address.rsplit(":", 1)
    if scheme == "https":
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if client_cert is not None:
            context.load_cert_chain(*client_cert)
        connection: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, int(port), context=context, timeout=timeout
        )
    else:
        connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("GET", path, headers={"User-Agent": "kube-probe/1.36", "Accept": "*/*"})
        return connection.getresponse().status
    finally:
        connection.close()


def probe(check: Probe) -> bool:
    """One run of a probe, as the kubelet judges it: an HTTP status from 200 to 399, or a TCP connection
    accepted, within timeoutSeconds."""
    try:
        if check.handler == "tcpSocket":
            socket.create_connection(("127.0.0.1", check.port), timeout=check.timeout).close()
            return True
        status = kubelet_get(f"{check.scheme.lower()}://127.0.0.1:{check.port}", check.path, timeout=check.timeout)
    except (OSError, http.client.HTTPException):
        return False
    return 200 <= status < 400
