"""A full disk, a read-only filesystem and a directory the user may not write are one line each, naming the path
and what to do, never a traceback; the re-run of a finished stage writes nothing, so it works on a read-only copy.

The filesystems are real: a 32 KiB tmpfs (ENOSPC) and a read-only bind mount (EROFS), each in a private mount
namespace (`unshare -m`, root here; `unshare -rm` maps an unprivileged user to root in its own namespace), and a
directory owned by root that the CLI runs as `nobody` against (EACCES; `setpriv`; as non-root the directory is
chmod 0555 instead, which root would ignore)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO

TINY = ["curate.total=60", "curate.eval_size=4"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "drafter.cli", *args]


def env() -> dict:
    return {**os.environ, "DRAFTER_NO_PROGRESS": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def in_namespace(setup: str, mount_point: Path, command: list[str]) -> subprocess.CompletedProcess:
    """Run `command` in a private mount namespace where `setup` (a shell line using $M) has mounted `mount_point`."""
    flags = "-m" if os.geteuid() == 0 else "-rm"
    probe = subprocess.run(["unshare", flags, "sh", "-c", setup, "sh"], env={**os.environ, "M": str(mount_point)},
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here (unshare {flags}): {probe.stderr.strip()}")
    return subprocess.run(["unshare", flags, "sh", "-c", f'{setup} && exec "$@"', "sh", *command], cwd=REPO,
                          env={**env(), "M": str(mount_point)}, capture_output=True, text=True, timeout=300)


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_the_file_and_the_fix(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    done = in_namespace('mount -t tmpfs -o size=32k tmpfs "$M"', runs,
                        cli("curate", "--config", "configs/tiny.yaml", f"runs_dir={runs}", *TINY))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    line = last_line(done.stderr)
    assert line.startswith(f"drafter curate: error: No space left on device: {runs}/tiny/curate/"), line
    assert line.endswith("free space there, or point runs_dir to a larger disk; then run the same command again "
                         "(finished units are kept)")


@pytest.mark.slow
def test_a_finished_stage_reruns_on_a_read_only_filesystem_and_a_write_there_is_one_line(tmp_path):
    runs = tmp_path / "runs"
    first = subprocess.run(cli("curate", "--config", "configs/tiny.yaml", f"runs_dir={runs}", *TINY), cwd=REPO,
                           env=env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    files = {p: p.stat().st_mtime_ns for p in runs.rglob("*")}
    read_only = 'mount --bind "$M" "$M" && mount -o remount,ro,bind "$M" "$M"'
    again = in_namespace(read_only, runs, cli("curate", "--config", "configs/tiny.yaml", f"runs_dir={runs}", *TINY))
    assert again.returncode == 0 and "already complete" in again.stdout, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*")} == files
    forced = in_namespace(read_only, runs, cli("curate", "--config", "configs/tiny.yaml", f"runs_dir={runs}", *TINY,
                                               "--force"))
    assert forced.returncode == 2 and "Traceback" not in forced.stderr, forced.stderr[-3000:]
    assert last_line(forced.stderr) == (f"drafter curate: error: Read-only file system: {runs}/tiny/curate/lock — "
                                        "that filesystem is mounted read-only: make it writable, or point runs_dir "
                                        "elsewhere")


@pytest.fixture
def shared_dir():
    """A directory other users can reach (pytest's own base directory is 0700), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="drafter-eacces-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_a_directory_the_user_may_not_write_is_one_line(shared_dir):
    runs = shared_dir / "runs"
    runs.mkdir(mode=0o755)
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: no way to drop to a user that permissions apply to")
        blocked = [p for p in (*shared_dir.parents, *REPO.parents, *Path(sys.executable).parents)
                   if not p.stat().st_mode & 0o001]  # a directory other users cannot pass through
        if blocked or not all(os.stat(p).st_mode & 0o005 == 0o005 for p in (REPO, Path(sys.executable).parent)):
            pytest.skip("the repository, the interpreter or the directory is not readable by other users")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    else:
        runs.chmod(0o555)
        prefix = []
    done = subprocess.run(prefix + cli("curate", "--config", "configs/tiny.yaml", f"runs_dir={runs}", *TINY),
                          cwd=REPO, env={**env(), "HOME": str(shared_dir)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert last_line(done.stderr) == (f"drafter curate: error: Permission denied: {runs}/tiny — this user may not "
                                      "write there: fix the permissions, or point runs_dir elsewhere")

