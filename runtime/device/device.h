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
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "runtime/common/logging.h"
#include "runtime/common/status.h"

namespace strata {

enum class DeviceType { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;

  static Device Cpu() { return Device{}; }
  static Device Cuda(int index) { return Device{DeviceType::kCuda, index}; }
  bool is_cpu() const { return type == DeviceType::kCpu; }
  std::string ToString() const;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
};

// Number of usable CUDA devices: 0 when strata is built without CUDA, when no driver is loaded, or
// when no GPU is present. Never fails.
int CudaDeviceCount();

// Thread-safe byte accounting with an optional hard limit.
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

// One allocation on a device (64-byte aligned host memory on the CPU). Frees itself and returns
// its bytes to the budget on destruction.
class Buffer {
 public:
  [[nodiscard]] static StatusOr<std::shared_ptr<Buffer>> Allocate(Device device, size_t bytes,
                                                                  MemoryBudget* budget = nullptr);
  // A buffer over memory someone else owns (a tier's slot); destroying it frees nothing.
  static std::shared_ptr<Buffer> Wrap(Device device, void* data, size_t bytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  Buffer(Device device, void* data, size_t bytes, MemoryBudget* budget, bool owned = true)
      : device_(device), data_(data), bytes_(bytes), budget_(budget), owned_(owned) {}
  Device device_;
  void* data_;
  size_t bytes_;
  MemoryBudget* budget_;
  bool owned_;
};

enum class DType { kF32 = 0, kF64 = 1, kI32 = 2 };
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

// A dense, row-major view of (part of) a Buffer. Copies share the buffer.
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
  void* raw_data() const { return static_cast<char*>(buffer_->data()) + offset_bytes_; }

  // Same storage, new shape with the same number of elements.
  Tensor Reshape(Shape shape) const;
  // `shape` elements starting `offset` elements into this tensor's storage (which must hold them).
  Tensor View(int64_t offset, Shape shape) const;
  // Rows [begin, end) along the first dimension.
  Tensor Rows(int64_t begin, int64_t end) const;
  // Sets every element to zero (host memset on the CPU).
  void SetZero();
  // Element-wise copy from a tensor of the same shape and dtype.
  void CopyFrom(const Tensor& src);

 private:
  Shape shape_;
  DType dtype_ = DType::kF32;
  std::shared_ptr<Buffer> buffer_;
  size_t offset_bytes_ = 0;
};

}  // namespace strata
