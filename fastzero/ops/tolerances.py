"""One tolerance table per dtype, for every comparison of a kernel with its
reference (tests and benchmark checks alike): torch.testing's defaults for
bf16/fp16, fp32 a little looser than its default to allow a few ulps between
a fused multiply-add and PyTorch's separate ops over several steps."""

import torch

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, msg: str = "") -> None:
    """torch.testing.assert_close at the tolerance of ``dtype`` (default: actual's)."""
    tol = TOLERANCES[dtype or actual.dtype]
    a, e = actual.float(), expected.float()
    if a.shape == e.shape and _isclose_all(a.reshape(-1), e.reshape(-1), tol):
        return  # fast path; torch.testing's precise message only on a mismatch (it is slow on 64M elements)
    torch.testing.assert_close(a, e, **tol, msg=lambda m: f"{msg}\n{m}" if msg else m)


def _isclose_all(a: torch.Tensor, e: torch.Tensor, tol: dict, chunk: int = 1 << 16) -> bool:
    # In chunks: small temporaries come from the heap, not fresh pages (5x faster at 64M).
    return all(bool(torch.isclose(a[i : i + chunk], e[i : i + chunk], **tol).all()) for i in range(0, a.numel(), chunk))
