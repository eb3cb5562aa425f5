// Devices, memory budgets, buffers and tensors.
//
// Devices, buffers and streams are separate ideas (as in ggml-backend): a Device says where memory
// lives and which kernels run on it; a Buffer is one allocation on a device, charged to a
// MemoryBudget; a Tensor is a typed, shaped view of a Buffer. The CPU device always exists; the
// CUDA device exists when strata is built with CUDA and a GPU is present.
//
// A MemoryBudget is a hard limit: an allocation that would exceed it fails with
// RESOURCE_EXHAUSTED instead of succeeding slowly. On a machine without a GPU, the tiered store's
// "device tier" is host memory under such a budget, so out-of-core behaviour is exercised and
// measured everywhere.
//
// Ownership and threads, in short: a Buffer is shared (std::shared_ptr) by every Tensor over it
// and freed with the last one; the MemoryBudget it is charged to must outlive it. MemoryBudget is
// thread-safe. Buffers and Tensors are plain values with no synchronisation of the bytes they
// point at: threads may write disjoint parts, and the caller orders everything else. A CopyStream
// and its CopyEvents are used by one thread at a time. The free functions may be called from any
// thread; on a GPU they make the right device current only for the duration of the call.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/common/logging.h"
#include "core/common/status.h"

namespace strata {

enum class DeviceType { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;

  static Device Cpu() { return Device{}; }
  // "cpu", "cuda" (GPU 0) or "cuda:N"; an error naming the text otherwise. Whether that GPU
  // exists is not checked here.
  [[nodiscard]] static StatusOr<Device> Parse(const std::string& text);
  static Device Cuda(int index) { return Device{DeviceType::kCuda, index}; }
  bool is_cpu() const { return type == DeviceType::kCpu; }
  std::string ToString() const;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
};

// Number of usable CUDA devices: 0 when strata is built without CUDA, when no driver is loaded, or
// when no GPU is present. Never fails.
int CudaDeviceCount();

// The GPU's name, compute capability, memory, SM count and driver and runtime versions ("NVIDIA
// H100 80GB HBM3, sm_90, 79 GiB, 132 SMs, driver API 13.0, runtime 13.0"), or why there is none.
// For logs and benchmark headers.
std::string CudaDeviceDescription(int index = 0);

// Makes `device`'s GPU the calling thread's current one (cudaSetDevice), so that the CUDA calls
// that name no device — page-locked allocations, event waits — use its context and not GPU 0's;
// nothing for the CPU device, or where the GPU is not there. A process placed on one GPU calls it
// on each thread that works for it (the trainer: its own and its compute pool's).
void UseDevice(Device device);

// Page-locks host memory [data, data + bytes) for the GPU (cudaHostRegister) so copies from and
// to it run at full bus speed and asynchronously. Returns false and does nothing where there is
// no GPU (or for null / zero bytes); an error if the driver refuses. Undo with UnpinHostMemory
// before freeing the memory; the caller keeps owning it.
[[nodiscard]] StatusOr<bool> PinHostMemory(void* data, size_t bytes);
void UnpinHostMemory(void* data);

// Copies `bytes` between any two of host and device memory (cudaMemcpy with unified addressing;
// memcpy for host to host). Synchronous for the host: on return host source memory may be reused
// and host destination memory holds the bytes. A device-to-device copy may still be running on the
// GPU's default stream, which orders it before later copies and kernels of blocking streams.
void CopyBytes(void* dst, const void* src, size_t bytes);
// Zeroes `bytes` at `data` on `device` (memset, or cudaMemset ordered before later work; the host
// does not wait for it).
void ZeroBytes(Device device, void* data, size_t bytes);

// An ordered queue of copies between host and device memory (a CUDA stream on `device`'s GPU),
// with events to order it against other queues. On the CPU device the copies run at once and the
// events are always complete, so callers have one code path.
//
// Not thread-safe: one thread at a time enqueues on a stream (the tiered store's copy stage owns
// its). The memory of a CopyAsync is borrowed until the copy completed (Synchronize, or an event
// recorded after it is Done): keep both sides allocated and the source unchanged until then.
// Destroying the stream waits for the copies in flight.
class CopyEvent;
class CopyStream {
 public:
  [[nodiscard]] static StatusOr<std::unique_ptr<CopyStream>> Create(Device device);
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  // Enqueues a copy (any direction). Host memory should be pinned (PinHostMemory) for the copy
  // to be asynchronous; with pageable memory CUDA stages it and the call may block.
  [[nodiscard]] Status CopyAsync(void* dst, const void* src, size_t bytes);
  // Marks everything enqueued so far; `event` can then be waited on by this or another stream.
  // Re-recording an event moves its mark; waits already enqueued keep the old one.
  [[nodiscard]] Status Record(CopyEvent* event);
  // Work enqueued after this call starts once `event` has completed (its latest Record as of this
  // call; the event need not outlive the call).
  [[nodiscard]] Status Wait(const CopyEvent& event);
  // Work enqueued after this call starts once all work already enqueued on the GPU's other
  // blocking streams (the compute stream, and memsets and copies on the default stream) has
  // completed: an event recorded on the legacy default stream, which waits for them. Call it
  // before copying out of memory that kernels may still be writing, or into memory they may
  // still be reading.
  [[nodiscard]] Status WaitForDeviceWork();
  // Waits for everything enqueued so far; returns the first copy's error, if any.
  [[nodiscard]] Status Synchronize();
  Device device() const { return device_; }
  void* native() const { return stream_; }  // cudaStream_t, or null on the CPU

 private:
  CopyStream(Device device, void* stream) : device_(device), stream_(stream) {}
  Device device_;
  void* stream_;
  void* fence_ = nullptr;  // cudaEvent_t of WaitForDeviceWork
};

// A mark in a CopyStream. Record (through CopyStream), Done and Synchronize are not synchronised
// with each other: one thread at a time uses an event.
class CopyEvent {
 public:
  CopyEvent() = default;
  ~CopyEvent();
  CopyEvent(const CopyEvent&) = delete;
  CopyEvent& operator=(const CopyEvent&) = delete;
  // True once the work it marks has completed (or when it was never recorded).
  bool Done() const;
  [[nodiscard]] Status Synchronize() const;

 private:
  friend class CopyStream;
  void* event_ = nullptr;  // cudaEvent_t, created on first Record
  int device_ = -1;
};

// Thread-safe byte accounting with an optional hard limit: Reserve and Release may be called from
// any thread (atomics, no lock). Whoever charges it (Buffer, the tiered store's arenas) keeps a
// pointer to it: the budget must outlive everything charged to it.
class MemoryBudget {
 public:
  // limit_bytes == 0 means unlimited.
  explicit MemoryBudget(std::string name, size_t limit_bytes = 0)
      : name_(std::move(name)), limit_(limit_bytes) {}

  // Charges `bytes`, or fails with RESOURCE_EXHAUSTED naming the budget, what was asked and what
  // is left.
  [[nodiscard]] Status Reserve(size_t bytes);
  void Release(size_t bytes);

  const std::string& name() const { return name_; }
  size_t limit() const { return limit_; }
  size_t used() const { return used_.load(); }
  size_t peak() const { return peak_.load(); }
  void ResetPeak() { peak_.store(used_.load()); }

 private:
  std::string name_;
  size_t limit_;
  std::atomic<size_t> used_{0};
  std::atomic<size_t> peak_{0};
};

// One allocation on a device (64-byte aligned host memory on the CPU, cudaMalloc memory on a GPU).
// Frees itself and returns its bytes to the budget on destruction. Handed out as a shared_ptr:
// every Tensor over it holds a reference, and data() stays valid while any reference lives.
// Immutable after creation, so any thread may read its fields; the bytes are the callers' to
// order. `budget` (may be null) must outlive the buffer.
class Buffer {
 public:
  [[nodiscard]] static StatusOr<std::shared_ptr<Buffer>> Allocate(Device device, size_t bytes,
                                                                  MemoryBudget* budget = nullptr);
  // A buffer over memory someone else owns (a tier's slot); destroying it frees nothing. The owner
  // keeps `data` allocated for as long as this buffer or any tensor over it is used.
  static std::shared_ptr<Buffer> Wrap(Device device, void* data, size_t bytes);
  // Page-locked host memory (cudaHostAlloc) when a GPU is present, so copies to and from the GPU
  // run asynchronously at full bus speed; ordinary aligned host memory otherwise. A CPU buffer
  // either way.
  [[nodiscard]] static StatusOr<std::shared_ptr<Buffer>> AllocatePinned(
      size_t bytes, MemoryBudget* budget = nullptr);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool pinned() const { return kind_ == Kind::kPinned; }

 private:
  enum class Kind { kHost, kPinned, kCuda, kWrapped };
  Buffer(Device device, void* data, size_t bytes, MemoryBudget* budget, Kind kind)
      : device_(device), data_(data), bytes_(bytes), budget_(budget), kind_(kind) {}
  Device device_;
  void* data_;
  size_t bytes_;
  MemoryBudget* budget_;
  Kind kind_;
};

// kBF16: bfloat16 (fp32's sign and exponent, 7 mantissa bits), held as its 16 bits (uint16_t);
// the compute copies of a BF16 model's GEMM weights (runtime/model/parameter.h).
enum class DType { kF32 = 0, kF64 = 1, kI32 = 2, kBF16 = 3 };
size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);

template <typename T>
constexpr DType DTypeOf();
template <>
constexpr DType DTypeOf<float>() {
  return DType::kF32;
}
template <>
constexpr DType DTypeOf<double>() {
  return DType::kF64;
}
template <>
constexpr DType DTypeOf<int32_t>() {
  return DType::kI32;
}
template <>
constexpr DType DTypeOf<uint16_t>() {
  return DType::kBF16;
}

// Up to four dimensions, stored inline: making a view allocates nothing.
class Shape {
 public:
  static constexpr int kMaxRank = 4;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(const std::vector<int64_t>& dims);

  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t& operator[](int i) { return dims_[i]; }
  int64_t numel() const;
  const int64_t* begin() const { return dims_; }
  const int64_t* end() const { return dims_ + rank_; }
  bool operator==(const Shape& o) const;
  std::string ToString() const;

 private:
  int64_t dims_[kMaxRank] = {0, 0, 0, 0};
  int rank_ = 0;
};

// A dense, row-major view of (part of) a Buffer. Copies share the buffer and keep it alive; the
// pointers data(), f32(), i32(), bf16() and raw_data() return are valid while any tensor over the
// buffer lives. A value: copying or viewing it is safe from any thread, but nothing orders reads
// and writes of the elements between threads (or, on a GPU, between streams) except the caller.
class Tensor {
 public:
  Tensor() = default;

  // Allocates; CHECK-fails if the allocation fails (for activations sized from a validated
  // config). Use TryEmpty where failure is an expected outcome (budgeted tiers).
  static Tensor Empty(Shape shape, DType dtype = DType::kF32, Device device = Device::Cpu());
  static Tensor Zeros(Shape shape, DType dtype = DType::kF32, Device device = Device::Cpu());
  [[nodiscard]] static StatusOr<Tensor> TryEmpty(Shape shape, DType dtype, Device device,
                                                 MemoryBudget* budget);
  // A tensor over an existing buffer (from Buffer::Wrap or Allocate).
  static Tensor FromBuffer(std::shared_ptr<Buffer> buffer, Shape shape, DType dtype = DType::kF32);

  bool defined() const { return buffer_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  int64_t dim(int i) const { return shape_[i < 0 ? i + rank() : i]; }
  int64_t numel() const { return shape_.numel(); }
  size_t bytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return buffer_ ? buffer_->device() : Device::Cpu(); }
  std::string ShapeString() const;

  template <typename T>
  T* data() const {
    CHECK(dtype_ == DTypeOf<T>()) << "tensor is " << DTypeName(dtype_);
    return reinterpret_cast<T*>(static_cast<char*>(buffer_->data()) + offset_bytes_);
  }
  float* f32() const { return data<float>(); }
  int32_t* i32() const { return data<int32_t>(); }
  uint16_t* bf16() const { return data<uint16_t>(); }
  void* raw_data() const { return static_cast<char*>(buffer_->data()) + offset_bytes_; }

  // Same storage, new shape with the same number of elements.
  Tensor Reshape(Shape shape) const;
  // `shape` elements starting `offset` elements into this tensor's storage (which must hold them).
  Tensor View(int64_t offset, Shape shape) const;
  // Rows [begin, end) along the first dimension.
  Tensor Rows(int64_t begin, int64_t end) const;
  // Sets every element to zero (memset on the CPU; on a GPU a cudaMemset on the default stream,
  // ordered before later copies and kernels of blocking streams, which the host does not wait for).
  void SetZero();
  // Element-wise copy from a tensor of the same shape and dtype, on any device (as CopyBytes:
  // synchronous for the host side; GPU to GPU ordered on the default stream).
  void CopyFrom(const Tensor& src);
  // A copy of this tensor on `device` (a new buffer; this tensor's own if already there).
  Tensor To(Device device) const;
  // Its bytes to / from host memory (memcpy on the CPU, cudaMemcpy from a GPU; synchronous).
  void CopyToHost(void* dst) const;
  void CopyFromHost(const void* src) const;

 private:
  Shape shape_;
  DType dtype_ = DType::kF32;
  std::shared_ptr<Buffer> buffer_;
  size_t offset_bytes_ = 0;
};

}  // namespace strata
