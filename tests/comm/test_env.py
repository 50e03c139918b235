"""Process-group setup from the launcher's environment."""

import textwrap

import pytest

from fastzero.comm import dist_env
from fastzero.comm.env import first_slurm_host
from tests.dist import start_ranks


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
    d = dist_env(env)
    assert (d.rank, d.local_rank, d.world_size, d.master_addr, d.master_port, d.launcher) == (
        3,
        1,
        4,
        "10.0.0.5",
        1234,
        "torchrun",
    )


def test_openmpi_variables():
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "hostA",
    }
    d = dist_env(env)
    assert (d.rank, d.local_rank, d.world_size, d.master_addr, d.launcher) == (2, 0, 4, "hostA", "mpirun")
    single_host = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert dist_env(single_host).master_addr == "127.0.0.1"
    with pytest.raises(RuntimeError, match="mpirun -x MASTER_ADDR"):
        dist_env({k: v for k, v in env.items() if k != "MASTER_ADDR"})


def test_slurm_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-05,9],cpu1"}
    d = dist_env(env)
    assert (d.rank, d.local_rank, d.world_size, d.master_addr, d.launcher) == (5, 1, 8, "gpu03", "slurm")
    assert dist_env({**env, "MASTER_ADDR": "x"}).master_addr == "x"


@pytest.mark.parametrize(
    "nodelist, first", [("node1", "node1"), ("a[1-3]", "a1"), ("b[007,9]", "b007"), ("c12,d[1-2]", "c12")]
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_torchrun_takes_precedence_and_single_process_default():
    assert dist_env({"RANK": "0", "WORLD_SIZE": "1", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"}).launcher == "torchrun"
    d = dist_env({})
    assert (d.rank, d.world_size, d.launcher, d.master_port) == (0, 1, "single", 29500)


@pytest.mark.parametrize(
    "env, match",
    [
        ({"RANK": "0"}, "WORLD_SIZE is not set"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2, local rank 0, world size 2"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ],
)
def test_bad_environments_are_named(env, match):
    with pytest.raises(RuntimeError, match=match):
        dist_env(env)


def test_two_gloo_processes_form_a_group(tmp_path):
    """Two processes with torchrun's variables join one Gloo group and all-reduce."""
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from fastzero.comm import init_distributed
        env = init_distributed(timeout_s=60)
        t = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(t)
        print(env.rank, env.world_size, dist.get_backend(), t.item())
        dist.destroy_process_group()
    """)
    )
    procs = start_ranks(script, 2)
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert sorted(o.split()[0] for o, _ in outs) == ["0", "1"]
    assert all(o.split()[1:] == ["2", "gloo", "3.0"] for o, _ in outs)


def test_a_rank_that_dies_makes_the_other_fail_within_the_timeout(tmp_path):
    """Rank 1 exits right after joining; rank 0's next collective fails with
    an error after about `timeout_s` instead of hanging."""
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time, torch, torch.distributed as dist
        from fastzero.comm import init_distributed
        env = init_distributed(timeout_s=5)
        if env.rank == 1:
            os._exit(0)  # dies without a word
        t0 = time.time()
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as exc:
            print("failed after", round(time.time() - t0, 1), type(exc).__name__, flush=True)
            os._exit(3)
        print("no error")
    """)
    )
    procs = start_ranks(script, 2)
    out, err = procs[0].communicate(timeout=90)
    procs[1].communicate(timeout=30)
    # what counts is the error and its timing; the exit code after a broken
    # group depends on how torch tears down (it may abort)
    assert "failed after" in out and "no error" not in out, out + err[-2000:]
    assert float(out.split()[2]) < 60


@pytest.mark.parametrize("made_by", ["fastzero", "the script"])
def test_the_default_group_is_destroyed_at_exit_whoever_made_it(tmp_path, made_by):
    """Left alive, torch's teardown at interpreter exit may abort the process
    (SIGABRT) while Gloo's threads hold tensors; init_distributed registers
    the teardown once, also for a group the script made itself."""
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(f"""
        import atexit, torch, torch.distributed as dist
        from fastzero.comm import init_distributed
        # registered first, so it runs last (atexit is last-in, first-out)
        atexit.register(lambda: print("alive at exit:", dist.is_initialized(), flush=True))
        if {made_by == "the script"}:
            dist.init_process_group("gloo")
        init_distributed(timeout_s=60)
        init_distributed(timeout_s=60)  # once per process, however often it is called
        dist.all_reduce(torch.ones(3))
    """)
    )
    procs = start_ranks(script, 2)
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == "alive at exit: False", out + err[-2000:]
