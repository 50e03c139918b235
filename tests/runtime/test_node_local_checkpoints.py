"""checkpoint.use_node_local_storage on two simulated nodes: 4 Gloo ranks,
LOCAL_RANK 0-1 on node 0 and 0-1 on node 1, each node's directory re-rooted
by FASTZERO_NODE_LOCAL_ROOT_<i> (fastzero.runtime.checkpoint_nodes).
Exact resume at stages 0-3, what each node's directory holds, merging the
nodes' directories into one elastic checkpoint, the layout check, and a
crash of one node's writer at points of a save."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastzero.checkpoint import consolidate
from fastzero.runtime import checkpoint_files as files
from fastzero.runtime import checkpoint_io as ckpt
from fastzero.runtime.checkpoint_nodes import RESHARD, Nodes, node_dir
from fastzero.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.dist import run_ranks, start_ranks
from tests.paths import WORKERS
from tests.runtime.test_zero_engine import assert_params, reference

WORKER = WORKERS / "node_local.py"
NODE_LOCAL = {"checkpoint": {"use_node_local_storage": True}}
STAGES = (0, 1, 2, 3)


def nodes_env(tmp_path) -> tuple[dict, list]:
    roots = [tmp_path / "node0", tmp_path / "node1"]
    for root in roots:
        root.mkdir()
    return {f"FASTZERO_NODE_LOCAL_ROOT_{i}": str(r) for i, r in enumerate(roots)}, roots


def launch(tmp_path, name, world, runs, env, local_world=2, timeout=600):
    for i, run in enumerate(runs):
        run.setdefault("out", str(tmp_path / f"{name}{i}"))
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps(runs))
    run_ranks(WORKER, world, [spec], timeout=timeout, env=env, local_world=local_world)
    return [[torch.load(f"{run['out']}.rank{r}.pt") for r in range(world)] for run in runs]


def on_node(path, i: int, roots) -> Path:
    """Node `i`'s directory for the configured `path`."""
    return node_dir(path, i, {f"FASTZERO_NODE_LOCAL_ROOT_{i}": str(roots[i])})


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per stage: 6 steps uninterrupted, and 3 steps then a node-local save (4 ranks, 2 nodes)."""
    tmp = tmp_path_factory.mktemp("node_local")
    env, roots = nodes_env(tmp)
    runs = []
    for stage in STAGES:
        runs += [dict(stage=stage, steps=6), dict(stage=stage, steps=3, save_at=3, save=str(tmp / f"s{stage}"))]
        runs[-1]["top"] = NODE_LOCAL
    results = launch(tmp, "first", 4, runs, env)
    return tmp, env, roots, {s: results[2 * i : 2 * i + 2] for i, s in enumerate(STAGES)}


def test_each_node_holds_its_ranks_files_and_the_same_shared_files(saved):
    tmp, _, roots, _ = saved
    for stage in STAGES:
        configured = tmp / f"s{stage}"
        assert not configured.exists()  # every byte went to the nodes' own directories
        a, b = (tree(on_node(configured, i, roots)) for i in (0, 1))
        version = ckpt.resolve(on_node(configured, 0, roots))
        prefix = f"global_step3/{version.name}/"
        top = ["latest", "zero_to_fp32.py", "global_step3/current"]  # each node's leader writes the script too
        assert sorted(a) == sorted(top + [prefix + f for f in SHARED + RANKS[0]])
        assert sorted(b) == sorted(top + [prefix + f for f in SHARED + RANKS[1]])
        for name in top + [prefix + f for f in SHARED]:
            assert a[name] == b[name], name  # rank 0's bytes on both nodes
        manifest = json.loads(a[prefix + "manifest.json"])
        assert manifest["node_local"] == {"nodes": [[0, 1], [2, 3]]} and manifest["stage"] == stage
        holders = {f for f, index in manifest["files"].items() if index}  # stage 0: each node's writer
        assert holders == ({"rank00000.pt", "rank00002.pt"} if stage == 0 else set(RANKS[0] + RANKS[1]))


SHARED = ["manifest.json", "extra.pt"]
RANKS = [["rank00000.pt", "rank00001.pt"], ["rank00002.pt", "rank00003.pt"]]


def test_a_resume_at_the_same_layout_is_exact_and_a_different_stage_is_refused(saved):
    """Loaded by fresh processes at the same layout: the same losses, bit
    for bit, and the same params as the uninterrupted run, at every stage.
    The same checkpoint at another stage is refused on every rank, and so
    are nodes that name different checkpoints none of which every node
    holds (node 0 the stage-2 run's, node 1 the stage-1 run's) and nodes
    whose manifests differ under the same names; no engine changed."""
    tmp, env, roots, results = saved
    for i, stage in enumerate((2, 1)):
        shutil.copytree(on_node(tmp / f"s{stage}", i, roots), on_node(tmp / "mixed", i, roots))
        shutil.copytree(on_node(tmp / "s2", i, roots), on_node(tmp / "forged", i, roots))
    # node 1's manifest says something else (the manifest itself carries no checksum)
    manifest = ckpt.resolve(on_node(tmp / "forged", 1, roots)) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"global_samples": ', '"global_samples": 1'))
    runs = [dict(stage=s, steps=6, start=3, load=str(tmp / f"s{s}"), top=NODE_LOCAL) for s in STAGES]
    runs.append(dict(mode="refused", stage=1, load=str(tmp / "s2")))
    runs.append(dict(mode="refused", stage=2, load=str(tmp / "mixed")))
    runs.append(dict(mode="refused", stage=2, load=str(tmp / "forged")))
    *resumed, refusals, mixed, forged = launch(tmp, "resume", 4, runs, env)
    for stage, ranks in zip(STAGES, resumed):
        full, first = results[stage]
        for r in range(4):
            assert first[r]["losses"] + ranks[r]["losses"] == full[r]["losses"], (stage, r)
            assert_params(ranks[r]["params"], full[r]["params"], rtol=0, atol=0)
    for res in refusals:
        assert res["unchanged"] and RESHARD in res["error"], res["error"]
        assert "saved node-local by 4 ranks in nodes [[0, 1], [2, 3]] at ZeRO stage 2" in res["error"]
    for res in mixed:
        assert res["unchanged"] and "none of them is complete on every node" in res["error"], res["error"]
    for res in forged:
        assert res["unchanged"] and "the manifest in node 1's directory differs from node 0's" in res["error"]


def merged(saved, stage) -> str:
    tmp, _, roots, _ = saved
    out = tmp / f"merged{stage}"
    if not out.exists():
        for i in (0, 1):
            shutil.copytree(on_node(tmp / f"s{stage}", i, roots), out, dirs_exist_ok=True)
    return str(out)


@pytest.mark.parametrize("stage", STAGES)
def test_merged_node_directories_are_one_ordinary_checkpoint(saved, stage, tmp_path):
    """Every node's directory copied into one: consolidate, the CLI and
    zero_to_fp32 give the saved model; one node's directory alone is
    refused naming the merge."""
    tmp, _, roots, results = saved
    _, first = results[stage]
    want = first[0]["params"]
    directory = merged(saved, stage)
    sd = consolidate(directory)
    assert sd.keys() >= want.keys()
    assert_params(sd, want, rtol=0, atol=0)
    assert_params(get_fp32_state_dict_from_zero_checkpoint(directory), want, rtol=0, atol=0)
    out = tmp_path / "model.pt"
    cli = [sys.executable, "-m", "fastzero.checkpoint", "consolidate", directory, str(out)]
    subprocess.run(cli, check=True, capture_output=True)
    assert_params(torch.load(out), want, rtol=0, atol=0)
    one = on_node(tmp / f"s{stage}", 1, roots)
    with pytest.raises(ckpt.CheckpointError, match=r"rank00000.pt is missing .*one node's part of a node-local"):
        consolidate(one)


def test_merged_directories_load_elastically_and_another_world_size_is_refused(saved):
    """2 ranks: the merged stage-2 checkpoint (saved by 4) resumes at stage
    1 as if uninterrupted; a node-local load of the nodes' directories at
    this world size is refused on both ranks, naming the fix."""
    tmp, env, _, _ = saved
    runs = [
        dict(stage=1, gas=4, steps=6, start=3, load=merged(saved, 2)),
        dict(mode="refused", stage=2, load=str(tmp / "s2")),
    ]
    resumed, refusals = launch(tmp, "elastic", 2, runs, env, local_world=1)
    want = reference(4, steps=6)
    for res in resumed:
        assert_params(res["params"], want)
    for res in refusals:
        assert res["unchanged"] and RESHARD in res["error"], res["error"]
        assert "this job has 2 ranks in nodes [[0], [1]]" in res["error"]


def test_two_nodes_on_one_host_without_distinct_directories_are_refused(tmp_path):
    """LOCAL_RANK not counting per node (here: every rank its own node, all
    on this host, one directory): refused before anything is written."""
    runs = [dict(stage=1, steps=1, save_at=1, save=str(tmp_path / "c"), top=NODE_LOCAL)]
    with pytest.raises(AssertionError) as info:
        launch(tmp_path, "collide", 2, runs, {}, local_world=1)
    said = str(info.value)
    assert "rank 0 exited" in said and "rank 1 exited" in said and said.count("would both write") >= 2
    assert not (tmp_path / "c").exists()


def test_node_dir_and_layout_helpers(tmp_path):
    assert node_dir("rel/ckpt", 0, {}) == type(tmp_path)("rel/ckpt")
    env = {"FASTZERO_NODE_LOCAL_ROOT_1": str(tmp_path)}
    assert node_dir("/x/ckpt", 1, env) == tmp_path / "x" / "ckpt"
    with pytest.raises(ValueError, match="FASTZERO_NODE_LOCAL_ROOT_0=.*no such directory"):
        node_dir("/x", 0, {"FASTZERO_NODE_LOCAL_ROOT_0": str(tmp_path / "missing")})
    nodes = Nodes([[0, 1], [2, 3]], 1, 3)
    assert not nodes.leader and nodes.leaders == [0, 2] and nodes.mine == [2, 3]
    assert Nodes([[0, 1], [2, 3]], 1, 2).leader


# (victim rank, checkpoint_files operation, its nth call in the second save, the second save's tag)
CRASHES = [
    (2, "_write_bytes", 1, "t"),  # node 1's writer, copying extra.pt: before any node's files are complete
    (2, "replace", 1, "t"),  # node 1's writer, before flipping "t": node 0 may have flipped already
    (2, "replace", 2, "t2"),  # node 1's writer, before flipping latest to a new tag
    (0, "replace", 1, "t"),  # node 0's writer (rank 0), before flipping "t"
]


def test_a_writer_crashing_mid_save_leaves_a_checkpoint_every_node_loads(tmp_path):
    """One node's writer dies at a point of a save (the other ranks then
    fail in the save's next collective). A fresh job then loads `latest`
    and tag "t" on every node: the previous checkpoint or the new one,
    whole, the same on every rank; a next save succeeds from there."""
    env, roots = nodes_env(tmp_path)
    env["FASTZERO_DIST_TIMEOUT"] = "120"
    dirs, states = [], []
    for k, (victim, op, nth, tag) in enumerate(CRASHES):
        directory = tmp_path / f"crash{k}"
        run = dict(mode="crash", stage=2, gas=1, dir=str(directory), victim=victim, op=op, nth=nth, tag=tag)
        run["out"] = str(tmp_path / f"crash{k}")
        spec = tmp_path / f"crash{k}.json"
        spec.write_text(json.dumps([run]))
        procs = start_ranks(WORKER, 4, [spec], env=env, local_world=2)
        codes = [p.wait(timeout=600) for p in procs]
        errs = [p.stderr.read() for p in procs]
        assert codes[victim] == 17, errs[victim][-3000:]
        assert all(c != 0 for c in codes), codes
        dirs.append(str(directory))
        states.append([torch.load(f"{run['out']}.rank{r}.pt") for r in range(4)])
    (recovered,) = launch(tmp_path, "recover", 4, [dict(mode="recover", stage=2, gas=1, dirs=dirs)], env)
    for k, (_, op, _, tag) in enumerate(CRASHES):
        old, new = states[k][0]["old"], states[k][0]["new"]
        seen = []
        for r in range(4):
            got = recovered[r][k]
            for which in (None, "t", "again"):
                steps = got[which]["steps"]
                assert steps in (2, 4), (k, which, steps)
                assert_params(got[which]["params"], old if steps == 2 else new, rtol=0, atol=0)
                assert steps == recovered[0][k][which]["steps"], "the ranks loaded different checkpoints"
            seen.append(got[None]["steps"])
            if tag == "t2":  # "t" was not the tag being saved: it is the previous checkpoint, untouched
                assert got["t"]["steps"] == 2
        if op == "_write_bytes":  # before every node's files were durable: no node flipped
            assert set(seen) == {2}, seen
        else:  # after: the other node flipped, and the new checkpoint is complete on both
            assert set(seen) == {4}, seen
            said = recovered[0][k][None]["warnings"]
            assert any("the nodes name different checkpoints" in w for w in said), said
    # what each node's directory holds after the next save: one version per tag, no lock
    for directory in dirs:
        for i in range(len(roots)):
            node = on_node(directory, i, roots)
            assert not (node / files.LOCK).exists()
            assert len([p for p in (node / "t").iterdir() if p.is_dir()]) == 1
