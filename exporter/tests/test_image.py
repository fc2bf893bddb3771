"""The container image, built from deploy/Dockerfile and run as the DaemonSet runs it (issue 25).

No registry can be reached here, so the base image is a local stand-in for python:3.11-slim-bookworm, made with
mmdebstrap from the machine's Debian mirror (/work/shared/containers.md has the recipe and why each step is
there). That base is slow to make and changes only with its recipe: it is cached outside the checkout as a
tarball keyed by the recipe's hash, and kept in podman's storage under its own tag (never the official name).
So are the build's apt-get steps (tagged beside it, gone with it); the steps that copy the checkout, the volprobe
image and its container are removed at the end. Cold (no cache) about 65 s, warm about 15 s, mostly pip in the
build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from .support.debian import debian_mirrors
from .support.harness import REPO, free_port, locked, parse_metrics, probes_done

NEEDED = ("podman", "mmdebstrap")
pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(
        not all(map(shutil.which, NEEDED)),
        reason=f"not installed: {' '.join(t for t in NEEDED if not shutil.which(t))} (.ci/run installs them)",
    ),
]

CACHE = Path(os.environ.get("VOLPROBE_IMAGE_CACHE", "/var/cache/volprobe-ci/image-base"))
BASE_REPOSITORY = "localhost/volprobe-test-base"  # a test's own name: the official one stays unshadowed
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# The host's hard limits are below podman's defaults, and its hybrid cgroups are refused by crun.
# What Debian's official images (and so python:*-slim) configure apt with: no .deb or package cache kept after an
# install, no translations fetched. Without it, the image keeps every .deb its apt-get installs downloaded.
_CLEAN = '"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"'
APT_AS_IN_DEBIANS_IMAGES = f"""\
DPkg::Post-Invoke {{ {_CLEAN}; }};
APT::Update::Post-Invoke {{ {_CLEAN}; }};
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
"""
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
"""


def base_recipe(mirrors: list[str]) -> tuple[list[str], list[str]]:
    """The mmdebstrap arguments (without the output) and `podman import --change`s of the base image."""
    excludes = ["/usr/share/man/*", "/usr/share/locale/*", "/usr/share/doc/*", "/usr/share/info/*"]
    mmdebstrap = [
        "--variant=minbase",
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        "--include=python3,python3-venv,ca-certificates,libpython3.11-dev",
        '--aptopt=APT::Install-Recommends "false"',
        *[f"--dpkgopt=path-exclude={pattern}" for pattern in excludes],
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        f'--customize-hook=printf %s {shlex.quote(APT_AS_IN_DEBIANS_IMAGES)} > "$1/etc/apt/apt.conf.d/docker-clean"'
        ' && rm -f "$1"/var/cache/apt/*.bin',  # which mmdebstrap's clean-up, reading that, would leave
        # Debian's python3 refuses pip installs: a venv at /usr/local stands in for the official image's Python.
        '--customize-hook=chroot "$1" python3 -m venv /usr/local',
        "bookworm",
    ]
    changes = ["ENV LANG=C.UTF-8", 'CMD ["python3"]']
    return mmdebstrap, changes


def podman(conf: Path, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    result = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"podman {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def local_base(conf: Path) -> str:
    """The base image's tag in podman's storage: imported from the cache, or made (mmdebstrap) and cached."""
    mirrors = debian_mirrors()
    assert mirrors, "no bookworm mirror in /etc/apt's sources"
    mmdebstrap, changes = base_recipe(mirrors)
    key = hashlib.sha256(json.dumps([mmdebstrap, mirrors, changes]).encode()).hexdigest()[:16]
    tag = f"{BASE_REPOSITORY}:{key}"
    if podman(conf, "image", "exists", tag, check=False).returncode == 0:
        return tag
    tarball = CACHE / f"{key}.tar"
    if not tarball.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = CACHE / f"{key}.{os.getpid()}.partial.tar"
        made = subprocess.run(
            ["mmdebstrap", "--quiet", *mmdebstrap, str(partial), *mirrors], capture_output=True, text=True, timeout=600
        )
        assert made.returncode == 0, made.stderr[-4000:]
        partial.rename(tarball)
        for stale in CACHE.glob("*.tar"):  # earlier recipes' bases
            if stale != tarball:
                stale.unlink(missing_ok=True)
    podman(conf, "import", *[f"--change={c}" for c in changes], str(tarball), tag)
    # Earlier recipes' bases, and the build steps kept on them (tagged KEY-ID: children, so removed first).
    listed = podman(conf, "images", "--format={{.Repository}}:{{.Tag}}", BASE_REPOSITORY).stdout.split()
    stale = [image for image in listed if not image.startswith(tag)]
    remove_images(conf, sorted(stale, key=lambda image: "-" in image.split(":")[-1]))
    return tag


def remove_images(conf: Path, images: list[str]) -> None:
    """Remove images, children first (later in the list, or found by retrying); one still in use stays."""
    remaining = list(reversed(images))
    while remaining:
        failed = [image for image in remaining if podman(conf, "rmi", image, check=False).returncode != 0]
        if len(failed) == len(remaining):
            return
        remaining = failed


def keep_unchanging_steps(conf: Path, base: str, steps: list[str]) -> None:
    """Of a build's step images, keep those no COPY went into (the apt-get steps: slow, and unchanged until the
    base or the Dockerfile changes), tagged beside the base so that they go when it goes; remove the others
    (each run's COPY of the checkout makes new ones, the last being the image built), and kept steps of earlier
    Dockerfiles."""
    ids = [podman(conf, "image", "inspect", "--format={{.Id}}", step, check=False).stdout.strip() for step in steps]
    base_id = podman(conf, "image", "inspect", "--format={{.Id}}", base, check=False).stdout.strip()
    ids = [image for image in ids if image and image != base_id]
    keep, drop = [], []
    for image in ids:
        history = podman(conf, "history", "--no-trunc", "--format={{.CreatedBy}}", image, check=False).stdout
        (drop if "COPY" in history else keep).append(image)
    prefix = base + "-"
    for image in keep:
        podman(conf, "tag", image, prefix + image[:12], check=False)
    listed = podman(conf, "images", "--format={{.Repository}}:{{.Tag}}", BASE_REPOSITORY, check=False).stdout
    earlier = [
        tag for tag in listed.split() if tag.startswith(prefix) and tag[len(prefix) :] not in {i[:12] for i in keep}
    ]
    remove_images(conf, drop)
    remove_images(conf, earlier)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def wait_for(predicate, what: str, logs, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.2)


@contextlib.contextmanager
def as_udev_would(device: str):
    """The loop node as udev makes disks (root:disk 0660): there is no udev here, and the container sees the
    host's mode. Restored afterwards."""
    before = os.stat(device)
    os.chown(device, 0, 6)
    os.chmod(device, 0o660)
    try:
        yield device
    finally:
        os.chown(device, before.st_uid, before.st_gid)
        os.chmod(device, before.st_mode & 0o7777)


def test_the_image_builds_and_serves_a_devices_probes_as_the_daemonset_runs_it(tmp_path, make_loop):
    conf = tmp_path / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    started = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    with locked(CACHE / "lock"):  # one base made at a time, by the first run (or worker) that needs it
        base = local_base(conf)
    based = time.monotonic()
    name = f"volprobe-test-{uuid.uuid4().hex[:12]}"
    image = f"localhost/{name}:latest"
    steps: list[str] = []
    try:
        build = podman(
            conf,
            "build",
            "--pull=never",
            "--layers",  # each step's image: the next run reuses the unchanging ones (keep_unchanging_steps)
            f"--build-arg=BASE={base}",
            f"--volume={CA_BUNDLE}:{CA_BUNDLE}:ro",  # pip inside the build checks PyPI's certificate
            "--file",
            str(REPO / "deploy" / "Dockerfile"),
            "--tag",
            image,
            str(REPO),
            timeout=600,
            check=False,
        )
        steps = re.findall(r"^--> ([0-9a-f]{11,64})$", build.stdout, re.MULTILINE)
        assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
        built = time.monotonic()
        size = int(podman(conf, "image", "inspect", "--format={{.Size}}", image).stdout)
        print(
            f"\nimage {image}: {size} bytes ({size / 1e6:.0f} MB); base {based - started:.1f} s, "
            f"build {built - based:.1f} s"
        )
        with as_udev_would(make_loop(16 * 1024 * 1024)) as device:
            _run_as_the_daemonset(conf, tmp_path, image, name, device)
    finally:
        podman(conf, "rm", "--force", "--ignore", name, check=False)
        keep_unchanging_steps(conf, base, steps)  # before the image goes: removing it removes untagged parents
        podman(conf, "rmi", "--force", "--ignore", image, check=False)


def _run_as_the_daemonset(conf: Path, tmp_path: Path, image: str, name: str, device: str) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "volprobe.yml").write_text(
        f"state_directory: /var/lib/volprobe\ntargets: [{{name: vol, device: {device}}}]\n"
    )
    state = tmp_path / "state"  # the node's /var/lib/volprobe, as the init container leaves it: nobody's
    state.mkdir()
    os.chown(state, 65534, 65534)
    port = free_port()
    podman(
        conf,
        "run",
        "--detach",
        f"--name={name}",
        "--user=65534:6",
        "--read-only",
        f"--device={device}",
        "--security-opt=unmask=/sys/dev/block",  # podman hides it; volprobe finds the disk's queue there
        "--network=host",
        f"--volume={config}:/etc/volprobe:ro",
        f"--volume={state}:/var/lib/volprobe",
        image,
        "--config=/etc/volprobe/volprobe.yml",
        f"--web.listen-address=127.0.0.1:{port}",
    )

    def logs() -> str:
        result = podman(conf, "logs", name, check=False)
        return result.stdout + result.stderr

    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: get(f"{url}/-/ready"), "/-/ready", logs)
    first = wait_for(lambda: probes_done(parse_metrics(get(f"{url}/metrics")), "vol"), "a read probe", logs)
    wait_for(lambda: probes_done(parse_metrics(get(f"{url}/metrics")), "vol") > first, "more read probes", logs)
    # SIGTERM, as the kubelet stops a pod: volprobe saves its state and exits 0.
    podman(conf, "stop", "--time=15", name, timeout=60)
    exit_code = podman(conf, "inspect", "--format={{.State.ExitCode}}", name).stdout.strip()
    assert exit_code == "0", logs()
    saved = list(state.glob("volume-*.json"))
    assert saved and all(f.stat().st_uid == 65534 for f in saved), logs()
