#!/usr/bin/env bash
# Everything GPU-side in one go, for the occasions when a GPU is lent (one
# H200, inside 8 minutes): build the CPU and CUDA ops, run the GPU tests and
# the Triton tests on the GPU, run the GPU benchmarks. Logs, JSON, a Markdown
# report and charts go to $OUT (the device tool's folder) or
# bench/results/gpu-<date>; at most 8 files (the JSON and the charts in one
# tarball), as the device tool brings back.
#
#   bash bench/gpu_check.sh            # on the GPU machine
#   bash bench/gpu_check.sh --dry-run  # anywhere: every step that needs no GPU
#                                      # (nvcc builds for sm_80/sm_90, CPU build,
#                                      # the GPU benchmark's case list)
#
# The GPU machine reaches no package registry: nothing is installed; the
# repo runs from its folder (PYTHONPATH) with that machine's torch and
# triton, and the native ops build just in time into a cache.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT=${OUT:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FASTZERO_CACHE_DIR=${FASTZERO_CACHE_DIR:-/tmp/fastzero-cache}
PY=${PYTHON:-python3}
status=0
summary=()

step() {  # step NAME COMMAND...: run it, its output into the one log, a line into the summary
  local name=$1 t0=$SECONDS rc
  shift
  echo "== $name: $*" | tee -a "$LOG"
  "$@" >>"$LOG" 2>&1
  rc=$?
  if ((rc == 0)); then
    summary+=("ok      $name ($((SECONDS - t0)) s)")
  else
    summary+=("FAILED  $name (exit $rc, $((SECONDS - t0)) s)")
    status=1
    tail -n 30 "$LOG"
  fi
}

step env "$PY" -c "
import platform, torch
try:
    import triton; tv = triton.__version__
except ImportError: tv = None
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', tv, 'gpu', gpu)
"
step build_cpu "$PY" -c "
from fastzero import native
assert native.cpu_ops() is not None, native.cpu_ops_error()
print('CPU kernels:', native.cpu_isa())
"
if ((DRY)); then
  step compile_cuda "$PY" -c "
from fastzero.native import build
out = build.compile_check()
print({arch: [p.name for p in objs] for arch, objs in out.items()})
"
  step bench_list "$PY" -m bench.run --list --device cuda
  step bench_list_states "$PY" -m bench.run --list --device cuda --dtype bf16states,int8states
else
  step build_cuda "$PY" -c "
from fastzero import native
ok, why = native.cuda_available()
assert ok, why
print('CUDA kernels ready')
"
  step tests_gpu "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/
  step tests_triton "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_triton_kernels.py \
    tests/ops/sparse_attention/test_attention.py tests/ops/onebit/test_triton.py tests/ops/quant/test_triton.py \
    tests/ops/adam/test_bf16_states_triton.py tests/ops/adam/test_int8_states_triton.py \
    tests/ops/adam/test_bf16_stochastic_params_triton.py
  step bench_gpu "$PY" -m bench.run --kernel fused_adam --kernel fused_lamb --device cuda \
    --json "$OUT/gpu.json" --report "$OUT/gpu.md"
  # the state formats at 1M and 64M params (the check runs the plain-PyTorch reference on the GPU: int64
  # temporaries of the params' size)
  step bench_gpu_states "$PY" -m bench.run --kernel fused_adam --device cuda --dtype bf16states,int8states --sizes 1M,64M \
    --json "$OUT/gpu_states.json" --report "$OUT/gpu_states.md"
  step bench_onebit "$PY" -m bench.run --kernel onebit --device cuda --quick \
    --json "$OUT/onebit.json" --report "$OUT/onebit.md"
  step bench_quant "$PY" -m bench.run --kernel quant --device cuda --quick \
    --json "$OUT/quant.json" --report "$OUT/quant.md"
  step bench_sparse_attention "$PY" -m bench.run --kernel sparse_attention --device cuda --quick \
    --json "$OUT/sparse_attention.json" --report "$OUT/sparse_attention.md"
  # not here: --kernel tp (tensor parallelism at TP=2 needs 2 ranks; NCCL cannot put 2 ranks on one GPU), and the
  # ZeRO families: multi-process jobs over Gloo, CPU-only
fi

# the device tool brings back at most 8 files: the log and the Markdown reports as they are, the JSON results
# and the charts in one tarball
if compgen -G "$OUT/*.png" >/dev/null || compgen -G "$OUT/*.json" >/dev/null; then
  (cd "$OUT" && tar cf results.tar $(ls ./*.png ./*.json 2>/dev/null) && rm -f ./*.png ./*.json)
fi
echo "== summary ($SECONDS s; files in $OUT)" | tee -a "$LOG"
printf '%s\n' "${summary[@]}" | tee -a "$LOG"
if [[ -f "$OUT/gpu.md" ]]; then grep -E '^\| fastzero|^## ' "$OUT/gpu.md"; fi
exit $status
