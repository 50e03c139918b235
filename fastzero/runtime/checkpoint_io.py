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
Checkpoints live on a file system every rank sees.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastzero.runtime.groups import STATE_KEYS, PieceState

FORMAT, VERSION = "fastzero-checkpoint", 2
READABLE_VERSIONS = (1, 2)  # 1: the tag directory holds the files, no checksums or aliases
LATEST, POINTER, LOCK = "latest", "current", ".fastzero-save.lock"
MAX_TAG_BYTES = 200  # below the 255-byte name limit of common file systems, with room for temporaries
DTYPES = ("float32", "float16", "bfloat16")
_VERSION_DIR = re.compile(r"step\d+-[0-9a-f]{12}")
_RANK_FILE = re.compile(r"rank\d{5,}\.pt")
_LEGACY_FILES = re.compile(r"manifest\.json|extra\.pt|rank\d{5,}\.pt|\.current\.tmp")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_CHUNK = 1 << 20  # CRC32 is streamed in 1 MiB chunks


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this engine; nothing was changed."""


class CheckpointSaveError(CheckpointError):
    """A save that could not complete (the disk is full, say): its partial
    files were removed, ``latest`` and the previous checkpoints are intact."""


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


# -- tags ------------------------------------------------------------------------------------------
def check_tag(tag: str) -> str:
    """`tag` if it is a valid checkpoint tag, else a ValueError naming the rule.

    A tag is the name of a directory in the save directory, round-tripped
    exactly through ``latest``: non-empty, at most 200 bytes of UTF-8, no
    leading or trailing whitespace, no control characters (NUL, newline),
    no ``/`` or ``\\``, not starting with ``.`` (``.``, ``..`` and hidden names
    are the layout's own), and not ``latest``."""
    if not isinstance(tag, str):
        raise ValueError(f"checkpoint tag {tag!r}: must be a str")
    rule = None
    if not tag:
        rule = "must not be empty"
    elif tag != tag.strip():
        rule = "must not begin or end with whitespace"
    elif any(ord(c) < 32 or ord(c) == 127 for c in tag):
        rule = "must not contain control characters (NUL, newline, tab, ...)"
    elif "/" in tag or "\\" in tag:
        rule = "must not contain '/' or '\\' (a tag is one directory name)"
    elif tag.startswith("."):
        rule = "must not start with '.' ('.', '..' and hidden names are the checkpoint layout's own)"
    elif tag == LATEST:
        rule = f"must not be {LATEST!r} (the file that names the newest tag)"
    else:
        try:
            size = len(tag.encode("utf-8"))
        except UnicodeEncodeError:
            rule = "must be valid Unicode (it has a lone surrogate)"
        else:
            if size > MAX_TAG_BYTES:
                rule = f"must be at most {MAX_TAG_BYTES} bytes of UTF-8 (it has {size})"
    if rule is not None:
        raise ValueError(f"checkpoint tag {tag!r}: {rule}")
    return tag


# -- the file operations a save makes (module-level, so the fault tests can intercept each one) -----
class _CrcWriter:
    """A file wrapper that computes the CRC32 and size of what passes through."""

    def __init__(self, f) -> None:
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write(path: Path, obj: Any) -> dict[str, int]:
    """``torch.save`` to `path`, fsynced; returns the file's ``crc32`` and ``bytes``."""
    with open(path, "wb") as f:
        w = _CrcWriter(f)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return {"crc32": w.crc, "bytes": w.size}


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _mkdir(path: Path) -> None:
    path.mkdir()


def _create_exclusive(path: Path, text: str) -> None:
    """Creates `path` with `text`; FileExistsError when it exists (O_CREAT | O_EXCL)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path)


def _unlink(path: Path) -> None:
    os.unlink(path)


def _rmdir(path: Path) -> None:
    os.rmdir(path)


# -- saving ----------------------------------------------------------------------------------------
def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _disk_full(path: Path, nbytes: int, exc: OSError) -> CheckpointSaveError:
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return CheckpointSaveError(
        f"disk full ({errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}) while writing {path}: "
        f"{nbytes:,} bytes of tensors to write, {free} on its file system; the partial save is removed and "
        "'latest' and the previous checkpoints are intact"
    )


def _save_file(path: Path, obj: Any) -> dict[str, int]:
    try:
        return _write(path, obj)
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise _disk_full(path, _tensor_bytes(obj), exc) from exc
        raise


def _save_text(path: Path, text: str) -> None:
    try:
        _write_text(path, text)
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise _disk_full(path, 0, exc) from exc
        raise


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # it exists under another user (or the pid is not one we can ask about)
    return True


def _acquire_lock(root: Path, tag: str) -> Path:
    """Takes the save lock of `root` for this process (rank 0), or raises a
    CheckpointError naming the save that holds it."""
    lock = root / LOCK
    host = socket.gethostname()
    me = json.dumps({"host": host, "pid": os.getpid(), "started": time.time(), "tag": tag})
    for _ in range(3):
        try:
            _create_exclusive(lock, me)
            return lock
        except FileExistsError:
            pass
        try:
            owner = json.loads(lock.read_text())
            who = (owner["host"], int(owner["pid"]), float(owner["started"]), owner.get("tag"))
        except FileNotFoundError:
            continue  # released meanwhile: try again
        except (OSError, ValueError, KeyError, TypeError):
            raise CheckpointError(
                f"{root}: the save lock {lock} exists but its owner is unreadable (a save that crashed while "
                "taking it?); if no save into this directory is running, remove the file"
            ) from None
        o_host, o_pid, o_started, o_tag = who
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(o_started))
        if o_host == host and not _pid_alive(o_pid):
            warnings.warn(
                f"{lock}: taking over a stale save lock (pid {o_pid} on {o_host}, since {since}, tag {o_tag!r}: "
                "that process is gone)",
                stacklevel=4,
            )
            try:
                _unlink(lock)
            except FileNotFoundError:
                pass
            continue
        raise CheckpointError(
            f"{root}: another job is saving into this directory (lock {lock} held by pid {o_pid} on host "
            f"{o_host} since {since}, tag {o_tag!r}); two saves into one directory would mix their files. "
            "If that job is dead, remove the lock file"
        )
    raise CheckpointError(f"{root}: could not take the save lock {lock} (it keeps changing hands)")


def _release_lock(lock: Path | None) -> None:
    if lock is None:
        return
    try:
        _unlink(lock)
    except FileNotFoundError:
        pass
    except Exception as exc:  # the save itself is complete (or already failed): say so, do not mask it
        warnings.warn(f"could not remove the save lock {lock}: {exc}; remove it by hand", stacklevel=4)


def _remove_quietly(path: Path, what: str) -> None:
    try:
        if path.is_dir():
            _rmtree(path)
        elif path.exists():
            _unlink(path)
    except Exception as exc:
        warnings.warn(f"could not remove {what} {path}: {exc}; the next save of this tag removes it", stacklevel=4)


def _remove_old_versions(tag_dir: Path, keep: str) -> None:
    """After the flip: the tag's other versions (the replaced one, those of
    interrupted saves) and the files of the first layout go."""
    legacy = [p for p in tag_dir.iterdir() if p.is_file() and _LEGACY_FILES.fullmatch(p.name)]
    legacy.sort(key=lambda p: p.name != "manifest.json")  # the manifest first: a half-removed save is no checkpoint
    for p in legacy:
        _remove_quietly(p, "a file of the replaced checkpoint")
    for p in tag_dir.iterdir():
        if p.is_dir() and p.name != keep and _VERSION_DIR.fullmatch(p.name):
            _remove_quietly(p, "the replaced checkpoint")


def _all_gather_objects(comm, obj) -> list:
    if comm.world_size == 1:
        return [obj]
    out = [None] * comm.world_size
    torch.distributed.all_gather_object(out, obj, group=comm.group)
    return out


def _outcomes(comm, error: BaseException | None, payload: Any = None) -> tuple[list, list[tuple[int, str]]]:
    """Every rank's payload, and which ranks failed (with their message)."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    gathered = _all_gather_objects(comm, (msg, payload))
    return [p for _, p in gathered], [(r, m) for r, (m, _) in enumerate(gathered) if m is not None]


def _raise_failed(
    error: BaseException | None, failed: list[tuple[int, str]], what: str, then: str = "the partial save is removed"
) -> None:
    if error is not None:
        raise error
    rank, msg = failed[0]
    raise CheckpointSaveError(f"rank {rank} failed {what} ({msg}); {then}")


def save_checkpoint(engine, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True) -> str:
    """Every rank calls it. Returns the tag's directory ``<save_dir>/<tag>``.

    Any failure (the disk full, another job holding the lock) raises on
    every rank and leaves ``latest`` and the previous checkpoints intact."""
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        raise RuntimeError(
            f"save_checkpoint in the middle of gradient accumulation (micro-step {engine.micro_steps}, "
            f"{engine.gradient_accumulation_steps()} per step): the partial gradients would be lost; save after step()"
        )
    comm, root = engine.comm, Path(save_dir)
    tag = check_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")  # before any write
    tag_dir = root / tag
    lock = version = None
    created = flipped = False
    error: BaseException | None = None

    def abort() -> None:  # rank 0, before the flip: the new version goes, the old one was never touched
        if version is not None:
            _remove_quietly(tag_dir / version, "the partial save")
        if created:
            try:
                _rmdir(tag_dir)
            except OSError:
                pass
        _release_lock(lock)

    # 1. rank 0 takes the lock and makes the version directory; everyone learns its name
    if comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = _acquire_lock(root, tag)
            created = not tag_dir.exists()
            if created:
                _mkdir(tag_dir)
            version = f"step{engine.global_steps}-{uuid.uuid4().hex[:12]}"
            _mkdir(tag_dir / version)
        except Exception as exc:
            error = exc
            abort()
    payloads, failed = _outcomes(comm, error, version)
    if failed:
        _raise_failed(error, failed, "to start the save")
    version = payloads[0]
    path = tag_dir / version

    # 2. every rank writes its file (fsynced, with its checksum)
    index = info = None
    try:
        pieces = []
        if engine.stage > 0 or comm.rank == 0:  # stage 0: every rank holds everything, rank 0 writes it
            for g, opt_params in _groups(engine):
                for piece in g.pieces_out(engine.optimizer, opt_params):
                    # a clone: not the whole storage
                    tensors = {k: v.detach().float().cpu().clone() for k, v in piece.tensors.items()}
                    pieces.append({"name": piece.name, "lo": piece.lo, "hi": piece.hi, **tensors})
        own = {"pieces": pieces, "rng": torch.get_rng_state(), "onebit": _onebit_state(engine)}
        info = _save_file(path / _rank_file(comm.rank), own)
        index = [[p["name"], p["lo"], p["hi"]] for p in pieces]
    except Exception as exc:
        error = exc
    payloads, failed = _outcomes(comm, error, (index, info))
    if failed:
        if comm.rank == 0:
            abort()
        comm.barrier()
        _raise_failed(error, failed, "to write its checkpoint file")

    # 3. rank 0: extra.pt, the manifest last, fsync, then flip the tag's pointer, then latest, then clean up
    if comm.rank == 0:
        try:
            aliases, rest = _module_split(engine)
            module_state = {k: v.detach().cpu().clone() for k, v in rest.items()}
            sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
            extra = {"client_state": client_state or {}, "module_state": module_state, "lr_scheduler": sched}
            checksums = {_rank_file(r): inf for r, (_, inf) in enumerate(payloads)}
            checksums["extra.pt"] = _save_file(path / "extra.pt", extra)
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
                "files": {_rank_file(r): idx for r, (idx, _) in enumerate(payloads)},
                "checksums": checksums,
                "aliases": aliases,
            }
            _save_text(path / "manifest.json", json.dumps(manifest, indent=1))
            _fsync_dir(path)
            _save_text(tag_dir / ".current.tmp", version)
            _replace(tag_dir / ".current.tmp", tag_dir / POINTER)
            flipped = True  # from here the tag is the new checkpoint
            _fsync_dir(tag_dir)
            if created:
                _fsync_dir(root)
            if save_latest:
                _save_text(root / ".latest.tmp", tag)
                _replace(root / ".latest.tmp", root / LATEST)
                _fsync_dir(root)
            _remove_old_versions(tag_dir, keep=version)
        except Exception as exc:
            error = exc
            if not flipped:
                abort()
            elif isinstance(exc, (OSError, CheckpointError)):  # the tag is the new checkpoint: say so
                error = CheckpointSaveError(
                    f"{tag_dir} is saved and complete, but finishing the save failed: {exc}; "
                    f"{LATEST!r} may still name the previous checkpoint"
                )
                error.__cause__ = exc
        if flipped:
            _release_lock(lock)
    _, failed = _outcomes(comm, error)
    if failed:
        _raise_failed(error, failed, "to finish the save", "its error says what was saved")
    return str(tag_dir)


# -- finding and validating ------------------------------------------------------------------------
def _tags(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / POINTER).is_file() or (p / "manifest.json").is_file())


def _locate(load_dir, tag=None) -> tuple[Path, Path] | None:
    """(the tag's directory, the directory of its complete files) for `tag`,
    or for the tag ``latest`` names (None when there is no ``latest``)."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        try:
            text = latest.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{latest} is unreadable: {exc}") from None
        try:
            tag = check_tag(text.strip())
        except ValueError as exc:
            raise CheckpointError(f"{latest} does not name a checkpoint: {exc}") from None
    else:
        tag = check_tag(str(tag))
    tag_dir = root / tag
    pointer = tag_dir / POINTER
    if pointer.is_file():
        try:
            version = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{pointer} is unreadable: {exc}") from None
        if not _VERSION_DIR.fullmatch(version):
            raise CheckpointError(f"{pointer} is corrupt: {version[:80]!r} is not a checkpoint version's name")
        data = tag_dir / version
        if not (data / "manifest.json").is_file():
            raise CheckpointError(f"{pointer} names {version}, which has no manifest.json: the checkpoint is damaged")
        return tag_dir, data
    if (tag_dir / "manifest.json").is_file():  # the first layout: the tag's directory holds the files
        return tag_dir, tag_dir
    hint = ""
    leftovers = [p.name for p in (root / f".{tag}.old", root / f".{tag}.tmp") if (p / "manifest.json").is_file()]
    if leftovers:
        hint = (
            f"; a save by an older fastzero was interrupted and left a complete checkpoint in {leftovers[0]}: "
            f"rename it to {tag} to load it"
        )
    elif tag_dir.is_dir():
        hint = " (an interrupted first save of this tag?)"
    raise CheckpointError(
        f"{tag_dir} is not a fastzero checkpoint (no {POINTER} and no manifest.json){hint}; "
        f"checkpoints in {root}: {_tags(root)}"
    )


def resolve(load_dir, tag=None) -> Path | None:
    """The directory of the checkpoint's files (``manifest.json``) for `tag`,
    or for the tag ``latest`` names (None when there is no ``latest``)."""
    located = _locate(load_dir, tag)
    return None if located is None else located[1]


def _is_int(v: Any, lo: int | None = None, hi: int | None = None) -> bool:
    return type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi)


def _validate(manifest: Any, where: Path) -> None:
    """The manifest against its schema: a CheckpointError naming the first
    field that is missing or of the wrong type."""

    def bad(field: str, expected: str, value: Any = None, missing: bool = False) -> CheckpointError:
        found = "it is missing" if missing else f"found {type(value).__name__} {value!r:.80}"
        return CheckpointError(f"{where}: field {field!r} must be {expected}; {found}")

    def need(field: str, expected: str, ok) -> Any:
        if field not in manifest:
            raise bad(field, expected, missing=True)
        if not ok(manifest[field]):
            raise bad(field, expected, manifest[field])
        return manifest[field]

    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: the manifest must be a JSON object; found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where.parent} is not a fastzero checkpoint (format {manifest.get('format')!r})")
    version = manifest.get("version")
    if version not in READABLE_VERSIONS or type(version) is not int:
        raise CheckpointError(
            f"{where.parent} is a fastzero checkpoint of version {version!r}; this fastzero reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    need("world_size", "an int >= 1", lambda v: _is_int(v, 1))
    need("stage", "an int in 0..3", lambda v: _is_int(v, 0, 3))
    need("dtype", f"one of {DTYPES}", lambda v: v in DTYPES)
    for field in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        need(field, "an int >= 0", lambda v: _is_int(v, 0))
    need("loss_scaler", "an object or null", lambda v: v is None or isinstance(v, dict))
    if "onebit_errors" in manifest:
        need("onebit_errors", "a bool", lambda v: isinstance(v, bool))
    shape_ok = lambda s: isinstance(s, list) and all(_is_int(d, 0) for d in s)
    params = need(
        "params",
        "an object of param name -> shape (a list of ints >= 0)",
        lambda v: isinstance(v, dict) and all(shape_ok(s) for s in v.values()),
    )
    need(
        "groups",
        'a list of objects {"step": int >= 0, "names": [param names], "hyper": object}',
        lambda v: (
            isinstance(v, list)
            and all(
                isinstance(g, dict)
                and _is_int(g.get("step"), 0)
                and isinstance(g.get("names"), list)
                and all(isinstance(n, str) and n in params for n in g["names"])
                and isinstance(g.get("hyper"), dict)
                for g in v
            )
        ),
    )
    numel = {n: int(torch.Size(s).numel()) for n, s in params.items()}
    need(
        "files",
        "an object of rank file name (rankNNNNN.pt) -> list of [param name, lo, hi] with 0 <= lo <= hi <= numel",
        lambda v: (
            isinstance(v, dict)
            and all(
                isinstance(f, str)
                and _RANK_FILE.fullmatch(f)
                and isinstance(index, list)
                and all(
                    isinstance(e, list)
                    and len(e) == 3
                    and isinstance(e[0], str)
                    and e[0] in numel
                    and _is_int(e[1], 0)
                    and _is_int(e[2], e[1], numel[e[0]])
                    for e in index
                )
                for f, index in v.items()
            )
        ),
    )
    if version >= 2:
        files = [*manifest["files"], "extra.pt"]
        sum_ok = lambda c: isinstance(c, dict) and _is_int(c.get("crc32"), 0, 2**32 - 1) and _is_int(c.get("bytes"), 0)
        need(
            "checksums",
            'an object of file name -> {"crc32": int, "bytes": int}, for every rank file and extra.pt',
            lambda v: isinstance(v, dict) and all(sum_ok(v.get(f)) for f in files),
        )
        need(
            "aliases",
            "an object of state_dict name -> the name of a param in 'params'",
            lambda v: isinstance(v, dict) and all(isinstance(a, str) and c in params for a, c in v.items()),
        )


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint files in `path`, validated."""
    where = Path(path) / "manifest.json"
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{where} is unreadable or corrupt: {exc}") from None
    _validate(manifest, where)
    return manifest


def _crc32(path: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return crc, size


def _read(path: Path, fname: str, manifest: dict, weights_only: bool = True) -> Any:
    """``torch.load`` of checkpoint file `fname`, after checking its size and
    CRC32 against the manifest (version 2; version 1 has no checksums)."""
    file = path / fname
    want = manifest.get("checksums", {}).get(fname) if manifest["version"] >= 2 else None
    if want is not None:
        try:
            crc, size = _crc32(file)
        except OSError as exc:
            raise CheckpointError(f"{file} is missing or unreadable: {exc}") from None
        if size != want["bytes"]:
            raise CheckpointError(
                f"{file} has {size} bytes; the manifest records {want['bytes']} (truncated or replaced)"
            )
        if crc != want["crc32"]:
            raise CheckpointError(
                f"{file}: checksum mismatch, expected CRC32 {want['crc32']:08x}, found {crc:08x}; the file is corrupt"
            )
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # torch raises many kinds for a truncated or foreign file
        raise CheckpointError(f"{file} is unreadable or corrupt ({type(exc).__name__}: {exc})") from None


def _pieces(
    path: Path, manifest: dict, wanted: dict[str, list[tuple[int, int]]], cache: dict[str, Any] | None = None
) -> dict[str, list[PieceState]]:
    """The saved pieces that overlap the `wanted` ranges, by param name,
    read from the files that hold them and checked (checksum, sizes). The
    files read are left in `cache`, by name."""
    cache = {} if cache is None else cache
    out: dict[str, list[PieceState]] = {}
    for fname, index in manifest["files"].items():
        if not any(n in wanted and any(lo < w_hi and w_lo < hi for w_lo, w_hi in wanted[n]) for n, lo, hi in index):
            continue
        data = cache[fname] = _read(path, fname, manifest)
        if not isinstance(data, dict) or not isinstance(data.get("pieces"), list):
            raise CheckpointError(f"{path / fname} holds no list of pieces; the file is corrupt")
        for piece in data["pieces"]:
            n = piece["hi"] - piece["lo"]
            if any(not isinstance(piece.get(k), torch.Tensor) or piece[k].numel() != n for k in STATE_KEYS):
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


def _read_extra(path: Path, manifest: dict) -> dict:
    extra = _read(path, "extra.pt", manifest, weights_only=False)  # client state may hold any object
    if not isinstance(extra, dict) or not isinstance(extra.get("module_state"), dict):
        raise CheckpointError(f"{path / 'extra.pt'} holds no module_state; the file is corrupt")
    return extra


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


def _module_state(engine, saved: dict, path: Path, strict: bool) -> tuple[dict, list[str], list[str]]:
    """The saved buffers and frozen params to load into the module, and the
    names missing from the checkpoint and not in the module. Strict: any
    such name is a CheckpointError; a shape that differs always is."""
    _, ours = _module_split(engine)
    missing = [k for k in ours if k not in saved]
    unexpected = [k for k in saved if k not in ours]
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


def _prepare(engine, load_dir, tag, strict: bool) -> _Ready | None:
    located = _locate(load_dir, tag)
    if located is None:
        return None
    tag_dir, path = located
    manifest = read_manifest(path)
    _check_model(manifest, engine, path)
    wanted: dict[str, list[tuple[int, int]]] = {}
    for g, opt_params in _groups(engine):
        for piece in g.owned(opt_params):
            wanted.setdefault(piece.name, []).append((piece.lo, piece.hi))
    files: dict[str, Any] = {}
    pieces = _pieces(path, manifest, wanted, files)
    extra = _read_extra(path, manifest)
    module_state, missing, unexpected = _module_state(engine, extra["module_state"], path, strict)
    same_world = manifest["world_size"] == engine.comm.world_size
    own_file = {}
    if same_world:
        name = _rank_file(engine.comm.rank)
        own_file = files[name] if name in files else _read(path, name, manifest)
        if not isinstance(own_file, dict):
            raise CheckpointError(f"{path / name} is not a rank file; the file is corrupt")
    return _Ready(tag_dir, manifest, pieces, extra, module_state, missing, unexpected, own_file, same_world)


def load_checkpoint(
    engine,
    load_dir,
    tag=None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_strict: bool = True,
):
    """Every rank calls it. Returns (the tag's directory, client_state), or
    (None, None) when `load_dir` has no ``latest`` and no tag is given.

    Every rank reads and checks all it needs, then the ranks agree (one small
    all-reduce); only if all are ready does any rank change its state. A
    rank that failed raises its own error, the others a CheckpointError
    naming it: nothing changed anywhere. `load_module_strict`: the module's
    buffers and frozen params must be exactly the checkpoint's (False: load
    those that match and warn about the rest)."""
    comm = engine.comm
    ready: _Ready | None = None
    error: BaseException | None = None
    try:
        ready = _prepare(engine, load_dir, tag, load_module_strict)
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
    _apply(engine, ready, load_optimizer_states, load_lr_scheduler_states)
    return str(ready.tag_dir), ready.extra["client_state"]


def _apply(engine, ready: _Ready, load_optimizer_states: bool, load_lr_scheduler_states: bool) -> None:
    """Every rank is ready: change the engine."""
    manifest, extra = ready.manifest, ready.extra
    if ready.missing or ready.unexpected:
        warnings.warn(
            f"load_module_strict=False: buffers and frozen params missing from the checkpoint (left as they are): "
            f"{ready.missing}; in the checkpoint but not in the module (ignored): {ready.unexpected}",
            stacklevel=4,
        )
    keys = STATE_KEYS if load_optimizer_states else ("master",)
    with torch.no_grad():
        for g, opt_params in _groups(engine):
            g.pieces_in(engine.optimizer, opt_params, ready.pieces, keys)
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
        engine.module.load_state_dict(ready.module_state, strict=False)  # checked: only the non-trained names
        if load_optimizer_states:
            _load_onebit_state(
                engine, ready.own_file.get("onebit"), ready.same_world, manifest.get("onebit_errors", False)
            )
    if load_lr_scheduler_states and engine.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    if engine.loss_scaler is not None and manifest["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    for key in ("global_steps", "global_samples", "skipped_steps"):
        setattr(engine, key, manifest[key])
    # saved at a boundary; the accumulation steps may differ now (another world size, same global batch)
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    rng = ready.own_file.get("rng")
    if rng is not None:
        torch.set_rng_state(rng)
    for g in engine.groups:
        g.zero_grads()


def consolidate(load_dir, tag=None) -> dict[str, torch.Tensor]:
    """The checkpoint's model as a plain fp32 ``state_dict`` (trainable params
    from their fp32 masters, plus buffers and frozen params, and a tied
    param under each of its names, as one tensor), loadable with
    ``model.load_state_dict``: DeepSpeed's ``zero_to_fp32``. Every file is
    checked against its checksum."""
    path = resolve(load_dir, tag)
    if path is None:
        raise CheckpointError(f"no 'latest' file in {load_dir}; pass the tag")
    manifest = read_manifest(path)
    shapes = manifest["params"]
    wanted = {n: [(0, int(torch.Size(s).numel()))] for n, s in shapes.items()}
    pieces = _pieces(path, manifest, wanted)
    out = dict(_read_extra(path, manifest)["module_state"])
    for name, shape in shapes.items():
        flat = torch.empty(wanted[name][0][1], dtype=torch.float32)
        for piece in pieces.get(name, []):
            flat[piece.lo : piece.hi] = piece.tensors["master"]
        out[name] = flat.view(shape)
    for alias, name in manifest.get("aliases", {}).items():
        out[alias] = out[name]  # the same tensor under both names, as torch's state_dict shares it
    return out
