// cublas.h: cuBLAS opened with dlopen on first use.
#include "kernels/cuda/cublas.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/common/logging.h"
#include "kernels/cuda/cuda_ops.h"

namespace strata::cuda {
namespace {

// The table's pointer types are those of the header's declarations: each cast picks the extern
// "C" function of that signature (GemmEx and GemmStridedBatchedEx have C++ overloads beside it)
// and fails to compile when cuBLAS's signature differs. Unevaluated: nothing is linked.
static_assert(sizeof(static_cast<decltype(CublasApi::GemmEx)>(&cublasGemmEx)) > 0);
static_assert(sizeof(static_cast<decltype(CublasApi::GemmStridedBatchedEx)>(
                  &cublasGemmStridedBatchedEx)) > 0);

struct Library {
  CublasApi api{};
  std::string error;  // empty when every entry point was found
};

// dlopen by soname, then from the folder that holds the CUDA runtime this process loaded.
void* Open(const std::string& name, std::string* error) {
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle != nullptr) return handle;
  *error = dlerror();
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&cudaGetDeviceCount), &info) != 0 &&
      info.dli_fname != nullptr) {
    const std::string runtime = info.dli_fname;
    const size_t slash = runtime.rfind('/');
    if (slash != std::string::npos) {
      const std::string beside = runtime.substr(0, slash + 1) + name;
      handle = dlopen(beside.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) return handle;
      absl::StrAppend(error, "; beside the CUDA runtime: ", dlerror());
    }
  }
  return nullptr;
}

// The file dlopen loaded for `handle`.
std::string LoadedFile(void* handle) {
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || map == nullptr || map->l_name == nullptr) {
    return "?";
  }
  return map->l_name;
}

template <typename Fn>
void Resolve(void* handle, const char* symbol, Fn* fn, Library* lib) {
  *fn = reinterpret_cast<Fn>(dlsym(handle, symbol));
  if (*fn == nullptr && lib->error.empty()) {
    lib->error = absl::StrCat("the cuBLAS library loaded (", LoadedFile(handle), ") lacks ", symbol,
                              ": strata's GPU kernels need the cuBLAS of CUDA ", CUBLAS_VER_MAJOR);
  }
}

const Library& Load() {
  // Never destroyed: a Backend destroyed as the process exits still calls cublasDestroy.
  static const Library& library = *[] {
    auto* made = new Library;
    Library& lib = *made;
    const std::string name = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
    std::string error;
    const char* chosen = std::getenv("STRATA_CUBLAS_LIBRARY");
    void* handle = nullptr;
    if (chosen != nullptr && chosen[0] != '\0') {
      handle = dlopen(chosen, RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) {
        lib.error = absl::StrCat("cannot load cuBLAS from STRATA_CUBLAS_LIBRARY=", chosen, ": ",
                                 dlerror(), ". Point it at CUDA ", CUBLAS_VER_MAJOR, "'s ", name,
                                 ", or unset it to let strata find ", name, " itself");
        return made;
      }
    } else {
      handle = Open(name, &error);
    }
    if (handle == nullptr) {
      lib.error = absl::StrCat(
          "cannot load cuBLAS (", name, "): ", error, ". strata's GPU kernels need CUDA ",
          CUBLAS_VER_MAJOR,
          "'s cuBLAS: install it (the CUDA toolkit, or a PyTorch install's nvidia cuBLAS "
          "package) and put the folder that holds ",
          name, " on LD_LIBRARY_PATH");
      return made;
    }
    // Never closed: kernels and handles live until the process ends.
    CublasApi& a = lib.api;
    Resolve(handle, "cublasCreate_v2", &a.Create, &lib);
    Resolve(handle, "cublasDestroy_v2", &a.Destroy, &lib);
    Resolve(handle, "cublasSetStream_v2", &a.SetStream, &lib);
    Resolve(handle, "cublasSetMathMode", &a.SetMathMode, &lib);
    Resolve(handle, "cublasGetStatusName", &a.GetStatusName, &lib);
    Resolve(handle, "cublasGetStatusString", &a.GetStatusString, &lib);
    Resolve(handle, "cublasGemmEx", &a.GemmEx, &lib);
    Resolve(handle, "cublasGemmStridedBatchedEx", &a.GemmStridedBatchedEx, &lib);
    Resolve(handle, "cublasGemmGroupedBatchedEx", &a.GemmGroupedBatchedEx, &lib);
    return made;
  }();
  return library;
}

}  // namespace

bool CublasAvailable(std::string* why) {
  const Library& lib = Load();
  if (why != nullptr) *why = lib.error;
  return lib.error.empty();
}

const CublasApi& Cublas() {
  const Library& lib = Load();
  CHECK(lib.error.empty()) << lib.error;
  return lib.api;
}

}  // namespace strata::cuda
