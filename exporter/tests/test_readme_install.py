"""The README's install commands, run as written on fresh machines (issue 42: "The README's install commands, run
as written on a fresh Debian 12, give a running, scraped exporter").

A fresh machine is a podman container booting systemd (PID 1) from a minbase Debian 12 or 13 with what a cloud
image has besides: systemd, dbus, sudo and curl. It is made with mmdebstrap from the machine's mirrors, cached
as a tarball keyed by its recipe and kept in podman's storage under a tag of its own. It gets CAP_SYS_ADMIN (the
unit's sandboxing makes mount namespaces) and one loop device of the test's, as udev would make it (root:disk
0660), and no other device of this machine: a configuration probing "every whole disk" finds only that one. The
checkout (its git-tracked and untracked, not ignored, files) and dist/'s packages are copied to /src, owned by
`admin`, a user of group sudo, who runs each line of a README block as written, in /src, with bash -o pipefail.
`sudoedit` writes the test's configuration (SUDO_EDITOR). Two things are not as a user does them, and why:
- `sudo .ci/package` is not run in the machine: .ci/run runs it before the suite (it makes Debian roots with
  mmdebstrap, which a container cannot); its dist/ is what the machine is given (test_package tests it).
- A `curl ... | grep` line is run again until it succeeds, for up to a minute, as a user would retry it: the
  series it looks for appear with the first probe, a second after a start or reload.

The blocks: the package on Debian 12 and 13, pipx on Debian 12 (whose pipx 1.1 has no --global), the first
command of the README, and the upgrade from 0.1.0 on Debian 13: 0.1.0 (the tree of PREVIOUS_RELEASE, from git)
installed first as 0.1.0's README said (`sudo pipx install --global .`; Debian 13's pipx 1.7 has --global).
apt's downloads are kept between runs in a cache of each release's. Each about 40 to 90 s, mostly apt and pip.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from volprobe import __version__

from .support.debian import RELEASES, Release, debian_mirrors, the_deb
from .support.harness import REPO, locked, parse_metrics, probes_done
from .support.podman import as_udev_would, containers_conf, needs, podman

pytestmark = [pytest.mark.root, pytest.mark.slow, needs("podman", "mmdebstrap", "git")]

CACHE = Path(os.environ.get("VOLPROBE_MACHINE_CACHE", "/var/cache/volprobe-ci/machines"))
IMAGE_REPOSITORY = "localhost/volprobe-test-machine"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# 0.1.0: the last commit before 0.2.0's release commit (9c0b83d, "release: 0.2.0, CHANGELOG, --version, ...").
PREVIOUS_RELEASE = "50caacf702755e0484e3953a1fc6a653026a6f82"
PREVIOUS_VERSION = "0.1.0"
# What a cloud image has besides minbase, and what the machine needs to boot: systemd as init.
MACHINE_PACKAGES = "systemd,systemd-sysv,dbus,sudo,curl,ca-certificates"
USER = "admin"
PORT = 10130  # the README's: each machine has a network namespace of its own
BY_RELEASE = {release.number: release for release in RELEASES}


def machine_image(conf: Path, release: Release) -> str:
    """The fresh machine's image in podman's storage: imported from the cache, or made (mmdebstrap) and cached."""
    mirrors = debian_mirrors(release.suite)
    assert mirrors, "no bookworm mirror in /etc/apt's sources"
    recipe = [
        "--variant=minbase",
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        '--aptopt=APT::Install-Recommends "false"',
        f"--include={MACHINE_PACKAGES}",
        # A user of group sudo, as a cloud image's first user, with no password to type.
        f'--customize-hook=chroot "$1" useradd --create-home --groups sudo --shell /bin/bash {USER}'
        f" && echo '{USER} ALL=(ALL:ALL) NOPASSWD: ALL' > \"$1/etc/sudoers.d/{USER}\""
        f' && chmod 440 "$1/etc/sudoers.d/{USER}"',
        release.suite,
    ]
    changes = ['CMD ["/sbin/init"]', "ENV LANG=C.UTF-8"]
    key = hashlib.sha256(json.dumps([recipe, mirrors, changes]).encode()).hexdigest()[:16]
    tag = f"{IMAGE_REPOSITORY}:{release.suite}-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with locked(CACHE / f"{release.suite}.lock"):
        if podman(conf, "image", "exists", tag, check=False).returncode == 0:
            return tag
        tarball = CACHE / f"{release.suite}-{key}.tar"
        if not tarball.exists():
            partial = CACHE / f"{release.suite}-{key}.{os.getpid()}.partial.tar"
            made = subprocess.run(
                ["mmdebstrap", "--quiet", *recipe, str(partial), *mirrors], capture_output=True, text=True, timeout=900
            )
            assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-4000:]
            partial.rename(tarball)
            for stale in CACHE.glob(f"{release.suite}-*.tar"):  # this release's earlier recipes
                if stale != tarball:
                    stale.unlink(missing_ok=True)
        podman(conf, "import", *[f"--change={c}" for c in changes], str(tarball), tag)
        listed = podman(conf, "images", "--format={{.Repository}}:{{.Tag}}", IMAGE_REPOSITORY).stdout.split()
        for stale in listed:
            if stale != tag and stale.startswith(f"{IMAGE_REPOSITORY}:{release.suite}-"):
                podman(conf, "rmi", stale, check=False)
    return tag


@dataclass
class Machine:
    conf: Path
    name: str
    release: Release
    device: str  # the one block device it has (the host's loop device, as udev would make it)

    def apt_lock(self) -> contextlib.AbstractContextManager[None]:
        """Held by a machine while its apt runs: the machines of a release share apt's download cache, whose lock
        apt does not wait for."""
        return locked(CACHE / f"apt-archives-{self.release.suite}.lock")

    def run(
        self, command: str, *, user: str = USER, workdir: str = "/src", timeout: float = 600, answers: bool = False
    ) -> str:
        """A command line in the machine, by bash with pipefail, as `user`: its output; it must exit 0."""
        result = self.attempt(command, user=user, workdir=workdir, timeout=timeout, answers=answers)
        assert result.returncode == 0, (
            f"on {self.name}, as {user} in {workdir}: {command}\nexit {result.returncode}\n"
            f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}\n{self.journal()}"
        )
        return result.stdout

    def attempt(
        self, command: str, *, user: str = USER, workdir: str = "/src", timeout: float = 600, answers: bool = False
    ) -> subprocess.CompletedProcess:
        """`answers`: a user's "y" to each of apt's questions on stdin (podman's --interactive, only then: with it,
        podman 4.3 at times loses the output of a command that does not read its stdin)."""
        return podman(
            self.conf,
            "exec",
            *(["--interactive"] if answers else []),
            f"--user={user}",
            f"--workdir={workdir}",
            "--env=SUDO_EDITOR=/usr/local/bin/write-test-config",
            "--env=DEBIAN_FRONTEND=noninteractive",
            self.name,
            "bash",
            "-o",
            "pipefail",
            "-c",
            command,
            check=False,
            timeout=timeout,
            input="y\n" * 10 if answers else None,
        )

    def journal(self) -> str:
        result = self.attempt("journalctl -u volprobe --no-pager | tail -40", user="root", workdir="/")
        return f"journal of volprobe.service:\n{result.stdout}{result.stderr}"

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        self.run(f"install -D -m {mode:o} /dev/stdin {shlex.quote(path)} <<'EOF'\n{text}EOF", user="root", workdir="/")

    def metrics(self) -> str:
        return self.run(f"curl -sf localhost:{PORT}/metrics", user="root", workdir="/")

    def unit(self, *properties: str) -> dict[str, str]:
        shown = self.run(f"systemctl show volprobe -p {','.join(properties)}", user="root", workdir="/")
        return dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)


def tree_tarball(files: dict[str, bytes], owner: int = 1000) -> bytes:
    """A tarball of these files (relative paths), owned by `owner` (the machine's admin, its first user)."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as archive:
        for name, content in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o755 if content.startswith(b"#!") else 0o644
            info.uid = info.gid = owner
            archive.addfile(info, io.BytesIO(content))
    return data.getvalue()


def checkout_files() -> dict[str, bytes]:
    """The checkout as a user has it: the files git tracks and untracked ones it does not ignore, with dist/'s
    packages (built by .ci/package before the suite, or here when missing)."""
    listed = subprocess.run(
        ["git", "-c", f"safe.directory={REPO}", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    files = {name: (REPO / name).read_bytes() for name in listed.split("\0") if name and (REPO / name).is_file()}
    for release in RELEASES:
        deb = the_deb(release)
        files[f"dist/{deb.name}"] = deb.read_bytes()
    return files


def previous_release_files() -> dict[str, bytes]:
    """0.1.0's tree, from git (`git archive`); skips when the checkout does not have that commit (a shallow clone)."""
    git = ["git", "-c", f"safe.directory={REPO}", "-C", str(REPO)]
    if subprocess.run([*git, "cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}"]).returncode != 0:
        pytest.skip(f"{PREVIOUS_RELEASE} (0.1.0) is not in this checkout's history (a shallow clone?)")
    archive = subprocess.run([*git, "archive", "--format=tar", PREVIOUS_RELEASE], capture_output=True, check=True)
    files = {}
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                extracted = tar.extractfile(member)
                assert extracted is not None
                files[member.name] = extracted.read()
    return files


@contextlib.contextmanager
def fresh_machine(tmp_path: Path, release: Release, make_loop) -> Iterator[Machine]:
    """A fresh machine of `release` booted (systemd running), with the user, the test's editor and a 16 MiB loop
    device of its own (`machine.device`); removed at the end."""
    with as_udev_would(make_loop(16 * 1024 * 1024)) as device:
        yield from _booted(tmp_path, release, device)


def _booted(tmp_path: Path, release: Release, device: str) -> Iterator[Machine]:
    conf = containers_conf(tmp_path)
    image = machine_image(conf, release)
    archives = CACHE / f"apt-archives-{release.suite}"
    (archives / "partial").mkdir(parents=True, exist_ok=True)
    name = f"volprobe-machine-{uuid.uuid4().hex[:12]}"
    try:
        podman(
            conf,
            "run",
            "--detach",
            f"--name={name}",
            f"--hostname={name[:63]}",
            "--systemd=always",
            "--cap-add=SYS_ADMIN",  # the unit's sandboxing (ProtectSystem=, PrivateTmp=...) makes mount namespaces
            "--security-opt=seccomp=unconfined",
            "--security-opt=unmask=/sys/dev/block",  # podman hides it; volprobe finds a disk's queue there
            f"--device={device}",
            f"--volume={CA_BUNDLE}:{CA_BUNDLE}:ro",  # the host's trust: PyPI is reached as the host reaches it
            f"--volume={archives}:/var/cache/apt/archives",
            image,
        )
        machine = Machine(conf, name, release, device)
        deadline = time.monotonic() + 120
        while True:  # until systemd, booting, has its bus (then --wait waits for the boot's end)
            state = machine.attempt("systemctl is-system-running --wait", user="root", workdir="/", timeout=120)
            if state.stdout.strip() in ("running", "degraded") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert state.stdout.strip() in ("running", "degraded"), f"systemd: {state.stdout}{state.stderr}"
        machine.write(
            "/usr/local/bin/write-test-config",
            "#!/bin/sh\n# sudoedit's editor: the test's configuration\ncat /tmp/wanted.yml > \"$1\"\n",
            0o755,
        )
        yield machine
    finally:
        podman(conf, "rm", "--force", "--time=5", name, check=False, timeout=120)


def copy_tree(machine: Machine, tmp_path: Path, files: dict[str, bytes], where: str) -> None:
    tarball = tmp_path / f"{where.strip('/').replace('/', '-')}.tar"
    tarball.write_bytes(tree_tarball(files))
    podman(machine.conf, "cp", str(tarball), f"{machine.name}:/tmp/tree.tar")
    machine.run(
        f"mkdir -p {where} && tar -C {where} -xf /tmp/tree.tar && chown -R {USER}: {where}", user="root", workdir="/"
    )


def readme_block(text: str, containing: str) -> list[str]:
    """The command lines of the README's one ```sh block with a line containing `containing` (continuations
    joined; blank lines and whole-line comments left out)."""
    blocks = re.findall(r"(?ms)^```sh\n(.*?)^```$", text)
    found = [block for block in blocks if any(containing in line for line in block.splitlines())]
    assert len(found) == 1, f"{len(found)} ```sh blocks with {containing!r}"
    lines = found[0].replace("\\\n", " ").splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def run_as_written(machine: Machine, lines: list[str], workdir: str = "/src") -> None:
    for line in lines:
        if line.split("#")[0].split() == ["sudo", ".ci/package"]:
            continue  # run by .ci/run before the suite; its dist/ is in /src (the module's docstring)
        if line.startswith("curl ") and "| grep" in line:
            deadline = time.monotonic() + 60
            while machine.attempt(line, workdir=workdir).returncode != 0 and time.monotonic() < deadline:
                time.sleep(1)
        apt = re.search(r"\bapt(-get)?\b", line) is not None
        with machine.apt_lock() if apt else contextlib.nullcontext():
            machine.run(line, workdir=workdir, answers=apt)


def config_probing(device: str) -> str:
    return f"# the test's, through sudoedit\ntargets:\n  - name: vol\n    device: {device}\n"


def assert_serving(machine: Machine, version: str, binary: str) -> None:
    """volprobe.service runs `binary` (where its ExecStart found it), of `version`, probing the test's device."""
    unit = machine.unit("ActiveState", "MainPID", "NRestarts")
    assert unit["ActiveState"] == "active" and unit["NRestarts"] == "0", f"{unit}\n{machine.journal()}"
    # Read as the process's own user: root here has no CAP_SYS_PTRACE, and Debian 13's /proc hides it from root.
    uid = machine.run(f"stat -c %u /proc/{unit['MainPID']}", user="root", workdir="/").strip()
    cmdline = machine.run(f"tr '\\0' ' ' </proc/{unit['MainPID']}/cmdline", user=uid, workdir="/").split()
    assert cmdline[1:2] == [binary], f"{cmdline}\n{machine.journal()}"  # the venv's python, then the script
    samples = parse_metrics(machine.metrics())
    (labels, _), *_ = samples["volprobe_build_info"]
    assert labels["version"] == version, labels
    first = probes_done(samples, "vol")
    deadline = time.monotonic() + 30
    while probes_done(parse_metrics(machine.metrics()), "vol") <= first:
        assert time.monotonic() < deadline, f"the device's probes do not advance\n{machine.journal()}"
        time.sleep(0.5)


@pytest.mark.parametrize("release", RELEASES, ids=lambda release: f"debian{release.number}")
def test_the_package_installs_and_serves_as_the_readme_says(tmp_path, make_loop, release):
    readme = (REPO / "README.md").read_text()
    lines = readme_block(readme, "sudo .ci/package")
    with fresh_machine(tmp_path, release, make_loop) as machine:
        device = machine.device
        copy_tree(machine, tmp_path, checkout_files(), "/src")
        machine.write("/tmp/wanted.yml", config_probing(device))
        run_as_written(machine, lines)
        assert machine.unit("FragmentPath")["FragmentPath"] == f"/{release.units}/volprobe.service"
        assert machine.run("dpkg-query -W -f='${Version}' volprobe") == release.version
        # The reload took the edited configuration: its one target is probed (the packaged one has none).
        assert_serving(machine, __version__, "/usr/bin/volprobe")
        user = machine.run("stat -c %U /proc/$(systemctl show -p MainPID --value volprobe)").strip()
        assert user == "volprobe", user


def test_pipx_installs_and_serves_as_the_readme_says(tmp_path, make_loop):
    readme = (REPO / "README.md").read_text()
    lines = readme_block(readme, "pipx install .")
    with fresh_machine(tmp_path, BY_RELEASE[12], make_loop) as machine:
        device = machine.device
        copy_tree(machine, tmp_path, checkout_files(), "/src")
        machine.write("/tmp/wanted.yml", config_probing(device))
        run_as_written(machine, lines)
        assert machine.unit("FragmentPath")["FragmentPath"] == "/etc/systemd/system/volprobe.service"
        assert_serving(machine, __version__, "/usr/local/bin/volprobe")
        timer = parse_metrics(machine.metrics())["volprobe_build_info"][0][0]["timer"]
        assert timer == "c", "gcc and python3-dev were installed: the C timer should have been built"


def test_the_first_command_of_the_readme_serves(tmp_path, make_loop):
    """`python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/volprobe`, as root in the checkout, after
    the `apt install python3-venv` its comment asks for on Debian."""
    readme = (REPO / "README.md").read_text()
    (command,) = [line for line in readme_block(readme, ".venv/bin/volprobe") if ".venv/bin/volprobe" in line]
    prerequisite = re.search(r"`(apt install [^`]+)`", readme.split(command)[0].rsplit("```sh", 1)[1])
    assert prerequisite, "the comment above the first command names no apt install"
    with fresh_machine(tmp_path, BY_RELEASE[12], make_loop) as machine:
        copy_tree(machine, tmp_path, checkout_files(), "/src")
        with machine.apt_lock():
            machine.run(f"sudo apt-get update -q && sudo {prerequisite.group(1)} -y")
        machine.run(f"nohup sh -c {shlex.quote(command)} >/tmp/first.log 2>&1 &", user="root")
        deadline = time.monotonic() + 300
        while machine.attempt(f"curl -sf localhost:{PORT}/-/ready", user="root").returncode != 0:
            log = machine.attempt("tail -20 /tmp/first.log", user="root").stdout
            assert time.monotonic() < deadline, f"the first command serves nothing after 300 s:\n{log}"
            time.sleep(1)
        (labels, _), *_ = parse_metrics(machine.metrics())["volprobe_build_info"]
        assert labels["version"] == __version__, labels


def test_the_upgrade_from_0_1_0_as_the_readme_says(tmp_path, make_loop):
    """0.1.0 installed as its README said (pipx --global, its unit copied to /etc/systemd/system), serving and
    with state; then the README's upgrade block: the package's unit runs, the configuration and state are kept."""
    old_files = previous_release_files()
    old_lines = readme_block(old_files["README.md"].decode(), "sudo pipx install --global .")
    lines = readme_block((REPO / "README.md").read_text(), "sudo systemctl disable --now volprobe")
    with fresh_machine(tmp_path, BY_RELEASE[13], make_loop) as machine:
        device = machine.device
        copy_tree(machine, tmp_path, old_files, "/old")
        copy_tree(machine, tmp_path, checkout_files(), "/src")
        wanted = config_probing(device)
        machine.write("/tmp/wanted.yml", wanted)
        # 0.1.0's README took pipx as given, and a compiler for its C timer.
        with machine.apt_lock():
            machine.run("sudo apt-get update -q && sudo apt-get install -y -q pipx gcc python3-dev")
        run_as_written(machine, old_lines, workdir="/old")
        assert_serving(machine, PREVIOUS_VERSION, "/usr/local/bin/volprobe")
        # What 0.1.0 remembers per volume, saved when it stops (the first line of the upgrade).
        run_as_written(machine, lines[:1])
        saved = machine.run("sudo ls /var/lib/private/volprobe").split()
        assert saved, "0.1.0 saved no state"

        run_as_written(machine, lines[1:])
        assert machine.unit("FragmentPath")["FragmentPath"] == f"/{BY_RELEASE[13].units}/volprobe.service"
        assert_serving(machine, __version__, "/usr/bin/volprobe")
        machine.run("test ! -e /usr/local/bin/volprobe && test ! -e /etc/systemd/system/volprobe.service")
        assert machine.run("cat /etc/volprobe/volprobe.yml") == wanted, "the configuration was not kept"
        machine.run("test -f /etc/volprobe/volprobe.yml.dpkg-dist")
        kept = machine.run("sudo ls /var/lib/private/volprobe").split()
        assert set(saved) <= set(kept), f"state lost: {saved} -> {kept}"
        owners = machine.run(
            "sudo stat -c %U /var/lib/private/volprobe "
            + " ".join(f"/var/lib/private/volprobe/{name}" for name in saved)
        ).split()
        assert set(owners) == {"volprobe"}, owners
