// device.h on the CUDA runtime. Compiled only when strata is built with CUDA. A machine with the
// toolkit but no driver or GPU (CI) gets "no GPU" answers from these functions, never a crash.
#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/device/cuda_internal.h"
#include "core/device/device.h"

namespace strata {
namespace {

Status CudaError(cudaError_t err, const std::string& what) {
  const std::string text =
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  cudaGetLastError();  // clear a sticky launch-independent error so later calls start clean
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(text);
  return absl::InternalError(text);
}

#define STRATA_CUDA_RETURN(expr, what)                                   \
  do {                                                                   \
    const cudaError_t strata_err_ = (expr);                              \
    if (strata_err_ != cudaSuccess) return CudaError(strata_err_, what); \
  } while (0)

// Makes `device` current for the calling thread, and leaves it so: a strata thread works for one
// GPU (its process's), and going back to a thread's default, GPU 0, would make a context there
// for every worker placed on another GPU (cudaSetDevice creates the device's primary context).
// -1 (host memory only) leaves the current device as it is.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (device < 0) return;
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != device) cudaSetDevice(device);
  }
};

}  // namespace

int CudaDeviceCount() {
  // The set of visible devices is fixed when the process starts (CUDA_VISIBLE_DEVICES), so ask
  // once.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error so later calls start clean
      return 0;
    }
    return n;
  }();
  return count;
}

std::string CudaDeviceDescription(int index) {
  int count = CudaDeviceCount();
  if (count == 0) return "no CUDA device (built with CUDA; no GPU or driver found)";
  if (index < 0 || index >= count) return absl::StrCat("no CUDA device ", index, " of ", count);
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    cudaGetLastError();
    return absl::StrCat("CUDA device ", index, " (properties unavailable)");
  }
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  return absl::StrCat(prop.name, ", sm_", prop.major, prop.minor, ", ", prop.totalGlobalMem >> 30,
                      " GiB, ", prop.multiProcessorCount, " SMs, driver API ", driver / 1000, ".",
                      driver % 1000 / 10, ", runtime ", runtime / 1000, ".", runtime % 1000 / 10);
}

void UseDevice(Device device) {
  if (!device.is_cpu() && device.index >= 0 && device.index < CudaDeviceCount()) {
    DeviceGuard guard(device.index);
  }
}

StatusOr<bool> PinHostMemory(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0 || CudaDeviceCount() == 0) return false;
  STRATA_CUDA_RETURN(cudaHostRegister(data, bytes, cudaHostRegisterPortable),
                     absl::StrCat("pinning ", bytes, " bytes of host memory (cudaHostRegister)"));
  return true;
}

void UnpinHostMemory(void* data) {
  if (data == nullptr || CudaDeviceCount() == 0) return;
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();  // it was not pinned
}

void CopyBytes(void* dst, const void* src, size_t bytes) { internal::CudaCopy(dst, src, bytes); }

StatusOr<std::unique_ptr<CopyStream>> CopyStream::Create(Device device) {
  if (device.is_cpu()) return std::unique_ptr<CopyStream>(new CopyStream(device, nullptr));
  DeviceGuard guard(device.index);
  cudaStream_t stream = nullptr;
  STRATA_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                     absl::StrCat("creating a copy stream on ", device.ToString()));
  return std::unique_ptr<CopyStream>(new CopyStream(device, stream));
}

CopyStream::~CopyStream() {
  if (stream_ == nullptr) return;
  DeviceGuard guard(device_.index);
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  if (fence_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(fence_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

Status CopyStream::CopyAsync(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (stream_ == nullptr) {  // a CPU stream: host memory on both sides
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  DeviceGuard guard(device_.index);
  STRATA_CUDA_RETURN(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream_)),
      absl::StrCat("copying ", bytes, " bytes on ", device_.ToString(), "'s copy stream"));
  return absl::OkStatus();
}

Status CopyStream::Record(CopyEvent* event) {
  if (stream_ == nullptr) return absl::OkStatus();  // CPU copies are complete when enqueued
  DeviceGuard guard(device_.index);
  if (event->event_ == nullptr || event->device_ != device_.index) {
    if (event->event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event->event_));
    cudaEvent_t e = nullptr;
    STRATA_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                       "creating a copy event");
    event->event_ = e;
    event->device_ = device_.index;
  }
  STRATA_CUDA_RETURN(
      cudaEventRecord(static_cast<cudaEvent_t>(event->event_), static_cast<cudaStream_t>(stream_)),
      "recording a copy event");
  return absl::OkStatus();
}

Status CopyStream::Wait(const CopyEvent& event) {
  if (stream_ == nullptr) return event.Synchronize();
  if (event.event_ == nullptr) return absl::OkStatus();
  DeviceGuard guard(device_.index);
  STRATA_CUDA_RETURN(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_),
                                         static_cast<cudaEvent_t>(event.event_), 0),
                     "ordering a copy stream after an event");
  return absl::OkStatus();
}

Status CopyStream::WaitForDeviceWork() {
  if (stream_ == nullptr) return absl::OkStatus();
  DeviceGuard guard(device_.index);
  if (fence_ == nullptr) {
    cudaEvent_t e = nullptr;
    STRATA_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                       "creating a copy stream's fence event");
    fence_ = e;
  }
  // The legacy default stream (0) waits for all earlier work of every blocking stream, so an
  // event recorded on it completes after the compute enqueued so far.
  STRATA_CUDA_RETURN(cudaEventRecord(static_cast<cudaEvent_t>(fence_), 0),
                     "recording a fence on the default stream");
  STRATA_CUDA_RETURN(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), static_cast<cudaEvent_t>(fence_), 0),
      "ordering a copy stream after the device's work");
  return absl::OkStatus();
}

Status CopyStream::Synchronize() {
  if (stream_ == nullptr) return absl::OkStatus();
  DeviceGuard guard(device_.index);
  STRATA_CUDA_RETURN(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)),
                     absl::StrCat("a copy on ", device_.ToString()));
  return absl::OkStatus();
}

CopyEvent::~CopyEvent() {
  if (event_ == nullptr) return;
  DeviceGuard guard(device_);
  cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

bool CopyEvent::Done() const {
  if (event_ == nullptr) return true;
  DeviceGuard guard(device_);  // on the event's GPU, not on GPU 0 where a thread starts
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (err == cudaErrorNotReady) return false;
  if (err != cudaSuccess) cudaGetLastError();
  return true;  // an error surfaces in Synchronize
}

Status CopyEvent::Synchronize() const {
  if (event_ == nullptr) return absl::OkStatus();
  DeviceGuard guard(device_);
  STRATA_CUDA_RETURN(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)),
                     "waiting for a copy event");
  return absl::OkStatus();
}

namespace internal {

Status CudaMalloc(int device, size_t bytes, void** out) {
  *out = nullptr;
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda:", device, " does not exist (", count,
        " CUDA device(s) found); run on a machine with an NVIDIA GPU or use the CPU device"));
  }
  if (bytes == 0) return absl::OkStatus();
  DeviceGuard guard(device);
  STRATA_CUDA_RETURN(cudaMalloc(out, bytes),
                     absl::StrCat("allocating ", bytes, " bytes on cuda:", device));
  return absl::OkStatus();
}

void CudaFree(int device, void* data) {
  if (data == nullptr) return;
  DeviceGuard guard(device);
  cudaFree(data);
}

Status CudaHostAlloc(size_t bytes, void** out) {
  *out = nullptr;
  if (bytes == 0 || CudaDeviceCount() == 0) return absl::OkStatus();
  STRATA_CUDA_RETURN(cudaHostAlloc(out, bytes, cudaHostAllocPortable),
                     absl::StrCat("allocating ", bytes, " bytes of pinned host memory"));
  return absl::OkStatus();
}

void CudaFreeHost(void* data) {
  if (data != nullptr) cudaFreeHost(data);
}

// The GPU that owns `p`, or -1 for host memory.
int DeviceOfPointer(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

void CudaCopy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (CudaDeviceCount() == 0) {  // no GPU: both sides are host memory
    std::memcpy(dst, src, bytes);
    return;
  }
  // On the GPU that owns the device side: the legacy default stream of that device is what
  // orders this copy after (and before) the work of its compute stream.
  int device = DeviceOfPointer(dst);
  if (device < 0) device = DeviceOfPointer(src);
  DeviceGuard guard(device);
  const cudaError_t err = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
  CHECK(err == cudaSuccess) << "cudaMemcpy of " << bytes << " bytes: " << cudaGetErrorName(err)
                            << " (" << cudaGetErrorString(err) << ")";
}

void CudaZero(int device, void* data, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  const cudaError_t err = cudaMemset(data, 0, bytes);
  CHECK(err == cudaSuccess) << "cudaMemset of " << bytes << " bytes on cuda:" << device << ": "
                            << cudaGetErrorName(err);
}

}  // namespace internal
}  // namespace strata
