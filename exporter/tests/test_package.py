"""The Debian packages (issue 42): dist/volprobe_VERSION-1+debN_ARCH.deb, as `.ci/package` builds one for each of
Debian 12 and 13, each installed with apt into a fresh root of its release, run, upgraded over itself with an
edited conffile, and purged. And what the package may grant and how it is built (issue 52): a login account
named volprobe that was there first is never put in group disk (install, upgrade, purge), with a warning; every
path of each .deb has the mode and owner of its table; and .ci/package-deb, the step that puts a .deb together,
makes the same package under umask 077, 000 and 002.

The root is a minbase Debian 12 or 13 made with mmdebstrap from the machine's mirrors (cached as a tarball
keyed by its recipe and mirrors, as test_image's base is; each run unpacks a fresh copy). apt inside it reaches
the same mirrors; the .debs it downloads are kept in a cache of their own between runs. There is no systemd in
the root: the exporter is started directly, with the package's configuration, and scraped from here; that the
unit is enabled is what deb-systemd-helper leaves without systemd, its symlink.

`.ci/run` builds dist/ with `.ci/package` before the suite; run alone, this test builds the package when dist/
has none for the version in exporter/volprobe/__init__.py. Each install test about 35 s on an idle machine
(apt's installs, mostly; 65 to 100 s on a busy one of two cores), the modes a few seconds; the first time about
a minute more (mmdebstrap, apt's downloads), and the package's build (.ci/package, 75 s) when dist/ has none.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tarfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from volprobe import __version__

from .support.debian import RELEASES, Release, debian_mirrors, the_deb
from .support.harness import REPO, free_port, locked, parse_metrics
from .support.podman import needs

pytestmark = [pytest.mark.root, pytest.mark.slow, needs("mmdebstrap", "dpkg-deb", "chroot", "findmnt")]

CACHE = Path(os.environ.get("VOLPROBE_PACKAGE_TEST_CACHE", "/var/cache/volprobe-ci/package-test-root"))
# A clean Debian: what `apt install ./volprobe_....deb` meets on a fresh machine (minbase: Essential and apt).
ROOT_RECIPE = [
    "--variant=minbase",
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
    '--aptopt=APT::Install-Recommends "false"',
]
CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
APT_ENV = {**CHROOT_ENV, "DEBIAN_FRONTEND": "noninteractive"}
# Where systemd looks for an ExecStart command given by name (systemd.service(5), "Command lines").
SYSTEMD_SEARCH_PATH = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin")
# What the package installs (besides /opt/volprobe's venv), and so what a purge must take away.
PACKAGE_PATHS = (
    "usr/bin/volprobe",
    "etc/volprobe/volprobe.yml",
    "etc/default/volprobe",
    "usr/share/doc/volprobe/copyright",
)


def assert_enables_the_unit(root: Path, release: Release) -> None:
    """deb-systemd-helper's symlink names the package's unit: on Debian 13's merged /usr it may name it through
    /lib, the same file."""
    target = os.readlink(root / ENABLED)
    unit = root / release.units / "volprobe.service"
    assert os.path.realpath(root / target.lstrip("/")) == os.path.realpath(unit), f"{ENABLED} -> {target}"


def units_of(release: Release) -> tuple[str, ...]:
    """The package's units, where its release puts them."""
    return (f"{release.units}/volprobe.service", f"{release.units}/volprobe-warmup@.service")


ENABLED = "etc/systemd/system/multi-user.target.wants/volprobe.service"
# Left out of the before/after comparison of the root: apt's and dpkg's own records, logs, and the mounts.
NOT_COMPARED = ("proc", "sys", "dev", "run", "tmp", "var/lib/apt", "var/lib/dpkg", "var/cache", "var/log")


def checkout_commit() -> str | None:
    """The commit of the checkout the package is built from (`git rev-parse HEAD`), or None if it is not a git
    checkout (a source tarball's tree), where .ci/package can give only "unknown"."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        return None
    found = subprocess.run(
        ["git", "-c", f"safe.directory={REPO}", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return found.stdout.strip() if found.returncode == 0 else None


def test_the_wheel_carries_the_commit_it_was_built_from():
    """python -m build makes the wheel from the sdist, where there is no .git: .ci/package hands setup.py the
    commit ($VOLPROBE_REVISION), which writes it into the wheel's volprobe/_build.py."""
    commit = checkout_commit()
    if commit is None:
        pytest.skip(f"{REPO} is not a git checkout: no commit to carry")
    the_deb(RELEASES[0])  # .ci/package builds the wheel with the .debs
    wheels = sorted((REPO / "dist").glob(f"volprobe-{__version__}-*.whl"))
    assert wheels, "no wheel in dist/ (.ci/package)"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            made: dict[str, object] = {}
            exec(archive.read("volprobe/_build.py").decode(), made)
        assert made["REVISION"] == commit, f"{wheel.name}: revision {made['REVISION']}: stale? (.ci/package)"
        assert made["BRANCH"] != "unknown", f"{wheel.name}: branch unknown"


def base_tarball(release: Release) -> Path:
    """The minbase root as a tarball: from the cache, or made with mmdebstrap and cached, keyed by its recipe."""
    mirrors = debian_mirrors(release.suite)
    assert mirrors, "no bookworm mirror in /etc/apt's sources"
    recipe = [*ROOT_RECIPE, release.suite]
    key = hashlib.sha256(json.dumps([recipe, mirrors]).encode()).hexdigest()[:16]
    tarball = CACHE / f"{release.suite}-{key}.tar"
    with locked(CACHE / "root.lock"):
        if not tarball.exists():
            # mmdebstrap's output format follows the name
            partial = CACHE / f"{release.suite}-{key}.{os.getpid()}.partial.tar"
            made = subprocess.run(
                ["mmdebstrap", "--quiet", *recipe, str(partial), *mirrors],
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-4000:]
            partial.rename(tarball)
            for stale in CACHE.glob("*.tar"):  # this release's earlier recipes' roots, and unnamed ones
                if stale != tarball and (stale.name.startswith(f"{release.suite}-") or "-" not in stale.name):
                    stale.unlink(missing_ok=True)
    return tarball


def mounts_under(root: Path) -> list[str]:
    listed = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout.split()
    return [m for m in listed if m == str(root) or m.startswith(f"{root}/")]


@contextlib.contextmanager
def fresh_root(tmp_path: Path, release: Release) -> Iterator[Path]:
    """A fresh copy of the minbase root with /proc, /sys and /dev of this machine, and apt's download cache, mounted
    in it: every mount undone (umount -R) and the root removed at the end, never while anything is mounted in it."""
    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(["tar", "-C", str(root), "-xf", str(base_tarball(release))], check=True)
    archives = CACHE / f"apt-archives-{release.suite}"  # a version names one file within a release only
    (archives / "partial").mkdir(parents=True, exist_ok=True)
    mounted: list[Path] = []
    try:
        for args, point in (
            (["-t", "proc", "proc"], "proc"),
            (["--rbind", "/sys"], "sys"),
            (["--rbind", "/dev"], "dev"),
            (["--bind", str(archives)], "var/cache/apt/archives"),
        ):
            subprocess.run(["mount", *args, str(root / point)], check=True)
            mounted.append(root / point)
            if "--rbind" in args:  # so that unmounting it here unmounts nothing of the machine's
                subprocess.run(["mount", "--make-rslave", str(root / point)], check=True)
        shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
        yield root
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "-R", str(point)], capture_output=True)
        left = mounts_under(root)
        assert not left, f"still mounted, so {root} is kept: {left}"
        shutil.rmtree(root)


def in_root(root: Path, *cmd: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """Run a command in the root; its output (stdout and stderr), asserting it exits 0."""
    result = subprocess.run(
        ["chroot", str(root), *cmd],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or CHROOT_ENV,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{' '.join(cmd)}: exit {result.returncode}\n{result.stdout[-6000:]}"
    return result.stdout


def apt_get(root: Path, *args: str) -> str:
    """apt-get in the root, one at a time on this machine: the roots of a release share one download cache
    (fresh_root), whose lock a second apt-get finds taken (exit 100) while the first holds it."""
    with locked(CACHE / "apt-get.lock"):
        return in_root(root, "apt-get", "-y", "-q", *args, env=APT_ENV, timeout=600)


def depends_of(deb: Path) -> list[str]:
    """The package names of the .deb's Depends (first of each alternative, version constraints dropped)."""
    field = subprocess.run(["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True, check=True)
    return sorted({part.split("|")[0].split("(")[0].strip() for part in field.stdout.split(",")})


def tree(root: Path) -> set[str]:
    """Every path in the root, relative to it, but under NOT_COMPARED."""
    paths: set[str] = set()
    for directory, dirs, files in os.walk(root):
        relative = os.path.relpath(directory, root)
        if relative != ".":
            paths.add(relative)
        dirs[:] = [d for d in dirs if os.path.normpath(os.path.join(relative, d)) not in NOT_COMPARED]
        paths.update(os.path.normpath(os.path.join(relative, f)) for f in files)
    return paths


def package_state(root: Path) -> str:
    result = subprocess.run(
        ["chroot", str(root), "dpkg-query", "-W", "-f=${Version} ${db:Status-Abbrev}", "volprobe"],
        capture_output=True,
        text=True,
        env=CHROOT_ENV,
    )
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def rebuilt(deb: Path, release: Release, directory: Path, version: str, conffile_addition: str) -> Path:
    """The .deb again as version `version`, its /etc/volprobe/volprobe.yml changed: an upgrade that meets a
    locally edited conffile whose packaged version changed too (where dpkg asks, or --force-confold keeps)."""
    tree_dir = directory / "tree"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree_dir)], check=True)
    control = tree_dir / "DEBIAN/control"
    control.write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", control.read_text()))
    conffile = tree_dir / "etc/volprobe/volprobe.yml"
    conffile.write_text(conffile.read_text() + conffile_addition)
    md5sums = tree_dir / "DEBIAN/md5sums"
    digest = hashlib.md5(conffile.read_bytes()).hexdigest()
    md5sums.write_text(
        re.sub(r"(?m)^\S+(  etc/volprobe/volprobe\.yml)$", lambda m: digest + m.group(1), md5sums.read_text())
    )
    out = directory / deb.name.replace(f"_{release.version}_", f"_{version}_")
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(tree_dir), str(out)], check=True, stdout=subprocess.DEVNULL
    )
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def serves_in_root(root: Path, release: Release, log: Path) -> None:
    """The installed exporter, started in the root as the unit would (its config; a port of the test's), answers a
    scrape from outside the root with its build_info, then stops cleanly on SIGTERM."""
    port = free_port()
    command = ["/usr/bin/volprobe", "--config", "/etc/volprobe/volprobe.yml", f"--web.listen-address=127.0.0.1:{port}"]
    with open(log, "w") as out:
        process = subprocess.Popen(
            ["chroot", str(root), *command], stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=CHROOT_ENV
        )
    try:
        deadline = time.monotonic() + 60
        text = None
        while text is None and time.monotonic() < deadline and process.poll() is None:
            try:
                text = scrape(port)
            except OSError:
                time.sleep(0.2)
        assert text is not None, f"no scrape answered on :{port} (exit {process.poll()})\n{log.read_text()[-4000:]}"
        (labels, value), *_ = parse_metrics(text)["volprobe_build_info"]
        assert labels["version"] == __version__ and value == 1, labels
        assert labels["timer"] == "c", f"the package's C timer is not in use: {labels}"
        assert labels["python_version"].startswith(f"{release.python}."), labels
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0, f"exit {process.returncode} on SIGTERM\n{log.read_text()[-4000:]}"


@pytest.mark.parametrize("release", RELEASES, ids=lambda release: f"debian{release.number}")
def test_the_deb_installs_with_apt_runs_upgrades_keeping_the_edited_config_and_purges(tmp_path, release):
    deb = the_deb(release)
    upgrade_version = f"{release.version}+test1"
    packaged_config = (REPO / "deploy/packaging/debian/volprobe.yml").read_text()
    with fresh_root(tmp_path, release) as root:
        shutil.copy(deb, root / "tmp" / deb.name)
        apt_get(root, "update")
        # Its dependencies first, so that what volprobe adds, and what its purge leaves, can be told apart.
        apt_get(root, "install", "--no-install-recommends", *depends_of(deb))
        before = tree(root)

        # -- Install, with apt, as the README says ---------------------------------------------------------
        apt_get(root, "install", f"/tmp/{deb.name}")
        assert package_state(root) == f"{release.version} ii"
        for path in (*PACKAGE_PATHS, *units_of(release)):
            assert os.path.lexists(root / path), f"/{path} is missing"
        assert os.readlink(root / "usr/bin/volprobe") == "/opt/volprobe/bin/volprobe"
        # The venv's interpreter is Debian's python3, which the package depends on.
        assert os.readlink(root / "opt/volprobe/bin/python3") == "/usr/bin/python3"
        assert "home = /usr/bin" in (root / "opt/volprobe/pyvenv.cfg").read_text()
        # The units are systemd/'s own, and their ExecStart finds the package's binary as systemd would.
        for unit in ("volprobe.service", "volprobe-warmup@.service"):
            text = (root / release.units / unit).read_text()
            assert text == (REPO / "systemd" / unit).read_text(), (
                f"{unit} differs from systemd/{unit}: {deb} is stale? (.ci/package)"
            )
            (exec_start,) = [line for line in text.splitlines() if line.startswith("ExecStart=")]
            command = exec_start.removeprefix("ExecStart=").split()[0]
            candidates = [command] if command.startswith("/") else [f"/{d}/{command}" for d in SYSTEMD_SEARCH_PATH]
            found = [c for c in candidates if subprocess.run(["chroot", str(root), "test", "-x", c]).returncode == 0]
            assert found == ["/usr/bin/volprobe"], f"{unit}: {command} resolves to {found} in the root"
        assert (root / "etc/volprobe/volprobe.yml").read_text() == packaged_config
        assert re.search(r'(?m)^ARGS=""$', (root / "etc/default/volprobe").read_text())
        conffiles = in_root(root, "dpkg-query", "-W", "-f=${Conffiles}", "volprobe")
        assert {line.split()[0] for line in conffiles.splitlines() if line.strip()} == {
            "/etc/volprobe/volprobe.yml",
            "/etc/default/volprobe",
        }
        # Enabled the Debian way: deb-systemd-helper made the symlink, with no systemd running.
        assert_enables_the_unit(root, release)
        # The system user, in group disk.
        passwd = in_root(root, "getent", "passwd", "volprobe").strip().split(":")
        assert int(passwd[2]) < 1000 and passwd[5] == "/var/lib/volprobe" and passwd[6].endswith("nologin"), passwd
        assert "disk" in in_root(root, "id", "-nG", "volprobe").split()

        version = in_root(root, "volprobe", "--version")
        assert re.search(rf"\bversion {re.escape(__version__)}\b", version.splitlines()[0]), version
        # The commit it was built from, though the venv was pip-installed from the sdist (no .git in it).
        commit = checkout_commit()
        if commit is not None:
            assert f"revision: {commit})" in version.splitlines()[0], f"{version}: {deb} is stale? (.ci/package)"
        assert re.search(r"(?m)^\s*probe timer:\s+c$", version), version
        assert "OK" in in_root(root, "volprobe", "check-config", "/etc/volprobe/volprobe.yml")
        serves_in_root(root, release, tmp_path / "volprobe.log")
        # The state directory as the unit's StateDirectory= with DynamicUser=yes lays it out, with a volume's state
        # in it: a purge takes it away (below).
        (root / "var/lib/private/volprobe").mkdir(parents=True, mode=0o700)
        (root / "var/lib/private/volprobe/vol-0123456789abcdef0.json").write_text("{}\n")
        (root / "var/lib/volprobe").symlink_to("private/volprobe")

        # -- Upgrade over itself, the configuration edited here and changed in the package -----------------
        edited = packaged_config.replace("  exclude: []", "  exclude: ['sr0']") + "# edited on this machine\n"
        assert edited != packaged_config + "# edited on this machine\n", "the default config changed: edit another key"
        (root / "etc/volprobe/volprobe.yml").write_text(edited)
        newer = rebuilt(deb, release, tmp_path, upgrade_version, "# changed in the package\n")
        shutil.copy(newer, root / "tmp" / newer.name)
        apt_get(root, "install", "-o", "Dpkg::Options::=--force-confold", f"/tmp/{newer.name}")
        assert package_state(root) == f"{upgrade_version} ii"
        assert (root / "etc/volprobe/volprobe.yml").read_text() == edited, "the edited configuration was not kept"
        assert (root / "etc/volprobe/volprobe.yml.dpkg-dist").read_text().endswith("# changed in the package\n")
        assert_enables_the_unit(root, release)
        assert __version__ in in_root(root, "volprobe", "--version").splitlines()[0]
        assert "disk" in in_root(root, "id", "-nG", "volprobe").split()

        # -- Purge --------------------------------------------------------------------------------------
        apt_get(root, "purge", "volprobe")
        assert package_state(root) == "unknown", package_state(root)  # dpkg forgot it
        for path in (
            *PACKAGE_PATHS,
            *units_of(release),
            "opt/volprobe",
            "etc/volprobe",
            ENABLED,
            "var/lib/volprobe",
            "var/lib/private/volprobe",
        ):
            assert not os.path.lexists(root / path), f"/{path} is left after purge"
        # Debian's convention: the system user stays (files it owned may outlive the package), but not in group
        # disk, which postinst gave it (issue 52).
        in_root(root, "getent", "passwd", "volprobe")
        assert "disk" not in in_root(root, "id", "-nG", "volprobe").split(), "still in group disk after purge"
        left = sorted(tree(root) - before)
        allowed = {
            # The user's: adduser's backups of the files it changed (the user stays).
            "etc/passwd-",
            "etc/group-",
            "etc/shadow-",
            "etc/gshadow-",
            # systemd's parent of DynamicUser= state directories, made above in systemd's stead.
            "var/lib/private",
            # deb-systemd-helper's directories of its state and of the symlink it made and removed.
            "etc/systemd/system/multi-user.target.wants",
            "var/lib/systemd/deb-systemd-helper-enabled",
            "var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants",
            "var/lib/systemd/deb-systemd-helper-masked",
        }
        assert set(left) <= allowed, f"left after purge: {left}"
        dirs = [path for path in left if (root / path).is_dir()]
        assert all(not any((root / path).iterdir()) for path in dirs), f"not empty after purge: {dirs}"
        changed_etc = {p for p in before if p.startswith("etc/")} - tree(root)
        assert not changed_etc, f"removed by the purge, though not the package's: {sorted(changed_etc)}"


# -- Someone else's account named volprobe (issue 52) -----------------------------------------------------------

WARNING = "volprobe: WARNING: an account volprobe exists that this package did not make"


def groups_of(root: Path, user: str) -> list[str]:
    return in_root(root, "id", "-nG", user).split()


@pytest.mark.parametrize("release", RELEASES, ids=lambda release: f"debian{release.number}")
def test_a_login_account_named_volprobe_is_never_given_group_disk(tmp_path, release):
    """A login account named volprobe that was there first is left as it was: not put in group disk (raw reads of
    every disk) on install or upgrade, its membership not touched on purge, with a warning that says what to do;
    the install succeeds and the unit is enabled. Doing what the warning says (the account removed, then
    dpkg-reconfigure) gives the package its own system user in group disk, which a purge takes out of it."""
    deb = the_deb(release)
    with fresh_root(tmp_path, release) as root:
        shutil.copy(deb, root / "tmp" / deb.name)
        apt_get(root, "update")
        apt_get(root, "install", "--no-install-recommends", *depends_of(deb))
        in_root(root, "useradd", "-m", "-s", "/bin/bash", "volprobe")
        account = in_root(root, "getent", "passwd", "volprobe")
        groups = groups_of(root, "volprobe")
        assert "disk" not in groups, groups

        # -- Install ------------------------------------------------------------------------------------
        out = apt_get(root, "install", f"/tmp/{deb.name}")
        assert package_state(root) == f"{release.version} ii"
        assert groups_of(root, "volprobe") == groups, "the account's groups were changed"
        assert in_root(root, "getent", "passwd", "volprobe") == account, "the account was changed"
        assert WARNING in out, out[-4000:]
        assert "NOT added to group disk" in out and "dpkg-reconfigure volprobe" in out, out[-4000:]
        assert "IS in group disk" not in out, out[-4000:]
        assert_enables_the_unit(root, release)

        # -- Upgrade (the same version again: postinst configure with the installed version) ---------------
        out = apt_get(root, "install", "--reinstall", f"/tmp/{deb.name}")
        assert WARNING in out, out[-4000:]
        assert groups_of(root, "volprobe") == groups, "the account's groups were changed on upgrade"

        # -- Already in group disk (as the package's earlier versions left it): kept, and said --------------
        in_root(root, "usermod", "-aG", "disk", "volprobe")
        out = apt_get(root, "install", "--reinstall", f"/tmp/{deb.name}")
        assert WARNING in out and "IS in group disk" in out and "deluser volprobe disk" in out, out[-4000:]
        apt_get(root, "purge", "volprobe")
        assert package_state(root) == "unknown"
        assert in_root(root, "getent", "passwd", "volprobe") == account, "the account was changed by the purge"
        assert "disk" in groups_of(root, "volprobe"), "a membership the package did not give was taken away"
        assert (root / "home/volprobe").is_dir()

        # -- What the warning says to do ------------------------------------------------------------------
        apt_get(root, "install", f"/tmp/{deb.name}")
        in_root(root, "userdel", "-r", "volprobe")
        out = in_root(root, "dpkg-reconfigure", "volprobe", env=APT_ENV)
        assert WARNING not in out, out
        passwd = in_root(root, "getent", "passwd", "volprobe").strip().split(":")
        assert int(passwd[2]) < 1000 and passwd[5] == "/var/lib/volprobe" and passwd[6].endswith("nologin"), passwd
        assert "disk" in groups_of(root, "volprobe")
        apt_get(root, "purge", "volprobe")
        in_root(root, "getent", "passwd", "volprobe")  # kept, as Debian keeps system users
        assert "disk" not in groups_of(root, "volprobe"), "the package's system user is still in group disk"


# -- Modes and owners of every path in the packages (issue 52) --------------------------------------------------

DIRECTORY, SYMLINK = 0o755, 0o777  # dpkg-deb writes a symlink's mode as 0777
# The control archive: nothing else, and these modes.
CONTROL_TABLE = {
    ".": (tarfile.DIRTYPE, DIRECTORY),
    "control": (tarfile.REGTYPE, 0o644),
    "md5sums": (tarfile.REGTYPE, 0o644),
    "conffiles": (tarfile.REGTYPE, 0o644),
    "postinst": (tarfile.REGTYPE, 0o755),
    "prerm": (tarfile.REGTYPE, 0o755),
    "postrm": (tarfile.REGTYPE, 0o755),
}


def package_table(release: Release) -> dict[str, tuple[bytes, int]]:
    """Every path of the data archive outside the venv, its type and mode: the package's own files."""
    table: dict[str, tuple[bytes, int]] = {".": (tarfile.DIRTYPE, DIRECTORY)}
    for path in ("opt", "opt/volprobe", "usr/share/doc/volprobe", "etc/default", "etc/volprobe", release.units):
        parts = Path(path).parts
        for depth in range(1, len(parts) + 1):
            table[str(Path(*parts[:depth]))] = (tarfile.DIRTYPE, DIRECTORY)
    table["usr/bin"] = (tarfile.DIRTYPE, DIRECTORY)
    files = [
        "etc/default/volprobe",  # conffiles
        "etc/volprobe/volprobe.yml",
        *units_of(release),
        "usr/share/doc/volprobe/copyright",
        *(f"usr/share/doc/volprobe/{p.name}" for p in (REPO / "systemd/volprobe.service.d").glob("*.conf.example")),
    ]
    table.update({path: (tarfile.REGTYPE, 0o644) for path in files})
    table["usr/bin/volprobe"] = (tarfile.SYMTYPE, SYMLINK)
    return table


def venv_mode(path: str, kind: bytes) -> int:
    """A path of the venv (/opt/volprobe): directories 0755, its commands (bin/, but the activate scripts, which a
    shell sources) and C extensions (.so) 0755, every other file 0644."""
    if kind == tarfile.DIRTYPE:
        return DIRECTORY
    if kind == tarfile.SYMTYPE:
        return SYMLINK
    parts = path.split("/")
    command = parts[2] == "bin" and not parts[-1].lower().startswith("activate")
    return 0o755 if command or path.endswith(".so") else 0o644


def members(deb: Path, part: str) -> dict[str, tarfile.TarInfo]:
    """The members of the .deb's control (--ctrl-tarfile) or data (--fsys-tarfile) archive, by path ("." the root)."""
    archive = subprocess.run(["dpkg-deb", part, str(deb)], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {os.path.normpath(member.name): member for member in tar.getmembers()}


def modes_of(deb: Path) -> dict[str, tuple[bytes, int, int, int, str, str, str]]:
    """Every path of the .deb (control members prefixed DEBIAN/): its type, mode, owner and symlink target."""
    table = {}
    for part, prefix in (("--ctrl-tarfile", "DEBIAN/"), ("--fsys-tarfile", "")):
        for path, m in members(deb, part).items():
            table[prefix + path] = (m.type, stat.S_IMODE(m.mode), m.uid, m.gid, m.uname, m.gname, m.linkname)
    return table


def assert_modes_and_owners(deb: Path, release: Release) -> None:
    """Every path of the .deb is root:root with the mode of its table; nothing is outside them."""
    wrong = []
    for part, prefix in (("--ctrl-tarfile", "DEBIAN/"), ("--fsys-tarfile", "")):
        table = CONTROL_TABLE if prefix else package_table(release)
        found = members(deb, part)
        assert set(table) - set(found) == set(), f"{deb.name}: missing {sorted(set(table) - set(found))}"
        for path, member in found.items():
            if path in table:
                kind, mode = table[path]
            elif not prefix and path.startswith("opt/volprobe/"):
                kind, mode = member.type, venv_mode(path, member.type)
                assert kind in (tarfile.DIRTYPE, tarfile.REGTYPE, tarfile.SYMTYPE), f"{path}: type {kind!r}"
            else:
                raise AssertionError(f"{deb.name}: {prefix}{path} is in no table")
            got = (member.type, stat.S_IMODE(member.mode), member.uid, member.gid, member.uname, member.gname)
            if got != (kind, mode, 0, 0, "root", "root"):
                kinds = {tarfile.DIRTYPE: "directory", tarfile.REGTYPE: "file", tarfile.SYMTYPE: "symlink"}
                wrong.append(
                    f"{prefix}{path}: {kinds.get(got[0], got[0])} {got[1]:04o} {got[2]}:{got[3]} {got[4]}:{got[5]},"
                    f" not {kinds[kind]} {mode:04o}"
                )
    assert not wrong, f"{deb.name}: {len(wrong)} paths off their table (expected root:root):\n" + "\n".join(wrong[:40])


@pytest.mark.parametrize("release", RELEASES, ids=lambda release: f"debian{release.number}")
def test_every_path_of_the_deb_has_its_mode_and_owner(release):
    """Each .deb's every path, control files included, is root:root with its mode: directories and executables
    0755, other files (conffiles among them) 0644; and the conffiles are regular files of the package."""
    deb = the_deb(release)
    assert_modes_and_owners(deb, release)
    data = members(deb, "--fsys-tarfile")
    for line in subprocess.run(
        ["dpkg-deb", "-I", str(deb), "conffiles"], capture_output=True, text=True
    ).stdout.split():
        assert stat.S_IMODE(data[line.lstrip("/")].mode) == 0o644 and data[line.lstrip("/")].isreg(), line


def as_built_under(tree: Path, umask: int) -> None:
    """Give every path of `tree` the mode a build under `umask` gives it (directories 0777, files 0666 or 0777 when
    executable, less the umask) and the builder's uid and gid, as if it had just been built so."""
    for directory, dirs, files in os.walk(tree):
        for name in [*dirs, *files]:
            path = os.path.join(directory, name)
            os.lchown(path, 1000, 1000)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                continue
            full = 0o777 if stat.S_ISDIR(mode) or mode & 0o111 else 0o666
            os.chmod(path, full & ~umask)


@pytest.mark.parametrize("umask", [0o077, 0o000, 0o002], ids=lambda umask: f"umask{umask:03o}")
def test_the_deb_has_the_same_modes_whatever_the_builders_umask(tmp_path, umask):
    """.ci/package-deb, .ci/package's step that puts each .deb together, run under another umask on a venv built
    under it (its modes, another owner) makes a package whose every path has the mode and owner of dist/'s."""
    release = RELEASES[-1]
    deb = the_deb(release)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path / "unpacked")], check=True)
    venv = tmp_path / "unpacked/opt/volprobe"
    as_built_under(venv, umask)
    out = tmp_path / deb.name
    built = subprocess.run(
        [
            "sh",
            "-c",
            f'umask {umask:03o} && exec "$@"',
            "sh",
            str(REPO / ".ci/package-deb"),
            str(venv),
            str(release.number),
            release.python,
            f"/{release.units}",
            __version__,
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VOLPROBE_DEB_COMPRESSION": "none"},  # the modes are the same; xz takes half a minute
    )
    assert built.returncode == 0, f".ci/package-deb: exit {built.returncode}\n{built.stdout}\n{built.stderr}"
    assert_modes_and_owners(out, release)
    assert modes_of(out) == modes_of(deb)
