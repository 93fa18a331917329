"""examples/cluster/cluster.py when it cannot run: a port already taken, a
node whose daemon does not start. Each fails with one clear `error:` line
and exit status 1, and leaves no process behind: every process it started is
found by the temporary folder in its command line (TMPDIR is the test's own)
and must be gone when the script returns.

The cluster itself runs in ctest's `cluster_quick` (and `make cluster`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

import pytest

from serve_util import build_dir, die_with_parent

SCRIPT = Path(__file__).resolve().parents[2] / "examples/cluster/cluster.py"

pytestmark = pytest.mark.skipif(
    not (shutil.which("haproxy") and shutil.which("prometheus")),
    reason="haproxy or prometheus missing (scripts/install-deps.sh installs them)")


def processes_mentioning(text: str) -> List[str]:
    """The live processes whose command line contains `text`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and text.encode() in cmdline:
            words = cmdline.split(b"\0")
            found.append(f"{pid}: " + b" ".join(words).decode(errors="replace"))
    return found


@pytest.fixture
def tmp_path():
    """A short temporary folder: the daemons' UNIX socket paths under it
    must stay within 108 bytes (pytest's own are too deep)."""
    path = Path(tempfile.mkdtemp(prefix="mcc-test-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_script(tmp_path: Path, *args: str, build: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, str(SCRIPT), "--quick", "--build", str(build),
                           "--out", str(tmp_path / "results"), *args],
                          env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=die_with_parent)


def test_a_taken_port_is_named_and_nothing_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # HAProxy's front end is P+2: take it.
        out = run_script(tmp_path, "--base-port", str(port - 2), build=build_dir())
    assert out.returncode == 1, out
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: port 127.0.0.1:{port} is taken "
                      "(choose another --base-port)"], out.stderr
    assert processes_mentioning(str(tmp_path)) == []


def test_a_daemon_that_does_not_start_stops_everything_started(tmp_path):
    """Node n3's daemon exits at once; n1's and n2's daemons and workers are
    already running by then, and must be stopped."""
    fake = tmp_path / "build"
    (fake / "bin").mkdir(parents=True)
    real = build_dir() / "bin" / "modelcache"
    wrapper = fake / "bin" / "modelcache"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"/n3/run/"*) echo "n3 refuses to start" >&2; exit 3;; esac\n'
        f'exec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    (fake / "python").symlink_to(build_dir() / "python")
    out = run_script(tmp_path, build=fake)
    assert out.returncode == 1, out
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors[:1] == ["error: n3: the daemon did not start:"], out.stderr
    assert "n3 refuses to start" in out.stderr
    assert processes_mentioning(str(tmp_path)) == []
