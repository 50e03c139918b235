"""The quantization family's backends, fastest first (see fastzero.ops.backend
for the rule that picks one). Each target is a module with
``quant_quantize(x, codes, scales, bits, block, stochastic, seed)``,
``quant_dequantize(codes, scales, out, block)`` and
``quant_dequantize_sum(codes, scales, out, block)`` over checked buffers
(codes [R, C] and scales [R, blocks] for the sum)."""

from fastzero.ops.backend import Backend, Family, always, cpu_status, cuda_status, triton_status

FAMILY = Family(
    "quant",
    "block-wise quantization",
    [
        Backend("cuda", ("cuda",), ("cuda",), cuda_status, "fastzero.ops.quant.cuda"),
        Backend("triton", ("cuda",), ("cuda", "cpu"), triton_status, "fastzero.triton_kernels.quant"),
        Backend("cpu", ("cpu",), ("cpu",), cpu_status, "fastzero.ops.quant.cpu"),
        Backend("reference", ("cpu", "cuda"), ("cpu", "cuda"), always, "fastzero.ops.quant.reference"),
    ],
)
