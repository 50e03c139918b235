"""The ``fastzero`` launcher: hostfiles, the commands it runs, a local run,
and two "hosts" as two network namespaces on this machine."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastzero.launcher import LaunchError, main, parse_hostfile
from tests.dist import free_port

SCRIPT = Path(__file__).parent / "workers" / "launch_train.py"


def test_hostfile_is_parsed_with_deepspeeds_format():
    text = "# cluster\nworker-0 slots=4\n\nworker-1   slots = 2  # smaller\n"
    assert parse_hostfile(text) == [("worker-0", 4), ("worker-1", 2)]


@pytest.mark.parametrize(
    "text, match",
    [
        ("worker-0 4", "expected 'hostname slots=N'"),
        ("a slots=0", "slots=0"),
        ("a slots=1\na slots=2", "listed twice"),
        ("# none", "no hosts"),
    ],
)
def test_bad_hostfiles_are_named(text, match):
    with pytest.raises(LaunchError, match=match):
        parse_hostfile(text)


def test_dry_run_shows_one_torchrun_per_host(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    assert main(["--hostfile", str(hosts), "--master_port", "1234", "--dry_run", str(SCRIPT), "--x", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("ssh -o BatchMode=yes node-a") and " node-b " in lines[1]
    for rank, line in enumerate(lines):
        assert f"--node_rank={rank}" in line and "--nnodes=2" in line and "--master_addr=node-a" in line
        assert "--master_port=1234" in line and line.endswith("--x 1'")
    assert main(["--hostfile", str(hosts), "--launcher", "pdsh", "--dry_run", str(SCRIPT)]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("pdsh -S -f 1024 -w node-a,node-b") and "--node_rank=%n" in line
    hosts.write_text("node-a slots=2\nnode-b slots=1\n")
    assert main(["--hostfile", str(hosts), "--launcher", "pdsh", "--dry_run", str(SCRIPT)]) == 2
    assert "slots differ" in capsys.readouterr().err


def test_missing_script_or_hostfile_is_an_error(tmp_path, capsys):
    assert main(["nowhere.py"]) == 2 and "no such training script" in capsys.readouterr().err
    assert main(["--hostfile", str(tmp_path / "h"), str(SCRIPT)]) == 2 and "does not exist" in capsys.readouterr().err


def launch(args, out, env=None, prefix=()):
    cmd = [*prefix, sys.executable, "-m", "fastzero.launcher", *args, str(SCRIPT), str(out)]
    return subprocess.Popen(
        cmd,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def test_local_launch_matches_one_process(tmp_path):
    finish(launch(["--nproc_per_node", "2", "--master_port", str(free_port())], tmp_path / "two.pt"))
    finish(launch(["--nproc_per_node", "1", "--master_port", str(free_port())], tmp_path / "one.pt"))
    two, one = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: 10.231.x.1 and 10.231.x.2."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = f"fz{os.getpid() % 100000}"
    subnet = f"10.231.{os.getpid() % 250}"
    names = [f"{tag}a", f"{tag}b"]
    made = []
    try:
        for ns in names:
            if _ip("netns", "add", ns).returncode != 0:
                pytest.skip(f"cannot make network namespaces here: {_ip('netns', 'add', ns).stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", f"{tag}0", "type", "veth", "peer", "name", f"{tag}1")]
        for i, ns in enumerate(names):
            dev = f"{tag}{i}"
            steps += [
                ("link", "set", dev, "netns", ns),
                ("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", dev),
                ("-n", ns, "link", "set", dev, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"cannot wire network namespaces here (ip {' '.join(step)}: {res.stderr.strip()})")
        yield [(ns, f"{tag}{i}", f"{subnet}.{i + 1}") for i, ns in enumerate(names)]
    finally:
        for ns in made:
            _ip("netns", "del", ns)


def test_two_hosts_train_like_one_host_with_four_ranks(tmp_path, two_hosts):
    port = str(free_port())
    master = two_hosts[0][2]
    procs = [
        launch(
            [
                "--nnodes",
                "2",
                "--node_rank",
                str(rank),
                "--nproc_per_node",
                "2",
                "--master_addr",
                master,
                "--master_port",
                port,
            ],
            tmp_path / "multi.pt",
            env={"GLOO_SOCKET_IFNAME": dev},
            prefix=("ip", "netns", "exec", ns),
        )
        for rank, (ns, dev, _) in enumerate(two_hosts)
    ]
    outs = [finish(p) for p in procs]
    assert "rank 0 of 4 done" in outs[0] and "rank 3 of 4 done" in outs[1]
    finish(launch(["--nproc_per_node", "4", "--master_port", str(free_port())], tmp_path / "single.pt"))
    multi, single = torch.load(tmp_path / "multi.pt"), torch.load(tmp_path / "single.pt")
    for name in single:
        torch.testing.assert_close(multi[name], single[name], rtol=1e-5, atol=1e-6)
