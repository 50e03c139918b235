"""What every rank must agree on before training starts: the resolved config
and the model's params (names, shapes, dtypes). Ranks started with different
configs would otherwise fail later in a mismatched collective (a Gloo abort,
a hang until the timeout) or, for a hyperparameter such as the lr, train a
silently mixed model.

:func:`check_start` all-gathers one short digest per rank; only when the
digests differ does it gather the full descriptions to name the first
difference. A rank whose config failed to load takes part too, so every
rank raises instead of the others waiting for it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from fastzero.comm import Comm
from fastzero.config import Config, ConfigError, to_dict
from fastzero.parallel import is_tensor_parallel
from fastzero.runtime.stage3 import logical_shape

# per-rank by design: where each rank's monitor would write
PER_RANK_KEYS = ("tensorboard", "csv_monitor")


class RankMismatch(ConfigError):
    """Ranks started with different configs or models."""


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def describe_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as dotted keys (defaults filled in), less the per-rank ones."""
    flat = _flatten(to_dict(cfg))
    return {k: v for k, v in flat.items() if k.split(".")[0] not in PER_RANK_KEYS}


def describe_model(module: torch.nn.Module) -> dict[str, Any]:
    """Each param's and buffer's logical shape, dtype and whether it trains,
    by name. A tensor-parallel param's piece may differ in size across
    tensor ranks (an uneven split): its split dim stands in for its shape."""
    out = {}
    for name, p in module.named_parameters():
        shape = (
            f"split on dim {getattr(p, 'partition_dim', None)}" if is_tensor_parallel(p) else tuple(logical_shape(p))
        )
        out[name] = f"param {shape} {str(p.dtype).removeprefix('torch.')}" + ("" if p.requires_grad else " frozen")
    for name, b in module.named_buffers():
        out[name] = f"buffer {tuple(b.shape)} {str(b.dtype).removeprefix('torch.')}"
    return out


def _digest(described: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(described, sort_keys=False, default=repr).encode()).hexdigest()[:16]


def _first_difference(ours: dict, theirs: dict) -> tuple[str, Any, Any]:
    missing = object()
    for key in [*ours, *(k for k in theirs if k not in ours)]:
        a, b = ours.get(key, missing), theirs.get(key, missing)
        if a != b:
            show = lambda v: "(absent)" if v is missing else repr(v)
            return key, show(a), show(b)
    return "the order of the entries", "", ""


def check_start(
    comm: Comm, cfg: Config | None, error: Exception | None, module: torch.nn.Module, part: int = 0
) -> None:
    """Raises on every rank when a rank's config failed to load (`error`),
    or when the ranks' resolved configs or models differ: the first
    differing key or param, with its value on the first rank and on the
    first rank that differs. Models are compared among ranks of the same
    `part` (a pipeline stage holds other layers than its neighbours)."""
    if comm.world_size == 1:
        if error is not None:
            raise error
        return
    config = describe_config(cfg) if cfg is not None else None
    model = describe_model(module)
    mine = (
        None if error is None else f"{type(error).__name__}: {error}",
        _digest(config or {}),
        (part, _digest(model)),
    )
    everyone = comm.all_gather_objects(mine)
    failed = [(r, e) for r, (e, _, _) in enumerate(everyone) if e is not None]
    if failed:
        if error is not None:
            raise error
        rank, message = failed[0]
        raise RankMismatch(f"rank {rank} could not load its config ({message}); every rank stops")
    for index, what in ((1, "config"), (2, "model")):
        # per rank, the first rank it must agree with: any for the config, the first of its part for the model
        peer = [0 if index == 1 else next(q for q, e in enumerate(everyone) if e[2][0] == d[2][0]) for d in everyone]
        if all(d[index] == everyone[p][index] for d, p in zip(everyone, peer)):
            continue
        full = comm.all_gather_objects(config if what == "config" else model)
        other = next(r for r, d in enumerate(everyone) if d[index] != everyone[peer[r]][index])
        first = peer[other]
        key, a, b = _first_difference(full[first], full[other])
        label = "config key" if what == "config" else "model entry"
        raise RankMismatch(
            f"the ranks started with different {what}s: {label} {key} is {a} on rank {first} and {b} on rank "
            f"{other}. Start every rank with the same {'config' if what == 'config' else 'model definition'}"
        )
