"""Bad input is refused up front with an error that names it: the launcher's
arguments and hostfiles, ``FASTZERO_*`` environment variables, config files,
op hyperparameters and shapes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastzero.launcher import LaunchError, main, parse_hostfile
from tests.paths import REPO, WORKERS

SCRIPT = WORKERS / "pid_sleep.py"

# ---------------------------------------------------------------------------
# The launcher


@pytest.mark.parametrize(
    "host",
    ["-oProxyCommand=touch_x", "-v", "a;rm", "a$(id)", "a`id`", "a|b", "a&b", "a'b", 'a"b', "a,b", "a>b", "a\\b"],
)
def test_a_hostfile_host_that_is_not_a_host_name_is_refused(host):
    with pytest.raises(LaunchError, match="is not a host name"):
        parse_hostfile(f"{host} slots=1\n")


def test_host_names_ssh_takes_are_accepted():
    text = "node-1 slots=1\n10.0.0.2 slots=1\nuser@node.example.com slots=1\n[fe80::1%eth0] slots=1\nnode_3 slots=1\n"
    assert [h for h, _ in parse_hostfile(text)][-1] == "node_3"


def test_absurd_slot_counts_are_refused():
    with pytest.raises(LaunchError, match="slots=1025; must be >= 1 and <= 1024"):
        parse_hostfile("a slots=1025\n")
    assert parse_hostfile("a slots=1024\n") == [("a", 1024)]


@pytest.mark.parametrize(
    "args, match",
    [
        (["--nproc_per_node", "0"], "--nproc_per_node 0: must be >= 1"),
        (["--nproc_per_node", "-2"], "--nproc_per_node -2: must be >= 1"),
        (["--nproc_per_node", "5000"], "--nproc_per_node 5000: must be >= 1 and <= 1024"),
        (["--master_port", "0"], "--master_port 0: must be a TCP port"),
        (["--master_port", "70000"], "--master_port 70000: must be a TCP port"),
        (["--master_port", "-1"], "--master_port -1: must be a TCP port"),
        (["--master_addr=-oProxyCommand=x"], "--master_addr '-oProxyCommand=x' is not a host name"),
        (["--max_restarts", "-1"], "--max_restarts -1: must be >= 0"),
        (["--nnodes", "2", "--node_rank", "2"], "0 <= node_rank < nnodes"),
    ],
)
def test_bad_launcher_arguments_are_refused(args, match, capsys):
    assert main([*args, "--dry_run", str(SCRIPT)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastzero: error: ") and match in err and "Traceback" not in err


def test_a_directory_or_missing_script_is_refused(tmp_path, capsys):
    assert main(["--dry_run", str(tmp_path)]) == 2
    assert "is a directory; give the training script's path" in capsys.readouterr().err
    assert main(["--dry_run", str(tmp_path / "train.py")]) == 2
    assert "no such training script" in capsys.readouterr().err


def test_a_bad_hostfile_file_is_refused(tmp_path, capsys):
    assert main(["--hostfile", str(tmp_path), "--dry_run", str(SCRIPT)]) == 2
    assert f"hostfile {tmp_path} is a directory" in capsys.readouterr().err
    hosts = tmp_path / "hosts"
    hosts.write_bytes(b"node\xff slots=1\n")
    assert main(["--hostfile", str(hosts), "--dry_run", str(SCRIPT)]) == 2
    assert f"hostfile {hosts} is not UTF-8" in capsys.readouterr().err
    hosts.write_text("--help slots=1\n")
    assert main(["--hostfile", str(hosts), "--dry_run", str(SCRIPT)]) == 2
    assert f"{hosts}:1: host '--help' is not a host name" in capsys.readouterr().err


def test_the_command_line_error_has_no_traceback(tmp_path):
    """Run as the command: one line on stderr, exit code 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "fastzero.launcher", "--nproc_per_node", "0", str(SCRIPT)],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["fastzero: error: --nproc_per_node 0: must be >= 1 and <= 1024"]
