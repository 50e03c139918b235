"""Hostfiles and resource filters with DeepSpeed's semantics
(``deepspeed/launcher/runner.py``), plus fastzero's up-front safety checks.

A hostfile has one ``hostname slots=N`` per line; lines starting with ``#``
and empty lines are skipped, and anything after ``slots=N`` is ignored (an
MPI hostfile's ``max_slots=`` too). Slot ``i`` of a host is its device ``i``.

``--include``/``--exclude`` take ``NODE_SPEC[@NODE_SPEC ...]`` with
``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``: ``worker-0@worker-1:0,2`` is all of
worker-0's slots and slots 0 and 2 of worker-1; ``worker-1:0`` excluded is
everything but slot 0 of worker-1. The two are mutually exclusive.
"""

from __future__ import annotations

import re
from pathlib import Path

# More processes per host than this is a typo (slots=40000), not a machine.
MAX_SLOTS = 1024
# A host name or address as ssh and pdsh take it: names, IPv4, [IPv6], user@host.
# No leading '-' (ssh would read an option), no whitespace, no shell
# metacharacters, no ',' (pdsh's list separator).
HOST_RE = re.compile(r"[A-Za-z0-9_\[][A-Za-z0-9_.@:%\[\]-]*")
# DeepSpeed's hostfile line: a host, whitespace, slots=N, then anything.
# fastzero also takes spaces around '='.
LINE_RE = re.compile(r"(\S+)\s+slots\s*=\s*(\d+)(?:\s.*)?")

Resources = dict[str, list[int]]  # host -> the slots (device indices) used there, in hostfile order


class LaunchError(RuntimeError):
    pass


def check_host(host: str, what: str) -> None:
    if HOST_RE.fullmatch(host) is None:
        raise LaunchError(
            f"{what} {host!r} is not a host name or address "
            "(letters, digits and . _ - @ : % [ ]; not starting with '-')"
        )


def parse_hostfile(text: str, source: str = "hostfile") -> list[tuple[str, int]]:
    """[(host, slots)] in file order; each host once."""
    hosts: list[tuple[str, int]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE_RE.fullmatch(line)
        if match is None:
            raise LaunchError(
                f"{source}:{lineno}: hostfile contains a bad entry: {line!r}; expected 'hostname slots=N'"
            )
        host, slots = match.group(1), int(match.group(2))
        check_host(host, f"{source}:{lineno}: host")
        if not 1 <= slots <= MAX_SLOTS:
            raise LaunchError(f"{source}:{lineno}: {host} has slots={slots}; must be >= 1 and <= {MAX_SLOTS}")
        if any(h == host for h, _ in hosts):
            raise LaunchError(f"{source}:{lineno}: hostfile contains multiple entries for {host}: listed twice")
        hosts.append((host, slots))
    if not hosts:
        raise LaunchError(f"{source} lists no hosts: empty or not 'hostname slots=N' lines")
    return hosts


def read_hostfile(name: str) -> list[tuple[str, int]]:
    path = Path(name)
    if not path.exists():
        raise LaunchError(f"hostfile {path} does not exist")
    if path.is_dir():
        raise LaunchError(f"hostfile {path} is a directory")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LaunchError(f"hostfile {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise LaunchError(f"hostfile {path} cannot be read: {exc.strerror}") from None
    return parse_hostfile(text, str(path))


def parse_node_specs(spec: str, flag: str = "--include") -> dict[str, list[int]]:
    """``a:0,1@b`` -> {a: [0, 1], b: []} (an empty list: the whole host);
    a host named twice gets the union of its slots, sorted."""
    out: dict[str, list[int]] = {}
    for node in spec.split("@"):
        host, colon, slots = node.partition(":")
        if not host or (colon and not slots) or ":" in slots:
            raise LaunchError(f"{flag} {spec!r}: {node!r} is not NAME or NAME:SLOT[,SLOT...]")
        check_host(host, f"{flag}: host")
        try:
            numbers = [int(s) for s in slots.split(",")] if colon else []
        except ValueError:
            raise LaunchError(f"{flag} {spec!r}: slots {slots!r} of {host} are not numbers") from None
        if any(n < 0 for n in numbers):
            raise LaunchError(f"{flag} {spec!r}: slots of {host} must be >= 0")
        out[host] = sorted(set(out.get(host, []) + numbers))
    return out


def parse_resource_filter(hosts: Resources, include: str = "", exclude: str = "") -> Resources:
    """`hosts` filtered by an include or an exclude string (DeepSpeed's
    ``parse_resource_filter``): the hosts keep their order, hosts left with
    no slot are dropped."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive")
    if not include and not exclude:
        return dict(hosts)
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    kept: Resources = {} if include else {h: list(s) for h, s in hosts.items()}
    for host, slots in parse_node_specs(spec, flag).items():
        if host not in hosts:
            raise LaunchError(f"{flag}: hostname '{host}' not found in hostfile")
        for slot in slots:
            if slot not in hosts[host]:
                raise LaunchError(f"{flag}: no slot '{slot}' specified on host '{host}'")
        if include:
            kept[host] = slots or list(hosts[host])
        else:
            kept[host] = [s for s in kept[host] if s not in slots] if slots else []
    return {h: kept[h] for h in hosts if kept.get(h)}


def select_resources(
    pool: list[tuple[str, int]],
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> Resources:
    """What DeepSpeed's runner runs on: the hostfile's slots filtered by
    --include/--exclude, then the first `num_nodes` hosts, then slots
    0..num_gpus-1 on each. --num_nodes/--num_gpus do not mix with a filter."""
    if (num_nodes is not None or num_gpus is not None) and (include or exclude):
        raise LaunchError("cannot specify --num_nodes/--num_gpus with --include/--exclude")
    active = parse_resource_filter({h: list(range(n)) for h, n in pool}, include, exclude)
    if not active:
        raise LaunchError(f"--include/--exclude left no slot on any host of {[h for h, _ in pool]}")
    if num_nodes is not None:
        if not 1 <= num_nodes <= len(active):
            raise LaunchError(f"--num_nodes {num_nodes}: must be >= 1 and <= the {len(active)} hosts available")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus is not None:
        active = {h: list(range(num_gpus)) for h in active}
    return active


def parse_core_list(text: str) -> list[int]:
    """``0,2-4,6`` -> [0, 2, 3, 4, 6] (DeepSpeed's ``parse_range_list``:
    ascending, non-overlapping)."""
    out: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise LaunchError(f"--bind_core_list {text!r}: {part!r} is not N or N-M") from None
        if first < 0 or first > last:
            raise LaunchError(f"--bind_core_list {text!r}: bad range {part!r} (need 0 <= start <= end)")
        if out and first <= out[-1]:
            raise LaunchError(f"--bind_core_list {text!r}: ranges must be ascending and not overlap")
        out.extend(range(first, last + 1))
    return out


def cores_for_rank(cores: list[int], local_size: int, local_rank: int) -> list[int]:
    """DeepSpeed's split: len(cores) // local_size cores each, in order."""
    per_rank = len(cores) // local_size
    if per_rank < 1:
        raise LaunchError(f"--bind_cores_to_rank: {len(cores)} cores for {local_size} ranks; need one each")
    return cores[per_rank * local_rank : per_rank * (local_rank + 1)]
