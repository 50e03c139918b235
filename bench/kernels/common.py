"""What several families share: where fastzero's backends can run here, and
the bandwidth probes (rooflines) a case's figures are measured against in the
same rounds."""

from __future__ import annotations

import torch

from fastzero import native
from fastzero.ops.backend import cuda_status, triton_status
from fastzero.ops.tolerances import assert_close

from ..harness import Provider, Runner, Unavailable


def cpu_kernels():
    """(fastzero's native CPU kernels, the index of the ISA they run); Unavailable where they did not build."""
    ops = native.cpu_ops()
    if ops is None:
        raise Unavailable(f"native kernels unavailable: {native.cpu_ops_error()}")
    return ops, native.ISA_NAMES.index(native.cpu_isa())


def backend_ready(backend: str | None, device: str) -> None:
    """Unavailable unless fastzero's `backend` ("cpu", "cuda", "triton"; None: the op's own choice) can run on
    `device` tensors here."""
    if device == "cuda" and not torch.cuda.is_available():
        raise Unavailable("no CUDA device")
    if backend == "cpu":
        cpu_kernels()
    elif backend in ("cuda", "triton"):
        ok, why = cuda_status() if backend == "cuda" else triton_status(device)
        if not ok:
            raise Unavailable(why)


def our_backends(device: str) -> list[tuple[str, str | None]]:
    """(provider, backend) of fastzero's kernels on `device`: the CPU's own choice, or each GPU backend."""
    return [("fastzero", None)] if device == "cpu" else [("fastzero_cuda", "cuda"), ("fastzero_triton", "triton")]


def roofline(device: str, sizes: list[int], *, writes: bool = False, codes: int | None = None) -> Provider:
    """The bandwidth probe over tensors of `sizes` elements: on the CPU the in-place stream of Adam's shape
    (28 B per element), for a kernel that mostly writes (`writes`) the write probe (4 B per element), or for
    quantize (`codes`: its bit width) the probe of its traffic (read 4 B, write codes_bits / 8 B per element);
    on a GPU a copy (8 B per element)."""
    n = sum(sizes)
    if device == "cuda":
        return Provider("roofline", "roofline", lambda: cuda_copy_roofline(n), bytes=8 * n)
    if codes is not None:
        return Provider("roofline", "roofline", lambda: narrow_roofline(sizes, codes), bytes=n * (4 + codes / 8))
    if writes:
        return Provider("roofline", "roofline", lambda: write_roofline(sizes), bytes=4 * n)
    return Provider("roofline", "roofline", lambda: stream_roofline(sizes), bytes=28 * n)


def stream_roofline(sizes: list[int]) -> Runner:
    """The CPU bandwidth probe over tensors of the case's sizes: the bytes of
    an Adam step per element (read 4 arrays, write 3) and the same layout."""
    ops, isa = cpu_kernels()
    arrays = [[torch.empty(n).uniform_(-1, 1) for n in sizes] for _ in range(4)]
    ptrs = [[t.data_ptr() for t in ts] for ts in arrays]

    def step():
        ops.stream_update(isa, *ptrs, sizes, 1e-7, torch.get_num_threads())

    def check():
        a, b, c, d = arrays
        want = [[t + 1e-7 * bt for t, bt in zip(ts, b)] for ts in (a, c, d)]
        step()
        for got, exp in zip((a, c, d), want):
            for g, e in zip(got, exp):
                assert_close(g, e)

    return Runner(step=step, check=check)


STREAM_OUT_BYTES = 8 << 20  # csrc/cpu/onebit.cpp's kStreamOutBytes: larger outputs bypass the cache


def write_roofline(sizes: list[int]) -> Runner:
    """The CPU write-bandwidth probe: every element of tensors of the case's
    sizes set, nothing read (4 B per element), as the 1-bit unpack writes:
    plain stores while the output fits in the caches, cache-bypassing ones
    from STREAM_OUT_BYTES. The ceiling of a kernel that mostly writes, where
    the in-place probe, whose writes follow its reads of the same lines,
    overstates it."""
    ops, isa = cpu_kernels()
    arrays = [torch.empty(n) for n in sizes]
    ptrs = [t.data_ptr() for t in arrays]
    nt = 4 * sum(sizes) >= STREAM_OUT_BYTES

    def step():
        ops.stream_fill(isa, ptrs, sizes, 0.5, nt, torch.get_num_threads())

    def check():
        step()
        for t in arrays:
            assert bool((t == 0.5).all()), "the write probe left other values"

    return Runner(step=step, check=check)


STREAM_CODES_BYTES = 1 << 20  # csrc/cpu/quant.cpp's kStreamCodesBytes: larger codes bypass the cache


def narrow_roofline(sizes: list[int], bits: int) -> Runner:
    """The CPU probe of quantize's traffic: fp32 tensors of the case's sizes
    read once and a code written per value (bits 8: a byte; 4: a nibble),
    stored as quantize stores its codes (cache-bypassing from
    STREAM_CODES_BYTES of codes), with no arithmetic to speak of. Quantize
    reads four bytes for each it writes; on a CPU one read stream per core
    can be well below the in-place probe's mixed traffic, so that probe is not
    this kernel's ceiling."""
    ops, isa = cpu_kernels()
    xs = [torch.empty(n).uniform_(-1, 1) for n in sizes]
    outs = [torch.empty(n if bits == 8 else (n + 1) // 2, dtype=torch.uint8) for n in sizes]
    nt = sum(o.numel() for o in outs) >= STREAM_CODES_BYTES

    def step():
        ops.stream_narrow(
            isa, [t.data_ptr() for t in xs], [t.data_ptr() for t in outs], sizes, bits, nt, torch.get_num_threads()
        )

    def check():
        for o in outs:
            o.fill_(0x55)
        step()
        for x, o in zip(xs, outs):
            assert torch.equal(o, narrow_codes(x, bits)), "the quantize-shaped probe wrote other codes"

    return Runner(step=step, check=check)


def narrow_codes(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What narrow_roofline writes for fp32 x: its bit patterns as int32, clamped to the code range (uint8)."""
    lim = 127 if bits == 8 else 7
    q = x.view(torch.int32).clamp(-lim, lim).to(torch.uint8)
    if bits == 8:
        return q
    q = q & 0xF
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return q[0::2] | (q[1::2] << 4)


def cuda_copy_roofline(numel: int) -> Runner:
    """The GPU's copy bandwidth: dst.copy_(src) over `numel` fp32 elements
    (bytes read plus written = 8 per element)."""
    if not torch.cuda.is_available():
        raise Unavailable("no CUDA device")
    src = torch.empty(numel, device="cuda").uniform_(-1, 1)
    dst = torch.empty_like(src)

    def check():
        dst.copy_(src)
        assert torch.equal(dst, src)

    return Runner(step=lambda: dst.copy_(src), check=check, cuda=True)
