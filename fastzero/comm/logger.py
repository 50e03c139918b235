"""DeepSpeed's communication logger: the ``comms_logger`` config section and
``fastzero.comm.log_summary()``. Per collective and message size it counts
the calls and keeps each one's latency and bandwidth, as
``deepspeed.comm`` does, so scripts that read DeepSpeed's summary (or its
``return_dict=True`` form) keep working.

What is logged, while the logger is enabled:

- the engine's own collectives (:class:`fastzero.comm.Comm`: gradient
  reduction, the param all-gathers, the norm's all-reduce, ZeRO++'s
  quantized exchanges), each timed from launch to completion: asynchronous
  ones too, which are what the engine runs;
- every call of ``fastzero.comm``'s DeepSpeed-named functions
  (``all_reduce(..., prof=False, log_name="all_reduce", debug=None)``), an
  asynchronous one (``async_op=True``) also until it completes;
- the tensor-parallel layers' collectives (:func:`timer`).

Not logged: the pipeline's sends and receives (posted ahead, their time is
the wait for the other stage).

Which of them: all (``prof_all``, the default), or those whose log name is
in ``prof_ops``, or one call given ``prof=True``. Collectives that move
nothing (one rank) are not logged.

The message size of an op is the bytes one rank puts in: an all-reduce's,
broadcast's or send's tensor, an all-gather's input, a reduce-scatter's
output (the rank's chunk), an all-to-all's input. Bandwidths in Gbit/s over
the group's ranks: algbw is DeepSpeed's (the size per second, times the
ranks for an all-gather or reduce-scatter, twice it for an all-reduce),
busbw nccl-tests' (the size per second times (n - 1) / n, or 2 (n - 1) / n
for an all-reduce). A device (NCCL) collective's future completes when it
is queued, so a logged one ends at a ``torch.cuda.synchronize()``, as in
DeepSpeed.

Where DeepSpeed differs (docs/monitoring.md): it enables the logger
whenever the config has the section, whatever ``enabled`` says (fastzero
reads ``enabled``); on the CPU it stops an asynchronous op's timer at
launch; it counts an all-gather-into-tensor as 0 bytes and a
reduce-scatter's whole input as its per-rank size; an op outside its
bandwidth table (``all_gather_object``) exits the process; and its
straggler breakdown pairs ops in the order each rank logged them.
``log_summary(show_straggler=True)`` first checks that every rank logged
the same ops, and raises on every rank if not.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from datetime import datetime
from typing import Any

import torch

logger = logging.getLogger("fastzero")

# algbw and busbw per byte of the message, per second: (algbw factor, busbw factor) as functions of the ranks n
_GATHERS = ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")
_ALL_TO_ALL = ("all_to_all", "all_to_all_single")
_ALL_REDUCE = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce")


def _factors(op: str, n: int) -> tuple[float, float]:
    if op in _GATHERS:
        return n, n - 1
    if op in _ALL_TO_ALL:
        return 1.0, (n - 1) / n
    if op in _ALL_REDUCE:
        return 2.0, 2 * (n - 1) / n
    return 1.0, 1.0  # point to point, broadcast, reduce, gather, scatter, barrier, the object collectives


def bandwidth(op: str, msg_size: int, latency_ms: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbit/s of one `op` that moved `msg_size` bytes per
    rank over `world_size` ranks in `latency_ms` (module docstring); zeros
    for an op that took no measurable time."""
    if latency_ms <= 0 or msg_size <= 0:
        return 0.0, 0.0
    alg, bus = _factors(op, world_size)
    per_ms = msg_size / latency_ms  # bytes per ms
    to_gbps = 8 / 1e6  # bytes/ms -> Gbit/s
    return per_ms * alg * to_gbps, per_ms * bus * to_gbps


def convert_size(size_bytes: int) -> str:
    """A byte count as DeepSpeed prints it: "0B", "512.0 B", "1.5 MB" (powers of 1024)."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = min(int(math.floor(math.log(size_bytes, 1024))), len(names) - 1)
    return f"{round(size_bytes / 1024**i, 2)} {names[i]}"


def trim_mean(data: list[float], trim_percent: float) -> float:
    """The mean of `data` without its `trim_percent` smallest and largest
    values (DeepSpeed's; 0 for no data)."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent = {trim_percent!r}: must be in [0, 1]")
    n = len(data)
    if n == 0:
        return 0.0
    ordered = sorted(data)
    k = int(round(n * trim_percent))
    kept = ordered[k : n - k] or ordered  # trimming everything leaves the whole list
    return sum(kept) / len(kept)


class CommsLogger:
    """DeepSpeed's ``CommsLogger``: the data is ``{record name: {message
    size: [count, [latency ms], [algbw Gbps], [busbw Gbps]]}}``
    (:meth:`get_raw_data`). Collectives may finish on a backend thread, so
    appends hold a lock."""

    def __init__(self) -> None:
        self.comms_dict: dict[str, dict[int, list]] = {}
        self.enabled = False
        self.verbose = False
        self.debug = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self._lock = threading.Lock()

    # -- settings -----------------------------------------------------------------------------------

    def configure(self, section: Any) -> None:
        """Takes a ``comms_logger`` section (:class:`fastzero.config.CommsLoggerConfig`)."""
        self.enabled = section.enabled
        self.verbose = section.verbose
        self.debug = section.debug
        self.prof_all = section.prof_all
        self.prof_ops = list(section.prof_ops)

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def wants(self, log_name: str, prof: bool = False) -> bool:
        """Whether a call logged as `log_name` is logged now."""
        return self.enabled and (prof or self.prof_all or log_name in self.prof_ops)

    def record_name(self, log_name: str, caller: str) -> str:
        """`log_name`, with the caller appended in debug mode (DeepSpeed's form)."""
        return f"{log_name} | [Caller Func: {caller}]" if self.debug else log_name

    # -- data ---------------------------------------------------------------------------------------

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int, world_size: int = 1) -> None:
        """One op `raw_name` (its kind, for the bandwidth) logged under
        `record_name`: `latency` in ms, `msg_size` bytes per rank."""
        algbw, busbw = bandwidth(raw_name, msg_size, latency, world_size)
        with self._lock:
            sizes = self.comms_dict.setdefault(record_name, {})
            entry = sizes.get(msg_size)
            if entry is None:
                sizes[msg_size] = [1, [latency], [algbw], [busbw]]
            else:
                entry[0] += 1
                entry[1].append(latency)
                entry[2].append(algbw)
                entry[3].append(busbw)
        if self.verbose:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if rank == 0:
                logger.info(
                    f"comm op: {record_name} | time (ms): {latency:.2f} | msg size: {convert_size(msg_size)} | "
                    f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}"
                )

    def _snapshot(self) -> dict[str, dict[int, list]]:
        with self._lock:
            return {
                name: {size: [v[0], list(v[1]), list(v[2]), list(v[3])] for size, v in sizes.items()}
                for name, sizes in self.comms_dict.items()
            }

    def get_raw_data(self) -> dict[str, dict[int, list]]:
        """A copy of the data (class docstring)."""
        return self._snapshot()

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        with self._lock:
            self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(v[0] for sizes in self._snapshot().values() for v in sizes.values())

    @staticmethod
    def _summary(sizes: dict[int, list]) -> dict[int, dict]:
        return {
            size: {
                "count": v[0],
                "total_latency_ms": sum(v[1]),
                "avg_latency_ms": trim_mean(v[1], 0.1),
                "tput_avg_gbps": trim_mean(v[2], 0.1),
                "busbw_avg_gbps": trim_mean(v[3], 0.1),
                "msg_size_bytes": size,
                "msg_size_str": convert_size(size),
            }
            for size, v in sorted(sizes.items())
        }

    def get_operation_summary(self, operation_name: str) -> dict[int, dict] | None:
        """Per message size: count, total and trimmed-mean latency (ms) and bandwidths (Gbps); None if never logged."""
        sizes = self._snapshot().get(operation_name)
        return None if sizes is None else self._summary(sizes)

    def log_all(self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False):
        """Prints DeepSpeed's table (and, with `show_straggler`, the time
        each op waited for the slowest rank: a collective over the world
        that every rank must join); returns ``{"summary", "straggler_analysis",
        "metadata"}`` with `return_dict`."""
        data = self._snapshot()
        summary = {name: self._summary(sizes) for name, sizes in data.items()}
        if print_log:
            _print_table(
                summary,
                ("Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)", "busbw_avg (Gbps)"),
                ("total_latency_ms", "avg_latency_ms", "tput_avg_gbps", "busbw_avg_gbps"),
            )
        stragglers = _straggler_analysis(data) if show_straggler else None
        if print_log and stragglers is not None:
            print("_______________________________")
            print("Breakdown with straggler effect")
            print("-------------------------------")
            _print_table(
                stragglers,
                ("Total comm lat(ms)", "Total straggler(ms)", "Avg comm lat(ms)", "Avg straggler(ms)"),
                ("total_comm_lat_ms", "total_straggler_ms", "avg_comm_lat_ms", "avg_straggler_ms"),
            )
        if not return_dict:
            return None
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        return {
            "summary": summary,
            "straggler_analysis": stragglers,
            "metadata": {
                "world_size": torch.distributed.get_world_size() if distributed else 1,
                "rank": torch.distributed.get_rank() if distributed else 0,
                "timestamp": datetime.now().isoformat(),
            },
        }


def _print_table(rows: dict[str, dict[int, dict]], heads: tuple[str, ...], keys: tuple[str, ...]) -> None:
    """DeepSpeed's layout: columns of 20, a line per op name, then one per message size."""
    col = 20
    print("".join(f"{h: <{col}}" for h in ("Comm. Op", "Message Size", "Count", *heads)))
    for name, sizes in rows.items():
        print(name)
        for s in sizes.values():
            figures = "".join(f"{s[k]: <{col}.2f}" for k in keys)
            print(f"{' ': <{col}}{s['msg_size_str']: <{col}}{s['count']: <{col}}{figures}")


def _straggler_analysis(data: dict[str, dict[int, list]]) -> dict[str, dict[int, dict]]:
    """Per op: the fastest rank's latency (the communication itself) and
    how much longer this rank's took (waiting for the slowest to arrive).
    Ranks compare their ops sorted by (name, size): the order they were
    first logged in differs between ranks (a send on one is a receive first
    on the other; collectives on two groups finish in either order)."""
    dist = torch.distributed
    keys = sorted((name, size) for name, sizes in data.items() for size in sizes)
    lows = {key: list(data[key[0]][key[1]][1]) for key in keys}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ops = [(name, size, data[name][size][0]) for name, size in keys]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ops)
        differ = [r for r, theirs in enumerate(everyone) if theirs != ops]
        if differ:
            raise RuntimeError(
                f"log_summary(show_straggler=True): ranks {differ} logged other ops (names, sizes or counts) "
                f"than rank {dist.get_rank()}; the straggler breakdown compares the same ops across ranks. Log "
                "the same collectives on every rank (prof_all, or the same prof_ops), or call reset_log() on "
                "every rank at the same point"
            )
        flat = torch.tensor([x for key in keys for x in lows[key]], dtype=torch.float64)
        if flat.numel():
            on_gpu = dist.get_backend() == "nccl"
            moved = flat.to(torch.device("cuda", torch.cuda.current_device())) if on_gpu else flat
            dist.all_reduce(moved, op=dist.ReduceOp.MIN)
            it = iter(moved.cpu().tolist())
            lows = {key: [next(it) for _ in lows[key]] for key in keys}
    out: dict[str, dict[int, dict]] = {}
    for name, sizes in data.items():
        out[name] = {}
        for size, v in sorted(sizes.items()):
            lats, low = v[1], lows[(name, size)]
            waits = [a - b for a, b in zip(lats, low, strict=True)]
            out[name][size] = {
                "count": v[0],
                "total_comm_lat_ms": sum(low),
                "total_straggler_ms": sum(waits),
                "avg_comm_lat_ms": trim_mean(low, 0.1),
                "avg_straggler_ms": trim_mean(waits, 0.1),
                "msg_size_bytes": size,
                "msg_size_str": convert_size(size),
            }
    return out


comms_logger = CommsLogger()


def timer(op: str, nbytes: int, world_size: int, caller: str, log_name: str | None = None, prof: bool = False):
    """Starts timing one `op` of `nbytes` per rank, logged as `log_name`
    (default: `op`), when the logger wants it (`prof`: this call asks) and
    the op moves bytes between ranks: returns the function to call once the
    op completes (it logs it; it takes and ignores a future), or None."""
    log_name = op if log_name is None else log_name
    if not comms_logger.wants(log_name, prof) or world_size <= 1:
        return None
    record = comms_logger.record_name(log_name, caller)
    start = time.perf_counter()

    def done(*_) -> None:
        comms_logger.append(op, record, (time.perf_counter() - start) * 1e3, nbytes, world_size)

    return done


def caller_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up (the one that called a collective)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "<module>"


# -- deepspeed.comm's functions --------------------------------------------------------------------------------


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """DeepSpeed's ``configure``: the ``comms_logger`` section of
    `deepspeed_config` (a :class:`fastzero.config.Config`, a dict or a
    path), then each argument that is not None. ``initialize`` calls it
    with the config when the section is given."""
    from fastzero.config import load_section, read_config_file  # the config layer: imported when used

    if deepspeed_config is not None:
        where = ""
        if isinstance(deepspeed_config, (str, os.PathLike)):
            where = f"config file {os.fsdecode(deepspeed_config)}: "
            deepspeed_config = read_config_file(deepspeed_config)
        try:
            section = load_section(deepspeed_config, "comms_logger")
        except ValueError as exc:
            raise type(exc)(f"{where}{exc}") from None
        # a file or dict without the section leaves the logger as it is (DeepSpeed's), and so does a Config whose
        # section is the defaults
        if isinstance(deepspeed_config, dict):
            given = "comms_logger" in deepspeed_config
        else:
            given = section != type(section)()
        if given:
            comms_logger.configure(section)
    for name, value in (("enabled", enabled), ("prof_all", prof_all), ("verbose", verbose), ("debug", debug)):
        if value is None:
            continue
        if not isinstance(value, bool):
            raise TypeError(f"configure({name}={value!r}): give True or False")
        setattr(comms_logger, name, value)
    if prof_ops is not None:
        prof_ops = prof_ops if isinstance(prof_ops, str) else list(prof_ops)
        if isinstance(prof_ops, str) or not all(isinstance(op, str) for op in prof_ops):
            raise TypeError(f"configure(prof_ops={prof_ops!r}): give a list of op names, e.g. ['all_reduce']")
        comms_logger.prof_ops = list(prof_ops)


def _barrier() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed's ``log_summary``: every rank meets (a barrier), rank 0
    prints the table of what was logged, and with `return_dict` every rank
    returns its own figures (:meth:`CommsLogger.log_all`). Every rank must
    call it."""
    _barrier()
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    try:
        return comms_logger.log_all(print_log=rank == 0, show_straggler=show_straggler, return_dict=return_dict)
    finally:
        _barrier()


def reset_log() -> None:
    """Forgets what was logged (per-epoch figures: call it at each epoch's start)."""
    comms_logger.reset_data()


def has_comm_data() -> bool:
    """Whether any collective was logged since the start or the last :func:`reset_log`."""
    return comms_logger.has_data()


def get_comm_operation_count() -> int:
    """The number of collectives logged, all kinds together."""
    return comms_logger.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    """The record names logged (``["all_reduce", "reduce_scatter_tensor"]``)."""
    return comms_logger.get_operation_names()
