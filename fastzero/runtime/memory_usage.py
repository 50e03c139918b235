"""What ``"memory_breakdown": true`` logs every ``steps_per_print`` steps:
DeepSpeed's ``see_memory_usage`` lines (on a GPU torch.cuda's allocated,
peak, reserved and peak reserved GB; the host's used memory), this process's
resident set (current and peak), and the engine's model states on this rank
by kind (``Engine.memory_breakdown()``, in bytes).

Unlike DeepSpeed's, the peaks are not reset after each report: they are the
peaks since the start (or since the script last reset them), the value the
monitor's ``peak_memory_mb`` reports too."""

from __future__ import annotations

import os
import resource

import torch

GB = 1024**3


def process_rss_bytes() -> int | None:
    """This process's resident set now (Linux's /proc/self/statm), or None where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def process_peak_rss_bytes() -> int:
    """This process's largest resident set so far (getrusage; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_memory_used() -> tuple[int, float] | None:
    """(bytes used, percent used) of the host's memory, as psutil's
    ``virtual_memory()`` counts them (total - available), from /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if len(line.split()) >= 2}
        total, available = info["MemTotal"], info["MemAvailable"]
    except (OSError, ValueError, KeyError):
        return None
    return total - available, round(100 * (total - available) / total, 1)


def memory_usage_lines(engine, message: str) -> list[str]:
    """The lines logged for `engine` under `message` (DeepSpeed's first line)."""
    gb = lambda n: round(n / GB, 2)  # noqa: E731
    lines = [message]
    device = engine.device
    if device.type == "cuda":
        lines.append(
            f"MA {gb(torch.cuda.memory_allocated(device))} GB "
            f"Max_MA {gb(torch.cuda.max_memory_allocated(device))} GB "
            f"CA {gb(torch.cuda.memory_reserved(device))} GB "
            f"Max_CA {gb(torch.cuda.max_memory_reserved(device))} GB"
        )
    host = host_memory_used()
    if host is not None:
        lines.append(f"CPU Virtual Memory:  used = {gb(host[0])} GB, percent = {host[1]}%")
    rss = process_rss_bytes()
    peak = process_peak_rss_bytes()
    lines.append(f"Process RSS {'n/a' if rss is None else gb(rss)} GB Max_RSS {gb(peak)} GB")
    states = engine.memory_breakdown()
    listed = ", ".join(f"{kind} {n}" for kind, n in states.items())
    lines.append(f"Model states (bytes on rank {engine.global_rank}): {listed}, total {sum(states.values())}")
    return lines
