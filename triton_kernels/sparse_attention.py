r"""Block-sparse flash attention in Triton, forward and backward.

A layout ``[heads, nb, nb]`` says which ``block x block`` tiles of the
attention matrix exist. Per query block the forward iterates only over the
key blocks its row keeps (a CSR list per head), with the online softmax in
fp32, and never materialises a seq x seq matrix:

.. math::
    s = q k^T \cdot \text{scale} + \text{masks};\quad
    o = \text{softmax}(s)\, v;\quad \text{lse} = \log \textstyle\sum_j e^{s_j}

The backward recomputes the probabilities from the saved per-row log-sum-exp:
dQ per query block over its kept key blocks; dK, dV per key block over the
query blocks that keep it (the transposed lists). Masks are additive fp32:
``kpm`` [batch, seq] per key, ``am`` [seq, seq] or [heads, seq, seq]; ``causal`` masks the upper
triangle inside diagonal blocks (the layout is block-causal already). A row
that keeps nothing (or masks everything) gives zeros, not NaN. The source of
truth is ``fastzero.ops.sparse_attention.dense_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

NEG = float("-inf")


def csr(layout: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row lists (kept key blocks per query block) and column lists (query
    blocks that keep each key block), per head: (row_ptr [H, nb+1],
    cols [nnz], col_ptr [H, nb+1], rows [nnz]), int32; heads are offset
    into one flat index array."""
    lay = layout.to(torch.bool)
    heads, nb, _ = lay.shape

    def lists(m: Tensor) -> tuple[Tensor, Tensor]:
        counts = m.sum(-1).reshape(-1)  # per (head, row)
        ptr = torch.zeros(heads * nb + 1, dtype=torch.int64, device=m.device)
        ptr[1:] = counts.cumsum(0)
        idx = m.reshape(heads * nb, nb).nonzero()[:, 1]
        return ptr.to(torch.int32), idx.to(torch.int32)

    row_ptr, cols = lists(lay)
    col_ptr, rows = lists(lay.transpose(1, 2))
    return row_ptr, cols, col_ptr, rows


@triton.jit
def _mm(a, b, FP32: tl.constexpr):
    """a @ b accumulated in fp32: exact (ieee) for fp32 inputs, else in b's
    dtype (the fp32 probabilities are rounded to it, as flash attention does)."""
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _probs_and_ds(
    q,
    k,
    v,
    do,
    lse,
    delta,
    qi,
    kj,
    b,
    h,
    scale,
    KPM,
    AM,
    s_kpm_b,
    s_am_h,
    s_am,
    BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_AM: tl.constexpr,
    FP32: tl.constexpr,
):
    """The backward's tile: probabilities recomputed from the saved lse, and
    dS = P * (dO V^T - rowsum(dO * O))."""
    s = _scores(q, k, qi, kj, b, h, scale, KPM, AM, s_kpm_b, s_am_h, s_am, BLOCK, CAUSAL, HAS_KPM, HAS_AM, FP32)
    p = tl.exp(s - lse[:, None])
    dp = _mm(do, tl.trans(v), FP32)
    return p, p * (dp - delta[:, None])


@triton.jit
def _scores(
    q,
    k,
    qi,
    kj,
    b,
    h,
    scale,
    KPM,
    AM,
    s_kpm_b,
    s_am_h,
    s_am,
    BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_AM: tl.constexpr,
    FP32: tl.constexpr,
):
    """One tile of scores, fp32, masked: query block qi x key block kj."""
    s = _mm(q, tl.trans(k), FP32) * scale
    rows = qi * BLOCK + tl.arange(0, BLOCK)
    cols = kj * BLOCK + tl.arange(0, BLOCK)
    if HAS_KPM:
        s += tl.load(KPM + b * s_kpm_b + cols)[None, :]
    if HAS_AM:
        s += tl.load(AM + h * s_am_h + rows[:, None] * s_am + cols[None, :])
    if CAUSAL:
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    return s


@triton.jit
def _fwd(
    Q,
    K,
    V,
    OUT,
    LSE,
    ROW_PTR,
    COLS,
    KPM,
    AM,
    scale,
    seq,
    nb,
    heads,
    s_b,
    s_h,
    s_s,
    s_kpm_b,
    s_am_h,
    s_am,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_AM: tl.constexpr,
    FP32: tl.constexpr,
):
    qi = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    offs = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    base = b * s_b + h * s_h
    q = tl.load(Q + base + (qi * BLOCK + offs)[:, None] * s_s + d[None, :])
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    start = tl.load(ROW_PTR + h * nb + qi)
    end = tl.load(ROW_PTR + h * nb + qi + 1)
    for e in range(start, end):
        kj = tl.load(COLS + e)
        kv = base + (kj * BLOCK + offs)[:, None] * s_s + d[None, :]
        k = tl.load(K + kv)
        v = tl.load(V + kv)
        s = _scores(q, k, qi, kj, b, h, scale, KPM, AM, s_kpm_b, s_am_h, s_am, BLOCK, CAUSAL, HAS_KPM, HAS_AM, FP32)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far: no NaN from -inf - -inf
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p, v, FP32)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]  # rows that keep nothing: zeros
    tl.store(OUT + base + (qi * BLOCK + offs)[:, None] * s_s + d[None, :], out.to(OUT.dtype.element_ty))
    # +inf for empty rows: the backward's exp(s - lse) is 0 there
    lse = tl.where(empty, float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + bh * seq + qi * BLOCK + offs, lse)


@triton.jit
def _bwd_dq(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    ROW_PTR,
    COLS,
    KPM,
    AM,
    scale,
    seq,
    nb,
    heads,
    s_b,
    s_h,
    s_s,
    s_kpm_b,
    s_am_h,
    s_am,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_AM: tl.constexpr,
    FP32: tl.constexpr,
):
    qi = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    offs = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    base = b * s_b + h * s_h
    rows = base + (qi * BLOCK + offs)[:, None] * s_s + d[None, :]
    q = tl.load(Q + rows)
    do = tl.load(DO + rows)
    lse = tl.load(LSE + bh * seq + qi * BLOCK + offs)
    delta = tl.load(DELTA + bh * seq + qi * BLOCK + offs)
    dq = tl.zeros([BLOCK, D], tl.float32)
    start = tl.load(ROW_PTR + h * nb + qi)
    end = tl.load(ROW_PTR + h * nb + qi + 1)
    for e in range(start, end):
        kj = tl.load(COLS + e)
        kv = base + (kj * BLOCK + offs)[:, None] * s_s + d[None, :]
        k = tl.load(K + kv)
        v = tl.load(V + kv)
        _, ds = _probs_and_ds(
            q,
            k,
            v,
            do,
            lse,
            delta,
            qi,
            kj,
            b,
            h,
            scale,
            KPM,
            AM,
            s_kpm_b,
            s_am_h,
            s_am,
            BLOCK,
            CAUSAL,
            HAS_KPM,
            HAS_AM,
            FP32,
        )
        dq += _mm(ds, k, FP32)
    tl.store(DQ + rows, (dq * scale).to(DQ.dtype.element_ty))


@triton.jit
def _bwd_dkdv(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    COL_PTR,
    ROWS,
    KPM,
    AM,
    scale,
    seq,
    nb,
    heads,
    s_b,
    s_h,
    s_s,
    s_kpm_b,
    s_am_h,
    s_am,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_AM: tl.constexpr,
    FP32: tl.constexpr,
):
    kj = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    offs = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    base = b * s_b + h * s_h
    cols = base + (kj * BLOCK + offs)[:, None] * s_s + d[None, :]
    k = tl.load(K + cols)
    v = tl.load(V + cols)
    dk = tl.zeros([BLOCK, D], tl.float32)
    dv = tl.zeros([BLOCK, D], tl.float32)
    start = tl.load(COL_PTR + h * nb + kj)
    end = tl.load(COL_PTR + h * nb + kj + 1)
    for e in range(start, end):
        qi = tl.load(ROWS + e)
        rows = base + (qi * BLOCK + offs)[:, None] * s_s + d[None, :]
        q = tl.load(Q + rows)
        do = tl.load(DO + rows)
        lse = tl.load(LSE + bh * seq + qi * BLOCK + offs)
        delta = tl.load(DELTA + bh * seq + qi * BLOCK + offs)
        p, ds = _probs_and_ds(
            q,
            k,
            v,
            do,
            lse,
            delta,
            qi,
            kj,
            b,
            h,
            scale,
            KPM,
            AM,
            s_kpm_b,
            s_am_h,
            s_am,
            BLOCK,
            CAUSAL,
            HAS_KPM,
            HAS_AM,
            FP32,
        )
        dv += _mm(tl.trans(p), do, FP32)
        dk += _mm(tl.trans(ds), q, FP32)
    tl.store(DK + cols, (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + cols, dv.to(DV.dtype.element_ty))


def _meta(q: Tensor, block: int, causal: bool, kpm: Tensor | None, am: Tensor | None) -> dict:
    return dict(
        BLOCK=block,
        D=q.shape[-1],
        CAUSAL=causal,
        HAS_KPM=kpm is not None,
        HAS_AM=am is not None,
        FP32=q.dtype == torch.float32,
        num_warps=4 if block * q.shape[-1] <= 64 * 64 else 8,
    )


def _masks(q: Tensor, kpm: Tensor | None, am: Tensor | None) -> tuple[Tensor, Tensor, tuple[int, int, int]]:
    """Mask pointers and strides: kpm [B, S]; am [S, S] or [H, S, S] (one per head)."""
    dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
    s_am_h = am.stride(0) if am is not None and am.dim() == 3 else 0
    strides = (kpm.stride(0) if kpm is not None else 0, s_am_h, am.stride(-2) if am is not None else 0)
    return (kpm if kpm is not None else dummy), (am if am is not None else dummy), strides


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lists: tuple,
    block: int,
    scale: float,
    causal: bool,
    kpm: Tensor | None = None,
    am: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) for contiguous q, k, v [B, H, S, D] (S a multiple of the
    block); masks fp32 contiguous or None."""
    batch, heads, seq, dim = q.shape
    nb = seq // block
    out = torch.empty_like(q)
    lse = torch.empty(batch * heads, seq, dtype=torch.float32, device=q.device)
    k_arg, a_arg, mask_strides = _masks(q, kpm, am)
    _fwd[(nb, batch * heads)](
        q,
        k,
        v,
        out,
        lse,
        lists[0],
        lists[1],
        k_arg,
        a_arg,
        scale,
        seq,
        nb,
        heads,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        *mask_strides,
        **_meta(q, block, causal, kpm, am),
    )
    return out, lse


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    lists: tuple,
    block: int,
    scale: float,
    causal: bool,
    kpm: Tensor | None = None,
    am: Tensor | None = None,
):
    """(dq, dk, dv)."""
    batch, heads, seq, dim = q.shape
    nb = seq // block
    do = do.contiguous()
    delta = (do.float() * out.float()).sum(-1).reshape(batch * heads, seq)  # rowsum(dO * O)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    k_arg, a_arg, mask_strides = _masks(q, kpm, am)
    meta = _meta(q, block, causal, kpm, am)
    strides = (q.stride(0), q.stride(1), q.stride(2), *mask_strides)
    _bwd_dq[(nb, batch * heads)](
        q, k, v, do, dq, lse, delta, lists[0], lists[1], k_arg, a_arg, scale, seq, nb, heads, *strides, **meta
    )
    _bwd_dkdv[(nb, batch * heads)](
        q, k, v, do, dk, dv, lse, delta, lists[2], lists[3], k_arg, a_arg, scale, seq, nb, heads, *strides, **meta
    )
    return dq, dk, dv
