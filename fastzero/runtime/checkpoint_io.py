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

FORMAT, VERSION = "fastzero-checkpoint", 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this engine; nothing was changed."""


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _owned(engine) -> list[tuple[str, int, int, torch.Tensor, int]]:
    """(param name, lo, hi, optimizer param, offset in it) for every piece of
    a param whose master and optimizer state this rank holds."""
    return [piece for g, og in zip(engine.groups, engine.optimizer.param_groups) for piece in g.owned(og["params"])]


def _state(engine, opt_param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The flattened fp32 master, exp_avg and exp_avg_sq of one optimizer
    param (creating the state if no step has run yet)."""
    state = engine.optimizer.state[opt_param]
    if not state:
        engine.optimizer._init_state(opt_param, state)
    master = state.get("master_param", opt_param)
    return {"master": master.reshape(-1), "exp_avg": state["exp_avg"].reshape(-1),
            "exp_avg_sq": state["exp_avg_sq"].reshape(-1)}  # fmt: skip


def _onebit_state(engine) -> dict | None:
    """1-bit Adam's error-feedback buffers on this rank (the optimizer's at
    stage 0, the groups' at stage 1): per-rank state, like the RNG."""
    if not getattr(engine, "onebit", False):
        return None
    groups = [None if g.compress_error is None else g.compress_error.cpu() for g in engine.groups]
    return {"stage": engine.stage, "optimizer": engine.optimizer.error_state(), "groups": groups}


def _has_errors(engine) -> bool:
    """Whether 1-bit Adam has error-feedback state (it is past freeze_step)."""
    if not getattr(engine, "onebit", False):
        return False
    return engine.optimizer.error_bytes() > 0 or any(g.compress_error is not None for g in engine.groups)


def _load_onebit_state(engine, saved: dict | None, same_world: bool, had_errors: bool) -> None:
    """Restores this rank's error buffers when the world size and stage are
    the saved ones; else they restart from zero (with a warning when the
    checkpoint had some)."""
    if not getattr(engine, "onebit", False):
        return
    restored = same_world and saved is not None and saved["stage"] == engine.stage
    restored = restored and engine.optimizer.load_error_state(saved["optimizer"])
    if not restored:
        engine.optimizer.load_error_state(None)
    for g, error in zip(engine.groups, saved["groups"] if restored else [None] * len(engine.groups)):
        g.compress_error = None if error is None else error.to(g.device)
    if not restored and had_errors:
        warnings.warn("1-bit Adam: the checkpoint's error-feedback buffers are for another world size or stage; "
                      "they restart from zero (a one-time, bounded perturbation)", stacklevel=4)  # fmt: skip


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
        for name, lo, hi, opt_param, off in _owned(engine):
            tensors = {k: v[off : off + hi - lo].detach().float().cpu().clone()  # a clone: not the whole storage
                       for k, v in _state(engine, opt_param).items()}  # fmt: skip
            pieces.append({"name": name, "lo": lo, "hi": hi, **tensors})
    own = {"pieces": pieces, "rng": torch.get_rng_state(), "onebit": _onebit_state(engine)}
    _write(tmp / _rank_file(comm.rank), own)
    index = [[p["name"], p["lo"], p["hi"]] for p in pieces]
    indexes = _all_gather_objects(comm, index)
    comm.barrier()
    if comm.rank == 0:
        trainable = {id(p) for g in engine.groups for p in g.params}
        module_state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict(keep_vars=True).items()
                        if id(v) not in trainable}  # fmt: skip
        sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        extra = {"client_state": client_state or {}, "module_state": module_state, "lr_scheduler": sched}
        _write(tmp / "extra.pt", extra)
        manifest = {
            "format": FORMAT, "version": VERSION, "world_size": comm.world_size, "stage": engine.stage,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "onebit_errors": _has_errors(engine),
            "groups": [{"step": int(float(og.get("step", 0))), "names": g.names,
                        "hyper": {k: v for k, v in og.items() if k != "params" and k != "step"}}
                       for g, og in zip(engine.groups, engine.optimizer.param_groups)],
            "params": {n: list(s) for g in engine.groups for n, s in zip(g.names, g.shapes)},
            "files": {_rank_file(r): idx for r, idx in enumerate(indexes)},
        }  # fmt: skip
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


def _pieces(path: Path, manifest: dict, wanted: dict[str, list[tuple[int, int]]]) -> dict[str, list[dict]]:
    """The saved pieces that overlap the `wanted` ranges, by param name,
    read from the files that hold them and checked for size."""
    out: dict[str, list[dict]] = {}
    for fname, index in manifest["files"].items():
        if not any(n in wanted and any(lo < w_hi and w_lo < hi for w_lo, w_hi in wanted[n]) for n, lo, hi in index):
            continue
        data = _load(path / fname)
        for piece in data["pieces"]:
            n = piece["hi"] - piece["lo"]
            if any(piece[k].numel() != n for k in ("master", "exp_avg", "exp_avg_sq")):
                raise CheckpointError(f"{path / fname}: piece {piece['name']}[{piece['lo']}:{piece['hi']}] has "
                                      "tensors of the wrong size; the file is corrupt")  # fmt: skip
            out.setdefault(piece["name"], []).append(piece)
    for name, ranges in wanted.items():
        for lo, hi in ranges:
            covered = sum(
                min(hi, p["hi"]) - max(lo, p["lo"]) for p in out.get(name, []) if p["lo"] < hi and lo < p["hi"]
            )
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
                raise CheckpointError(f"{path}: param {name} has shape {tuple(saved[name])} in the checkpoint and "
                                      f"{tuple(shape)} in the model")  # fmt: skip
    ours = {n for g in engine.groups for n in g.names}
    extra = [n for n in saved if n not in ours]
    if extra:
        raise CheckpointError(f"{path}: param {extra[0]} of the checkpoint is not trained by this engine")
    if [grp["names"] for grp in manifest["groups"]] != [g.names for g in engine.groups]:
        raise CheckpointError(f"{path}: the checkpoint's param groups differ from the engine's")


def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True):  # fmt: skip
    """Every rank calls it. Returns (path, client_state), or (None, None)
    when `load_dir` has no ``latest`` and no tag is given."""
    path = resolve(load_dir, tag)
    if path is None:
        warnings.warn(f"no 'latest' file in {load_dir}: nothing loaded (pass tag= to load a given checkpoint)",
                      stacklevel=3)  # fmt: skip
        return None, None
    manifest = read_manifest(path)
    _check_model(manifest, engine, path)
    owned = _owned(engine)
    wanted: dict[str, list[tuple[int, int]]] = {}
    for name, lo, hi, _, _ in owned:
        wanted.setdefault(name, []).append((lo, hi))
    pieces = _pieces(path, manifest, wanted)
    extra = _load(path / "extra.pt", weights_only=False)  # client state may hold any object
    same_world = manifest["world_size"] == engine.comm.world_size
    own_file = _load(path / _rank_file(engine.comm.rank)) if same_world else {}
    rng = own_file.get("rng")
    # everything is read and checked: now change the engine
    keys = ("master", "exp_avg", "exp_avg_sq") if load_optimizer_states else ("master",)
    with torch.no_grad():
        for name, lo, hi, opt_param, off in owned:
            st = _state(engine, opt_param)
            for piece in pieces[name]:
                a, z = max(lo, piece["lo"]), min(hi, piece["hi"])
                if a >= z:
                    continue
                for key in keys:
                    st[key][off + a - lo : off + z - lo].copy_(piece[key][a - piece["lo"] : z - piece["lo"]])
            if st["master"].data_ptr() != opt_param.data_ptr():  # low-precision training: the param from its master
                opt_param.reshape(-1)[off : off + hi - lo].copy_(st["master"][off : off + hi - lo])
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
            flat[piece["lo"] : piece["hi"]] = piece["master"]
        out[name] = flat.view(shape)
    return out
