"""The ``fastzero`` launcher under signals and failing scripts: no worker
outlives a stopped or killed launcher, and the script's exit code (or
128+signal) comes back. Workers write their pids to files; every wait polls
for a condition with a deadline (no sleep-and-hope)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist import free_port
from tests.paths import REPO, WORKERS

SCRIPT = WORKERS / "pid_sleep.py"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc: Linux")


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def launch(tmp_path: Path, action: str, *extra: str, nproc: int = 2, env: dict | None = None) -> subprocess.Popen:
    args = extra or ("--nproc_per_node", str(nproc), "--master_port", str(free_port()))
    return subprocess.Popen(
        [sys.executable, "-m", "fastzero.launcher", *args, str(SCRIPT), str(tmp_path), action],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def worker_pids(tmp_path: Path, proc: subprocess.Popen, n: int = 2) -> list[int]:
    """The pids the n workers wrote, once they all have (fails if the launcher ends first)."""
    files = [tmp_path / f"{rank}.pid" for rank in range(n)]

    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"the launcher ended ({proc.returncode}) first:\n{proc.communicate()[0][-3000:]}")
        return all(f.exists() for f in files)

    wait_for(ready, 120, "the workers' pid files")
    return [int(f.read_text()) for f in files]


def kill_all(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_every_worker(tmp_path, sig):
    proc = launch(tmp_path, "sleep")
    pids = worker_pids(tmp_path, proc)
    try:
        proc.send_signal(sig)
        wait_for(lambda: not any(alive(p) for p in pids), 20, f"the workers to stop after {sig.name}")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, out[-3000:]
    finally:
        kill_all(pids)
        if proc.poll() is None:
            proc.kill()


def test_a_sigkilled_launcher_leaves_no_worker(tmp_path):
    proc = launch(tmp_path, "sleep")
    pids = worker_pids(tmp_path, proc)
    try:
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in pids), 20, "the workers to die with the launcher")
    finally:
        kill_all(pids)


def test_the_scripts_exit_code_comes_back(tmp_path):
    proc = launch(tmp_path, "exit:3")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out[-3000:]
    assert "exitcode  : 3" in out


def test_a_worker_killed_by_a_signal_gives_128_plus_the_signal(tmp_path):
    proc = launch(tmp_path, f"signal:{int(signal.SIGKILL)}")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]


def test_a_successful_script_exits_0(tmp_path):
    proc = launch(tmp_path, "exit:0")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]


@pytest.fixture
def fake_ssh(tmp_path):
    """An ``ssh`` on PATH that runs the remote command here (every "host" is
    this machine): the launcher's ssh mode, end to end, without sshd."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text('#!/bin/sh\nfor last; do :; done\nexec /bin/sh -c "$last"\n')
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    out = tmp_path / "out"
    out.mkdir()
    args = ("--hostfile", str(hosts), "--master_addr", "127.0.0.1", "--master_port", str(free_port()))
    return out, args, {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_ssh_mode_forwards_a_signal_to_every_host(fake_ssh):
    out, args, env = fake_ssh
    proc = launch(out, "sleep", *args, env=env)
    pids = worker_pids(out, proc)
    try:
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not any(alive(p) for p in pids), 20, "the workers of both hosts to stop")
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        kill_all(pids)
        if proc.poll() is None:
            proc.kill()


def test_ssh_mode_a_sigkilled_launcher_stops_every_host(fake_ssh):
    """The ssh client dies with the launcher; the remote torchrun sees its
    stdin (the connection) close and shuts its workers down."""
    out, args, env = fake_ssh
    proc = launch(out, "sleep", *args, env=env)
    pids = worker_pids(out, proc)
    try:
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in pids), 40, "the workers of both hosts to stop")
    finally:
        kill_all(pids)


def test_ssh_mode_passes_the_exit_code_on(fake_ssh):
    out, args, env = fake_ssh
    proc = launch(out, "exit:5", *args, env=env)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 5, log[-3000:]
