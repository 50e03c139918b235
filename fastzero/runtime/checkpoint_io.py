"""Checkpoints that do not depend on the shard layout, durable at every instant.

Each rank writes the pieces of params it owns, keyed by param name and element
range (``rank00003.pt``: fp32 master, exp_avg, exp_avg_sq of elements [lo, hi)
of the flattened param, and its RNG state), and rank 0 writes ``extra.pt``
(lr scheduler, client state, the module's buffers and frozen params) and, last,
``manifest.json`` (world size, stage, dtype, param names and shapes, which file
holds which ranges, steps, group hyperparameters, loss scaler, each file's
CRC32 and size, and the names that alias a trained param, as a tied LM head
does). A load reads whichever pieces overlap what the loading rank owns, so it
resumes at any world size and stage, with the optimizer state; :func:`consolidate`
assembles a plain fp32 ``state_dict``.

With a pipeline the ranks hold different params: rank 0 writes the union of
what every rank sends with its file index (names, shapes, groups, aliases;
each stage's buffers), and a load matches params, groups and buffers by name,
so a checkpoint loads at any pipeline layout (docs/checkpoints.md).

Layout of a save directory::

    latest                  the tag of the newest checkpoint (text, replaced atomically)
    .fastzero-save.lock     while a save runs: its owner (host, pid, start time, tag)
    <tag>/current           the name of the tag's complete version (text, replaced atomically)
    <tag>/<version>/        one complete save (``step<N>-<random hex>``): manifest.json, extra.pt,
                            rank00000.pt, ...

A save writes a fresh ``<version>`` directory that nothing points to, fsyncs
every file and the directory, then flips ``<tag>/current`` to it
(``os.replace``), then ``latest`` to the tag, and only then deletes the tag's
older versions. So at every instant ``latest`` and every tag resolve to a
complete checkpoint, the old one or the new one; what a crash leaves (a
version nothing points to, a stale ``current``/``latest`` temporary, a stale
lock) is ignored, and removed or taken over by the next save. A directory of
fastzero's first layout (``<tag>/manifest.json``, manifest version 1, no
checksums) still loads, and a save over it replaces it the same safe way.

Rank 0 holds a lock file in the save directory for the duration of a save, so
two jobs saving into one directory fail clearly instead of mixing their files;
a stale lock (this host, its process gone) is taken over with a warning.

A load reads and checks everything it needs first (the manifest against its
schema, each file it reads against its checksum, the model's params and
buffers against the checkpoint's), the ranks agree through one small
all-reduce, and only if every rank is ready does any rank change its state:
all ranks load or none does.

The engine's state goes through its groups' state API
(:class:`fastzero.runtime.groups.ZeroGroup`: ``owned``, ``pieces_out``,
``pieces_in``, ``rank_state``), never through a group's or the optimizer's
internals, so any group that implements it checkpoints the same way.
Checkpoints live on a file system every rank sees, or, with
``checkpoint.use_node_local_storage``, on each node's own disk: each node's
first rank writes there what rank 0 writes otherwise (the same bytes), every
rank its own file, and a load reads its node's directory only, at the layout
that saved it (:mod:`fastzero.runtime.checkpoint_nodes`).

This module holds what needs the engine: save, load (prepare, agree, apply),
the pieces, the module's state, 1-bit Adam's state, and :func:`consolidate`.
Below it, :mod:`fastzero.runtime.checkpoint_manifest` holds the manifest's
format, schema and checked reads, and :mod:`fastzero.runtime.checkpoint_files`
the layout on disk: tags, every file operation a save makes, the lock, and
finding a tag's files.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastzero.runtime import checkpoint_files as files
from fastzero.runtime import checkpoint_nodes
from fastzero.runtime import checkpoint_tp as tp
from fastzero.runtime.checkpoint_files import CheckpointError, CheckpointSaveError, check_tag, rank_file, resolve
from fastzero.runtime.checkpoint_manifest import FORMAT, VERSION, read_checked, read_manifest
from fastzero.runtime.groups import PieceState

log = logging.getLogger(__name__)

__all__ = [  # with what the other checkpoint modules hold, the public names stay here
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "CheckpointSaveError",
    "check_tag",
    "consolidate",
    "load_checkpoint",
    "read_manifest",
    "resolve",
    "save_checkpoint",
]


# -- the engine's state: its groups, the module's other names, 1-bit Adam's errors -----------------
def _comm(engine):
    """The ranks a checkpoint spans: all of them (the data-parallel ranks and, with tensor parallelism, the
    tensor ranks of each); files are named by rank here."""
    return getattr(engine, "world_comm", engine.comm)


def _groups(engine):
    """Each ZeRO group with the optimizer's tensors for it."""
    return [(g, og["params"]) for g, og in zip(engine.groups, engine.optimizer.param_groups)]


def _storage_key(t: torch.Tensor):
    """What makes two tensors the same memory: storage, offset, shape, strides,
    dtype (None for empty tensors, such as stage 3's partitioned params)."""
    try:
        if t.numel() == 0 or t.device.type == "meta":
            return None
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    except (RuntimeError, NotImplementedError):
        return None


def _module_split(engine) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The module's ``state_dict`` names beside the trained params' own:
    ``aliases`` (a name that is a trained param under another name, as a
    tied LM head: alias -> the param's name) and the rest, its buffers and
    frozen params (name -> tensor), which ``extra.pt`` holds."""
    canonical = {id(p): n for g in engine.groups for n, p in zip(g.names, g.params)}
    by_storage = {}
    for g in engine.groups:
        for n, p in zip(g.names, g.params):
            key = _storage_key(p)
            if key is not None:
                by_storage.setdefault(key, n)
    aliases, rest = {}, {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        target = canonical.get(id(t))
        if target is None and isinstance(t, torch.Tensor):
            key = _storage_key(t)
            target = by_storage.get(key) if key is not None else None
        if target is None:
            rest[name] = t
        elif target != name:
            aliases[name] = target
    return aliases, rest


def _onebit_state(engine) -> dict | None:
    """1-bit Adam's error-feedback buffers on this rank (the optimizer's at
    stage 0, the groups' at stage 1): per-rank state, like the RNG."""
    if not engine.onebit:
        return None
    groups = [g.rank_state() for g in engine.groups]
    return {"stage": engine.stage, "optimizer": engine.optimizer.error_state(), "groups": groups}


def _has_errors(engine) -> bool:
    """Whether 1-bit Adam has error-feedback state (it is past freeze_step)."""
    if not engine.onebit:
        return False
    return engine.optimizer.error_bytes() > 0 or any(g.rank_state() is not None for g in engine.groups)


def _load_onebit_state(engine, saved: dict | None, same_world: bool, had_errors: bool) -> None:
    """Restores this rank's error buffers when the world size and stage are
    the saved ones; else they restart from zero (with a warning when the
    checkpoint had some)."""
    if not engine.onebit:
        return
    restored = same_world and saved is not None and saved["stage"] == engine.stage
    restored = restored and engine.optimizer.load_error_state(saved["optimizer"])
    if not restored:
        engine.optimizer.load_error_state(None)
    for g, state in zip(engine.groups, saved["groups"] if restored else [None] * len(engine.groups)):
        g.load_rank_state(state)
    if not restored and had_errors:
        warnings.warn(
            "1-bit Adam: the checkpoint's error-feedback buffers are for another world size or stage; "
            "they restart from zero (a one-time, bounded perturbation)",
            stacklevel=5,
        )


# -- saving ----------------------------------------------------------------------------------------
def _outcomes(comm, error: BaseException | None, payload: Any = None) -> tuple[list, list[tuple[int, str]]]:
    """Every rank's payload, and which ranks failed (with their message)."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    gathered = comm.all_gather_objects((msg, payload))
    return [p for _, p in gathered], [(r, m) for r, (m, _) in enumerate(gathered) if m is not None]


def _raise_failed(
    error: BaseException | None, failed: list[tuple[int, str]], what: str, then: str = "the partial save is removed"
) -> None:
    if error is not None:
        raise error
    rank, msg = failed[0]
    raise CheckpointSaveError(f"rank {rank} failed {what} ({msg}); {then}")


def _validated_tag(comm, tag: str, mode: str) -> str:
    """Rank 0's tag, after comparing every rank's (``checkpoint.tag_validation``:
    ignore, warn, fail): ranks that name different tags get a warning or a
    CheckpointError on every rank, before anything is written."""
    if mode == "ignore" or comm.world_size == 1:
        return tag
    tags = comm.all_gather_objects(tag)
    if len(set(tags)) > 1:
        differ = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags) if t != tags[0])
        msg = f"save_checkpoint: the ranks' tags differ (rank 0: {tags[0]!r}, {differ})"
        if mode == "fail":
            raise CheckpointError(f"{msg}; checkpoint.tag_validation is 'fail': nothing was saved")
        warnings.warn(f"{msg}; rank 0's tag is used (checkpoint.tag_validation 'warn')", stacklevel=4)
    return tags[0]


def _extra_and_manifest(engine, path: Path, payloads: list, client_state, exclude_frozen: bool, nodes) -> str:
    """Rank 0: writes ``extra.pt`` into `path` and returns the manifest's
    text (every rank's file index, checksum and contribution in `payloads`:
    the manifest holds their union; `nodes`: the node layout of a
    node-local save, else None)."""
    union = _union(engine, [c for _, _, c in payloads], exclude_frozen)
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    extra = {"client_state": client_state or {}, "module_state": union["module"], "lr_scheduler": sched}
    extra["frozen_params"] = union["frozen"]
    extra["excluded_frozen_params"] = union["excluded"]  # not saved: a strict load does not miss them
    checksums = {rank_file(r): inf for r, (_, inf, _) in enumerate(payloads)}
    checksums["extra.pt"] = files.save_file(path / "extra.pt", extra)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": _comm(engine).world_size,
        "stage": engine.stage,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "master_dtype": str(engine.master_dtype).removeprefix("torch."),  # what the pieces' "master" values were
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "onebit_errors": _has_errors(engine),
        "optimizer": _state_kind(engine),
        "state_format": _state_format(engine),
        "groups": union["groups"],
        "params": union["params"],
        "files": {rank_file(r): idx for r, (idx, _, _) in enumerate(payloads)},
        "checksums": checksums,
        "aliases": union["aliases"],
    }
    if nodes is not None:
        manifest["node_local"] = {"nodes": nodes.ranks}
    # the union's splits: with a pipeline, rank 0 holds only its own stage's params
    size = tp.engine_tp(engine)[0]
    split = tp.manifest_entry({n: tp.Split(d, s, size) for n, (d, s) in union["splits"].items()}, size)
    if split is not None:
        manifest["tensor_parallel"] = split
    if union["pipeline"] is not None:  # informational: a load matches params by name at any layout
        manifest["pipeline"] = union["pipeline"]
    return json.dumps(manifest, indent=1)


def _logical_shapes(engine) -> dict[str, list[int]]:
    """Every trained param's shape, a tensor-parallel one's unsplit (the checkpoint's params are the logical ones)."""
    splits = tp.engine_splits(engine)
    return {
        n: splits[n].full_shape(list(s)) if n in splits else list(s)
        for g in engine.groups
        for n, s in zip(g.names, g.shapes)
    }


def _pipeline_of(engine) -> tuple[int, int, int] | None:
    """(stages, virtual stages, this rank's stage) of a pipeline engine with more than one stage, else None."""
    if getattr(engine, "pipe_comm", None) is None or not hasattr(engine, "stage_id"):
        return None
    return engine.num_stages, engine.virtual_stages, engine.stage_id


def _contribution(engine, exclude_frozen: bool) -> dict:
    """What this rank adds to the manifest and ``extra.pt``: its params'
    logical shapes, its groups (names, step, hyper), aliases, and its
    module's other names (frozen params, and which of them the save leaves
    out). A pipeline stage's first data (and tensor) rank also sends its
    buffers and frozen params (other stages hold other ones); without a
    pipeline rank 0's are the model's and no tensor travels."""
    aliases, rest = _module_split(engine)
    frozen = sorted(k for k, v in rest.items() if isinstance(v, torch.nn.Parameter))
    excluded = frozen if exclude_frozen else []
    pipe = _pipeline_of(engine)
    sends = pipe is not None and _comm(engine).rank != 0 and engine.comm.rank == 0 and tp.engine_tp(engine)[1] == 0
    groups = [
        {
            "step": int(float(og.get("step", 0))),
            "names": list(g.names),
            "hyper": {k: v for k, v in og.items() if k != "params" and k != "step"},
        }
        for g, og in zip(engine.groups, engine.optimizer.param_groups)
    ]
    return {
        "params": _logical_shapes(engine),
        "splits": {n: [sp.dim, sp.stride] for n, sp in tp.engine_splits(engine).items()},
        "groups": groups,
        "aliases": aliases,
        "frozen": frozen,
        "excluded": excluded,
        "module": {k: v.detach().cpu().clone() for k, v in rest.items() if k not in excluded} if sends else None,
        "stage": None if pipe is None else pipe[2],
    }


def _union(engine, contributions: list[dict], exclude_frozen: bool) -> dict:
    """Rank 0: the union of every rank's contribution (rank 0's own module
    state taken from its module). A name held by several ranks (a tied
    weight on several stages, a replica) must agree everywhere: shape,
    group step and hyperparameters, alias, buffer value."""
    mine = _contribution(engine, exclude_frozen)
    _, rest = _module_split(engine)
    mine["module"] = {k: v.detach().cpu().clone() for k, v in rest.items() if k not in mine["excluded"]}
    contributions = [mine, *contributions[1:]]
    params: dict[str, list[int]] = {}
    groups: list[dict] = []
    in_group: dict[str, dict] = {}
    aliases: dict[str, str] = {}
    module: dict[str, torch.Tensor] = {}
    owners: dict[str, list[int]] = {}
    splits: dict[str, list[int]] = {}
    frozen, excluded = set(), set()

    def disagree(what: str, name: str, rank: int) -> CheckpointSaveError:
        return CheckpointSaveError(
            f"save_checkpoint: {what} of {name} on rank {rank} differs from another rank's (the ranks' models are "
            "not replicas of one model); nothing was saved"
        )

    for rank, c in enumerate(contributions):
        for name, shape in c["params"].items():
            if params.setdefault(name, shape) != shape:
                raise disagree("the shape", name, rank)
            if c["stage"] is not None and c["stage"] not in owners.setdefault(name, []):
                owners[name].append(c["stage"])
        for name, split in c["splits"].items():
            if splits.setdefault(name, split) != split:
                raise disagree("the tensor split (dim, stride)", name, rank)
        for g in c["groups"]:
            fresh = [n for n in g["names"] if n not in in_group]
            for n in g["names"]:
                seen = in_group.get(n)
                if seen is not None and (seen["step"], json.dumps(seen["hyper"], sort_keys=True, default=str)) != (
                    g["step"],
                    json.dumps(g["hyper"], sort_keys=True, default=str),
                ):
                    raise disagree("the optimizer group (step, hyperparameters)", n, rank)
            if fresh:
                entry = {"step": g["step"], "names": fresh, "hyper": g["hyper"]}
                groups.append(entry)
                in_group.update(dict.fromkeys(fresh, entry))
        for alias, target in c["aliases"].items():
            if aliases.setdefault(alias, target) != target:
                raise disagree("the param aliased", alias, rank)
        frozen.update(c["frozen"])
        excluded.update(c["excluded"])
        for name, t in (c["module"] or {}).items():
            if name in module and not (module[name].shape == t.shape and torch.equal(module[name], t)):
                raise disagree("the buffer or frozen param", name, rank)
            module.setdefault(name, t)
    pipe = _pipeline_of(engine)
    layout = None
    if pipe is not None:
        layout = {"stages": pipe[0], "virtual_stages": pipe[1], "owners": {n: sorted(s) for n, s in owners.items()}}
    return {
        "params": params,
        "splits": splits,
        "groups": groups,
        "aliases": aliases,
        "module": module,
        "frozen": sorted(frozen),
        "excluded": sorted(excluded),
        "pipeline": layout,
    }


# Written beside the checkpoints, as DeepSpeed writes its zero_to_fp32.py there: users run it in place.
CONSOLIDATE_SCRIPT = "zero_to_fp32.py"
_SCRIPT_TEXT = """#!/usr/bin/env python
# Written by fastzero's save_checkpoint, as DeepSpeed writes its own zero_to_fp32.py: a checkpoint of this
# directory as a plain fp32 state dict, with DeepSpeed's command line:
#   python zero_to_fp32.py . OUTPUT_DIR [-t TAG] [--safe_serialization] [--max_shard_size 5GB]
#                          [--exclude_frozen_parameters]
# (also: python -m fastzero.checkpoint consolidate DIR OUT)
import sys

from fastzero.utils.zero_to_fp32 import main

sys.exit(main())
"""


def _write_script(root: Path) -> None:
    """The consolidating script in `root`, if it is not there as written (atomically: a reader never sees half)."""
    path = root / CONSOLIDATE_SCRIPT
    try:
        if path.is_file() and path.read_text(encoding="utf-8") == _SCRIPT_TEXT:
            return
        tmp = root / f".{CONSOLIDATE_SCRIPT}.tmp"
        tmp.write_text(_SCRIPT_TEXT, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:  # the checkpoint is complete: only the helper is missing
        warnings.warn(f"could not write {path}: {exc}; use python -m fastzero.checkpoint consolidate", stacklevel=4)


def _flip(root: Path, tag_dir: Path, tag: str, version: str, created: bool, save_latest: bool, flipped: list) -> None:
    """The tag's pointer to `version` (the instant the tag becomes the new
    checkpoint; `flipped` gets True then), then ``latest`` to the tag."""
    files.save_text(tag_dir / ".current.tmp", version)
    files.replace(tag_dir / ".current.tmp", tag_dir / files.POINTER)
    flipped.append(True)
    files.fsync_dir(tag_dir)
    if created:
        files.fsync_dir(root)
    if save_latest:
        files.save_text(root / ".latest.tmp", tag)
        files.replace(root / ".latest.tmp", root / files.LATEST)
        files.fsync_dir(root)


_CHUNK_BYTES = 64 << 20  # a node-local save sends rank 0's files to the other nodes in pieces of this size


def _broadcast_bytes(comm, data: bytes | None, keep: bool) -> bytes | None:
    """Rank 0's `data` on every rank that `keep`s it (the others get None),
    in chunks of at most 64 MiB; None everywhere when rank 0 has none (it
    failed). Every rank calls it."""
    size = torch.tensor([len(data) if comm.rank == 0 and data is not None else -1], device=comm.device)
    comm.broadcast(size, 0, "checkpoint").wait()
    n = int(size.item())
    if n < 0:
        return None
    out = bytearray()
    for lo in range(0, n, _CHUNK_BYTES):
        hi = min(n, lo + _CHUNK_BYTES)
        if comm.rank == 0:
            chunk = torch.frombuffer(bytearray(data[lo:hi]), dtype=torch.uint8).to(comm.device)
        else:
            chunk = torch.empty(hi - lo, dtype=torch.uint8, device=comm.device)
        comm.broadcast(chunk, 0, "checkpoint").wait()
        if keep and comm.rank != 0:
            out += chunk.cpu().numpy().tobytes()
    if comm.rank == 0:
        return data
    return bytes(out) if keep else None


def save_checkpoint(
    engine,
    save_dir,
    tag=None,
    client_state: dict | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> str:
    """Every rank calls it. Returns the tag's directory ``<save_dir>/<tag>``
    (with node-local storage, this node's).

    Any failure (the disk full, another job holding the lock) raises on
    every rank and leaves ``latest`` and the previous checkpoints intact.
    Every rank's tag is compared as ``checkpoint.tag_validation`` says; rank
    0's is the one used. `exclude_frozen_parameters`: the module's frozen
    params (``requires_grad=False``) are left out, and a load leaves them as
    the model has them (DeepSpeed's).

    ``checkpoint.use_node_local_storage``: `save_dir` is on each node's own
    disk; each node's first rank writes there what rank 0 writes otherwise
    (the same bytes: rank 0's ``extra.pt`` and manifest), every rank its own
    file, and the nodes flip their pointers only once every node's files
    are durable."""
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        raise RuntimeError(
            f"save_checkpoint in the middle of gradient accumulation (micro-step {engine.micro_steps}, "
            f"{engine.gradient_accumulation_steps()} per step): the partial gradients would be lost; save after step()"
        )
    comm = _comm(engine)
    tag = check_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")  # before any write
    tag = _validated_tag(comm, tag, engine._config.checkpoint.tag_validation)
    node_local = engine._config.checkpoint.use_node_local_storage
    if node_local:  # rank 0's tag and version name reach every node's writer with the layout's all-gather
        nodes, root, proposals = checkpoint_nodes.layout(comm, save_dir, (tag, files.new_version(engine.global_steps)))
        tag, planned = proposals[0]
    else:
        nodes, root, planned = checkpoint_nodes.shared(comm), Path(save_dir), None
    tag_dir = root / tag
    lock = version = None
    created = False
    flipped: list = []
    error: BaseException | None = None

    def abort() -> None:  # a writer, before the flip: the new version goes, the old one was never touched
        if version is not None:
            files.remove_quietly(tag_dir / version, "the partial save")
        if created:
            try:
                files.rmdir(tag_dir)
            except OSError:
                pass
        files.release_lock(lock)

    # 1. the writers (rank 0; node-local: each node's first rank) take the lock and make the version directory
    if nodes.leader:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = files.acquire_lock(root, tag)
            created = not tag_dir.exists()
            if created:
                files.mkdir(tag_dir)
            version = planned or files.new_version(engine.global_steps)
            files.mkdir(tag_dir / version)
        except Exception as exc:
            error = exc
            abort()
    payloads, failed = _outcomes(comm, error, (tag, version))
    if failed:
        if nodes.leader and error is None:  # another node's writer failed
            abort()
        _raise_failed(error, failed, "to start the save")
    tag, version = payloads[0]  # rank 0's tag, whatever tag_validation said of the others'
    tag_dir = root / tag
    path = tag_dir / version

    # 2. every rank writes its file (fsynced, with its checksum)
    index = info = contribution = None
    try:
        pieces = []
        splits, (_, tp_rank) = tp.engine_splits(engine), tp.engine_tp(engine)
        # stage 0: every data rank holds everything, the writers (and each tensor rank's first data rank) write it
        if engine.stage > 0 or nodes.leader or engine.comm.rank == 0:
            for g, opt_params in _groups(engine):
                for piece in g.pieces_out(engine.optimizer, opt_params):
                    split = splits.get(piece.name)
                    if split is None and tp_rank > 0:
                        continue  # a param whole on every tensor rank: tensor rank 0's copy is saved
                    # a clone: not the whole storage
                    tensors = {k: v.detach().float().cpu().clone() for k, v in piece.tensors.items()}
                    name = tp.qualified(piece.name, split, tp_rank)
                    entry = {"name": name, "lo": piece.lo, "hi": piece.hi, **tensors}
                    if piece.scalars:
                        entry["scalars"] = piece.scalars
                    pieces.append(entry)
        own = {"pieces": pieces, "rng": torch.get_rng_state(), "onebit": _onebit_state(engine)}
        info = files.save_file(path / rank_file(comm.rank), own)
        index = [[p["name"], p["lo"], p["hi"]] for p in pieces]
        contribution = _contribution(engine, exclude_frozen_parameters) if comm.rank != 0 else None
    except Exception as exc:
        error = exc
    payloads, failed = _outcomes(comm, error, (index, info, contribution))
    if failed:
        if nodes.leader:
            abort()
        comm.barrier()
        _raise_failed(error, failed, "to write its checkpoint file")
    if node_local:
        return _finish_node_local(
            engine, nodes, root, tag, version, created, lock, abort, payloads, client_state, exclude_frozen_parameters,
            save_latest,
        )  # fmt: skip

    # 3. rank 0: extra.pt, the manifest last, fsync, then flip the tag's pointer, then latest, then clean up
    if comm.rank == 0:
        try:
            text = _extra_and_manifest(engine, path, payloads, client_state, exclude_frozen_parameters, None)
            files.save_text(path / "manifest.json", text)
            files.fsync_dir(path)
            _flip(root, tag_dir, tag, version, created, save_latest, flipped)  # from the flip: the new checkpoint
            files.remove_old_versions(tag_dir, keep=version)
            _write_script(root)
        except Exception as exc:
            error = exc
            if not flipped:
                abort()
            elif isinstance(exc, (OSError, CheckpointError)):  # the tag is the new checkpoint: say so
                error = CheckpointSaveError(
                    f"{tag_dir} is saved and complete, but finishing the save failed: {exc}; "
                    f"{files.LATEST!r} may still name the previous checkpoint"
                )
                error.__cause__ = exc
        if flipped:
            files.release_lock(lock)
    _, failed = _outcomes(comm, error)
    if failed:
        _raise_failed(error, failed, "to finish the save", "its error says what was saved")
    return str(tag_dir)


def _finish_node_local(
    engine, nodes, root, tag, version, created, lock, abort, payloads, client_state, exclude_frozen, save_latest
) -> str:
    """Steps 3-5 of a node-local save, after every rank's file is durable:
    rank 0 makes ``extra.pt`` and the manifest and sends both to the other
    nodes' writers, which write and fsync them; once every node's files are
    durable (agreed), each writer flips its tag's pointer and ``latest``;
    once every node has flipped (agreed), each removes the tag's older
    versions. A crash between nodes' flips leaves nodes that name different
    checkpoints, each of them complete on every node: a load takes the
    newest (:func:`_locate_on_nodes`)."""
    comm, error = engine.comm, None
    tag_dir = root / tag
    path = tag_dir / version
    extra = text = None
    if comm.rank == 0:
        try:
            text = _extra_and_manifest(engine, path, payloads, client_state, exclude_frozen, nodes)
            extra = (path / "extra.pt").read_bytes()
        except Exception as exc:
            error, text, extra = exc, None, None
    copier = nodes.leader and comm.rank != 0
    extra = _broadcast_bytes(comm, extra, copier)
    text = _broadcast_bytes(comm, None if text is None else text.encode(), copier)
    if nodes.leader and error is None and extra is not None and text is not None:
        try:
            if copier:
                want = json.loads(text)["checksums"]["extra.pt"]
                got = files.save_bytes(path / "extra.pt", extra)
                if got != want:
                    raise CheckpointSaveError(f"{path / 'extra.pt'}: the copy of rank 0's file differs: {got}, {want}")
            files.save_text(path / "manifest.json", text.decode())
            files.fsync_dir(path)
        except Exception as exc:
            error = exc
    _, failed = _outcomes(comm, error)
    if failed:
        if nodes.leader:
            abort()
        _raise_failed(error, failed, "to write its node's checkpoint files", "every node's partial save is removed")

    # every node's files are durable: the writers flip, and keep the older versions until all have
    flipped: list = []
    if nodes.leader:
        try:
            _flip(root, tag_dir, tag, version, created, save_latest, flipped)
        except Exception as exc:
            error = exc
    _, failed = _outcomes(comm, error)
    if nodes.leader:
        if not failed:
            try:
                files.remove_old_versions(tag_dir, keep=version)
            except OSError as exc:  # the save is complete everywhere: leftovers only
                warnings.warn(f"could not remove the replaced versions in {tag_dir}: {exc}", stacklevel=4)
            _write_script(root)
        files.release_lock(lock)
    if failed:
        _raise_failed(
            error,
            failed,
            "to finish the save",
            "every node keeps the new checkpoint and the previous one (a load takes the newest checkpoint complete "
            f"on every node: the new one, {tag!r})",
        )
    return str(tag_dir)


# -- reading and checking what a load needs --------------------------------------------------------
_PIECE_FIELDS = ("name", "lo", "hi", "scalars")  # the rest of a saved piece: its per-element tensors
ADAM_STATE = "adam"  # the state kind of fastzero's Adam-family optimizers (master, exp_avg, exp_avg_sq)


def _state_kind(engine) -> str:
    """Which optimizer's state the pieces hold: ``adam`` for fastzero's
    own, the class (module.qualname) of a client optimizer."""
    return getattr(engine.optimizer, "state_kind", ADAM_STATE)


def _pieces(
    path: Path,
    manifest: dict,
    wanted: dict[str, list[tuple[int, int]]],
    cache: dict[str, Any] | None = None,
    only: set[str] | None = None,
    hint: str = "",
) -> dict[str, list[PieceState]]:
    """The saved pieces that overlap the `wanted` ranges, by param name,
    read from the files that hold them (those named in `only`, when given:
    a node's) and checked (checksum, sizes). The files read are left in
    `cache`, by name. A piece held by two files (stage 0 saved node-local:
    each node's writer holds every piece) is read from the first. `hint`
    ends the error for missing elements."""
    cache = {} if cache is None else cache
    out: dict[str, list[PieceState]] = {}
    seen: set[tuple[str, int, int]] = set()
    for fname, index in manifest["files"].items():
        if only is not None and fname not in only:
            continue
        fresh = [(n, lo, hi) for n, lo, hi in index if (n, lo, hi) not in seen]
        if not any(n in wanted and any(lo < w_hi and w_lo < hi for w_lo, w_hi in wanted[n]) for n, lo, hi in fresh):
            continue
        data = cache[fname] = read_checked(path, fname, manifest)
        if not isinstance(data, dict) or not isinstance(data.get("pieces"), list):
            raise CheckpointError(f"{path / fname} holds no list of pieces; the file is corrupt")
        added = set()
        for piece in data["pieces"]:
            key = (piece["name"], piece["lo"], piece["hi"])
            if key in seen:
                continue
            n = piece["hi"] - piece["lo"]
            tensors = {k: v for k, v in piece.items() if k not in _PIECE_FIELDS}
            scalars = piece.get("scalars", {})
            if (
                "master" not in tensors
                or any(not isinstance(v, torch.Tensor) or v.numel() != n for v in tensors.values())
                or not isinstance(scalars, dict)
            ):
                raise CheckpointError(
                    f"{path / fname}: piece {piece['name']}[{piece['lo']}:{piece['hi']}] has tensors of the wrong "
                    "size; the file is corrupt"
                )
            out.setdefault(piece["name"], []).append(
                PieceState(piece["name"], piece["lo"], piece["hi"], tensors, scalars)
            )
            added.add(key)
        seen |= added
    for name, ranges in wanted.items():
        for lo, hi in ranges:
            covered = sum(min(hi, p.hi) - max(lo, p.lo) for p in out.get(name, []) if p.lo < hi and lo < p.hi)
            if covered != hi - lo:
                raise CheckpointError(
                    f"{path}: elements [{lo}:{hi}] of {name} are missing from the checkpoint files{hint}"
                )
    return out


def _read_extra(path: Path, manifest: dict) -> dict:
    extra = read_checked(path, "extra.pt", manifest, weights_only=False)  # client state may hold any object
    if not isinstance(extra, dict) or not isinstance(extra.get("module_state"), dict):
        raise CheckpointError(f"{path / 'extra.pt'} holds no module_state; the file is corrupt")
    return extra


@dataclass(frozen=True)
class _Trained:
    """What every rank of the loading job trains and holds, by name (one all-gather across a pipeline's
    stages; without a pipeline every rank holds the whole model, and these are this rank's)."""

    params: frozenset[str]
    module: frozenset[str]  # buffers and frozen params


def _trained(engine, comm) -> _Trained:
    """Every rank calls it (a pipeline engine: one all-gather of names over the world)."""
    params = {n for g in engine.groups for n in g.names}
    module = set(_module_split(engine)[1])
    if _pipeline_of(engine) is not None:
        gathered = comm.all_gather_objects((sorted(params), sorted(module)))
        params = {n for p, _ in gathered for n in p}
        module = {n for _, m in gathered for n in m}
    return _Trained(frozenset(params), frozenset(module))


def _check_model(manifest: dict, engine, path: Path, trained: _Trained | None = None) -> None:
    """This rank's params against the checkpoint's (name, logical shape), and the params every rank trains
    (`trained`) against all the checkpoint holds: another model's checkpoint fails on every rank."""
    saved = manifest["params"]
    logical = _logical_shapes(engine)
    for g in engine.groups:
        for name in g.names:
            shape = logical[name]
            if name not in saved:
                raise CheckpointError(f"{path}: param {name} of the model is not in the checkpoint (another model?)")
            if list(shape) != saved[name]:
                raise CheckpointError(
                    f"{path}: param {name} has shape {tuple(saved[name])} in the checkpoint and "
                    f"{tuple(shape)} in the model"
                )
    ours = trained.params if trained is not None else {n for g in engine.groups for n in g.names}
    extra = [n for n in saved if n not in ours]
    if extra:
        where = "by any rank of this job" if _pipeline_of(engine) is not None else "by this engine"
        raise CheckpointError(f"{path}: param {extra[0]} of the checkpoint is not trained {where} (another model?)")
    missing = sorted(n for n in ours if n not in saved)
    if missing:  # another rank's param: each rank checks its own shapes, this one only names it
        raise CheckpointError(f"{path}: param {missing[0]} of the model is not in the checkpoint (another model?)")


def _saved_groups(manifest: dict, engine, path: Path) -> list[dict | None]:
    """For each of the engine's param groups, the saved group (step, hyper) its params were in: matched per
    param name, so a load at another pipeline layout (other groups per stage) takes each param's own. The
    params of one group must come from saved groups that agree (None: a group without params)."""
    by_name = {n: g for g in manifest["groups"] for n in g["names"]}
    out = []
    for i, g in enumerate(engine.groups):
        found = [by_name[n] for n in g.names if n in by_name]
        if not found:
            out.append(None)
            continue
        first = found[0]
        key = (first["step"], json.dumps(first["hyper"], sort_keys=True, default=str))
        for n, other in zip(g.names, found):
            if (other["step"], json.dumps(other["hyper"], sort_keys=True, default=str)) != key:
                raise CheckpointError(
                    f"{path}: the params of this engine's param group {i} were saved in groups with different "
                    f"step or hyperparameters ({g.names[0]} and {n}); put them in separate param groups, or pass "
                    "load_optimizer_states=False"
                )
        out.append(first)
    return out


def _module_state(
    engine, saved: dict, path: Path, strict: bool, excluded: list[str] = (), everyone: frozenset[str] | None = None
) -> tuple[dict, list[str], list[str]]:
    """The saved buffers and frozen params to load into the module, and the
    names missing from the checkpoint and not in the module (`everyone`:
    the names every rank's module holds, a pipeline's stages together). Strict: any
    such name is a CheckpointError; a shape that differs always is. The
    frozen params the save `excluded` (exclude_frozen_parameters) are not
    missing: the module keeps its own, as DeepSpeed's load does."""
    _, ours = _module_split(engine)
    left_out = {k for k in excluded if isinstance(ours.get(k), torch.nn.Parameter)}
    missing = [k for k in ours if k not in saved and k not in left_out]
    held = ours if everyone is None else everyone
    unexpected = [k for k in saved if k not in held]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path}: the module's buffers and frozen params differ from the checkpoint's: missing from the "
            f"checkpoint {missing}, in the checkpoint but not in the module {unexpected}; pass "
            "load_module_strict=False to load the ones that match"
        )
    state = {}
    for k, t in ours.items():
        if k not in saved:
            continue
        v = saved[k]
        if not isinstance(v, torch.Tensor) or (isinstance(t, torch.Tensor) and v.shape != t.shape):
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise CheckpointError(
                f"{path}: {k} is {shape} in the checkpoint and {tuple(getattr(t, 'shape', ()))} in the module"
            )
        state[k] = v
    return state, missing, unexpected


# -- loading -----------------------------------------------------------------------------------------
@dataclass
class _Ready:
    """What one rank read and checked, to apply once every rank is ready."""

    tag_dir: Path
    manifest: dict
    pieces: dict[str, list[PieceState]]
    extra: dict
    module_state: dict
    missing: list[str]
    unexpected: list[str]
    own_file: dict
    same_world: bool
    groups: list[dict | None]  # per engine param group, the saved group of its params


def _masters_from_weights(pieces: dict[str, list[PieceState]], dtype: torch.dtype) -> dict[str, list[PieceState]]:
    """``zero_optimization.load_from_fp32_weights: false``: each fp32 master
    re-made from the 16-bit weight, master = float(dtype(saved master)), as
    DeepSpeed re-makes them from the module's 16-bit params (the weights a
    16-bit run trains are its masters rounded). In fp32 training the masters
    are the weights: nothing changes."""
    if dtype == torch.float32:
        return pieces
    return {
        name: [
            PieceState(p.name, p.lo, p.hi, {**p.tensors, "master": p.tensors["master"].to(dtype).float()}, p.scalars)
            for p in group
        ]
        for name, group in pieces.items()
    }


def _check_layout(manifest: dict, engine, nodes, path: Path) -> set[str] | None:
    """A node-local load: the rank files this node's directory holds (None:
    all of them, a checkpoint saved to a shared directory and copied to
    every node), after checking that the checkpoint was saved at this
    layout (world size, ranks per node, stage)."""
    saved = manifest.get("node_local")
    if saved is None:
        return None
    ours = (_comm(engine).world_size, nodes.ranks, engine.stage)
    theirs = (manifest["world_size"], saved["nodes"], manifest["stage"])
    if ours != theirs:
        raise CheckpointError(
            f"{path}: saved node-local by {theirs[0]} ranks in nodes {theirs[1]} at ZeRO stage {theirs[2]}; this job "
            f"has {ours[0]} ranks in nodes {ours[1]} at stage {ours[2]}: {checkpoint_nodes.RESHARD}"
        )
    return {rank_file(r) for r in nodes.mine}


def _state_format(engine) -> dict | None:
    """The state format of fastzero's Adam-family optimizer (the pieces hold
    fp32 values whatever it is): ``{"format", "seed", "block_size"}``, the
    seed of its stochastic rounding (bf16 and int8 states, bf16 params
    without a master) so that a resume rounds as the uninterrupted run; None
    for a client optimizer."""
    opt = engine.optimizer
    fmt = getattr(opt, "state_format", None)
    return None if fmt is None else {"format": fmt, "seed": opt.seed, "block_size": opt.block_size}


def _load_state_format(engine, manifest: dict) -> None:
    """After the pieces are in, in this optimizer's format: one that rounds
    stochastically (bf16 states, bf16 params without masters) takes the saved
    seed of one that did, so that a resume rounds as the uninterrupted run;
    the log says what was converted (a warning where values were rounded: to
    bf16, to int8, or int8 re-encoded in other blocks), on rank 0, as the
    optimizer's state-dict load does."""
    ours = _state_format(engine)
    if ours is None:
        return
    saved = manifest.get("state_format") or {"format": "fp32", "seed": None, "block_size": None}  # before formats
    if saved["seed"] is not None and ours["seed"] is not None:
        engine.optimizer.seed = saved["seed"]
    same_layout = (manifest["world_size"], manifest["stage"]) == (_comm(engine).world_size, engine.stage)
    if _held_as(saved) == _held_as(ours) and (ours["format"] != "int8" or same_layout):
        return
    exact = _held_as(ours) == "fp32"  # decoding is exact; encoding rounds
    how = "exact" if exact else "rounded to nearest" if ours["format"] == "bf16" else "encoded in this layout's blocks"
    if _comm(engine).rank == 0:
        log.log(
            logging.INFO if exact else logging.WARNING,
            "load_checkpoint: the checkpoint's optimizer states (state_format=%r: %s, saved by %d ranks at stage %d) "
            "were converted to this optimizer's state_format=%r: %s, %s",
            saved["format"],
            _held_as(saved),
            manifest["world_size"],
            manifest["stage"],
            ours["format"],
            _held_as(ours),
            how,
        )


def _load_masters(engine, manifest: dict) -> None:
    """The log's note, on rank 0, of masters loaded across precisions: a
    checkpoint's fp32 masters into bf16 params without masters
    (``bf16.bf16_master_weights_and_grads``) are rounded to nearest (a
    warning); bf16 params saved without masters load exactly into fp32 ones
    (info)."""
    saved = manifest.get("master_dtype", "float32")  # before the field: masters were fp32 (or fp32 training)
    ours = str(engine.master_dtype).removeprefix("torch.")
    if saved == ours or _comm(engine).rank != 0:
        return
    if ours == "float32":
        log.info(
            "load_checkpoint: the checkpoint's params were %s without fp32 masters; this run's fp32 masters take "
            "their values exactly",
            saved,
        )
    else:
        log.warning(
            "load_checkpoint: the checkpoint's fp32 masters were rounded to nearest into this run's %s params, "
            "which have no fp32 master (bf16.bf16_master_weights_and_grads)",
            ours,
        )


def _held_as(fmt: dict) -> str:
    """What states of a format hold, for the log (under the engine
    "param_dtype" states are fp32: every low-precision param has an fp32
    master)."""
    if fmt["format"] == "int8":
        return f"int8 (blocks of {fmt['block_size']})"
    return "bf16" if fmt["format"] == "bf16" else "fp32"


def _prepare(
    engine, located, strict: bool, optimizer_states: bool = True, nodes=None, trained: _Trained | None = None
) -> _Ready | None:
    """Reads and checks all this rank needs from the checkpoint `located`
    ((the tag's directory, its files'), or None: nothing to load); `nodes`:
    a node-local load's layout; `trained`: what every rank trains and holds."""
    if located is None:
        return None
    tag_dir, path = located
    manifest = read_manifest(path)
    _check_model(manifest, engine, path, trained)
    groups = _saved_groups(manifest, engine, path) if optimizer_states else [None] * len(engine.groups)
    only = None if nodes is None else _check_layout(manifest, engine, nodes, path)
    saved_kind, kind = manifest.get("optimizer", ADAM_STATE), _state_kind(engine)
    if optimizer_states and saved_kind != kind:
        raise CheckpointError(
            f"{path}: the optimizer state was saved by {saved_kind} and this engine's optimizer is {kind}; pass "
            "load_optimizer_states=False to load the weights only"
        )
    wanted: dict[str, list[tuple[int, int]]] = {}
    for g, opt_params in _groups(engine):
        for piece in g.owned(opt_params):
            wanted.setdefault(piece.name, []).append((piece.lo, piece.hi))
    read: dict[str, Any] = {}
    hint = "" if only is None else f" in this node's directory: {checkpoint_nodes.RESHARD}"
    pieces = _tp_pieces(engine, path, manifest, wanted, read, only, hint)
    if not engine._config.zero_optimization.load_from_fp32_weights:
        pieces = _masters_from_weights(pieces, engine.dtype)
    extra = _read_extra(path, manifest)
    excluded = extra.get("excluded_frozen_params", [])
    everyone = None if trained is None else trained.module
    module_state, missing, unexpected = _module_state(engine, extra["module_state"], path, strict, excluded, everyone)
    same_size = (manifest.get("tensor_parallel") or {}).get("size", 1) == tp.engine_tp(engine)[0]
    pipe = _pipeline_of(engine)
    saved_pipe = manifest.get("pipeline") or {}
    same_pipe = (saved_pipe.get("stages", 1), saved_pipe.get("virtual_stages", 1)) == (pipe or (1, 1, 0))[:2]
    same_world = manifest["world_size"] == _comm(engine).world_size and same_size and same_pipe
    own_file = {}
    if same_world:
        name = rank_file(_comm(engine).rank)
        own_file = read[name] if name in read else read_checked(path, name, manifest)
        if not isinstance(own_file, dict):
            raise CheckpointError(f"{path / name} is not a rank file; the file is corrupt")
    return _Ready(tag_dir, manifest, pieces, extra, module_state, missing, unexpected, own_file, same_world, groups)


def _tp_pieces(engine, path, manifest, wanted, read, only, hint) -> dict[str, list[PieceState]]:
    """The saved pieces covering this rank's `wanted` ranges of each param,
    by the model's names: read directly when the tensor split is the saved
    one, else each param assembled whole from the saved split and this
    tensor rank's piece of it taken (a load at another tensor size)."""
    mine, saved = tp.engine_splits(engine), tp.saved_splits(manifest)
    if not mine and not saved:
        return _pieces(path, manifest, wanted, read, only, hint)
    rank, shapes = tp.engine_tp(engine)[1], manifest["params"]
    want: dict[str, list[tuple[int, int]]] = {}
    for name, ranges in wanted.items():
        want.update(tp.wanted_for(name, shapes[name], mine.get(name), saved.get(name), rank, ranges))
    got = _pieces(path, manifest, want, read, only, hint)
    return {n: tp.resplit(n, shapes[n], mine.get(n), saved.get(n), rank, got) for n in wanted}


def _named(located: tuple[str, str] | None) -> str:
    return "no 'latest'" if located is None else located[1]


def _locate_on_nodes(comm, nodes, root: Path, tag) -> tuple[Path, Path] | None:
    """A node-local load: the checkpoint every node loads, from each node's
    `tag` (or its ``latest``). Nodes that name different ones (a save
    interrupted between the nodes' flips) load the newest one complete on
    every node, with a warning. Every rank calls it; a failure raises on
    every rank."""
    error, mine = None, None
    try:
        located = files.locate(root, tag)
        if located is not None:
            mine = (located[0].name, located[1].relative_to(root).as_posix())
    except Exception as exc:
        error = exc
    named, failed = _outcomes(comm, error, mine)
    if failed:
        if error is not None:
            raise error
        rank, msg = failed[0]
        raise CheckpointError(
            f"rank {rank} failed to find the checkpoint in its node's directory ({msg}); nothing changed on any rank"
        )
    candidates = list(dict.fromkeys(n for n in named if n is not None))  # rank 0's first
    if not candidates:
        return None
    if len(candidates) == 1 and None not in named:
        return root / candidates[0][0], root / candidates[0][1]
    steps = []
    for _, rel in candidates:
        try:
            steps.append(read_manifest(root / rel)["global_steps"])
        except CheckpointError:
            steps.append(None)
    everyone = comm.all_gather_objects(steps)
    complete = [i for i in range(len(candidates)) if all(s[i] is not None for s in everyone)]
    said = "; ".join(f"node {n}: {_named(named[ranks[0]])}" for n, ranks in enumerate(nodes.ranks))
    if not complete:
        raise CheckpointError(
            f"the nodes' directories name different checkpoints ({said}) and none of them is complete on every "
            "node; nothing was changed on any rank"
        )
    best = max(complete, key=lambda i: (everyone[0][i], -i))
    warnings.warn(
        f"node-local checkpoint: the nodes name different checkpoints ({said}), as a save interrupted between the "
        f"nodes' flips leaves them; loading {candidates[best][1]}, the newest one complete on every node",
        stacklevel=4,
    )
    return root / candidates[best][0], root / candidates[best][1]


def load_checkpoint(
    engine,
    load_dir,
    tag=None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_strict: bool = True,
    load_module_only: bool = False,
):
    """Every rank calls it. Returns (the tag's directory, client_state), or
    (None, None) when `load_dir` has no ``latest`` and no tag is given.

    Every rank reads and checks all it needs, then the ranks agree (one small
    all-reduce); only if all are ready does any rank change its state. A
    rank that failed raises its own error, the others a CheckpointError
    naming it: nothing changed anywhere. `load_module_strict`: the module's
    buffers and frozen params must be exactly the checkpoint's (False: load
    those that match and warn about the rest)."""
    comm = _comm(engine)
    ready: _Ready | None = None
    error: BaseException | None = None
    nodes = located = None
    if engine._config.checkpoint.use_node_local_storage:  # every rank reads its node's directory only
        nodes, root, _ = checkpoint_nodes.layout(comm, load_dir)
        located = _locate_on_nodes(comm, nodes, root, tag)
    trained = _trained(engine, comm)  # before anything that can fail on one rank only: every rank gathers
    try:
        if nodes is None:
            located = files.locate(load_dir, tag)
        optimizer_states = load_optimizer_states and not load_module_only
        ready = _prepare(engine, located, load_module_strict, optimizer_states, nodes, trained)
    except Exception as exc:  # any failure must reach the agreement, or the other ranks would go on alone
        error = exc
    # one slot per rank (1: it failed), and the count of ranks that found no 'latest'
    flags = [0.0] * (comm.world_size + 1)
    if error is not None:
        flags[comm.rank] = 1.0
    elif ready is None:
        flags[-1] = 1.0
    flags = comm.all_reduce_scalars(flags, tag="checkpoint")
    failed = [r for r in range(comm.world_size) if flags[r] > 0]
    if failed:
        if error is not None:
            raise error
        raise CheckpointError(
            f"rank {failed[0]} failed to validate the checkpoint in {load_dir} (its error says why); "
            "nothing was changed on any rank"
        )
    nothing = round(flags[-1])
    if nothing == comm.world_size:
        warnings.warn(
            f"no 'latest' file in {load_dir}: nothing loaded (pass tag= to load a given checkpoint)", stacklevel=3
        )
        return None, None
    if nothing:
        raise CheckpointError(
            f"{nothing} of {comm.world_size} ranks found no 'latest' in {load_dir} and the others did (is it on a "
            "file system every rank sees?); nothing was changed on any rank"
        )
    if nodes is not None:  # every node read the same checkpoint: one small all-gather of the manifests' CRC32
        prints = comm.all_gather_objects(zlib.crc32(json.dumps(ready.manifest, sort_keys=True).encode()))
        if len(set(prints)) > 1:
            differ = [n for n, ranks in enumerate(nodes.ranks) if prints[ranks[0]] != prints[0]]
            raise CheckpointError(
                f"node-local checkpoint {ready.tag_dir.name!r}: the manifest in node {differ[0]}'s directory differs "
                "from node 0's (directories of different runs?); nothing was changed on any rank"
            )
    if load_module_only:
        load_optimizer_states = load_lr_scheduler_states = False
    _apply(engine, ready, load_optimizer_states, load_lr_scheduler_states, load_module_only)
    return str(ready.tag_dir), ready.extra["client_state"]


def _apply(
    engine, ready: _Ready, load_optimizer_states: bool, load_lr_scheduler_states: bool, module_only: bool = False
) -> None:
    """Every rank is ready: change the engine (with `module_only`, its
    weights and buffers only: no optimizer state, schedule, loss scale,
    counters or RNG, as DeepSpeed's ``load_module_only``)."""
    manifest, extra = ready.manifest, ready.extra
    if ready.missing or ready.unexpected:
        warnings.warn(
            f"load_module_strict=False: buffers and frozen params missing from the checkpoint (left as they are): "
            f"{ready.missing}; in the checkpoint but not in the module (ignored): {ready.unexpected}",
            stacklevel=4,
        )
    keys = None if load_optimizer_states else ("master",)  # None: every saved key
    with torch.no_grad():
        for g, opt_params in _groups(engine):
            g.pieces_in(engine.optimizer, opt_params, ready.pieces, keys)
        for group, saved in zip(engine.optimizer.param_groups, ready.groups):
            if load_optimizer_states and saved is not None:
                if "step" in group or saved["step"]:  # a client optimizer's groups may have no counter
                    group["step"] = saved["step"]
                group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved["hyper"].items()})
        sync = getattr(engine.optimizer, "sync_device_params", None)
        if sync is not None:  # separate masters (offloaded, a client optimizer's): the engine's tensors from them
            sync()
        sync_steps = getattr(engine.optimizer, "sync_steps", None)
        if sync_steps is not None:  # state[p]["step"] from the counters just set
            sync_steps()
        handles = [h for g in engine.groups for h in g.gather()]
        for h in handles:
            h.wait()
        engine.module.load_state_dict(ready.module_state, strict=False)  # checked: only the non-trained names
        _load_masters(engine, manifest)
        if load_optimizer_states:
            _load_state_format(engine, manifest)
            _load_onebit_state(
                engine, ready.own_file.get("onebit"), ready.same_world, manifest.get("onebit_errors", False)
            )
    if load_lr_scheduler_states and engine.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    if module_only:
        engine._zero_grads()
        return
    if engine.loss_scaler is not None and manifest["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    for key in ("global_steps", "global_samples", "skipped_steps"):
        setattr(engine, key, manifest[key])
    # saved at a boundary; the accumulation steps may differ now (another world size, same global batch)
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    rng = ready.own_file.get("rng")
    if rng is not None:
        torch.set_rng_state(rng)
    engine._zero_grads()


def consolidate(load_dir, tag=None, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's model as a plain fp32 ``state_dict`` (trainable params
    from their fp32 masters, plus buffers and frozen params, and a tied
    param under each of its names, as one tensor), loadable with
    ``model.load_state_dict``: DeepSpeed's ``zero_to_fp32``. Every file is
    checked against its checksum. ``exclude_frozen_parameters`` leaves the
    frozen params (``requires_grad=False``) out, keeping the buffers; a
    checkpoint written before fastzero recorded which names are frozen
    params cannot tell them from buffers and raises ``CheckpointError``."""
    path = resolve(load_dir, tag)
    if path is None:
        raise CheckpointError(f"no 'latest' file in {load_dir}; pass the tag")
    manifest = read_manifest(path)
    shapes, splits = manifest["params"], tp.saved_splits(manifest)
    wanted = {}
    for n, s in shapes.items():  # a param saved split across tensor ranks: every rank's piece
        wanted.update(tp.wanted_for(n, s, None, splits.get(n), 0, [(0, int(torch.Size(s).numel()))]))
    got = _pieces(path, manifest, wanted)
    pieces = {n: tp.resplit(n, s, None, splits.get(n), 0, got) for n, s in shapes.items()}
    extra = _read_extra(path, manifest)
    out = dict(extra["module_state"])
    if exclude_frozen_parameters:
        frozen = extra.get("frozen_params")
        if frozen is None:
            raise CheckpointError(
                f"{path}: this checkpoint does not record which of its module names are frozen params "
                "(saved by an older fastzero), so exclude_frozen_parameters cannot tell them from buffers"
            )
        for name in frozen:
            out.pop(name, None)
    for name, shape in shapes.items():
        flat = torch.empty(int(torch.Size(shape).numel()), dtype=torch.float32)
        for piece in pieces.get(name, []):
            flat[piece.lo : piece.hi] = piece.tensors["master"]
        out[name] = flat.view(shape)
    for alias, name in manifest.get("aliases", {}).items():
        out[alias] = out[name]  # the same tensor under both names, as torch's state_dict shares it
    return out
