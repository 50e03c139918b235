"""Flattened work lists: many tensors per launch, shared by the optimizer kernels.

A launch walks a list of *items*; an item is a chunk of up to
``BLOCK_SIZE * BLOCKS_PER_ITEM`` elements of one tensor. The kernel turns the
item's tensor index into typed pointers through a table of ``data_ptr()``
addresses (int64, cast to pointers inside the kernel: the trick of Triton's
grouped-GEMM tutorial). Items are sorted by dtype combination, so one launch per
combination covers every tensor of that combination with a contiguous slice of
the list. Tensor indices stay those of the caller's lists (LAMB writes its trust
ratio to ``coeffs_out[index]``).

The interpreter (TRITON_INTERPRET=1, Triton 3.9) supports the address table with
CPU tensors: its loads and stores dereference raw host addresses. So the CPU
tests run the very code path a GPU runs; there is no per-tensor fallback.

Also here: the two small device helpers both optimizers need (bias corrections,
rounding to the storage dtype), and the input checks.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastzero.checks import check_device_step

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter of Triton 3.9 converts bf16 wrongly: fp32 -> bf16 truncates (GPUs round
# to nearest even, as torch does), and bf16 subnormals -> fp32 come out wrong. There the
# kernels convert bf16 by hand, with integer ops; GPUs use the hardware conversions.
_BF16_BY_HAND = tl.constexpr(INTERPRET)

ROLES = ("param", "grad", "exp_avg", "exp_avg_sq", "param_copy")
INT8_ROLES = (*ROLES, "exp_avg_absmax", "exp_avg_sq_absmax")  # Adam's int8 states: codes and block scales
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.uint8: tl.uint8}


@triton.jit
def _typed_ptr(addrs_ptr, ROLE: tl.constexpr, n_tensors, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to tensor ``t``'s data in role ``ROLE`` (a row of the address table)."""
    ptr = tl.load(addrs_ptr + ROLE * n_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:  # every address of this launch is 16-byte aligned: lets the compiler vectorize
        ptr = tl.multiple_of(ptr, 16)  # on the pointer: a hint on the int does not survive the cast
    return ptr


@triton.jit
def _item(item_tensor_ptr, item_start_ptr, numels_ptr, item, BLOCK_SIZE: tl.constexpr, BLOCKS_PER_ITEM: tl.constexpr):
    """Tensor index, first element, end, and number of full blocks of a work item."""
    t = tl.load(item_tensor_ptr + item)
    start = tl.multiple_of(tl.load(item_start_ptr + item), BLOCK_SIZE)  # items start at multiples of the chunk
    end = tl.minimum(tl.load(numels_ptr + t), start + BLOCKS_PER_ITEM * BLOCK_SIZE)
    return t, start, end, (end - start) // BLOCK_SIZE


@triton.jit
def _to_fp32(x):
    """Storage dtype -> fp32 (exact)."""
    if x.dtype == tl.bfloat16:
        if _BF16_BY_HAND:
            y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.float32)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _to_storage(x, DTYPE: tl.constexpr):
    """fp32 -> storage dtype, rounding to nearest even like torch."""
    if DTYPE == tl.bfloat16:
        if _BF16_BY_HAND:
            bits = x.to(tl.uint32, bitcast=True)
            bits = tl.where(x != x, 0x7FC00000, bits)  # NaN stays a (quiet) NaN
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def _bias_corrections(step_ptr, log_beta1, log_beta2, BIAS_CORRECTION: tl.constexpr):
    """bc_i = 1 - beta_i**t in fp64 from t (a device scalar) and log(beta_i).

    fp32 would lose digits (1 - 0.999**1 keeps ~4 of them); from log(beta) rounded
    to fp32, bc is still exact to fp32 rounding (its relative error is at most
    that of log(beta))."""
    if BIAS_CORRECTION:
        t = tl.load(step_ptr).to(tl.float64)
        bc1 = 1.0 - tl.exp(t * tl.cast(log_beta1, tl.float64))
        bc2 = 1.0 - tl.exp(t * tl.cast(log_beta2, tl.float64))
    else:
        bc1 = tl.full((), 1.0, tl.float64)
        bc2 = tl.full((), 1.0, tl.float64)
    return bc1, bc2


def launch_config() -> tuple[int, int, int]:
    """(BLOCK_SIZE, BLOCKS_PER_ITEM, num_warps). On GPUs, 8 elements a thread and 8K
    elements an item keep the work list short (2 MB for 1B params). The interpreter pays
    per program and per helper call, not per element: 2 blocks an item, so that the
    tests still cover the loop over full blocks and the masked tail."""
    if INTERPRET:
        return 1024, 2, 4
    return 1024, 8, 4


def log_beta(beta: float) -> float:
    return math.log(beta) if beta > 0.0 else -math.inf  # beta = 0: beta**t = exp(-inf) = 0


# ---------------------------------------------------------------------------------------------
# Host side: the work list.


@dataclass(frozen=True)
class Group:
    """The items [begin, end) of one dtype combination: one launch."""

    dtypes: tuple  # tl dtypes per role (None: no param copy)
    aligned: bool
    begin: int
    end: int


@dataclass(frozen=True)
class WorkList:
    table: Tensor  # one int64 device tensor holding every array below (one host-to-device copy)
    addrs: Tensor  # [n_roles * n_tensors] data_ptr of tensor t in role r at r * n_tensors + t (0: none)
    numels: Tensor  # [n_tensors]
    first_item: Tensor  # [n_tensors] first item of each tensor (its items are contiguous)
    n_items_of: Tensor  # [n_tensors]
    item_tensor: Tensor  # [n_items] tensor index of each item
    item_start: Tensor  # [n_items] first element of each item
    n_tensors: int
    n_items: int
    groups: tuple[Group, ...]


_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 16  # optimizers call with the same tensors every step; a few param groups each


def work_list(lists: list[list[Tensor] | None], chunk: int) -> WorkList:
    """The work list of ``lists`` (one per role of ROLES or INT8_ROLES, None for an absent role), in chunks
    of ``chunk`` elements, cached on the addresses, sizes and dtypes it encodes
    (memory freed and reused by equal tensors yields the same, still valid list)."""
    n = len(lists[0])
    cols = [lst if lst is not None else [None] * n for lst in lists]
    rows = [tuple((t.data_ptr(), t.dtype) if t is not None else (0, None) for t in col) for col in cols]
    numels = [t.numel() for t in cols[0]]
    device = lists[0][0].device
    key = (device, chunk, tuple(numels), *rows)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit

    def combo(t: int) -> tuple:
        dtypes = tuple(None if r[t][1] is None else _TL_DTYPES[r[t][1]] for r in rows)
        return dtypes, all(r[t][0] % 16 == 0 for r in rows)

    combos = [combo(t) for t in range(n)]
    rank = {c: i for i, c in enumerate(dict.fromkeys(combos))}
    order = sorted(range(n), key=lambda t: rank[combos[t]])  # stable: list order within a combination
    counts_of = [-(-k // chunk) for k in numels]
    counts = torch.tensor(counts_of, dtype=torch.int64)
    first = torch.zeros(n, dtype=torch.int64)
    first[order] = torch.cumsum(counts[order], 0) - counts[order]
    item_tensor = torch.repeat_interleave(torch.tensor(order, dtype=torch.int64), counts[order])
    n_items = item_tensor.numel()
    item_start = (torch.arange(n_items, dtype=torch.int64) - first[item_tensor]) * chunk

    items_of = dict.fromkeys(rank, 0)
    for t in range(n):
        items_of[combos[t]] += counts_of[t]
    groups, begin = [], 0
    for c, k in items_of.items():
        groups.append(Group(dtypes=c[0], aligned=c[1], begin=begin, end=begin + k))
        begin += k
    addrs = torch.tensor([a for r in rows for a, _ in r], dtype=torch.int64)
    host = torch.cat([addrs, torch.tensor(numels, dtype=torch.int64), first, counts, item_tensor, item_start])
    if device.type == "cuda":
        host = host.pin_memory()  # an asynchronous copy: no host sync
    table = host.to(device, non_blocking=True)
    assert len(rows) in (len(ROLES), len(INT8_ROLES))
    sizes = [len(rows) * n, n, n, n, n_items, n_items]
    parts = torch.split(table, sizes)
    wl = WorkList(table, *parts, n_tensors=n, n_items=n_items, groups=tuple(groups))
    _CACHE[key] = wl
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return wl


# ---------------------------------------------------------------------------------------------
# Host side: input checks (DESIGN.md rule 6: a clear Python error before any pointer crosses).


def check_inputs(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    param_copies: list[Tensor] | None,
    scalars: dict[str, Tensor | None],
    state_format: str | None = None,
    **int8_scales,
) -> None:
    """fastzero.checks.check_device_step, on CUDA tensors (CPU tensors
    too under the interpreter); ``int8_scales``: the int8 states'
    ``exp_avg_absmax``, ``exp_avg_sq_absmax`` and ``block_size``."""
    hint = " (CPU tensors only under the interpreter, TRITON_INTERPRET=1 set before importing triton)"
    check_device_step(
        "the Triton kernels",
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        param_copies,
        scalars,
        device_types=("cuda", "cpu") if INTERPRET else ("cuda",),
        hint=hint,
        state_format=state_format,
        **int8_scales,
    )
