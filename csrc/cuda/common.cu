// The entry points every caller needs first (ABI version, chunk size, last
// error) and the host-side helpers of common.cuh.
#include <string>

#include "common.cuh"

namespace fz {

namespace {
thread_local std::string last_error;
}

int set_error(int code, const std::string& message) {
  last_error = message;
  return code;
}

int check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return FZ_OK;
  return set_error(FZ_ERR_CUDA, std::string("launching ") + kernel + " failed: " + cudaGetErrorName(err) +
                                    ": " + cudaGetErrorString(err));
}

int check_list(const char* fn, const char* what, void* const* ptrs, const int64_t* numel, int n,
               int dtype) {
  return check_list_of(fn, what, ptrs, numel, n, dtype == kF32 ? 4 : 2, dtype_name(dtype));
}

int check_list_of(const char* fn, const char* what, void* const* ptrs, const int64_t* numel, int n,
                  int64_t elem_bytes, const char* elem) {
  const std::string where = std::string(fn) + ": " + what;
  if (n > 0 && (ptrs == nullptr || numel == nullptr))
    return set_error(FZ_ERR_INVALID_ARGUMENT, where + ": null pointer array");
  for (int i = 0; i < n; ++i) {
    if (numel[i] < 0)
      return set_error(FZ_ERR_INVALID_ARGUMENT,
                       where + "[" + std::to_string(i) + "] has " + std::to_string(numel[i]) + " elements");
    if (numel[i] > 0 && ptrs[i] == nullptr)
      return set_error(FZ_ERR_INVALID_ARGUMENT, where + "[" + std::to_string(i) + "] is a null pointer");
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % elem_bytes != 0)
      return set_error(FZ_ERR_INVALID_ARGUMENT,
                       where + "[" + std::to_string(i) + "] is not aligned to its " + elem + " elements");
  }
  return FZ_OK;
}

namespace {

// Compiled for the same architectures as every kernel: whether it can be
// loaded on a device is whether they all can.
__global__ void probe_kernel(int* out) { *out = 1; }

std::string cuda_version(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

}  // namespace

}  // namespace fz

extern "C" {

int fz_cuda_check_device(void) {
  using namespace fz;
  return guarded("fz_cuda_check_device", []() -> int {
    int driver = 0, runtime = 0;
    (void)cudaDriverGetVersion(&driver);
    (void)cudaRuntimeGetVersion(&runtime);
    const std::string versions = " (the driver supports CUDA " + (driver ? cuda_version(driver) : "none") +
                                 "; the kernels were built with CUDA " + cuda_version(runtime) + ")";
    cudaFuncAttributes attr;
    const cudaError_t err = cudaFuncGetAttributes(&attr, probe_kernel);
    if (err == cudaSuccess) return FZ_OK;
    (void)cudaGetLastError();
    std::string hint;
    if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice)
      hint = "; update the NVIDIA driver, or build with the toolkit the driver supports (set CUDA_HOME)";
    else if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction)
      hint = "; this GPU's architecture is not in the build (set FASTZERO_CUDA_ARCHS, for example 80;90;100)";
    return set_error(FZ_ERR_CUDA, std::string("the CUDA kernels cannot run here: ") + cudaGetErrorName(err) + ": " +
                                      cudaGetErrorString(err) + versions + hint);
  });
}

int fz_cuda_abi_version(void) { return FZ_CUDA_ABI_VERSION; }

const char* fz_cuda_last_error(void) { return fz::last_error.c_str(); }

int64_t fz_cuda_chunk_elems(void) { return fz::kChunkSize; }

}  // extern "C"
