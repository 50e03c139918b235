"""Reading ``FASTZERO_*`` environment variables: one helper per kind of
value, each raising ``ValueError`` that names the variable, the value and
what is allowed. A setting that names nothing is an error, never a silent
default (docs/launcher.md lists every variable and its values).

Standard library only, in the lowest layer (fastzero.native), so every
layer may use it. ``fastzero/native/build.py`` is the exception: ``setup.py``
runs it by path, where fastzero is not importable, so it checks its one
variable (``FASTZERO_CACHE_DIR``) itself, as ``setup.py`` does its switches.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping


def _get(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The value, stripped; None when unset or empty (empty means unset)."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def env_float(
    name: str,
    default: float,
    *,
    min_exclusive: float | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> float:
    """A finite number (> `min_exclusive`, >= `minimum`, <= `maximum` when
    given), or `default` when unset."""
    raw = _get(name, environ)
    if raw is None:
        return default
    bounds = []
    if min_exclusive is not None:
        bounds.append(f"> {min_exclusive:g}")
    if minimum is not None:
        bounds.append(f">= {minimum:g}")
    if maximum is not None:
        bounds.append(f"<= {maximum:g}")
    allowed = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; it must be {allowed} (or unset)") from None
    if (
        not math.isfinite(value)
        or (min_exclusive is not None and value <= min_exclusive)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        raise ValueError(f"{name}={raw!r}: it must be {allowed} (or unset)")
    return value


def env_choice(
    name: str, choices: Iterable[str], default: str | None = None, *, environ: Mapping[str, str] | None = None
) -> str | None:
    """One of `choices` (compared in lower case), or `default` when unset."""
    raw = _get(name, environ)
    if raw is None:
        return default
    choices = tuple(choices)
    if raw.lower() not in choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}; unset it or pick one")
    return raw.lower()


def env_flag(name: str, default: bool, *, environ: Mapping[str, str] | None = None) -> bool:
    """``1`` or ``0`` (nothing else: "false" or "no" would read as on in a
    test of non-emptiness and as off in a test against "1"), or `default` when unset."""
    raw = _get(name, environ)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: it must be 1 or 0 (or unset)")
    return raw == "1"


def env_path(name: str, *, must_exist: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """A path (``~`` expanded), or None when unset. `must_exist`: "file" or
    "dir", the kind of thing that must be there; else a path that exists must
    at least not be a file when a directory is expected (see the callers)."""
    raw = _get(name, environ)
    if raw is None:
        return None
    path = os.path.expanduser(raw)
    if must_exist == "file" and not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "no such file"
        raise ValueError(f"{name}={raw!r}: {what}; it must name an existing file (or be unset)")
    if must_exist == "dir" and not os.path.isdir(path):
        what = "not a directory" if os.path.exists(path) else "no such directory"
        raise ValueError(f"{name}={raw!r}: {what}; it must name an existing directory (or be unset)")
    return path
