/* The C ABI of fastzero's CUDA kernels (libfastzero_cuda.so), loaded by
 * fastzero/native/loader.py with ctypes (signatures: fastzero/native/abi.py). No PyTorch here (DESIGN.md rule 2): raw
 * device pointers, element counts, dtype codes and a cudaStream_t passed as
 * void*.
 *
 * Conventions shared by every entry point:
 *  - Lists of tensors are host arrays of n device pointers (all of one dtype
 *    per list) and a host array of n element counts; every tensor contiguous.
 *  - Dtype codes are csrc/cpu/common.h's: 0 fp32, 1 fp16, 2 bf16, -1 none.
 *  - An optimizer's hyperparameters come as one struct, by pointer (host
 *    memory, read during the call only): fz_adam_hyper, fz_lamb_hyper of
 *    csrc/common/hyperparams.h (its folder must be on the include path).
 *    The constants derived from them are computed inside the kernels' .cu.
 *  - Scalars that change every step live on the device and are read there,
 *    so no call ever waits for the GPU: `step` (t >= 1, float32), `grad_scale`
 *    (grads are divided by it; NULL for none) and `found_inf` (when nonzero
 *    the kernels change nothing; NULL for none).
 *  - Every call only enqueues work on `stream` and returns 0, or a nonzero
 *    FZ_ERR_* code with a message that fz_cuda_last_error() returns (per
 *    thread). Nothing here aborts the process.
 *  - `partials` are scratch buffers the caller allocates on the device:
 *    fz_cuda_chunk_elems() elements per chunk, a tensor of numel elements has
 *    ceil(numel / chunk) chunks.
 */
#ifndef FASTZERO_CUDA_H_
#define FASTZERO_CUDA_H_

#include <stdint.h>

#include "hyperparams.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FZ_API __attribute__((visibility("default")))

/* Bumped whenever an entry point below is added or its signature or the
 * meaning of its arguments changes; Python refuses a mismatch. 2: the 1-bit pack and unpack. 3: the optimizer
 * hyperparameters as one struct (fz_adam_hyper, fz_lamb_hyper);
 * fz_cuda_clip_factor became fz_cuda_lamb_clip_factor. 5: fz_cuda_adam's
 * sr_seed (bf16 states written with stochastic rounding). 6: fz_cuda_adam_int8.
 * 7: seed, sr_states, sr_params of fz_cuda_adam and seed, sr_params of
 * fz_cuda_adam_int8 (bf16 params written with stochastic rounding). 8:
 * fz_cuda_adam_int8's codes rounded stochastically, keyed by its seed (the
 * same arguments, other bits: a library of 7 rounds them to nearest). */
#define FZ_CUDA_ABI_VERSION 8

enum {
  FZ_OK = 0,
  FZ_ERR_INVALID_ARGUMENT = 1, /* caught before any launch; nothing changed */
  FZ_ERR_CUDA = 2,             /* a launch failed; the message has CUDA's words */
  FZ_ERR_INTERNAL = 3
};

FZ_API int fz_cuda_abi_version(void);
FZ_API const char* fz_cuda_last_error(void);
/* Elements per chunk: one thread block's share of a tensor. */
FZ_API int64_t fz_cuda_chunk_elems(void);
/* 0 when the kernels can run on the current device; otherwise FZ_ERR_CUDA
 * and a message naming the cause (no driver, a driver older than the
 * runtime the library was built with, no code for this GPU's architecture). */
FZ_API int fz_cuda_check_device(void);

/* Adam/AdamW, fastzero/ops/adam/reference.py. p: fp32/fp16/bf16; g: any;
 * m, v: fp32 or p's dtype; copy (NULL or one per tensor): fp16/bf16, only
 * for fp32 p. hyper: not NULL. bias corrections 1 - beta^step are computed
 * on the device. seed: of stochastic rounding, in [0, 2^32) (any value when
 * nothing rounds stochastically). sr_states nonzero: m and v are bf16 (for p
 * of any dtype; copies as with fp32 states), written with stochastic
 * rounding keyed by (seed, step, element index); sr_params nonzero: p is
 * bf16 (no copy) and written with stochastic rounding by the same key
 * (reference.sr_param_bits), with m and v fp32 or bf16 (rounded to nearest
 * unless sr_states). Either: after the reference's pinned update (every op
 * rounded on its own). */
FZ_API int fz_cuda_adam(void* const* p, void* const* g, void* const* m, void* const* v,
                        void* const* copy, const int64_t* numel, int n, int p_dtype,
                        int g_dtype, int s_dtype, int c_dtype, const fz_adam_hyper* hyper,
                        const float* step, const float* grad_scale, const float* found_inf,
                        int64_t seed, int sr_states, int sr_params, void* stream);

/* Adam/AdamW with int8 block-wise states, fastzero/ops/adam/int8_codes.py:
 * m and v are uint8 codes (one per element), m_scales and v_scales their
 * fp32 block scales, ceil(numel / block_size) per tensor, block_size a power
 * of two from 64 to 4096. Each block is decoded with its old scales, updated
 * as fz_cuda_adam's stochastic-rounding path updates (the reference's
 * pinned update) and encoded again with new scales, the codes rounded
 * stochastically keyed by (seed, step, element index) as fz_cuda_adam's bf16
 * states, all to the reference's bits. p: fp32/fp16/bf16; g: any; copy (NULL
 * or one per tensor): fp16/bf16, only for fp32 p. hyper, step, grad_scale,
 * found_inf, seed, sr_params: as fz_cuda_adam's. */
FZ_API int fz_cuda_adam_int8(void* const* p, void* const* g, void* const* m, void* const* v,
                             void* const* copy, void* const* m_scales, void* const* v_scales,
                             const int64_t* numel, int n, int p_dtype, int g_dtype, int c_dtype,
                             int64_t block_size, const fz_adam_hyper* hyper, const float* step,
                             const float* grad_scale, const float* found_inf, int64_t seed,
                             int sr_params, void* stream);

/* Per-chunk sums of (x / scale)^2 in fp64, into partials[0 .. chunks): the
 * first pass of an L2 norm over a list of tensors of one dtype. */
FZ_API int fz_cuda_l2norm_partials(void* const* x, const int64_t* numel, int n, int dtype,
                                   const float* scale, const float* found_inf,
                                   double* partials, int64_t partials_len, void* stream);

/* LAMB's gradient clipping factor from all partials of
 * fz_cuda_l2norm_partials (the grads over every dtype group):
 * *clip_out = max(1, sqrt(sum) / hyper->max_grad_norm), as float32. Only
 * for clipping LAMB (max_grad_norm > 0; else an invalid argument). */
FZ_API int fz_cuda_lamb_clip_factor(const double* partials, int64_t partials_len,
                                    const fz_lamb_hyper* hyper, const float* found_inf,
                                    float* clip_out, void* stream);

/* LAMB (DeepSpeed's FusedLamb math), fastzero/ops/lamb/reference.py, for one
 * dtype group of a list: phase 1 updates m and v and sums ||p||^2, ||u||^2
 * per chunk into partials[0 .. 2*chunks); a trust-ratio kernel turns them
 * into r per tensor (ratio_scratch[i], fp64 scratch of n values, and
 * coeffs_out[out_index[i]]); phase 2 recomputes u and updates p (and copy).
 * hyper: not NULL. `clip`: NULL or the device factor of
 * fz_cuda_lamb_clip_factor. Dtype rules as fz_cuda_adam's. */
FZ_API int fz_cuda_lamb(void* const* p, void* const* g, void* const* m, void* const* v,
                        void* const* copy, const int64_t* numel, const int64_t* out_index,
                        int n, int p_dtype, int g_dtype, int s_dtype, int c_dtype,
                        const fz_lamb_hyper* hyper, const float* step, const float* grad_scale,
                        const float* clip, const float* found_inf, double* partials,
                        int64_t partials_len, double* ratio_scratch, float* coeffs_out,
                        void* stream);

/* 1-bit compression with error feedback (1-bit Adam's),
 * fastzero/ops/reference/onebit.py. Over `chunks` chunks of len = numel /
 * chunks elements (a multiple of 8): y = x + error; scales[c] =
 * sqrt(sum(y^2) / len) (sums in fp64, in a fixed order); bit i % 8 of byte
 * i / 8 of the chunk's bits is y_i >= 0; error = y - (bit ? scale : -scale).
 * x: fp32/fp16/bf16 (x_dtype); error fp32, updated in place; bits numel / 8
 * bytes; scales `chunks` floats. partials: fp64 scratch of chunks *
 * ceil(len / fz_cuda_chunk_elems()) values. */
FZ_API int fz_cuda_onebit_pack(const void* x, int x_dtype, float* error, uint8_t* bits, float* scales,
                               int64_t numel, int64_t chunks, double* partials, int64_t partials_len,
                               void* stream);

/* `rows` rows of row_bytes bytes of sign bits, one fp32 scale each, to fp32.
 * average == 0: out[r * 8 * row_bytes + i] = scales[r] * (bit i of row r ?
 * 1 : -1); nonzero: out[i] = (the fp32 sum over rows, in row order, of
 * scales[r] * sign) / rows, 8 * row_bytes elements. */
FZ_API int fz_cuda_onebit_unpack(const uint8_t* bits, const float* scales, float* out, int64_t rows,
                                 int64_t row_bytes, int average, void* stream);

/* Block-wise symmetric quantization, fastzero/ops/quant/reference.py. x: n
 * values (x_dtype fp32/fp16/bf16) in blocks of `block` (the last may be
 * partial); scales[b] = absmax / qmax (qmax 127 for bits 8, 7 for bits 4),
 * NaN for a block holding NaN or inf; codes rne(clamp(x / s, -qmax, qmax)),
 * or with `stochastic` floor(clamp(x / s + u(seed, i), -qmax, qmax)); 0 where
 * the scale is 0 or NaN. codes: int8 [n] (bits 8) or uint8 [ceil(n / 2)],
 * two's-complement nibbles, the even element low (bits 4, block even). */
FZ_API int fz_cuda_quant_quantize(const void* x, int x_dtype, void* codes, float* scales, int64_t n,
                                  int64_t block, int bits, int stochastic, uint32_t seed, void* stream);

/* out[i] (out_dtype) = the fp32 sum over r < ranks, in rank order, of
 * q_r[i] * scales[r * ceil(n / block) + i / block]; rank r's codes start
 * code_stride bytes after rank r - 1's. ranks == 1: dequantization. */
FZ_API int fz_cuda_quant_dequantize_sum(const void* codes, int bits, int64_t code_stride, const float* scales,
                                        int64_t ranks, void* out, int out_dtype, int64_t n, int64_t block,
                                        void* stream);

#ifdef __cplusplus
}
#endif

#endif /* FASTZERO_CUDA_H_ */
