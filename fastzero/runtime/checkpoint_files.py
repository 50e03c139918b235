"""The checkpoint layout on disk, with no engine knowledge: tag rules, the
names of the layout's files and version directories, every file operation a
save makes (each a module-level function, so the fault tests intercept them
all here), disk-full errors, the save lock, and finding a tag's complete
files. The overview (layout and guarantees) is in
:mod:`fastzero.runtime.checkpoint_io`."""

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
from pathlib import Path
from typing import Any

import torch

LATEST, POINTER, LOCK = "latest", "current", ".fastzero-save.lock"
MAX_TAG_BYTES = 200  # below the 255-byte name limit of common file systems, with room for temporaries
RANK_FILE = re.compile(r"rank\d{5,}\.pt")
_VERSION_DIR = re.compile(r"step\d+-[0-9a-f]{12}")
_LEGACY_FILES = re.compile(r"manifest\.json|extra\.pt|rank\d{5,}\.pt|\.current\.tmp")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_CHUNK = 1 << 20  # CRC32 is streamed in 1 MiB chunks


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this engine; nothing was changed."""


class CheckpointSaveError(CheckpointError):
    """A save that could not complete (the disk is full, say): its partial
    files were removed, ``latest`` and the previous checkpoints are intact."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def new_version(step: int) -> str:
    """A fresh name for a version directory of a save at `step`."""
    return f"step{step}-{uuid.uuid4().hex[:12]}"


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


def _write_bytes(path: Path, data: bytes) -> dict[str, int]:
    """`data` to `path`, fsynced (a file another rank made: node-local saves); its ``crc32`` and ``bytes``."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"crc32": zlib.crc32(data), "bytes": len(data)}


def mkdir(path: Path) -> None:
    path.mkdir()


def _create_exclusive(path: Path, text: str) -> None:
    """Creates `path` with `text`; FileExistsError when it exists (O_CREAT | O_EXCL)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path)


def _unlink(path: Path) -> None:
    os.unlink(path)


def rmdir(path: Path) -> None:
    os.rmdir(path)


# -- disk-full errors -----------------------------------------------------------------------------
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


def save_file(path: Path, obj: Any) -> dict[str, int]:
    """``_write``, with a full disk as a CheckpointSaveError that says how much was to be written."""
    try:
        return _write(path, obj)
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise _disk_full(path, _tensor_bytes(obj), exc) from exc
        raise


def save_text(path: Path, text: str) -> None:
    """``_write_text``, with a full disk as a CheckpointSaveError."""
    try:
        _write_text(path, text)
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise _disk_full(path, 0, exc) from exc
        raise


def save_bytes(path: Path, data: bytes) -> dict[str, int]:
    """``_write_bytes``, with a full disk as a CheckpointSaveError."""
    try:
        return _write_bytes(path, data)
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise _disk_full(path, len(data), exc) from exc
        raise


# -- the save lock and removing what a save replaced ----------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # it exists under another user (or the pid is not one we can ask about)
    return True


def acquire_lock(root: Path, tag: str) -> Path:
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


def release_lock(lock: Path | None) -> None:
    if lock is None:
        return
    try:
        _unlink(lock)
    except FileNotFoundError:
        pass
    except Exception as exc:  # the save itself is complete (or already failed): say so, do not mask it
        warnings.warn(f"could not remove the save lock {lock}: {exc}; remove it by hand", stacklevel=4)


def remove_quietly(path: Path, what: str) -> None:
    try:
        if path.is_dir():
            _rmtree(path)
        elif path.exists():
            _unlink(path)
    except Exception as exc:
        warnings.warn(f"could not remove {what} {path}: {exc}; the next save of this tag removes it", stacklevel=4)


def remove_old_versions(tag_dir: Path, keep: str) -> None:
    """After the flip: the tag's other versions (the replaced one, those of
    interrupted saves) and the files of the first layout go."""
    legacy = [p for p in tag_dir.iterdir() if p.is_file() and _LEGACY_FILES.fullmatch(p.name)]
    legacy.sort(key=lambda p: p.name != "manifest.json")  # the manifest first: a half-removed save is no checkpoint
    for p in legacy:
        remove_quietly(p, "a file of the replaced checkpoint")
    for p in tag_dir.iterdir():
        if p.is_dir() and p.name != keep and _VERSION_DIR.fullmatch(p.name):
            remove_quietly(p, "the replaced checkpoint")


# -- finding a checkpoint ------------------------------------------------------------------------
def _tags(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / POINTER).is_file() or (p / "manifest.json").is_file())


def locate(load_dir, tag=None) -> tuple[Path, Path] | None:
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
    elif tag_dir.is_dir() and (ds := sorted(tag_dir.glob("*model_states.pt"))):
        hint = (
            f": it is a DeepSpeed checkpoint ({ds[0].name}), whose layout fastzero does not read. Its weights "
            f"load with engine.load_module_state_dict(torch.load({str(ds[0])!r}, weights_only=False)) when that "
            "file holds the whole model (ZeRO stages 0-2), else from DeepSpeed's zero_to_fp32.py output through "
            "engine.load_state_dict; optimizer state does not carry over"
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
    located = locate(load_dir, tag)
    return None if located is None else located[1]


# -- checksums -------------------------------------------------------------------------------------
def crc32(path: Path) -> tuple[int, int]:
    """The CRC32 and size of the file at `path` (read in 1 MiB chunks)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return crc, size
