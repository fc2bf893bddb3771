"""One version, one changelog (issue 42): volprobe.__version__ is what `volprobe --version`, the newest release
of CHANGELOG.md and the image's label say; `--version` names the commit it was built from, in node_exporter's
form, from a checkout (git at run time) and from a built wheel (setup.py's stamp at build time)."""

from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from volprobe import __version__
from volprobe.mixin import MixinConfig
from volprobe.mixin.rules import renamed
from volprobe.probe import TIMER
from volprobe.version import UNKNOWN, stamp

from .support.harness import REPO, volprobe_command

CHANGELOG = REPO / "CHANGELOG.md"
RELEASE = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?$", re.MULTILINE)
SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
HEAD = re.compile(r"^volprobe, version (?P<version>\S+) \(branch: (?P<branch>\S+), revision: (?P<revision>\S+)\)$")


def version_lines(*command: str, **kwargs: object) -> list[str]:
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=60, check=False, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def releases() -> list[tuple[str, str | None]]:
    return [(m["version"], m["date"]) for m in RELEASE.finditer(CHANGELOG.read_text())]


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", "-c", f"safe.directory={cwd}", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_version_is_node_exporters_form_with_the_checkouts_commit():
    lines = version_lines(*volprobe_command("--version"))
    head = HEAD.match(lines[0])
    assert head, lines
    assert head["version"] == __version__
    if (REPO / ".git").exists() and shutil.which("git"):
        assert head["revision"] == git("rev-parse", "HEAD")
        assert head["branch"] == git("rev-parse", "--abbrev-ref", "HEAD")
    fields = dict(re.fullmatch(r"  ([a-z ]+):\s+(.*)", line).groups() for line in lines[1:])  # type: ignore[union-attr]
    assert list(fields) == ["build user", "build date", "python version", "probe timer", "platform"]
    assert fields["python version"] == f"{platform.python_implementation()} {platform.python_version()}"
    assert fields["probe timer"] == TIMER
    assert fields["platform"] == {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}.get(
        platform.machine(), fields["platform"]
    )


def test_the_version_is_the_newest_changelog_release():
    found = releases()
    assert found[0] == ("Unreleased", None), "Keep a Changelog: [Unreleased] first"
    newest, date = found[1]
    assert newest == __version__, f"CHANGELOG.md's newest release is {newest}, volprobe.__version__ {__version__}"
    assert date is not None
    dates = [datetime.date.fromisoformat(d) for _, d in found[1:] if d]
    assert dates == sorted(dates, reverse=True), "newest first"
    headings = set(re.findall(r"^### (.+)$", CHANGELOG.read_text(), re.MULTILINE))
    assert headings <= SECTIONS, headings - SECTIONS


def test_the_first_release_is_dated_by_the_first_commit():
    if not (REPO / ".git").exists() or not shutil.which("git"):
        pytest.skip("not a git checkout")
    first = git("log", "--reverse", "--format=%ad", "--date=short").splitlines()[0]
    assert releases()[-1] == ("0.1.0", first)


def test_the_changelog_names_the_renamed_recording_rules():
    text = CHANGELOG.read_text()
    changed = text.split(f"## [{__version__}]")[1].split("\n## [")[0].split("### Changed")[1].split("\n### ")[0]
    for old, new in renamed(MixinConfig()).items():
        assert f"`{old}` -> `{new}`" in changed, old


def test_the_images_version_label_is_the_package_version():
    """The label is the build arg VERSION, whose default is held here to the package's; a VERSION given that is
    not the package's fails the build (the RUN that compares it with what pip installed)."""
    text = (REPO / "deploy" / "Dockerfile").read_text()
    final = text[text.rindex("\nFROM ") :]  # the runtime stage: its ARG and LABEL
    (default,) = re.findall(r"^ARG VERSION=(\S+)$", final, re.MULTILINE)
    assert default == __version__
    assert re.search(r'^LABEL .*org\.opencontainers\.image\.version="\$\{VERSION\}"', final, re.MULTILINE)
    assert re.search(r"^RUN test .*volprobe\.__version__.* = \"\$VERSION\"", final, re.MULTILINE)


def _sources(into: Path) -> Path:
    """What the image's build copies (deploy/Dockerfile): the project, without its .git or built files."""
    into.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(REPO / name, into / name)
    shutil.copytree(
        REPO / "exporter" / "volprobe",
        into / "exporter" / "volprobe",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build.py"),
    )
    return into


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_wheel_built_from_a_checkout_names_its_commit_and_without_git_says_unknown(tmp_path):
    source = _sources(tmp_path / "src")
    git("init", "-q", "-b", "release", cwd=source)
    git("add", "-A", cwd=source)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    subprocess.run(["git", "commit", "-q", "-m", "build"], cwd=source, env=env, check=True)
    commit = git("rev-parse", "HEAD", cwd=source)
    wheels = tmp_path / "wheels"
    build_env = {**os.environ, "SOURCE_DATE_EPOCH": "1795046400"}  # 2026-11-19 (Debian's builds set it)
    for name in ("VOLPROBE_REVISION", "VOLPROBE_BRANCH"):
        build_env.pop(name, None)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), "."],
        cwd=source,
        env=build_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("volprobe-*.whl")
    assert wheel.name.startswith(f"volprobe-{__version__}-")
    installed = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    run_env = {**os.environ, "PYTHONPATH": str(installed)}
    lines = version_lines(sys.executable, "-m", "volprobe", "--version", cwd=tmp_path, env=run_env)
    assert lines[0] == f"volprobe, version {__version__} (branch: release, revision: {commit})"
    assert lines[2] == "  build date:       20261119-00:00:00"
    assert lines[1].split(":", 1)[1].strip() != UNKNOWN

    (installed / "volprobe" / "_build.py").unlink()  # a build that wrote none (and no checkout around it)
    lines = version_lines(sys.executable, "-m", "volprobe", "--version", cwd=tmp_path, env=run_env)
    assert lines[0] == f"volprobe, version {__version__} (branch: unknown, revision: unknown)"


def test_a_build_without_git_takes_the_revision_given_or_says_unknown(tmp_path):
    namespace: dict[str, str] = {}
    exec(stamp(tmp_path, {"VOLPROBE_REVISION": "abc123", "VOLPROBE_BRANCH": "main"}), namespace)
    assert (namespace["REVISION"], namespace["BRANCH"]) == ("abc123", "main")
    namespace.clear()
    exec(stamp(tmp_path, {"SOURCE_DATE_EPOCH": "0"}), namespace)
    assert (namespace["REVISION"], namespace["BRANCH"], namespace["DATE"]) == (UNKNOWN, UNKNOWN, "19700101-00:00:00")
