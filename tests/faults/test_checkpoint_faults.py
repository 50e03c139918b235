"""Checkpoint durability under faults (issue 13): a crash at every step of
replacing a tag, bad tags, a second job saving into the same directory, a
flipped byte, a manifest that breaks its schema, a full disk, buffers that
differ, tied weights, and a load that fails on one rank of two.

Crashes are simulated deterministically: each file operation of a save is
intercepted, the directory is copied as it stands just before the k-th one
(what a crash there leaves on disk) and the save is made to fail there."""

import errno
import json
import shutil
import socket
import subprocess
import time
import warnings

import pytest
import torch

import fastzero
from fastzero.checkpoint import main as checkpoint_cli
from fastzero.runtime import checkpoint_files as files
from fastzero.runtime import checkpoint_io as ckpt
from fastzero.runtime.checkpoint_io import CheckpointError, CheckpointSaveError, consolidate
from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.runtime.test_engine_single import batches, cfg
from tests.workers.checkpoint_agree import flip_byte
from tests.workers.train_zero import make_model

# every file operation a save makes, as checkpoint_files names them (the save and the lock call them there)
FILE_OPS = (
    "mkdir",
    "_create_exclusive",
    "_write",
    "_write_bytes",
    "_write_text",
    "replace",
    "fsync_dir",
    "_rmtree",
    "_unlink",
)


def run_engine(engine, data):
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def trained(stage=1, steps=2, model=None, seed=3, **config):
    config = cfg(zero_optimization={"stage": stage}, **config)
    engine, *_ = fastzero.initialize(model=model or make_model(), config=config)
    run_engine(engine, batches(steps, seed=seed))
    return engine


def same_dict(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def engine_state(engine) -> dict:
    with engine.gathered() as module:
        state = {f"module.{k}": v.detach().clone() for k, v in module.state_dict().items()}
    for i, g in enumerate(engine.optimizer.param_groups):
        for j, p in enumerate(g["params"]):
            state[f"opt.{i}.{j}"] = p.detach().clone()
            for key, t in engine.optimizer.state.get(p, {}).items():
                if isinstance(t, torch.Tensor):
                    state[f"opt.{i}.{j}.{key}"] = t.detach().clone()
    state["steps"] = torch.tensor([engine.global_steps, engine.global_samples, engine.micro_steps])
    return state


def versions(tag_dir):
    return sorted(p.name for p in tag_dir.iterdir() if p.is_dir())


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid names no process
    return proc.pid


def write_lock(root, host, pid, tag="other"):
    (root / files.LOCK).write_text(json.dumps({"host": host, "pid": pid, "started": time.time(), "tag": tag}))


def to_first_layout(tag_dir):
    """Turns a saved tag into fastzero's first layout: the files in the tag's
    directory, a version-1 manifest without checksums or aliases."""
    data = ckpt.resolve(tag_dir.parent, tag_dir.name)
    for f in data.iterdir():
        f.rename(tag_dir / f.name)
    data.rmdir()
    (tag_dir / files.POINTER).unlink()
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    manifest["version"] = 1
    del manifest["checksums"], manifest["aliases"]
    (tag_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))


# -- 1. replacing a tag is crash-safe at every instant ---------------------------------------------------
class Crash(Exception):
    """The simulated crash."""


def intercept(monkeypatch, on_call):
    """Routes each of FILE_OPS through on_call(name, real, args)."""
    for name in FILE_OPS:
        real = getattr(files, name)
        monkeypatch.setattr(files, name, lambda *a, _n=name, _r=real: on_call(_n, _r, a))


def check_complete(root, old: dict, new: dict, probe) -> str:
    """`latest` and the tag "t" both give a whole checkpoint, the old or the
    new one (consolidated, and loaded by an engine); returns which."""
    seen = []
    for tag in (None, "t"):
        sd = consolidate(root, tag)
        assert same_dict(sd, old) or same_dict(sd, new), f"tag {tag}: neither the old nor the new checkpoint"
        seen.append("old" if same_dict(sd, old) else "new")
    path, _ = probe.load_checkpoint(root, tag="t")
    assert path == str(root / "t") and probe.global_steps == (2 if seen[1] == "old" else 4)
    return seen[1]


@pytest.mark.parametrize("layout", ["versioned", "first", "node-local"])
def test_a_crash_at_every_step_of_replacing_a_tag_leaves_a_complete_checkpoint(tmp_path, monkeypatch, layout):
    """Replacing tag "t" (in this layout or the first one, or saved with
    use_node_local_storage, one node): at each of the
    save's file operations in turn, the directory as a crash there leaves it,
    and as the failed save leaves it, has `latest` and "t" loading the old
    checkpoint or the new one, whole; and a next save succeeds from there,
    takes over the crashed save's lock and clears its leftovers."""
    node_local = {"checkpoint": {"use_node_local_storage": True}} if layout == "node-local" else {}
    engine = trained(steps=2, **node_local)
    template = tmp_path / "template"
    engine.save_checkpoint(template, tag="t")
    if layout == "first":
        to_first_layout(template / "t")
    old = consolidate(template)
    run_engine(engine, batches(2, seed=9))
    engine.save_checkpoint(tmp_path / "reference", tag="t")
    new = consolidate(tmp_path / "reference")
    assert not same_dict(old, new)
    probe, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}, **node_local))

    calls = []
    intercept(monkeypatch, lambda name, real, args: (calls.append(name), real(*args))[1])
    shutil.copytree(template, tmp_path / "count")
    engine.save_checkpoint(tmp_path / "count", tag="t")
    monkeypatch.undo()
    assert {"_create_exclusive", "_write", "replace", "fsync_dir", "_unlink"} <= set(calls), calls
    assert ("_rmtree" in calls) == (layout != "first")  # the replaced version; the first layout's are files

    outcomes = set()
    for k in range(len(calls)):
        root, crashed = tmp_path / f"run{k}", tmp_path / f"crash{k}"
        shutil.copytree(template, root)
        count, at = [0], []

        def crash_at_k(name, real, args, k=k, root=root, crashed=crashed, count=count, at=at):
            count[0] += 1
            if count[0] == k + 1:
                shutil.copytree(root, crashed)  # what a crash before this operation leaves
                at.append((name, args))
                raise Crash(f"crash before {name} #{k}")
            return real(*args)

        intercept(monkeypatch, crash_at_k)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a crash in the clean-up after the flip is only a warning
            try:
                engine.save_checkpoint(root, tag="t")
            except Crash:
                pass
        monkeypatch.undo()
        assert crashed.is_dir(), f"operation {k} of {calls} was not reached"
        for state in (crashed, root):
            outcomes.add(check_complete(state, old, new, probe))
        if at != [("_unlink", (root / files.LOCK,))]:  # unless removing it was what failed
            assert not (root / files.LOCK).exists(), "the failed save kept its lock"
        lock = crashed / files.LOCK
        if lock.exists():  # the crashed process is gone: its lock is stale
            owner = json.loads(lock.read_text())
            write_lock(crashed, owner["host"], dead_pid())
            with pytest.warns(UserWarning, match="stale save lock"):
                engine.save_checkpoint(crashed, tag="t")
        else:
            engine.save_checkpoint(crashed, tag="t")
        assert same_dict(consolidate(crashed), new) and same_dict(consolidate(crashed, "t"), new)
        assert sorted(p.name for p in (crashed / "t").iterdir() if p.name != files.POINTER) == versions(crashed / "t")
        assert len(versions(crashed / "t")) == 1 and not lock.exists(), "leftovers of the crash remain"
    assert outcomes == {"old", "new"}


def test_a_checkpoint_of_the_first_layout_loads_and_its_interrupted_save_is_never_deleted(tmp_path):
    """A version-1 checkpoint (files in the tag's directory, no checksums)
    loads with no error. What the first layout's save left when it crashed
    between its renames (``latest`` naming a missing tag, the complete copy
    in ``.t.old``) is named by the error and survives the next save."""
    engine = trained(steps=2)
    engine.save_checkpoint(tmp_path, tag="t")
    to_first_layout(tmp_path / "t")
    want = engine_state(engine)
    fresh, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.load_checkpoint(tmp_path)[0] == str(tmp_path / "t")
    assert same_dict(engine_state(fresh), want)

    (tmp_path / "t").rename(tmp_path / ".t.old")
    shutil.copytree(tmp_path / ".t.old", tmp_path / ".t.tmp")
    with pytest.raises(CheckpointError, match=r"left a complete checkpoint in \.t\.old"):
        fresh.load_checkpoint(tmp_path)
    run_engine(engine, batches(1, seed=5))
    engine.save_checkpoint(tmp_path, tag="t")
    assert (tmp_path / ".t.old" / "manifest.json").is_file() and (tmp_path / ".t.tmp" / "manifest.json").is_file()
    assert fresh.load_checkpoint(tmp_path)[0] == str(tmp_path / "t") and fresh.global_steps == 3


# -- 2. tags -----------------------------------------------------------------------------------------
BAD_TAGS = [
    ("", "must not be empty"),
    (" lead", "whitespace"),
    ("trail ", "whitespace"),
    ("tab\t", "whitespace"),
    ("latest", "'latest'"),
    ("a/b", "'/'"),
    ("a\\b", "'/' or '\\'"),
    (".", "must not start with '.'"),
    ("..", "must not start with '.'"),
    (".hidden", "must not start with '.'"),
    (".t.tmp", "must not start with '.'"),
    ("nul\0byte", "control characters"),
    ("new\nline", "control characters"),
    ("x" * 201, "at most 200 bytes"),
    ("é" * 101, "at most 200 bytes of UTF-8 (it has 202)"),
]


@pytest.mark.parametrize("tag, rule", BAD_TAGS)
def test_a_bad_tag_is_refused_before_anything_is_written(tmp_path, tag, rule):
    engine = trained(steps=1)
    root = tmp_path / "ckpt"
    with pytest.raises(ValueError) as exc:
        engine.save_checkpoint(root, tag=tag)
    assert repr(tag) in str(exc.value) and rule in str(exc.value)
    assert not root.exists()
    with pytest.raises(ValueError, match="checkpoint tag"):
        engine.load_checkpoint(root, tag=tag)
    assert not root.exists()


GOOD_TAGS = ["with space", "ends.tmp", "ends.old", "current", "step3-0123456789ab", "ünïcødé", "x" * 200, "é" * 100]


def test_unusual_tags_round_trip_exactly(tmp_path, capsys):
    """Tags near the rules (inner spaces, the suffixes and names the layout
    uses inside a tag's directory, non-ASCII, 200 bytes) save and load
    exactly, by tag= and through ``latest``, and the CLI finds them."""
    engine = trained(steps=1)
    fresh, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}))
    for tag in GOOD_TAGS:
        assert engine.save_checkpoint(tmp_path, tag=tag) == str(tmp_path / tag)
        assert (tmp_path / "latest").read_text(encoding="utf-8") == tag
        assert fresh.load_checkpoint(tmp_path) == (str(tmp_path / tag), {})
    for tag in GOOD_TAGS:
        assert fresh.load_checkpoint(tmp_path, tag=tag)[0] == str(tmp_path / tag)
        assert ckpt.resolve(tmp_path, tag).parent == tmp_path / tag
        assert checkpoint_cli(["info", str(tmp_path), "--tag", tag]) == 0
        assert json.loads(capsys.readouterr().out)["global_steps"] == 1
    assert sorted(files._tags(tmp_path)) == sorted(GOOD_TAGS)


# -- 3. the save lock --------------------------------------------------------------------------------
def test_a_save_lock_held_by_a_live_job_is_refused(tmp_path):
    engine = trained(steps=1)
    engine.save_checkpoint(tmp_path, tag="a")
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        for host, pid in ((socket.gethostname(), sleeper.pid), ("elsewhere.example", dead_pid())):
            write_lock(tmp_path, host, pid)
            held = (tmp_path / files.LOCK).read_text()
            with pytest.raises(CheckpointError, match=f"another job is saving .* pid {pid} on host {host}"):
                engine.save_checkpoint(tmp_path, tag="b")
            assert (tmp_path / files.LOCK).read_text() == held  # not ours to remove
            assert not (tmp_path / "b").exists() and (tmp_path / "latest").read_text() == "a"
            assert versions(tmp_path / "a") == [ckpt.resolve(tmp_path).name]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_stale_lock_is_taken_over_and_every_save_releases_its_lock(tmp_path, monkeypatch):
    engine = trained(steps=1)
    write_lock(tmp_path, socket.gethostname(), dead_pid())
    with pytest.warns(UserWarning, match="taking over a stale save lock"):
        engine.save_checkpoint(tmp_path, tag="a")
    assert not (tmp_path / files.LOCK).exists()
    seen = []
    real = files._write

    def failing(path, obj):
        seen.append(json.loads((tmp_path / files.LOCK).read_text()))  # held while the files are written
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(files, "_write", failing)
    with pytest.raises(OSError, match="I/O error"):
        engine.save_checkpoint(tmp_path, tag="b")
    assert seen[0]["pid"] == __import__("os").getpid() and seen[0]["tag"] == "b"
    assert not (tmp_path / files.LOCK).exists() and not (tmp_path / "b").exists()
    monkeypatch.setattr(files, "_write", real)
    engine.save_checkpoint(tmp_path, tag="b")


# -- 4. checksums ------------------------------------------------------------------------------------
def test_a_flipped_byte_is_refused_by_load_and_consolidate(tmp_path):
    engine = trained(stage=1, steps=2)
    engine.save_checkpoint(tmp_path)
    fresh, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}))
    before = engine_state(fresh)
    shutil.copytree(tmp_path, tmp_path.parent / "intact")
    fresh.load_checkpoint(tmp_path.parent / "intact")  # untouched: loads
    assert same_dict(engine_state(fresh), engine_state(engine))
    data = ckpt.resolve(tmp_path)
    manifest = ckpt.read_manifest(data)
    for fname in ("rank00000.pt", "extra.pt"):
        shutil.copy(data / fname, tmp_path / "saved")
        flip_byte(data / fname)
        torch.load(data / fname, weights_only=False)  # the flip is invisible to torch.load
        want = manifest["checksums"][fname]["crc32"]
        found = files.crc32(data / fname)[0]
        message = f"{fname}: checksum mismatch, expected CRC32 {want:08x}, found {found:08x}"
        other, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}))
        with pytest.raises(CheckpointError, match=message):
            other.load_checkpoint(tmp_path)
        assert same_dict(engine_state(other), before)
        with pytest.raises(CheckpointError, match=message):
            consolidate(tmp_path)
        shutil.copy(tmp_path / "saved", data / fname)
    consolidate(tmp_path)


# -- 5. the manifest's schema ------------------------------------------------------------------------
def _set(key, value):
    return lambda m: m.__setitem__(key, value)


SCHEMA_BREAKS = [
    (lambda m: m.pop("files"), r"field 'files' must be an object of rank file name .* it is missing"),
    (_set("global_steps", "2"), r"field 'global_steps' must be an int >= 0; found str '2'"),
    (_set("global_steps", True), r"field 'global_steps' must be an int >= 0; found bool"),
    (_set("world_size", 0), r"field 'world_size' must be an int >= 1; found int 0"),
    (_set("stage", 4), r"field 'stage' must be an int in 0..3"),
    (_set("dtype", "float8"), r"field 'dtype' must be one of"),
    (_set("params", [[3, 4]]), r"field 'params' must be an object of param name -> shape"),
    (lambda m: m["params"].__setitem__("0.weight", [65, "33"]), r"field 'params'"),
    (_set("groups", {"step": 1}), r"field 'groups' must be a list of objects"),
    (lambda m: m["groups"][0].pop("hyper"), r"field 'groups'"),
    (lambda m: m["files"]["rank00000.pt"].append(["0.weight", 0, 10**6]), r"field 'files'.*0 <= lo <= hi <= numel"),
    (lambda m: m["files"].__setitem__("../../escape.pt", []), r"field 'files'"),
    (lambda m: m["checksums"].pop("extra.pt"), r"field 'checksums' must be .* for every rank file and extra.pt"),
    (lambda m: m["checksums"]["rank00000.pt"].__setitem__("crc32", "0"), r"field 'checksums'"),
    (_set("aliases", {"head": "nowhere"}), r"field 'aliases'"),
    (_set("version", 3), r"a fastzero checkpoint of version 3; this fastzero reads versions 1, 2"),
    (_set("format", "other"), r"is not a fastzero checkpoint"),
    (lambda m: m.clear(), r"is not a fastzero checkpoint"),
]


@pytest.mark.parametrize("n", range(len(SCHEMA_BREAKS)))
def test_a_manifest_that_breaks_its_schema_is_refused_and_nothing_changes(tmp_path, n):
    brk, message = SCHEMA_BREAKS[n]
    engine = trained(steps=2)
    engine.save_checkpoint(tmp_path)
    where = ckpt.resolve(tmp_path) / "manifest.json"
    manifest = json.loads(where.read_text())
    brk(manifest)
    where.write_text(json.dumps(manifest))
    fresh, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}))
    before = engine_state(fresh)
    with pytest.raises(CheckpointError, match=message):
        fresh.load_checkpoint(tmp_path)
    assert same_dict(engine_state(fresh), before)
    with pytest.raises(CheckpointError, match=message):
        consolidate(tmp_path)


# -- 6. a full disk, and the CLI's errors --------------------------------------------------------------
@pytest.mark.parametrize("fname", ["rank00000.pt", "extra.pt"])
def test_a_full_disk_fails_the_save_cleanly(tmp_path, monkeypatch, fname):
    engine = trained(stage=1, steps=2)
    engine.save_checkpoint(tmp_path, tag="good")
    before = consolidate(tmp_path)
    good = versions(tmp_path / "good")
    run_engine(engine, batches(1, seed=9))
    real = files._write

    def full(path, obj):
        if path.name == fname:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(files, "_write", full)
    numel = sum(p.numel() for p in engine.module.parameters())
    # rank00000.pt: the fp32 master, exp_avg and exp_avg_sq of every element, and the RNG state (bytes)
    nbytes = 3 * 4 * numel + torch.get_rng_state().numel() if fname == "rank00000.pt" else 0
    for tag in ("next", "good"):
        with pytest.raises(CheckpointSaveError, match=r"disk full \(ENOSPC") as exc:
            engine.save_checkpoint(tmp_path, tag=tag)
        msg = str(exc.value)
        assert f"/{tag}/step3-" in msg and fname in msg, msg
        assert f"{nbytes:,} bytes of tensors to write" in msg and "bytes free" in msg, msg
        assert (tmp_path / "latest").read_text() == "good" and not (tmp_path / "next").exists()
        assert versions(tmp_path / "good") == good and not (tmp_path / files.LOCK).exists()
        assert same_dict(consolidate(tmp_path), before)
    monkeypatch.setattr(files, "_write", real)
    engine.save_checkpoint(tmp_path, tag="good")
    assert consolidate(tmp_path)["0.weight"].ne(before["0.weight"]).any()


def test_a_failure_after_the_flip_says_the_tag_is_saved(tmp_path, monkeypatch):
    engine = trained(steps=1)
    engine.save_checkpoint(tmp_path, tag="a")
    real = files.replace

    def failing(src, dst):
        if dst.name == "latest":
            raise OSError(errno.EIO, "I/O error")
        return real(src, dst)

    monkeypatch.setattr(files, "replace", failing)
    with pytest.raises(CheckpointSaveError, match=r"/b is saved and complete, but finishing the save failed"):
        engine.save_checkpoint(tmp_path, tag="b")
    assert (tmp_path / "latest").read_text() == "a" and not (tmp_path / files.LOCK).exists()
    assert consolidate(tmp_path, "b").keys() == consolidate(tmp_path).keys()


def test_the_cli_prints_one_error_line_for_every_checkpoint_and_os_error(tmp_path, capsys):
    engine = trained(steps=1)
    engine.save_checkpoint(tmp_path / "c")
    cases = [
        (["consolidate", str(tmp_path / "c"), str(tmp_path / "missing" / "out.pt")], "No such file or directory"),
        (["consolidate", str(tmp_path / "nothing"), str(tmp_path / "out.pt")], "no 'latest' file"),
        (["info", str(tmp_path / "c"), "--tag", "../x"], "must not contain '/'"),
        (["info", str(tmp_path / "c"), "--tag", "absent"], "is not a fastzero checkpoint"),
    ]
    cases.append((["consolidate", str(tmp_path / "c"), str(tmp_path / "out.pt")], "checksum mismatch"))
    for i, (argv, message) in enumerate(cases):
        if i == len(cases) - 1:
            flip_byte(ckpt.resolve(tmp_path / "c") / "rank00000.pt")
        assert checkpoint_cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.pt").exists()


# -- 7. buffers and frozen params are loaded strictly ----------------------------------------------------
def bn_model(extra=False, no_counter=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.BatchNorm1d(65), torch.nn.Linear(65, 17))
    model[2].bias.requires_grad_(False)  # a frozen param: saved with the buffers
    if extra:
        model.register_buffer("scale", torch.ones(3))
    if no_counter:
        model[1].register_buffer("num_batches_tracked", None)
    return model


@pytest.mark.parametrize(
    "kind, message",
    [
        ("extra", r"missing from the checkpoint \['scale'\], in the checkpoint but not in the module \[\]"),
        ("no_counter", r"missing from the checkpoint \[\], in the checkpoint but not in the module "),
    ],
)
def test_buffers_that_differ_are_refused_unless_load_module_strict_is_false(tmp_path, kind, message):
    engine = trained(steps=2, model=bn_model())
    engine.save_checkpoint(tmp_path)
    saved = engine_state(engine)
    fresh, *_ = fastzero.initialize(model=bn_model(**{kind: True}), config=cfg(zero_optimization={"stage": 1}))
    before = engine_state(fresh)
    with pytest.raises(CheckpointError, match=message):
        fresh.load_checkpoint(tmp_path)
    assert same_dict(engine_state(fresh), before)
    name = "scale" if kind == "extra" else "1.num_batches_tracked"
    with pytest.warns(UserWarning, match=rf"load_module_strict=False.*'{name}'"):
        fresh.load_checkpoint(tmp_path, load_module_strict=False)
    got = engine_state(fresh)
    assert all(torch.equal(got[k], v) for k, v in saved.items() if k in got), "what matches was not loaded"
    assert torch.equal(got["module.1.running_mean"], saved["module.1.running_mean"])
    assert torch.equal(got["module.2.bias"], saved["module.2.bias"])  # the frozen param


# -- 8. tied weights ---------------------------------------------------------------------------------
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize("stage", [2, 3])
def test_tied_weights_survive_consolidate_and_save_16bit_model(tmp_path, stage):
    """GPT-2's lm_head.weight is its wte.weight: consolidate and
    save_16bit_model give state dicts that load strictly, tied."""
    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}
    engine, *_ = fastzero.initialize(model=gpt2(), config=cfg(train_micro_batch_size_per_gpu=2, zero_optimization=zero))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 101, (2, 16), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    manifest = ckpt.read_manifest(ckpt.resolve(tmp_path / "ckpt"))
    assert manifest["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    sd = consolidate(tmp_path / "ckpt")
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    with engine.gathered() as module:
        trained_wte = module.transformer.wte.weight.detach().clone()
    assert torch.equal(sd["transformer.wte.weight"], trained_wte)
    for state in (sd, engine.save_16bit_model(tmp_path / "16") and torch.load(tmp_path / "16" / "pytorch_model.bin")):
        model = gpt2()
        model.load_state_dict(state, strict=True)
        assert model.lm_head.weight is model.transformer.wte.weight
        assert torch.equal(model.lm_head.weight.detach(), trained_wte)
    fresh, *_ = fastzero.initialize(model=gpt2(), config=cfg(train_micro_batch_size_per_gpu=2, zero_optimization=zero))
    fresh.load_checkpoint(tmp_path / "ckpt")  # strict: the alias is neither missing nor unexpected
    with fresh.gathered() as module:
        assert torch.equal(module.lm_head.weight, trained_wte)


# -- 9. a load (or a save) that fails on one rank fails on every rank ----------------------------------------
def test_a_load_that_fails_on_one_rank_changes_no_rank(tmp_path):
    """Two ranks; only rank 1's file has a flipped byte: rank 1 raises the
    checksum error, rank 0 that rank 1 failed, and neither engine changed
    (params, masters, steps, RNG); no rank hangs. Then a save whose write
    fails on rank 1 only: both ranks raise, the partial save is removed."""
    run_ranks(WORKERS / "checkpoint_agree.py", 2, [tmp_path / "ckpt", tmp_path / "out"], timeout=240)
    r0, r1 = (torch.load(tmp_path / f"out.rank{r}.pt") for r in range(2))
    assert "rank00001.pt: checksum mismatch" in r1["error"], r1["error"]
    assert r0["error"].startswith("CheckpointError: rank 1 failed to validate the checkpoint"), r0["error"]
    assert "nothing was changed on any rank" in r0["error"]
    assert r0["unchanged"] and r1["unchanged"]
    assert r1["save_error"].startswith("CheckpointSaveError: disk full (ENOSPC"), r1["save_error"]
    assert r0["save_error"].startswith("CheckpointSaveError: rank 1 failed to write its checkpoint file"), r0
    for res in (r0, r1):
        assert res["left"] == ["global_step2", "latest", "zero_to_fp32.py"] and res["latest"] == "global_step2", res


def test_a_deepspeed_checkpoint_is_named_with_how_to_take_its_weights(tmp_path):
    """A DeepSpeed checkpoint directory (global_stepN/mp_rank_00_model_states.pt
    holding {"module": state_dict} at stages 0-2) is refused with the call
    that loads its weights, and that call works."""
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 2}))
    weights = {k: torch.randn_like(v) for k, v in engine.module_state_dict().items()}
    tag = tmp_path / "global_step4"
    tag.mkdir()
    torch.save({"module": weights}, tag / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step4")
    with pytest.raises(CheckpointError, match=r"a DeepSpeed checkpoint \(mp_rank_00_model_states.pt\).*load_module"):
        engine.load_checkpoint(str(tmp_path))
    engine.load_module_state_dict(torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False))
    assert all(torch.equal(weights[k], v) for k, v in engine.module_state_dict().items())
