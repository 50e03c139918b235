"""ZeRO-Offload of the optimizer: each rank's fp32 master params and Adam
state live in CPU memory (pinned when asked and CUDA can pin), and the step
is the CPU Adam kernel's functional entry point with the fused unscale and
the fused write of the low-precision param copy: one pass over CPU memory.

The step runs in chunks, pipelined with the transfers: while chunk k is
updated, chunk k+1's gradients come to the CPU and chunk k-1's params go
back to the device (a side CUDA stream on GPUs; a copy thread when the
"device" is the CPU, so the same path runs and is tested on CPU machines).

Staging: the grads come into a CPU buffer (and, with bf16/fp16 params, the
param copy the kernel writes goes out of one). When the shard holds more
than ``sub_group_size`` elements, those are two rotating buffers of
``sub_group_size // 2`` elements each, rounded down to a power of two but at
least one int8 block (the piece being updated and the one in flight), so
staging is bounded by ``sub_group_size`` elements per kind (or two blocks);
else one buffer the size of each tensor.

The pieces are a power of two in size (at least one block of int8 states)
and start at multiples of it, so each gives exactly the bits of one step over
the whole shard, in every state format (:meth:`OffloadedAdam._piece_format`):
fp32 states are elementwise; int8 states' blocks are whole in a piece (the
scales of elements [lo, hi) are scales [lo // block, ceil(hi / block))); bf16
and int8 states round with bits keyed by each element's index in its tensor,
which a piece starting at `lo` would shift, so it takes the seed under which
its indices draw the shard's bits (:func:`fastzero.ops.adam.reference.sr_seed_at`,
exact for a piece of at most 2^k elements at a multiple of 2^k). bf16
params written with stochastic rounding (``bf16_stochastic_round``) take
the same seed: their bits come from the same hash of (seed, step, index).

Without master weights (``bf16.bf16_master_weights_and_grads``) the CPU copy
of each shard tensor is in its own dtype (bf16): the kernel updates it in
place, with stochastic rounding, and it goes back to the device as it is
(no fp32 master, no staging of a param copy).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from fastzero.ops import AdamHyperparams, CPUAdam, cpu_adam_step
from fastzero.ops.adam.reference import sr_seed_at

CHUNK = 1 << 22  # at most this many elements per pipelined piece (16 MiB of fp32 master)
MIN_CHUNK = 1 << 16  # at least this many: each piece is one kernel call, and a call has a fixed cost
PIECES = 4  # a shard smaller than PIECES * CHUNK is cut in about this many pieces, so transfers still overlap


class Transfers:
    """Asynchronous copies between the device and the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pool = None if self.cuda else ThreadPoolExecutor(1, thread_name_prefix="fastzero-offload")

    def copy(self, dst: Tensor, src: Tensor):
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(src.device if src.is_cuda else dst.device))
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            return event
        return self.pool.submit(dst.copy_, src)

    @staticmethod
    def wait(handle) -> None:
        if isinstance(handle, Future):
            handle.result()
        else:
            torch.cuda.current_stream().wait_event(handle)
            handle.synchronize()  # the CPU kernel reads what the copy wrote


def _cpu_buffer(like: Tensor, dtype: torch.dtype, pin: bool) -> Tensor:
    return torch.empty(like.numel(), dtype=dtype, device="cpu", pin_memory=pin)


class OffloadedAdam(CPUAdam):
    """Adam/AdamW whose params are CPU fp32 masters of the given device
    tensors (the rank's shard chunks, each with its ``.grad``). ``step``
    brings the grads over, updates the masters and writes the device
    tensors back, chunk by chunk. The state format is CPUAdam's
    (``state_format``, ``seed``, ``block_size``): the same bits as one
    step over each shard tensor (the module's docstring). With
    ``master_weights=False`` the CPU copies keep the device tensors' dtype
    (bf16 params without an fp32 master, written with stochastic rounding
    under ``bf16_stochastic_round``)."""

    def __init__(
        self,
        params,
        *,
        master_weights: bool = True,
        pin_memory: bool = False,
        chunk: int | None = None,
        sub_group_size: int = 1_000_000_000,
        **kwargs,
    ) -> None:
        groups = list(params)
        groups = groups if groups and isinstance(groups[0], dict) else [{"params": groups}]
        self.pin = pin_memory and torch.cuda.is_available()  # pinning needs CUDA
        self.chunk = chunk  # None: sized from the shard (see PIECES)
        self.device_of: dict[Tensor, Tensor] = {}  # master -> device tensor
        cpu_groups = []
        for g in groups:
            masters = []
            for dev in g["params"]:
                master = _cpu_buffer(dev, torch.float32 if master_weights else dev.dtype, self.pin)
                master.copy_(dev.detach().reshape(-1))
                self.device_of[master] = dev
                masters.append(master)
            cpu_groups.append({**g, "params": masters})
        super().__init__(cpu_groups, **kwargs)
        first = next(iter(self.device_of.values()))
        self.transfers = Transfers(first.grad.device if first.grad is not None else first.device)
        self.dtype = first.dtype
        # staging on the CPU: the grads that come in, and (low precision) the param copy the kernel writes
        total = sum(m.numel() for m in self.device_of)
        self.ring = total > sub_group_size  # rotating buffers of a piece each (see the module's docstring)
        self.piece_cap = self._aligned(sub_group_size // 2) if self.ring else None
        low = first.dtype != next(iter(self.device_of)).dtype  # the kernel writes a copy in the device's dtype
        if self.ring:
            slot = lambda: torch.empty(self.piece_cap, dtype=first.dtype, pin_memory=self.pin)
            self.grad_in = [slot(), slot()]
            self.param_out = [slot(), slot()] if low else None
        else:
            self.grad_in = {m: _cpu_buffer(m, first.dtype, self.pin) for m in self.device_of}
            self.param_out = {m: _cpu_buffer(m, first.dtype, self.pin) for m in self.device_of} if low else None

    def sync_device_params(self) -> None:
        """The device tensors from the masters (after a checkpoint load)."""
        for master, dev in self.device_of.items():
            dev.reshape(-1).copy_(master)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | None = None, found_inf=None):
        if found_inf is not None and bool(found_inf):
            return None
        for gi, group in enumerate(self.param_groups):
            hp = AdamHyperparams.from_group(group)  # checks them too
            total = sum(m.numel() for m in group["params"])
            chunk = self.chunk or min(CHUNK, max(MIN_CHUNK, -(-total // PIECES)))
            chunk = self._aligned(min(chunk, self.piece_cap) if self.ring else chunk)
            pieces = [(m, lo, min(lo + chunk, m.numel())) for m in group["params"] for lo in range(0, m.numel(), chunk)]
            if not pieces:
                continue
            group["step"] = int(group.get("step", 0)) + 1

            def staged(buffers, k: int, m: Tensor, lo: int, hi: int) -> Tensor:
                return buffers[k % 2][: hi - lo] if self.ring else buffers[m][lo:hi]

            def fetch(k: int, pieces=pieces):
                m, lo, hi = pieces[k]
                return self.transfers.copy(
                    staged(self.grad_in, k, m, lo, hi), self.device_of[m].grad.reshape(-1)[lo:hi]
                )

            incoming, outgoing = fetch(0), []
            for k, (m, lo, hi) in enumerate(pieces):
                following = fetch(k + 1) if k + 1 < len(pieces) else None
                self.transfers.wait(incoming)
                if self.ring and k >= 2:  # this piece's out buffer was piece k-2's: its copy must be done
                    self.transfers.wait(outgoing[k - 2])
                state = self.init_state(m)
                copies = None if self.param_out is None else [staged(self.param_out, k, m, lo, hi)]
                cpu_adam_step(
                    [m[lo:hi]],
                    [staged(self.grad_in, k, m, lo, hi)],
                    [state["exp_avg"][lo:hi]],
                    [state["exp_avg_sq"][lo:hi]],
                    step=group["step"],
                    hp=hp,
                    grad_scale=grad_scale,
                    param_copies=copies,
                    **self._piece_format(state, group["step"], lo, hi),
                )
                out = m[lo:hi] if copies is None else copies[0]
                outgoing.append(self.transfers.copy(self.device_of[m].reshape(-1)[lo:hi], out))
                incoming = following
            for handle in outgoing:
                self.transfers.wait(handle)
            self._publish_step(gi, group)
        return None

    def _aligned(self, n: int) -> int:
        """The piece size for at most `n` elements: a power of two (the
        pieces start at its multiples), at least one block of int8 states."""
        return max(1 << (max(1, n).bit_length() - 1), self.block_size or 1)

    def _piece_format(self, state: dict, step: int, lo: int, hi: int) -> dict:
        """The state format's arguments of the step over elements [lo, hi) of
        one master (a piece from :meth:`_aligned`'s sizes): stochastic
        rounding (bf16 and int8 states, bf16 params), the seed under which the piece
        draws the whole master's bits; int8, the scales of its blocks."""
        out = {}
        if self.seed is not None:  # bf16 states or bf16_stochastic_round: one hash gives both their bits
            out["seed"] = sr_seed_at(self.seed, step, lo)
        if self.bf16_stochastic_round:
            out["bf16_stochastic_round"] = True
        if self.state_format == "bf16":
            out["state_format"] = "bf16"
        if self.state_format == "int8":
            blocks = slice(lo // self.block_size, -(-hi // self.block_size))
            out.update(
                state_format="int8",
                exp_avg_absmax=[state["exp_avg_absmax"][blocks]],
                exp_avg_sq_absmax=[state["exp_avg_sq_absmax"][blocks]],
                block_size=self.block_size,
            )
        return out

    def offloaded_bytes(self) -> dict[str, int]:
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        states = [t for s in self.state.values() for t in s.values() if isinstance(t, Tensor) and t.dim() > 0]
        listed = lambda b: list(b.values()) if isinstance(b, dict) else list(b or ())
        staging = [*listed(self.grad_in), *listed(self.param_out)]
        return {"master": nbytes(self.device_of), "optimizer": nbytes(states), "staging": nbytes(staging)}
