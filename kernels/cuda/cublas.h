// cuBLAS, loaded when the first GPU kernel needs it rather than when the process starts.
//
// Why: libcublas.so pulls in libcublasLt.so, whose static initializers take ~0.4 s of CPU in every
// process that links it (measured with perf on a 2-core EPYC VM: 70% of `strata version`'s
// 0.58 s). A CUDA build's CPU-only runs, every `strata check` / `status` / `ckpt` call and every
// worker process paid it. strata links only the CUDA runtime (cheap to load: it initialises on its
// first call) and opens cuBLAS with dlopen the first time a Backend is made.
//
// The library is found as the dynamic loader finds any: LD_LIBRARY_PATH, then the RUNPATH of the
// program or libstrata.so (the folder of the CUDA runtime strata was built against), the system's
// paths; then, last, the folder that holds the loaded libcudart (a toolkit keeps both there).
// STRATA_CUBLAS_LIBRARY, when set, names the file to load instead (one of several CUDA installs);
// nothing else is tried then.
//
// Threads: Cublas() and CublasAvailable() (declared in cuda_ops.h) may be called from any thread;
// the first call loads the library (a function-local static: once, thread-safe), and the table
// never changes nor is destroyed afterwards (a Backend may be destroyed as the process exits).
#pragma once

#include <cublas_v2.h>

namespace strata::cuda {

// The cuBLAS entry points strata calls, with the header's own signatures (cublas.cc checks them
// against <cublas_api.h> at compile time).
struct CublasApi {
  decltype(&cublasCreate_v2) Create;
  decltype(&cublasDestroy_v2) Destroy;
  decltype(&cublasSetStream_v2) SetStream;
  decltype(&cublasSetMathMode) SetMathMode;
  decltype(&cublasGetStatusName) GetStatusName;
  decltype(&cublasGetStatusString) GetStatusString;
  cublasStatus_t (*GemmEx)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                           const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                           int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                           cublasGemmAlgo_t);
  cublasStatus_t (*GemmStridedBatchedEx)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                         int, int, const void*, const void*, cudaDataType, int,
                                         long long int, const void*, cudaDataType, int,
                                         long long int, const void*, void*, cudaDataType, int,
                                         long long int, int, cublasComputeType_t, cublasGemmAlgo_t);
  decltype(&cublasGemmGroupedBatchedEx) GemmGroupedBatchedEx;
};

// The loaded library's entry points. CHECK-fails with CublasAvailable's explanation (cuda_ops.h)
// when cuBLAS cannot be loaded; callers that can report an error ask CublasAvailable first.
const CublasApi& Cublas();

}  // namespace strata::cuda
