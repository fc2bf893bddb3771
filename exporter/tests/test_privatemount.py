"""volprobe.privatemount on real mounts: a directory opened through a private copy of its mount is the same
filesystem, and files opened through it keep no unmount of the original from succeeding; without CAP_SYS_ADMIN
the directory is opened at its path, and that is said."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from volprobe import privatemount

from .support.harness import REPO, run

pytestmark = pytest.mark.root


@pytest.fixture
def tmpfs(tmp_path: Path):
    point = tmp_path / "volume"
    point.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=4m", "volume", str(point))
    yield point
    if os.path.ismount(point):
        run("umount", "-l", str(point))


def test_a_file_opened_through_the_copy_is_the_volumes_and_does_not_keep_it_mounted(tmpfs: Path) -> None:
    assert privatemount.available() == (True, "")
    directory = privatemount.open_directory(str(tmpfs))
    try:
        st = os.fstat(directory)
        assert (st.st_dev, st.st_ino) == (os.stat(tmpfs).st_dev, os.stat(tmpfs).st_ino)
        assert os.fstatvfs(directory).f_fsid == os.statvfs(tmpfs).f_fsid
        fd = os.open("probe", os.O_CREAT | os.O_RDWR, 0o600, dir_fd=directory)
    finally:
        os.close(directory)
    try:
        assert (tmpfs / "probe").exists()  # the volume's own file
        os.pwrite(fd, b"in flight", 0)
        # The unmount succeeds at once, the file still open: it holds the copy, not this mount.
        result = subprocess.run(["umount", str(tmpfs)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert not os.path.ismount(tmpfs)
        assert os.pwrite(fd, b"and after", 0) == 9  # the filesystem lives on while the file is open
        assert os.readlink(f"/proc/self/fd/{fd}") == "/probe"  # named from the copy's root
    finally:
        os.close(fd)


def test_a_symlink_or_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "link").symlink_to(tmp_path)
    for name in ("file", "link"):
        with pytest.raises(OSError) as raised:
            privatemount.open_directory(str(tmp_path / name))
        assert isinstance(raised.value, NotADirectoryError), raised.value


def test_without_cap_sys_admin_the_directory_opens_at_its_path_and_that_is_said(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    code = (
        "import os, sys; from volprobe import privatemount as p; "
        "print(p.available()); fd = p.open_directory(sys.argv[1]); print(os.fstat(fd).st_ino)"
    )
    # nobody, keeping CAP_DAC_READ_SEARCH alone to reach this interpreter and the repository (under /root).
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    prefix += ["--inh-caps=-all,+dac_read_search", "--ambient-caps=-all,+dac_read_search", "--"]
    result = subprocess.run(
        [*prefix, sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "exporter")},
    )
    assert result.returncode == 0, result.stderr
    available, inode = result.stdout.splitlines()
    assert available == "(False, 'open_tree: Operation not permitted; pod volumes are opened at their path')"
    assert int(inode) == os.stat(tmp_path).st_ino


LOCKED_DOWN = os.ST_NODEV | os.ST_NOSUID | os.ST_NOEXEC


def test_the_copy_is_nodev_nosuid_noexec_and_a_device_node_in_the_volume_does_not_open_through_it(
    tmpfs: Path,
) -> None:
    """The kubelet's mount allows devices (this tmpfs does); a tenant's device node in its volume opens at the
    mount's path, never through the copy volprobe opens it by, whose own options (read from the descriptor, the
    mount it is on) say nodev, nosuid, noexec."""
    os.mknod(tmpfs / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's
    assert os.statvfs(tmpfs).f_flag & LOCKED_DOWN == 0
    os.close(os.open(tmpfs / "null", os.O_RDONLY))  # the kubelet's mount: it opens
    directory = privatemount.open_directory(str(tmpfs))
    try:
        assert os.statvfs(directory).f_flag & LOCKED_DOWN == LOCKED_DOWN
        with pytest.raises(PermissionError):
            os.open("null", os.O_RDONLY | os.O_NONBLOCK, dir_fd=directory)
        fd = os.open("file", os.O_CREAT | os.O_RDWR, 0o600, dir_fd=directory)  # its files do
        try:
            assert os.fstatvfs(fd).f_flag & LOCKED_DOWN == LOCKED_DOWN
        finally:
            os.close(fd)
    finally:
        os.close(directory)
    assert os.statvfs(tmpfs).f_flag & LOCKED_DOWN == 0  # the kubelet's mount is left as it was


@pytest.mark.parametrize("where", ["at the start", "on a volume"])
def test_without_mount_setattr_no_copy_is_used_and_that_is_said(tmpfs: Path, monkeypatch, where: str) -> None:
    """A copy that cannot be made nodev, nosuid and noexec (a kernel before 5.12: ENOSYS) is never used: private
    copies are unavailable from then on, with the reason, and directories open at their path as without
    open_tree."""
    real = privatemount._mount_setattr
    monkeypatch.setattr(privatemount, "_available", None)
    if where == "on a volume":
        assert privatemount.available() == (True, "")

    def missing(tree: int, attr_set: int) -> None:
        if os.fstat(tree).st_dev == os.stat(tmpfs).st_dev or where == "at the start":
            raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
        real(tree, attr_set)

    monkeypatch.setattr(privatemount, "_mount_setattr", missing)
    directory = privatemount.open_directory(str(tmpfs))
    try:
        assert os.readlink(f"/proc/self/fd/{directory}") == str(tmpfs)  # at its path, not "/" of a copy
    finally:
        os.close(directory)
    why = "mount_setattr: Function not implemented; pod volumes are opened at their path"
    assert privatemount.available() == (False, why)
    monkeypatch.setattr(privatemount, "_mount_setattr", real)
    assert privatemount.available() == (False, why)  # for the process: not tried again
