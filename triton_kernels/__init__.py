"""fastzero's Triton kernels, installed as ``fastzero.triton_kernels`` (never
as a top-level ``triton_kernels``, which the Triton project ships)."""
