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
 * Only the values the user sets live here; the constants a kernel derives
 * from them (bias corrections, step sizes, 1 - beta, ...) are computed
 * where the kernels are (csrc/cpu/adam.cpp and lamb.cpp, the .cu files of csrc/cuda).
 * Plain C, one field per line: `<type> <name>;`. */
#ifndef FASTZERO_HYPERPARAMS_H_
#define FASTZERO_HYPERPARAMS_H_

#include <stdint.h>

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

#ifdef __cplusplus
}
#endif

#endif /* FASTZERO_HYPERPARAMS_H_ */
