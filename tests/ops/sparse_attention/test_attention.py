"""Block-sparse attention: the Triton kernels (in the interpreter without a
GPU) and the CPU paths against dense attention with the equivalent element
mask in fp64, forward and gradients; the module's padding, masks and errors."""

import pytest
import torch

import fastzero.ops.sparse_attention.attention as sa
import fastzero.ops.sparse_attention.sparsity_config as sz
from fastzero.ops.sparse_attention import SparseAttention, block_sparse_attention
from fastzero.ops.sparse_attention.reference import dense_attention, expand_layout

# the Triton path runs on the GPU where there is one, else in the interpreter on CPU tensors
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class LayoutConfig:
    """A sparsity config with a given layout (the real configs have their own tests)."""

    def __init__(self, layout, block, attention="bidirectional"):
        self.layout, self.block, self.attention, self.num_heads = layout, block, attention, layout.shape[0]

    def make_layout(self, seq_len):
        nb = seq_len // self.block
        return self.layout[:, :nb, :nb]


def random_layout(heads, nb, causal, density=0.5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lay = (torch.rand(heads, nb, nb, generator=gen) < density).long()
    lay[:, torch.arange(nb), torch.arange(nb)] = 1  # the diagonal, as every DeepSpeed layout keeps it
    lay[0, 1] = 0  # a query block that keeps nothing: zeros, not NaN
    return lay.tril() if causal else lay


def reference(q, k, v, layout, block, causal, kpm=None, am=None, scale=None):
    """fp64 dense attention with the layout's element mask, and its grads."""
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    kpm = None if kpm is None else kpm.cpu()
    am = None if am is None else am.cpu()
    keep = expand_layout(layout, block, causal)[None]
    add = None
    if kpm is not None:
        add = kpm.double()[:, None, None, :]
    if am is not None:
        term = am.double()[None] if am.dim() == 3 else am.double()[None, None]
        add = term if add is None else add + term
    out = dense_attention(q, k, v, keep, scale or q.shape[-1] ** -0.5, add)
    return out, (q, k, v)


def check(out, grads, ref, ref_inputs, dout, atol=2e-5):
    ref.backward(dout.cpu().double())
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out.cpu().double(), ref.detach(), rtol=1e-4, atol=atol)
    for name, g, r in zip("qkv", grads, ref_inputs):
        torch.testing.assert_close(g.cpu().double(), r.grad, rtol=1e-4, atol=atol, msg=lambda m, n=name: f"d{n}: {m}")


def inputs(batch, heads, seq, dim, dtype=torch.float32, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq, dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(3)]


def masks(batch, heads, seq, kind, seed=2):
    gen = torch.Generator().manual_seed(seed)
    kpm = am = None
    if "kpm" in kind:
        kpm = torch.zeros(batch, seq)
        kpm[-1, -7:] = float("-inf")  # the last sample's padding
        kpm[0, :3] = -1.5
    if "am" in kind:
        am = 0.3 * torch.randn(heads if "head" in kind else 1, seq, seq, generator=gen)
        am = am if "head" in kind else am[0]
        am[..., 5, :] = float("-inf")  # a row the mask removes entirely
    return kpm, am


PATHS = ["triton", "cpu-dense", "cpu-blocked"]


def run(path, q, k, v, lay, block, causal, kpm, am, monkeypatch):
    if path == "cpu-blocked":
        monkeypatch.setattr(sa, "DENSE_CPU_MAX_SEQ", 0)
    backend = "triton" if path == "triton" else "reference"
    return block_sparse_attention(
        q, k, v, lay, block, causal=causal, key_padding_mask=kpm, attn_mask=am, backend=backend
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "block, dim, causal, kind",
    [
        (16, 16, False, ""),
        (16, 32, True, "kpm"),
        (32, 16, False, "kpm+am"),
        (16, 16, True, "am+head"),
        (32, 32, True, "kpm+am+head"),
    ],
)
def test_forward_and_gradients_match_dense_attention(path, block, dim, causal, kind, monkeypatch):
    batch, heads, nb = 2, 2, 4
    seq = nb * block
    device = TRITON_DEVICE if path == "triton" else "cpu"
    q, k, v = inputs(batch, heads, seq, dim, device=device)
    lay = random_layout(heads, nb, causal)
    kpm, am = (None if m is None else m.to(device) for m in masks(batch, heads, seq, kind))
    out = run(path, q, k, v, lay, block, causal, kpm, am, monkeypatch)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, ref_inputs = reference(q, k, v, lay, block, causal, kpm, am)
    check(out, [t.grad for t in (q, k, v)], ref, ref_inputs, dout)
    assert (out[:, 0, block : 2 * block] == 0).all()  # head 0's query block 1 keeps nothing


@pytest.mark.parametrize("path", PATHS)
def test_softmax_scale_and_fully_masked_rows(path, monkeypatch):
    q, k, v = inputs(1, 2, 64, 16, device=TRITON_DEVICE if path == "triton" else "cpu")
    lay = random_layout(2, 4, False)
    kpm = torch.full((1, 64), float("-inf"), device=q.device)  # every key padded: every row has nothing to attend
    out = block_sparse_attention(q, k, v, lay, 16, key_padding_mask=kpm, backend="triton" if path == "triton" else None)
    assert (out == 0).all()
    out = run(path, q, k, v, lay, 16, False, None, None, monkeypatch)
    scaled = block_sparse_attention(q, k, v, lay, 16, softmax_scale=0.5, backend="triton" if path == "triton" else None)
    ref, _ = reference(q, k, v, lay, 16, False, scale=0.5)
    torch.testing.assert_close(scaled.double(), ref.detach(), rtol=1e-4, atol=2e-5)
    assert not torch.allclose(out, scaled)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block, dim", [(16, 32), (32, 64), (64, 64), (64, 128), (128, 128), (128, 64)])
@gpu
@needs_cuda
def test_gpu_kernel_in_low_precision_tracks_fp32(dtype, block, dim):
    batch, heads, seq = 2, 4, 512
    nb = seq // block
    q, k, v = inputs(batch, heads, seq, dim, dtype, device="cuda")
    lay = random_layout(heads, nb, True, density=0.4)
    kpm, am = (m.cuda() for m in masks(batch, heads, seq, "kpm+am+head"))
    out = block_sparse_attention(q, k, v, lay, block, causal=True, key_padding_mask=kpm, attn_mask=am)
    dout = torch.randn_like(out)
    out.backward(dout)
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    keep = expand_layout(lay.cuda(), block, True)[None]
    ref = dense_attention(q2, k2, v2, keep, dim**-0.5, kpm[:, None, None, :] + am[None])
    ref.backward(dout.float())
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    for t, r in zip((q, k, v), (q2, k2, v2)):
        torch.testing.assert_close(t.grad.float(), r.grad, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cpu_path_tracks_fp64(dtype):
    q, k, v = inputs(2, 2, 64, 32, dtype)
    lay = random_layout(2, 4, True)
    out = block_sparse_attention(q, k, v, lay, 16, causal=True)
    ref, _ = reference(q, k, v, lay, 16, True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=3e-2)


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_module_pads_unpads_and_applies_masks_by_mode(mode):
    block, heads, seq = 16, 2, 45  # not a multiple of the block
    lay = random_layout(heads, 4, True, density=0.7)
    attn = SparseAttention(
        LayoutConfig(lay, block, "unidirectional"), key_padding_mask_mode=mode, attn_mask_mode=mode, max_seq_length=64
    )
    q, k, v = inputs(2, heads, seq, 16)
    keep_keys = torch.ones(2, seq)
    keep_keys[1, -4:] = 0
    gen = torch.Generator().manual_seed(5)
    rows = (torch.rand(seq, seq, generator=gen) > 0.2).float()
    kpm = keep_keys if mode == "mul" else torch.zeros(2, seq).masked_fill(keep_keys == 0, float("-inf"))
    am = rows if mode == "mul" else torch.zeros(seq, seq).masked_fill(rows == 0, float("-inf"))
    rpe = 0.1 * torch.randn(heads, seq, seq, generator=gen)
    out = attn(q, k, v, rpe=rpe, key_padding_mask=kpm, attn_mask=am)
    assert out.shape == q.shape
    dout = torch.randn_like(out)
    out.backward(dout)
    # the reference on the unpadded sequence: the layout's mask cut to seq, the masks made additive
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    keep = expand_layout(lay, block, True)[None, :, :seq, :seq]
    add = (
        torch.zeros(2, seq).masked_fill(keep_keys == 0, float("-inf")).double()[:, None, None, :]
        + torch.zeros(seq, seq).masked_fill(rows == 0, float("-inf")).double()
        + rpe.double()[None]
    )
    ref = dense_attention(q2, k2, v2, keep, 16**-0.5, add)
    check(out, [t.grad for t in (q, k, v)], ref, (q2, k2, v2), dout)


def test_module_errors_name_the_problem():
    lay = random_layout(2, 4, False)
    attn = SparseAttention(LayoutConfig(lay, 16), max_seq_length=64)
    q, k, v = inputs(1, 2, 64, 16)
    with pytest.raises(ValueError, match="longer than max_seq_length 64"):
        attn(*inputs(1, 2, 80, 16))
    with pytest.raises(ValueError, match="query has 3 heads, the sparsity config 2"):
        attn(*inputs(1, 3, 64, 16))
    with pytest.raises(ValueError, match="shapes differ"):
        attn(q, k[:, :, :32], v)
    with pytest.raises(ValueError, match="dtypes differ"):
        attn(q, k.double(), v)
    with pytest.raises(ValueError, match=r"key_padding_mask \(2, 64\): expected \(1, 64\)"):
        attn(q, k, v, key_padding_mask=torch.zeros(2, 64))
    with pytest.raises(ValueError, match="key_padding_mask_mode 'sum'"):
        SparseAttention(LayoutConfig(lay, 16), key_padding_mask_mode="sum")
    with pytest.raises(ValueError, match=r"layout \(2, 4, 4\) does not fit 2 heads and seq 32"):
        block_sparse_attention(q[:, :, :32], k[:, :, :32], v[:, :, :32], lay, 16)
    with pytest.raises(ValueError, match="head dims 16-128"):
        block_sparse_attention(*inputs(1, 2, 64, 24), lay, 16, backend="triton")


def test_pad_to_block_size_and_unpad():
    ids = torch.arange(10).reshape(2, 5)
    mask = torch.ones(2, 5, dtype=torch.long)
    pad, ids2, mask2, types, pos, embeds = sa.pad_to_block_size(4, input_ids=ids, attention_mask=mask, pad_token_id=7)
    assert pad == 3 and ids2.shape == (2, 8) and (ids2[:, 5:] == 7).all() and (mask2[:, 5:] == 0).all()
    assert types is None and pos is None and embeds is None
    out = torch.randn(2, 8, 3)
    assert torch.equal(sa.unpad_sequence_output(pad, out), out[:, :5])


def test_torch_compile_traces_the_module_without_a_graph_break():
    """The Triton path is a torch.library custom op with a fake and a
    backward: a compiled model keeps it in one graph."""
    lay = random_layout(2, 4, True)
    attn = SparseAttention(LayoutConfig(lay, 16, "unidirectional"), max_seq_length=64, backend="triton")
    q, k, v = inputs(1, 2, 64, 16)
    eager = attn(q, k, v)
    eager.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(t.grad, g)


CONFIGS = [
    lambda: sz.DenseSparsityConfig(num_heads=2, block=16),
    lambda: sz.FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2, num_global_blocks=1),
    lambda: sz.FixedSparsityConfig(
        num_heads=2,
        block=16,
        num_local_blocks=2,
        attention="unidirectional",
        different_layout_per_head=True,
        num_different_global_patterns=2,
    ),
    lambda: sz.VariableSparsityConfig(
        num_heads=2, block=16, num_random_blocks=1, local_window_blocks=[1, 2], global_block_indices=[0], seed=3
    ),
    lambda: sz.BigBirdSparsityConfig(num_heads=2, block=16, num_random_blocks=1, attention="unidirectional", seed=4),
    lambda: sz.BSLongformerSparsityConfig(num_heads=2, block=16, num_sliding_window_blocks=3, global_block_indices=[1]),
    lambda: sz.LocalSlidingWindowSparsityConfig(num_heads=2, block=16, num_sliding_window_blocks=3),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("make", CONFIGS, ids=lambda f: f().__class__.__name__)
def test_every_config_family_through_the_module(make, path, monkeypatch):
    """Each family's layout, a sequence that is not a multiple of the block,
    a key padding mask: equal to dense attention with the layout's mask."""
    if path == "cpu-blocked":
        monkeypatch.setattr(sa, "DENSE_CPU_MAX_SEQ", 0)
    config = make()
    device = TRITON_DEVICE if path == "triton" else "cpu"
    attn = SparseAttention(config, max_seq_length=80, backend="triton" if path == "triton" else "reference")
    seq = 72
    q, k, v = inputs(2, 2, seq, 16, device=device)
    kpm = torch.zeros(2, seq, device=device)
    kpm[1, -6:] = float("-inf")
    out = attn(q, k, v, key_padding_mask=kpm)
    dout = torch.randn_like(out)
    out.backward(dout)
    causal = config.attention == "unidirectional"
    keep = sz.dense_mask(attn.master_layout, 16, causal)[None, :, :seq, :seq]  # random blocks: the layout it drew
    q2, k2, v2 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(q2, k2, v2, keep, 0.25, kpm.cpu().double()[:, None, None, :])
    check(out, [t.grad for t in (q, k, v)], ref, (q2, k2, v2), dout)
