"""Block-sparse attention with DeepSpeed's layouts: ``SparseAttention`` (an
``nn.Module`` with DeepSpeed's ``SparseSelfAttention`` signature) and the
functional :func:`block_sparse_attention`.

On CUDA tensors it runs the Triton block-sparse flash attention
(``fastzero.triton_kernels.sparse_attention``: forward and backward, only the
kept blocks, never a seq x seq matrix). Without CUDA it computes the same
function in plain PyTorch: dense masked attention for short sequences, a
flash-style loop over query blocks that gathers only the kept key blocks beyond (memory
O(seq) for a bounded number of kept blocks per row). The math's source of
truth is :func:`fastzero.ops.sparse_attention.reference.dense_attention`.
The backend is the family registry's choice (``backend=`` >
``FASTZERO_BACKEND`` > the fastest here): ``triton`` or ``reference`` (the
plain-PyTorch path above).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fastzero.ops.sparse_attention.backends import FAMILY
from fastzero.ops.sparse_attention.reference import dense_attention, expand_layout, softmax_rows

DENSE_CPU_MAX_SEQ = 256  # the CPU path's dense form up to here (cheaper for short rows); blocked beyond


def _additive(batch: int, seq: int, kpm: Tensor | None, am: Tensor | None, device, dtype) -> Tensor | None:
    """key padding [B, S] and attention mask/rpe [S, S] or [H, S, S] as one
    additive term broadcasting to [B, H, S, S]."""
    out = None
    if kpm is not None:
        out = kpm.to(dtype)[:, None, None, :]
    if am is not None:
        term = am.to(dtype)
        term = term[None] if term.dim() == 3 else term[None, None]
        out = term if out is None else out + term
    return out


def _row_tile(q, k, v, lay, i, block, scale, causal, kpm, am):
    """Query block i against the key blocks it keeps (per head, padded to the
    row's largest count across heads and masked): the masked scores
    [B, H, block, count*block], the kept columns' indices for gathering
    [B, H, count*block, D], and the gathered keys and values; None if the
    row keeps nothing in any head."""
    batch, heads, seq, dim = q.shape
    kept = lay[:, i, :]  # [H, nb]
    count = int(kept.sum(-1).max())
    if count == 0:
        return None
    offs = torch.arange(block, device=q.device)
    order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)[:, :count]  # kept first; padding repeats
    valid = torch.gather(kept, 1, order)  # [H, count]
    cols = (order[:, :, None] * block + offs).reshape(heads, count * block)
    idx = cols[None, :, :, None].expand(batch, heads, count * block, dim)
    kb, vb = torch.gather(k, 2, idx), torch.gather(v, 2, idx)
    scores = torch.matmul(q[:, :, i * block : (i + 1) * block], kb.transpose(-1, -2)) * scale
    keep = valid.repeat_interleave(block, 1)[None, :, None, :]
    if causal:
        keep = keep & (cols[None, :, None, :] <= (i * block + offs)[None, None, :, None])
    if kpm is not None:
        keys = kpm.to(scores.dtype)[:, None, :].expand(batch, heads, seq)
        scores = scores + torch.gather(keys, 2, cols[None].expand(batch, heads, count * block))[:, :, None, :]
    if am is not None:
        rows = am[..., i * block : (i + 1) * block, :].to(scores.dtype)
        rows = rows.expand(heads, block, seq) if rows.dim() == 3 else rows[None].expand(heads, block, seq)
        scores = scores + torch.gather(rows, 2, cols[:, None, :].expand(heads, block, count * block))[None]
    return scores.masked_fill(~keep, float("-inf")), idx, kb, vb


class _BlockedAttention(torch.autograd.Function):
    """The CPU path beyond DENSE_CPU_MAX_SEQ, flash-style: the forward keeps
    only the output and the per-row log-sum-exp; the backward recomputes
    each query block's probabilities and adds its dK, dV into place, so time
    and memory grow with the kept blocks, not with seq x seq."""

    @staticmethod
    def forward(ctx, q, k, v, lay, block, scale, causal, kpm, am):
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("inf"), dtype=q.dtype, device=q.device)  # +inf: a row with nothing
        for i in range(lay.shape[1]):
            tile = _row_tile(q, k, v, lay, i, block, scale, causal, kpm, am)
            if tile is None:
                continue
            scores, _, _, vb = tile
            out[:, :, i * block : (i + 1) * block] = torch.matmul(softmax_rows(scores), vb)
            row_lse = torch.logsumexp(scores, -1)
            lse[:, :, i * block : (i + 1) * block] = torch.where(torch.isfinite(row_lse), row_lse, float("inf"))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (lay, block, scale, causal, kpm, am)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        lay, block, scale, causal, kpm, am = ctx.meta
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (dout * out).sum(-1)  # rowsum(dO * O)
        for i in range(lay.shape[1]):
            tile = _row_tile(q, k, v, lay, i, block, scale, causal, kpm, am)
            if tile is None:
                continue
            scores, idx, kb, vb = tile
            rows = slice(i * block, (i + 1) * block)
            p = torch.exp(scores - lse[:, :, rows, None])  # masked (-inf) and empty rows (+inf lse) give 0
            do = dout[:, :, rows]
            dv.scatter_add_(2, idx, torch.matmul(p.transpose(-1, -2), do))
            ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta[:, :, rows, None])
            dq[:, :, rows] = torch.matmul(ds, kb) * scale
            dk.scatter_add_(2, idx, torch.matmul(ds.transpose(-1, -2), q[:, :, rows]) * scale)
        return dq, dk, dv, None, None, None, None, None, None


def _blocked_attention(q, k, v, layout, block, scale, causal, kpm, am) -> Tensor:
    return _BlockedAttention.apply(q, k, v, layout.to(torch.bool), block, scale, causal, kpm, am)


# The Triton path as torch.library custom ops with fake (meta) implementations
# and a registered backward: torch.compile traces around them without a graph
# break, and autograd sees one op.
@torch.library.custom_op("fastzero::block_sparse_attention", mutates_args=())
def _attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    row_ptr: Tensor,
    cols: Tensor,
    col_ptr: Tensor,
    rows: Tensor,
    block: int,
    scale: float,
    causal: bool,
    kpm: Tensor | None,
    am: Tensor | None,
) -> tuple[Tensor, Tensor]:
    from fastzero.triton_kernels import sparse_attention as kernels

    return kernels.forward(q, k, v, (row_ptr, cols, col_ptr, rows), block, scale, causal, kpm, am)


@_attention_op.register_fake
def _(q, k, v, row_ptr, cols, col_ptr, rows, block, scale, causal, kpm, am):
    return torch.empty_like(q), q.new_empty(q.shape[0] * q.shape[1], q.shape[2], dtype=torch.float32)


@torch.library.custom_op("fastzero::block_sparse_attention_backward", mutates_args=())
def _attention_backward_op(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    row_ptr: Tensor,
    cols: Tensor,
    col_ptr: Tensor,
    rows: Tensor,
    block: int,
    scale: float,
    causal: bool,
    kpm: Tensor | None,
    am: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    from fastzero.triton_kernels import sparse_attention as kernels

    return kernels.backward(do, q, k, v, out, lse, (row_ptr, cols, col_ptr, rows), block, scale, causal, kpm, am)


@_attention_backward_op.register_fake
def _(do, q, k, v, out, lse, row_ptr, cols, col_ptr, rows, block, scale, causal, kpm, am):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, row_ptr, cols, col_ptr, rows, block, scale, causal, kpm, am = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], row_ptr, cols, col_ptr, rows)
    ctx.meta = (block, scale, causal, kpm, am)


def _backward(ctx, do, _dlse):
    q, k, v, out, lse, *lists = ctx.saved_tensors
    block, scale, causal, kpm, am = ctx.meta
    dq, dk, dv = _attention_backward_op(do.contiguous(), q, k, v, out, lse, *lists, block, scale, causal, kpm, am)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup)


@torch.compiler.disable
def _make_lists(layout: Tensor) -> tuple:
    """Data-dependent (nonzero): made eagerly, once per layout, outside any compiled graph."""
    from fastzero.triton_kernels import sparse_attention as kernels

    return kernels.csr(layout)


def _check_block(block: object, what: str = "block") -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {block!r}")
    return block


def _check_scale(softmax_scale: object) -> float | None:
    if softmax_scale is None:
        return None
    number = not isinstance(softmax_scale, bool) and isinstance(softmax_scale, int | float)
    if not number or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number (or None for 1/sqrt(head_dim)), got {softmax_scale!r}")
    return float(softmax_scale)


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Three tensors [batch, heads, seq, head_dim] of one shape, one float
    dtype and one device; heads, seq and head_dim >= 1 (batch may be 0)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor [batch, heads, seq, head_dim], got {type(t).__name__}")
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(
            f"query, key, value must be [batch, heads, seq, head_dim]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"query, key and value shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for dim, name in ((1, "heads"), (2, "seq"), (3, "head_dim")):
        if q.shape[dim] < 1:
            hint = " (an embedding smaller than the number of heads?)" if name == "head_dim" else ""
            raise ValueError(
                f"query, key, value {tuple(q.shape)} [batch, heads, seq, head_dim] have {name} = 0; "
                f"{name} must be >= 1{hint}"
            )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"query, key and value dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"dtype {q.dtype}: SparseAttention takes fp16, bf16 or fp32 (fp64 on the CPU path)")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"query, key and value are on different devices: {q.device}, {k.device}, {v.device}")


def check_inputs(q: Tensor, k: Tensor, v: Tensor, layout: Tensor, block: int) -> None:
    check_qkv(q, k, v)
    _check_block(block)
    heads, seq = q.shape[1], q.shape[2]
    if seq % block:
        raise ValueError(f"seq {seq} is not a multiple of the block {block}; SparseAttention pads for you")
    nb = seq // block
    if not isinstance(layout, Tensor):
        raise ValueError(
            f"layout must be a torch.Tensor [heads, seq // block, seq // block], got {type(layout).__name__}"
        )
    if layout.shape != (heads, nb, nb):
        raise ValueError(
            f"layout {tuple(layout.shape)} does not fit {heads} heads and seq {seq} in blocks of "
            f"{block}: expected ({heads}, {nb}, {nb})"
        )


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: Tensor,
    block: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    backend: str | None = None,
    lists: tuple | None = None,
) -> Tensor:
    """Block-sparse attention over q, k, v [B, H, S, D] with S a multiple of
    `block`. Masks are additive: `key_padding_mask` [B, S], `attn_mask`
    [S, S] or [H, S, S] (relative position terms go there too). `causal`
    masks the upper triangle inside diagonal blocks. `lists`: the layout's
    block lists (``triton_kernels.sparse_attention.csr``), if already made."""
    check_inputs(q, k, v, layout, block)
    softmax_scale = _check_scale(softmax_scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    kpm = None if key_padding_mask is None else key_padding_mask.to(torch.float32).contiguous()
    am = None if attn_mask is None else attn_mask.to(torch.float32).contiguous()
    if FAMILY.choose(q.device.type, backend).backend == "triton":
        if block not in (16, 32, 64, 128) or q.shape[-1] not in (16, 32, 64, 128):
            raise ValueError(
                f"the Triton kernel takes blocks 16-128 and head dims 16-128 (powers of two); "
                f"got block {block}, head_dim {q.shape[-1]}"
            )
        lists = lists if lists is not None else _make_lists(layout.to(q.device))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return _attention_op(q, k, v, *lists, block, scale, causal, kpm, am)[0]
    if q.shape[2] <= DENSE_CPU_MAX_SEQ:
        keep = expand_layout(layout.to(q.device), block, causal)[None]
        return dense_attention(q, k, v, keep, scale, _additive(q.shape[0], q.shape[2], kpm, am, q.device, q.dtype))
    return _blocked_attention(q, k, v, layout.to(q.device), block, scale, causal, kpm, am)


def _as_additive(mask: Tensor, mode: str, what: str) -> Tensor:
    """DeepSpeed's mask modes: 'add' masks are added to the scores, 'mul'
    masks keep where nonzero (0 becomes -inf)."""
    if mode == "add":
        return mask.to(torch.float32)
    if mode == "mul":
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(mask == 0, float("-inf"))
    raise ValueError(f"{what}_mode {mode!r}: 'add' or 'mul'")


class SparseAttention(torch.nn.Module):
    """DeepSpeed's ``SparseSelfAttention``: block-sparse attention with the
    layout of `sparsity_config` (a ``fastzero.ops.sparse_attention.sparsity_config`` config).

    ``forward(query, key, value, rpe=None, key_padding_mask=None,
    attn_mask=None)`` with q, k, v [batch, heads, seq, head_dim]; seq up to
    `max_seq_length`, padded to a multiple of the block and unpadded for you.
    `key_padding_mask` [batch, seq] and `attn_mask` [seq, seq] follow their
    modes ('add': added to the scores; 'mul': 0 masks out); `rpe` [seq, seq]
    or [heads, seq, seq] is added (no gradient flows to it). The softmax
    scale is `softmax_scale` (default 1/sqrt(head_dim)).
    """

    def __init__(
        self,
        sparsity_config,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
        softmax_scale: float | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in ("add", "mul"):
                raise ValueError(f"{name} {mode!r}: 'add' or 'mul'")
        if not all(hasattr(sparsity_config, a) for a in ("num_heads", "block", "make_layout")):
            raise ValueError(
                f"sparsity_config must be a sparsity config (fastzero.ops.SparsityConfig's subclasses), "
                f"got {type(sparsity_config).__name__}"
            )
        _check_block(sparsity_config.block, "sparsity_config.block")
        _check_block(max_seq_length, "max_seq_length")
        softmax_scale = _check_scale(softmax_scale)
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode, self.attn_mask_mode = key_padding_mask_mode, attn_mask_mode
        self.max_seq_length = max_seq_length
        self.softmax_scale = softmax_scale
        self.force_backend = backend  # backend= > FASTZERO_BACKEND > the fastest (fastzero.ops.backend)
        self.last_backend: str | None = None  # which ran the last forward
        block = sparsity_config.block
        padded = -(-max_seq_length // block) * block
        # DeepSpeed's way: one master layout at the longest length, sliced for shorter ones
        self.register_buffer("master_layout", sparsity_config.make_layout(padded), persistent=False)
        self._lists: dict[tuple, tuple] = {}  # (seq, device) -> the Triton path's block lists, made once

    def _block_lists(self, seq: int, device: torch.device) -> tuple | None:
        self.last_backend = FAMILY.choose(device.type, self.force_backend).backend
        if self.last_backend != "triton":
            return None
        key = (seq, str(device))
        if key not in self._lists:
            self._lists[key] = _make_lists(self.get_layout(seq).to(device))
        return self._lists[key]

    @property
    def causal(self) -> bool:
        return getattr(self.sparsity_config, "attention", "bidirectional") == "unidirectional"

    def get_layout(self, seq: int) -> Tensor:
        nb = seq // self.sparsity_config.block
        return self.master_layout[:, :nb, :nb]

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        rpe: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        check_qkv(query, key, value)
        batch, heads, seq, _ = query.shape
        if heads != self.sparsity_config.num_heads:
            raise ValueError(f"query has {heads} heads, the sparsity config {self.sparsity_config.num_heads}")
        if seq > self.max_seq_length:
            raise ValueError(
                f"seq {seq} is longer than max_seq_length {self.max_seq_length}; build SparseAttention "
                "with a larger max_seq_length"
            )
        block = self.sparsity_config.block
        pad = -seq % block
        kpm = None
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, seq):
                raise ValueError(f"key_padding_mask {tuple(key_padding_mask.shape)}: expected ({batch}, {seq})")
            kpm = _as_additive(key_padding_mask, self.key_padding_mask_mode, "key_padding_mask")
        am = None
        if attn_mask is not None:
            if attn_mask.shape[-2:] != (seq, seq):
                raise ValueError(f"attn_mask {tuple(attn_mask.shape)}: expected ({seq}, {seq})")
            am = _as_additive(attn_mask, self.attn_mask_mode, "attn_mask")
        if rpe is not None:
            if rpe.shape[-2:] != (seq, seq) or rpe.dim() not in (2, 3):
                raise ValueError(f"rpe {tuple(rpe.shape)}: expected ({seq}, {seq}) or ({heads}, {seq}, {seq})")
            am = rpe.detach().to(torch.float32) if am is None else am + rpe.detach().to(torch.float32)
        if pad:  # pad to whole blocks; padded keys are masked out, padded rows dropped
            query, key, value = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
            kpm = torch.zeros(batch, seq, device=query.device) if kpm is None else kpm
            kpm = torch.nn.functional.pad(kpm, (0, pad), value=float("-inf"))
            if am is not None:
                am = torch.nn.functional.pad(am, (0, pad, 0, pad))
        layout = self.get_layout(seq + pad)
        lists = self._block_lists(seq + pad, query.device)
        out = block_sparse_attention(
            query,
            key,
            value,
            layout,
            block,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
            key_padding_mask=kpm,
            attn_mask=am,
            backend=self.force_backend,
            lists=lists,
        )
        return out[:, :, :seq] if pad else out


def pad_to_block_size(
    block_size: int,
    input_ids=None,
    attention_mask=None,
    token_type_ids=None,
    position_ids=None,
    inputs_embeds=None,
    pad_token_id: int = 0,
    model_embeddings=None,
):
    """DeepSpeed's ``SparseAttentionUtils.pad_to_block_size``: pads a model's
    inputs at the end of the sequence to a multiple of `block_size`. Returns
    (pad_len, input_ids, attention_mask, token_type_ids, position_ids,
    inputs_embeds); undo with :func:`unpad_sequence_output`."""
    _check_block(block_size, "block_size")
    if input_ids is None and inputs_embeds is None:
        raise ValueError("pad_to_block_size needs input_ids [batch, seq] or inputs_embeds [batch, seq, hidden]")
    shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
    if len(shape) != 2:
        what = "input_ids" if input_ids is not None else "inputs_embeds"
        raise ValueError(f"{what} {tuple(shape)}: expected [batch, seq]{'' if input_ids is not None else ' + hidden'}")
    pad = -shape[1] % block_size
    if pad:
        fill = lambda t, value: None if t is None else torch.nn.functional.pad(t, (0, pad), value=value)  # noqa: E731
        if input_ids is not None:
            input_ids = fill(input_ids, pad_token_id)
        if inputs_embeds is not None:
            ids = torch.full((shape[0], pad), pad_token_id, dtype=torch.long, device=inputs_embeds.device)
            if model_embeddings is not None:  # the pad token's embedding, as DeepSpeed
                extra = model_embeddings(ids)
            else:
                extra = inputs_embeds.new_zeros(shape[0], pad, inputs_embeds.shape[-1])
            inputs_embeds = torch.cat([inputs_embeds, extra], dim=1)
        attention_mask = fill(attention_mask, 0)  # padded tokens are not attended to
        token_type_ids = fill(token_type_ids, 0)
        position_ids = fill(position_ids, pad_token_id)
    return pad, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds


def unpad_sequence_output(pad_len: int, sequence_output: Tensor) -> Tensor:
    """Drops the `pad_len` positions :func:`pad_to_block_size` added."""
    return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
