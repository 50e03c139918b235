"""Sums of squares of large gradient buffers, for global gradient norms
(the engine's clipping and overflow check, 1-bit Adam's max_grad_norm).

One ``torch.linalg.vector_norm`` over a whole flat buffer accumulates in
fp32 along long runs: on the CPU it comes out low, the more the longer the
buffer (about -1e-5 relative at 1e6 elements, -4e-4 at 1e7), so a clip
coefficient taken from it is too large by as much, every step, and more at
ZeRO stage 0 (the whole model's gradient on every rank) than above (a
shard each). torch's ``clip_grad_norm_`` takes one norm per param instead.
Here the buffer is cut into rows of :data:`BLOCK` elements, each row's norm
is taken in fp32 (short runs: within 1e-9 of exact for fp32 grads, 5e-8
for bf16 ones, at 8M elements) and the rows' squares are summed in fp64: one
pass over the buffer as before, as fast, no copy of it; the per-row
temporaries are about 1% of an fp32 buffer's bytes (2% of a bf16 one's).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 512  # elements per row: short enough that an fp32 row norm is exact to rounding


def sum_of_squares(t: Tensor) -> Tensor:
    """The sum of the squares of `t`'s elements, as a 0-d fp64 tensor on
    `t`'s device (no host sync); any dtype is read as fp32. inf or NaN in
    `t` gives inf or NaN."""
    flat = t.reshape(-1)
    n = flat.numel()
    full = n - n % BLOCK
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    if full:
        rows = torch.linalg.vector_norm(flat[:full].view(-1, BLOCK), dim=1, dtype=torch.float32)
        total += rows.double().square().sum()
    if n > full:
        total += torch.linalg.vector_norm(flat[full:], dtype=torch.float32).double().square()
    return total
