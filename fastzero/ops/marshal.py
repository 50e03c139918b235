"""What the native backends of fastzero.ops share: grouping lists by dtype
(one multi-tensor launch per combination, CPU and CUDA alike), and the checks
and marshalling on the Python side of csrc/cuda's C ABI (the ops are in each
family's cuda.py).

Python owns the tensors: every check (device, dtype, contiguity, sizes)
happens here, before a pointer reaches the kernels' C ABI
(csrc/cuda/fastzero_cuda.h), which :mod:`fastzero.native.loader` loads
with ctypes (an install-time build, ``$FASTZERO_CUDA_LIB``, or a
just-in-time build with nvcc into a cache on first use). Importing this
module never fails: without a GPU, nvcc or a working build,
:func:`fastzero.native.cuda_available` says why and the ops raise that
reason when called.

Per-step scalars stay on the device, so a step never waits for the GPU:
``step`` (t >= 1), ``grad_scale`` and ``found_inf`` are 0-d float32 tensors
read by the kernels, which compute the bias corrections themselves and change
nothing when ``found_inf`` is nonzero. Lists may mix dtypes: each dtype
combination is one multi-tensor launch (or a few, for very long lists).
"""

from __future__ import annotations

import ctypes
from collections import defaultdict

import torch
from torch import Tensor

from fastzero.native import DTYPE_CODES, NO_DTYPE

# ---------------------------------------------------------------------------
# Checks: everything the kernels assume, before any pointer crosses.


def check_flat(op: str, tensors: dict[str, Tensor], dtypes: dict[str, tuple], hint: str) -> torch.device:
    """The 1-D buffers of a onebit op: tensors, on one CUDA device (the
    first's), contiguous, of the dtypes allowed. Returns the device."""
    device = None
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise ValueError(f"{op}: {name} is on {t.device}; this op takes cuda tensors{hint}")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {device}; one call, one device")
        if t.dtype not in dtypes[name]:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes[name])
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: {allowed}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} is not contiguous; pass t.contiguous() (the kernel uses its memory as is)")
    return device


# ---------------------------------------------------------------------------
# Marshalling


def dtype_groups(params, grads, exp_avgs, param_copies) -> dict[tuple, list[int]]:
    """Tensor indices by dtype combination (param, grad, state, copy or None),
    in first-seen order: one multi-tensor launch each."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, g, m) in enumerate(zip(params, grads, exp_avgs)):
        c = None if param_copies is None else param_copies[i].dtype
        groups[(p.dtype, g.dtype, m.dtype, c)].append(i)
    return groups


def pointers(tensors, idx):
    """A C array of the data pointers of tensors[i] for i in idx."""
    return (ctypes.c_void_p * len(idx))(*[tensors[i].data_ptr() for i in idx])


def numels(tensors, idx):
    """A C array of the element counts of tensors[i] for i in idx."""
    return (ctypes.c_int64 * len(idx))(*[tensors[i].numel() for i in idx])


def ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def num_chunks(numel: int, chunk: int) -> int:
    return -(-numel // chunk)


def dtype_codes(key: tuple) -> tuple[int, int, int, int]:
    """The C dtype codes of a (param, grad, state, copy or None) combination."""
    p, g, s, c = key
    return DTYPE_CODES[p], DTYPE_CODES[g], DTYPE_CODES[s], NO_DTYPE if c is None else DTYPE_CODES[c]


def stream(device: torch.device) -> int:
    """The current CUDA stream of `device`, as the C ABI takes it."""
    return torch.cuda.current_stream(device).cuda_stream
