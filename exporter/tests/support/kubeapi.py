"""A Kubernetes API server as the tests talk to it (test_kube_apiserver's, and support/cluster.py's): a small
client (ApiServer: requests with a bearer token, 429s retried as client-go does, helm run against it), starting
its processes (etcd, kube-apiserver, and the node's components) until they are ready, the kubeconfig helm and the
components read, and the Prometheus Operator's CRDs the chart's objects need."""

from __future__ import annotations

import contextlib
import json
import re
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .harness import free_port

# The kinds the chart makes: where each is in the API. A kind added to the chart must be added here.
COLLECTIONS = {
    "ServiceAccount": "serviceaccounts",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "DaemonSet": "daemonsets",
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    "PrometheusRule": "prometheusrules",
}
API_VERSIONS = {"DaemonSet": "apps/v1"} | dict.fromkeys(
    ("ServiceMonitor", "PodMonitor", "PrometheusRule"), "monitoring.coreos.com/v1"
)
STARTUP_TIMEOUT = 90.0  # seconds; about 4 on an idle machine, more on a busy CI's two cores


class PortTaken(Exception):
    """A free port was taken by someone else between free_port() and the bind: start again on others."""


@dataclass
class Reply:
    status: int
    body: Any
    warnings: list[str]  # the API server's Warning headers, each message unquoted


@dataclass
class ApiServer:
    url: str
    token: str
    ca: Path
    kubeconfig: Path
    helm: str
    helm_env: dict[str, str]
    directory: Path

    def tls(self) -> ssl.SSLContext:
        return tls_context(self.ca)

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any, bytes]:
        request = urllib.request.Request(
            self.url + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, context=self.tls(), timeout=timeout) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read()

    def call(self, method: str, path: str, body: Any = None) -> Reply:
        """One request; a 429 (Too Many Requests: a storage still initializing, a busy API server) retried after
        the time it says, for up to 30 s, as client-go (and so helm) does."""
        deadline = time.monotonic() + 30
        while True:
            status, headers, raw = self.request(method, path, body)
            if status != 429 or time.monotonic() > deadline:
                break
            time.sleep(min(float(headers.get("Retry-After") or 1), 1.0))
        warnings = [unquote_warning(w) for w in headers.get_all("Warning") or []]
        return Reply(status, json.loads(raw) if raw else None, warnings)

    def get(self, path: str) -> Any:
        reply = self.call("GET", path)
        assert reply.status == 200, (path, reply.body)
        return reply.body

    def create(self, path: str, body: dict[str, Any], exist_ok: bool = False) -> Reply:
        reply = self.call("POST", path, body)
        assert reply.status == 201 or (exist_ok and reply.status == 409), (path, reply.status, reply.body)
        return reply

    def namespace(self, name: str, **pod_security: str) -> str:
        """A namespace with these Pod Security labels (enforce="privileged", warn="restricted"...) and the
        `default` ServiceAccount that the controller-manager would make."""
        labels = {f"pod-security.kubernetes.io/{mode}": level for mode, level in pod_security.items()}
        self.create("/api/v1/namespaces", {"metadata": {"name": name, "labels": labels}})
        self.create(f"/api/v1/namespaces/{name}/serviceaccounts", {"metadata": {"name": "default"}})
        return name

    def run_helm(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.helm, *args], env=self.helm_env, capture_output=True, text=True, timeout=180, cwd=self.directory
        )


def tls_context(ca: Path) -> ssl.SSLContext:
    """Trusting the CA that kube-apiserver made itself (--cert-dir: its serving certificate, then the CA's)."""
    return ssl.create_default_context(cafile=str(ca))


def unquote_warning(header: str) -> str:
    """`299 - "message with \\"quotes\\""` (RFC 7234's warn-code, agent and quoted text) -> the message."""
    match = re.fullmatch(r'\d{3} \S+ "(.*)"', header.strip())
    return re.sub(r"\\(.)", r"\1", match.group(1)) if match else header


def helm_warnings(stderr: str) -> list[str]:
    """The API server's warnings, as helm writes them to stderr (client-go's klog line
    `I1127 15:05:16.035433 12182 warnings.go:107] "Warning: unknown field \\"metadata.x\\""`, or a bare
    `Warning: ...`)."""
    found = []
    for line in stderr.splitlines():
        logged = re.search(r'\] "Warning: (.*)"$', line)
        if logged:
            found.append(json.loads(f'"{logged.group(1)}"'))
        elif line.startswith("Warning: "):
            found.append(line.removeprefix("Warning: "))
    return found


def tail(path: Path, size: int = 4000) -> str:
    return path.read_text(errors="replace")[-size:] if path.exists() else "(no log)"


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited 15 s later."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def start(command: list[str], log: Path, ready: Callable[[], bool], what: str) -> subprocess.Popen[bytes]:
    """Start `command` (its output to `log`, in its own process group), poll `ready` until it holds; on failure
    the process is stopped and the error names its log's end."""
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not ready():
            if process.poll() is not None:
                if "address already in use" in tail(log):
                    raise PortTaken(what)
                raise AssertionError(f"{what} exited with {process.returncode}:\n{tail(log)}")
            assert time.monotonic() < deadline, f"{what} not ready after {STARTUP_TIMEOUT} s:\n{tail(log)}"
            time.sleep(0.05)
    except BaseException:
        stop(process)
        raise
    return process


def answers(url: str, expected: Callable[[bytes], bool], context: ssl.SSLContext | None = None, **headers: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2, context=context) as r:
            return bool(expected(r.read()))
    except (OSError, ValueError):  # refused, not yet ready (HTTPError and SSLError are OSErrors), half an answer
        return False


def write_kubeconfig(path: Path, url: str, ca: Path, token: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": url, "certificate-authority": str(ca)}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)


def install_crds(api: ApiServer, directory: Path) -> None:
    """The Prometheus Operator's CRDs of the kinds the chart makes, POSTed (strictly validated) and Established."""
    names = []
    for kind, plural in COLLECTIONS.items():
        if API_VERSIONS.get(kind) != "monitoring.coreos.com/v1":
            continue
        crd = yaml.safe_load((directory / f"monitoring.coreos.com_{plural}.yaml").read_text())
        api.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions?fieldValidation=Strict", crd)
        names.append(crd["metadata"]["name"])

    def established() -> bool:
        for name in names:
            status = api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}").get("status", {})
            conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
            if conditions.get("Established") != "True":
                return False
        return True

    def served() -> bool:  # Established, and the storage of their objects ready to list (else 429)
        return established() and all(
            api.request("GET", f"/apis/monitoring.coreos.com/v1/{name.split('.')[0]}")[0] == 200 for name in names
        )

    deadline = time.monotonic() + 30
    while not served():
        assert time.monotonic() < deadline, f"the CRDs {names} not Established and served after 30 s"
        time.sleep(0.05)


def control_plane(
    binaries: Path,
    directory: Path,
    tokens: Path,
    key: Path,
    running: contextlib.ExitStack,
    started: list[subprocess.Popen[bytes]],
    authorization: str = "RBAC",
) -> tuple[str, Path]:
    """etcd, then kube-apiserver on it, each until it is ready; the API server's URL and CA certificate.
    `authorization`: "RBAC" for the API server alone, "Node,RBAC" where a kubelet joins (support/cluster.py).
    PortTaken when a free port was taken meanwhile: the caller tries again."""
    directory.mkdir()
    client, peer, secure = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{client}"
    etcd = start(
        [
            str(binaries / "etcd"),
            "--name=default",
            f"--data-dir={directory / 'etcd-data'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--initial-cluster-state=new",
            "--unsafe-no-fsync",  # a throwaway store: no fsync per write on a busy CI disk
            "--log-level=warn",
        ],
        directory / "etcd.log",
        lambda: answers(f"{etcd_url}/health", lambda body: json.loads(body).get("health") == "true"),
        "etcd",
    )
    started.append(etcd)
    running.callback(stop, etcd)
    certificates = directory / "certificates"
    ca = certificates / "apiserver.crt"  # kube-apiserver makes its own CA and serving certificate there
    url = f"https://127.0.0.1:{secure}"
    token = tokens.read_text().split(",")[0]

    def ready() -> bool:
        try:
            context = tls_context(ca)
        except OSError:  # not written yet, or half written (an SSLError)
            return False
        return answers(f"{url}/readyz", lambda body: body == b"ok", context, Authorization=f"Bearer {token}")

    apiserver = start(
        [
            str(binaries / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={secure}",
            f"--cert-dir={certificates}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-signing-key-file={key}",
            f"--service-account-key-file={key.with_suffix('.pub')}",
            f"--token-auth-file={tokens}",
            f"--authorization-mode={authorization}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--endpoint-reconciler-type=none",  # 127.0.0.1 cannot be the kubernetes Service's endpoint
            "--allow-privileged=true",  # as a cluster's: the chart's container is privileged
        ],
        directory / "apiserver.log",
        ready,
        "kube-apiserver",
    )
    started.append(apiserver)
    running.callback(stop, apiserver)
    return url, ca
