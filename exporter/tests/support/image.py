"""volprobe's image, built from deploy/Dockerfile with podman on a local stand-in for its Debian base (test_image's
and test_cluster's), and what the tests read of a process's privileges. No registry can be reached here, so the
base image is made with mmdebstrap from the machine's Debian mirror (/work/shared/containers.md has the recipe and
why each step is there), cached outside the checkout as a tarball keyed by the recipe's hash, and kept in
podman's storage under its own tag (never the official name); so are the build's apt-get steps."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .debian import debian_mirrors
from .harness import REPO, locked
from .podman import containers_conf, podman

CACHE = Path(os.environ.get("VOLPROBE_IMAGE_CACHE", "/var/cache/volprobe-ci/image-base"))
BASE_REPOSITORY = "localhost/volprobe-test-base"  # a test's own name: the official one stays unshadowed
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
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


@dataclass(frozen=True)
class Built:
    conf: Path  # CONTAINERS_CONF of every podman call
    image: str
    name: str  # the prefix of its pods' containers


@contextlib.contextmanager
def built_image(directory: Path) -> Iterator[Built]:
    """deploy/Dockerfile built with podman (its containers.conf in `directory`) on the local base, until the block
    ends; then removed, with the pods' containers named after it (the unchanging build steps kept for the next
    run). Needs root (podman's storage)."""
    conf = containers_conf(directory)
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
        done = time.monotonic()
        size = int(podman(conf, "image", "inspect", "--format={{.Size}}", image).stdout)
        print(
            f"\nimage {image}: {size} bytes ({size / 1e6:.0f} MB); base {based - started:.1f} s, "
            f"build {done - based:.1f} s"
        )
        yield Built(conf, image, name)
    finally:
        # The pods' containers: the prefix and each container's name (support/kubelet.py).
        listed = podman(conf, "ps", "--all", f"--filter=name={name}-", "--format={{.Names}}", check=False)
        for container_name in listed.stdout.split():
            if container_name.startswith(f"{name}-"):
                podman(conf, "rm", "--force", "--ignore", container_name, check=False)
        keep_unchanging_steps(conf, base, steps)  # before the image goes: removing it removes untagged parents
        podman(conf, "rmi", "--force", "--ignore", image, check=False)


# A process's capability sets: CAP_SYS_ADMIN's bit.
SYS_ADMIN = 1 << 21


def task_privileges(pid: str) -> dict[str, dict[str, int]]:
    """Each thread's capability sets and no_new_privs, from the host's /proc/PID/task/*/status."""
    found = {}
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        try:
            lines = (task / "status").read_text().splitlines()
            name = (task / "comm").read_text().strip()
        except FileNotFoundError:  # ended meanwhile
            continue
        status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
        sets = {key: int(status[key], 16) for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
        found[f"{task.name} {name}"] = {
            **sets,
            "NoNewPrivs": int(status["NoNewPrivs"]),
            "Uid": int(status["Uid"].split()[1]),
        }
    return found
