/* The hyperparameters of each optimizer kernel family as one C struct,
 * shared by the CPU kernels (csrc/cpu, through pybind11 as the struct's
 * bytes) and the CUDA kernels (csrc/cuda, by pointer across the C ABI).
 *
 * Each struct is its family's Python dataclass field for field, in
 * declaration order and under the same names: fastzero/ops/adam/hyperparams.py
 * (AdamHyperparams) and fastzero/ops/lamb/hyperparams.py (LambHyperparams).
 * Python builds it with Hyperparams.c_struct(): float -> double,
 * bool -> int32_t (0 or 1), int -> int64_t. tests/test_hyperparams_abi.py
 * parses this file and checks it against the dataclasses and against the
 * sizes the compiled extension reports.
 *
 * Below the structs, the values each family derives from them (bias
 * corrections, step sizes, 1 - beta, the clip divisor, the trust ratio), in
 * double as the reference's Python floats are, once for every backend: the
 * CPU kernels call them on the host, the CUDA kernels on the device. Each
 * backend only rounds them to float where its kernels use them.
 * Plain C; in the structs, one field per line: `<type> <name>;`. */
#ifndef FASTZERO_HYPERPARAMS_H_
#define FASTZERO_HYPERPARAMS_H_

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define FZ_HOST_DEVICE static inline __host__ __device__
#else
#define FZ_HOST_DEVICE static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Adam/AdamW (fastzero.ops.adam.reference.adam_step). */
typedef struct fz_adam_hyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int32_t bias_correction; /* bc_i = 1 - beta_i^t, else 1 */
  int32_t adamw_mode;      /* decoupled weight decay, else L2 through the grad */
} fz_adam_hyper;

/* LAMB, DeepSpeed's FusedLamb math (fastzero.ops.lamb.reference.lamb_step). */
typedef struct fz_lamb_hyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  int32_t eps_inside_sqrt; /* sqrt(v + eps), else sqrt(v) + eps */
  double weight_decay;
  int32_t bias_correction;
  double max_grad_norm; /* > 0: clip the global grad norm to it first; 0: off */
  double max_coeff;     /* the trust ratio is clamped to [min_coeff, max_coeff] */
  double min_coeff;
} fz_lamb_hyper;

/* ------------------------------------------------------------------------
 * What the kernels derive, at step t >= 1 (bc_i = 1 - beta_i^t, 1 without
 * bias correction). */

/* Adam: the update is p <- p * decay - step_size * m / (sqrt(v) / sqrt(bc2) + eps),
 * with g <- g + l2 * p first (AdamW: decay = 1 - lr * wd, l2 = 0; Adam: 1, wd) and
 * m <- m + (1 - beta1)(g - m) (fz_lerp_coeff). */
typedef struct fz_adam_derived {
  double one_minus_beta1;
  double one_minus_beta2;
  double step_size; /* lr / bc1 */
  double sqrt_bc2;
  double decay;
  double l2;
} fz_adam_derived;

FZ_HOST_DEVICE double fz_bias_correction(double beta, double step, int32_t enabled) {
  return enabled ? 1.0 - pow(beta, step) : 1.0;
}

FZ_HOST_DEVICE fz_adam_derived fz_adam_derive(const fz_adam_hyper* h, double step) {
  fz_adam_derived d;
  d.one_minus_beta1 = 1.0 - h->beta1;
  d.one_minus_beta2 = 1.0 - h->beta2;
  d.step_size = h->lr / fz_bias_correction(h->beta1, step, h->bias_correction);
  d.sqrt_bc2 = sqrt(fz_bias_correction(h->beta2, step, h->bias_correction));
  d.decay = h->adamw_mode ? 1.0 - h->lr * h->weight_decay : 1.0;
  d.l2 = h->adamw_mode ? 0.0 : h->weight_decay;
  return d;
}

/* Adam's first moment is torch.optim.Adam's lerp, m <- m + w (g - m) with
 * w = 1 - beta1 rounded to float, not beta1 * m + (1 - beta1) * g: beta1 and
 * 1 - beta1 rounded to float do not add up to 1 (0.9f + 0.1f = 1 - 2.2e-8),
 * which shrinks m a little every step, a drift against torch. As torch
 * computes it: m + w (g - m) when w < 0.5, else g + (w - 1)(g - m) (so that
 * beta1 = 0 gives m = g exactly); the kernels do fma(coeff, g - m, base) with
 * this coefficient and base m (w < 0.5) or g. */
FZ_HOST_DEVICE float fz_lerp_coeff(float w) { return w < 0.5f ? w : w - 1.0f; }

/* LAMB's global-norm clip divisor: max(1, ||g|| / max_grad_norm), 1 when off. */
FZ_HOST_DEVICE double fz_lamb_clip(const fz_lamb_hyper* h, double grad_sumsq) {
  if (!(h->max_grad_norm > 0.0)) return 1.0;
  const double norm = sqrt(grad_sumsq);
  return norm > h->max_grad_norm ? norm / h->max_grad_norm : 1.0;
}

/* clamp(||p|| / ||u||, min_coeff, max_coeff), 1 when a norm is 0; a NaN ratio
 * stays NaN, as the reference's min(max(...)) leaves it. */
FZ_HOST_DEVICE double fz_lamb_trust_ratio(const fz_lamb_hyper* h, double p_sumsq, double u_sumsq) {
  const double p_norm = sqrt(p_sumsq), u_norm = sqrt(u_sumsq);
  if (p_norm == 0.0 || u_norm == 0.0) return 1.0;
  double r = p_norm / u_norm;
  if (h->min_coeff > r) r = h->min_coeff;
  if (h->max_coeff < r) r = h->max_coeff;
  return r;
}

/* LAMB's step size lr * sqrt(bc2) / bc1. */
FZ_HOST_DEVICE double fz_lamb_step_size(const fz_lamb_hyper* h, double step) {
  return h->lr * sqrt(fz_bias_correction(h->beta2, step, h->bias_correction)) /
         fz_bias_correction(h->beta1, step, h->bias_correction);
}

#ifdef __cplusplus
}
#endif

#endif /* FASTZERO_HYPERPARAMS_H_ */
