"""Checkpoints that do not depend on the shard layout.

Each rank writes the pieces of params it owns, keyed by param name and element
range (``rank00003.pt``: fp32 master, exp_avg, exp_avg_sq of elements [lo, hi)
of the flattened param), and rank 0 writes ``manifest.json`` (world size,
stage, dtype, param names and shapes, which file holds which ranges, steps,
group hyperparameters, loss scaler) and ``extra.pt`` (lr scheduler, client
state, the module's buffers and frozen params). A load reads whichever pieces
overlap what the loading rank owns, so it resumes at any world size and stage,
with the optimizer state; :func:`consolidate` assembles a plain fp32
``state_dict``.

The engine's state goes through its groups' state API
(:class:`fastzero.runtime.groups.ZeroGroup`: ``owned``, ``pieces_out``,
``pieces_in``, ``rank_state``), never through a group's or the optimizer's
internals, so any group that implements it checkpoints the same way.

The save goes to ``.<tag>.tmp`` and is renamed to ``<tag>`` when complete;
``latest`` is replaced last. A crash mid-save leaves the previous checkpoint
and pointer intact. Checkpoints live on a file system every rank sees.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from fastzero.runtime.groups import STATE_KEYS, PieceState

FORMAT, VERSION = "fastzero-checkpoint", 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this engine; nothing was changed."""


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _groups(engine):
    """Each ZeRO group with the optimizer's tensors for it."""
    return [(g, og["params"]) for g, og in zip(engine.groups, engine.optimizer.param_groups)]


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
            stacklevel=4,
        )


def _write(path: Path, obj: Any) -> None:
    torch.save(obj, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(engine, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True) -> str:
    """Every rank calls it. Returns the checkpoint's directory."""
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        raise RuntimeError(
            f"save_checkpoint in the middle of gradient accumulation (micro-step {engine.micro_steps}, "
            f"{engine.gradient_accumulation_steps()} per step): the partial gradients would be lost; save after step()"
        )
    comm, root = engine.comm, Path(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or "/" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r}: must be a plain, non-empty name")
    final, tmp = root / tag, root / f".{tag}.tmp"
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    pieces = []
    if engine.stage > 0 or comm.rank == 0:  # stage 0: every rank holds everything, rank 0 writes it
        for g, opt_params in _groups(engine):
            for piece in g.pieces_out(engine.optimizer, opt_params):
                # a clone: not the whole storage
                tensors = {k: v.detach().float().cpu().clone() for k, v in piece.tensors.items()}
                pieces.append({"name": piece.name, "lo": piece.lo, "hi": piece.hi, **tensors})
    own = {"pieces": pieces, "rng": torch.get_rng_state(), "onebit": _onebit_state(engine)}
    _write(tmp / _rank_file(comm.rank), own)
    index = [[p["name"], p["lo"], p["hi"]] for p in pieces]
    indexes = _all_gather_objects(comm, index)
    comm.barrier()
    if comm.rank == 0:
        trainable = {id(p) for g in engine.groups for p in g.params}
        module_state = {
            k: v.detach().cpu().clone()
            for k, v in engine.module.state_dict(keep_vars=True).items()
            if id(v) not in trainable
        }
        sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        extra = {"client_state": client_state or {}, "module_state": module_state, "lr_scheduler": sched}
        _write(tmp / "extra.pt", extra)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": comm.world_size,
            "stage": engine.stage,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "onebit_errors": _has_errors(engine),
            "groups": [
                {
                    "step": int(float(og.get("step", 0))),
                    "names": g.names,
                    "hyper": {k: v for k, v in og.items() if k != "params" and k != "step"},
                }
                for g, og in zip(engine.groups, engine.optimizer.param_groups)
            ],
            "params": {n: list(s) for g in engine.groups for n, s in zip(g.names, g.shapes)},
            "files": {_rank_file(r): idx for r, idx in enumerate(indexes)},
        }
        text = json.dumps(manifest, indent=1)
        with open(tmp / "manifest.json", "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        old = root / f".{tag}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            pointer = root / ".latest.tmp"
            pointer.write_text(tag)
            os.replace(pointer, root / "latest")
    comm.barrier()
    return str(final)


def _all_gather_objects(comm, obj) -> list:
    if comm.world_size == 1:
        return [obj]
    out = [None] * comm.world_size
    torch.distributed.all_gather_object(out, obj, group=comm.group)
    return out


def resolve(load_dir, tag=None) -> Path | None:
    """The checkpoint directory for `tag`, or the one ``latest`` names (None
    when there is no ``latest``)."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.exists():
            return None
        tag = latest.read_text().strip()
    path = root / str(tag)
    if not (path / "manifest.json").exists():
        tags = sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists()) if root.is_dir() else []
        raise CheckpointError(f"{path} is not a fastzero checkpoint (no manifest.json); checkpoints in {root}: {tags}")
    return path


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / 'manifest.json'} is unreadable or corrupt: {exc}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not a fastzero checkpoint of version {VERSION}")
    return manifest


def _load(path: Path, weights_only: bool = True) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # torch raises many kinds for a truncated or foreign file
        raise CheckpointError(f"{path} is unreadable or corrupt ({type(exc).__name__}: {exc})") from None


def _pieces(path: Path, manifest: dict, wanted: dict[str, list[tuple[int, int]]]) -> dict[str, list[PieceState]]:
    """The saved pieces that overlap the `wanted` ranges, by param name,
    read from the files that hold them and checked for size."""
    out: dict[str, list[PieceState]] = {}
    for fname, index in manifest["files"].items():
        if not any(n in wanted and any(lo < w_hi and w_lo < hi for w_lo, w_hi in wanted[n]) for n, lo, hi in index):
            continue
        data = _load(path / fname)
        for piece in data["pieces"]:
            n = piece["hi"] - piece["lo"]
            if any(piece[k].numel() != n for k in STATE_KEYS):
                raise CheckpointError(
                    f"{path / fname}: piece {piece['name']}[{piece['lo']}:{piece['hi']}] has tensors of the wrong "
                    "size; the file is corrupt"
                )
            tensors = {k: piece[k] for k in STATE_KEYS}
            out.setdefault(piece["name"], []).append(PieceState(piece["name"], piece["lo"], piece["hi"], tensors))
    for name, ranges in wanted.items():
        for lo, hi in ranges:
            covered = sum(min(hi, p.hi) - max(lo, p.lo) for p in out.get(name, []) if p.lo < hi and lo < p.hi)
            if covered != hi - lo:
                raise CheckpointError(f"{path}: elements [{lo}:{hi}] of {name} are missing from the checkpoint files")
    return out


def _check_model(manifest: dict, engine, path: Path) -> None:
    saved = manifest["params"]
    for g in engine.groups:
        for name, shape in zip(g.names, g.shapes):
            if name not in saved:
                raise CheckpointError(f"{path}: param {name} of the model is not in the checkpoint (another model?)")
            if list(shape) != saved[name]:
                raise CheckpointError(
                    f"{path}: param {name} has shape {tuple(saved[name])} in the checkpoint and "
                    f"{tuple(shape)} in the model"
                )
    ours = {n for g in engine.groups for n in g.names}
    extra = [n for n in saved if n not in ours]
    if extra:
        raise CheckpointError(f"{path}: param {extra[0]} of the checkpoint is not trained by this engine")
    if [grp["names"] for grp in manifest["groups"]] != [g.names for g in engine.groups]:
        raise CheckpointError(f"{path}: the checkpoint's param groups differ from the engine's")


def load_checkpoint(
    engine, load_dir, tag=None, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True
):
    """Every rank calls it. Returns (path, client_state), or (None, None)
    when `load_dir` has no ``latest`` and no tag is given."""
    path = resolve(load_dir, tag)
    if path is None:
        warnings.warn(
            f"no 'latest' file in {load_dir}: nothing loaded (pass tag= to load a given checkpoint)", stacklevel=3
        )
        return None, None
    manifest = read_manifest(path)
    _check_model(manifest, engine, path)
    wanted: dict[str, list[tuple[int, int]]] = {}
    for g, opt_params in _groups(engine):
        for piece in g.owned(opt_params):
            wanted.setdefault(piece.name, []).append((piece.lo, piece.hi))
    pieces = _pieces(path, manifest, wanted)
    extra = _load(path / "extra.pt", weights_only=False)  # client state may hold any object
    same_world = manifest["world_size"] == engine.comm.world_size
    own_file = _load(path / _rank_file(engine.comm.rank)) if same_world else {}
    rng = own_file.get("rng")
    # everything is read and checked: now change the engine
    keys = STATE_KEYS if load_optimizer_states else ("master",)
    with torch.no_grad():
        for g, opt_params in _groups(engine):
            g.pieces_in(engine.optimizer, opt_params, pieces, keys)
        for group, saved in zip(engine.optimizer.param_groups, manifest["groups"]):
            if load_optimizer_states:
                group["step"] = saved["step"]
                group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved["hyper"].items()})
        sync = getattr(engine.optimizer, "sync_device_params", None)
        if sync is not None:  # offloaded masters: the device params from them
            sync()
        handles = [h for g in engine.groups for h in g.gather()]
        for h in handles:
            h.wait()
        engine.module.load_state_dict(extra["module_state"], strict=False)
        if load_optimizer_states:
            _load_onebit_state(engine, own_file.get("onebit"), same_world, manifest.get("onebit_errors", False))
    if load_lr_scheduler_states and engine.lr_scheduler is not None and extra["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    if engine.loss_scaler is not None and manifest["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    for key in ("global_steps", "global_samples", "skipped_steps"):
        setattr(engine, key, manifest[key])
    # saved at a boundary; the accumulation steps may differ now (another world size, same global batch)
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    if rng is not None:
        torch.set_rng_state(rng)
    for g in engine.groups:
        g.zero_grads()
    return str(path), extra["client_state"]


def consolidate(load_dir, tag=None) -> dict[str, torch.Tensor]:
    """The checkpoint's model as a plain fp32 ``state_dict`` (trainable params
    from their fp32 masters, plus buffers and frozen params), loadable with
    ``model.load_state_dict``: DeepSpeed's ``zero_to_fp32``."""
    path = resolve(load_dir, tag)
    if path is None:
        raise CheckpointError(f"no 'latest' file in {load_dir}; pass the tag")
    manifest = read_manifest(path)
    shapes = manifest["params"]
    wanted = {n: [(0, int(torch.Size(s).numel()))] for n, s in shapes.items()}
    pieces = _pieces(path, manifest, wanted)
    out = dict(_load(path / "extra.pt", weights_only=False)["module_state"])
    for name, shape in shapes.items():
        flat = torch.empty(wanted[name][0][1], dtype=torch.float32)
        for piece in pieces[name]:
            flat[piece.lo : piece.hi] = piece.tensors["master"]
        out[name] = flat.view(shape)
    return out
