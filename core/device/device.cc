#include "core/device/device.h"

#include <cctype>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "core/device/cuda_internal.h"

namespace strata {

#ifndef STRATA_WITH_CUDA
int CudaDeviceCount() { return 0; }
std::string CudaDeviceDescription(int) { return "no CUDA device (strata built without CUDA)"; }
void UseDevice(Device) {}
StatusOr<bool> PinHostMemory(void*, size_t) { return false; }
void UnpinHostMemory(void*) {}
void CopyBytes(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

StatusOr<std::unique_ptr<CopyStream>> CopyStream::Create(Device device) {
  if (!device.is_cpu()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a copy stream on ", device.ToString(), " needs strata built with CUDA (STRATA_CUDA=ON)"));
  }
  return std::unique_ptr<CopyStream>(new CopyStream(device, nullptr));
}
CopyStream::~CopyStream() = default;
Status CopyStream::CopyAsync(void* dst, const void* src, size_t bytes) {
  CopyBytes(dst, src, bytes);
  return absl::OkStatus();
}
Status CopyStream::Record(CopyEvent*) { return absl::OkStatus(); }
Status CopyStream::Wait(const CopyEvent&) { return absl::OkStatus(); }
Status CopyStream::WaitForDeviceWork() { return absl::OkStatus(); }
Status CopyStream::Synchronize() { return absl::OkStatus(); }
CopyEvent::~CopyEvent() = default;
bool CopyEvent::Done() const { return true; }
Status CopyEvent::Synchronize() const { return absl::OkStatus(); }

namespace internal {
Status CudaMalloc(int device, size_t, void** out) {
  *out = nullptr;
  return absl::FailedPreconditionError(
      absl::StrCat("cuda:", device,
                   " requested but strata was built without CUDA; rebuild with nvcc on PATH "
                   "(STRATA_CUDA=AUTO or ON) or use the CPU device"));
}
void CudaFree(int, void*) {}
Status CudaHostAlloc(size_t, void** out) {
  *out = nullptr;
  return absl::OkStatus();
}
void CudaFreeHost(void*) {}
void CudaCopy(void* dst, const void* src, size_t bytes) { CopyBytes(dst, src, bytes); }
void CudaZero(int, void*, size_t) { CHECK(false) << "no CUDA memory in a build without CUDA"; }
}  // namespace internal
#endif

StatusOr<Device> Device::Parse(const std::string& text) {
  if (text == "cpu") return Cpu();
  if (text == "cuda") return Cuda(0);
  int index = -1;
  if (absl::StartsWith(text, "cuda:") && absl::SimpleAtoi(text.substr(5), &index) && index >= 0 &&
      text.size() > 5 && std::isdigit(static_cast<unsigned char>(text[5]))) {
    return Cuda(index);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", text, "'; use cpu, cuda or cuda:N (N = GPU index)"));
}

std::string Device::ToString() const {
  return type == DeviceType::kCpu ? std::string("cpu") : absl::StrCat("cuda:", index);
}

Status MemoryBudget::Reserve(size_t bytes) {
  size_t cur = used_.load();
  while (true) {
    size_t next = cur + bytes;
    if (limit_ != 0 && next > limit_) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "memory budget '%s' exceeded: %d bytes requested, %d of %d in use; raise the budget in "
          "the config or lower batch/model sizes",
          name_, bytes, cur, limit_));
    }
    if (used_.compare_exchange_weak(cur, next)) {
      size_t peak = peak_.load();
      while (next > peak && !peak_.compare_exchange_weak(peak, next)) {
      }
      return absl::OkStatus();
    }
  }
}

void MemoryBudget::Release(size_t bytes) { used_.fetch_sub(bytes); }

StatusOr<std::shared_ptr<Buffer>> Buffer::Allocate(Device device, size_t bytes,
                                                   MemoryBudget* budget) {
  if (budget != nullptr) RETURN_IF_ERROR(budget->Reserve(bytes));
  if (!device.is_cpu()) {
    void* data = nullptr;
    Status s = internal::CudaMalloc(device.index, bytes, &data);
    if (!s.ok()) {
      if (budget != nullptr) budget->Release(bytes);
      return s;
    }
    return std::shared_ptr<Buffer>(new Buffer(device, data, bytes, budget, Kind::kCuda));
  }
  size_t rounded = (bytes + 63) / 64 * 64;
  void* data = rounded == 0 ? nullptr : std::aligned_alloc(64, rounded);
  if (rounded != 0 && data == nullptr) {
    if (budget != nullptr) budget->Release(bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("out of host memory allocating ", bytes, " bytes"));
  }
  return std::shared_ptr<Buffer>(new Buffer(device, data, bytes, budget, Kind::kHost));
}

StatusOr<std::shared_ptr<Buffer>> Buffer::AllocatePinned(size_t bytes, MemoryBudget* budget) {
  if (budget != nullptr) RETURN_IF_ERROR(budget->Reserve(bytes));
  void* data = nullptr;
  Status s = internal::CudaHostAlloc(bytes, &data);
  if (!s.ok()) {
    if (budget != nullptr) budget->Release(bytes);
    return s;
  }
  if (data != nullptr) {
    return std::shared_ptr<Buffer>(new Buffer(Device::Cpu(), data, bytes, budget, Kind::kPinned));
  }
  if (budget != nullptr) budget->Release(bytes);
  return Allocate(Device::Cpu(), bytes, budget);  // no GPU: nothing to pin for
}

std::shared_ptr<Buffer> Buffer::Wrap(Device device, void* data, size_t bytes) {
  return std::shared_ptr<Buffer>(new Buffer(device, data, bytes, nullptr, Kind::kWrapped));
}

Buffer::~Buffer() {
  switch (kind_) {
    case Kind::kWrapped:
      return;
    case Kind::kHost:
      std::free(data_);
      break;
    case Kind::kPinned:
      internal::CudaFreeHost(data_);
      break;
    case Kind::kCuda:
      internal::CudaFree(device_.index, data_);
      break;
  }
  if (budget_ != nullptr) budget_->Release(bytes_);
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return 8;
    case DType::kBF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      break;
  }
  return 4;
}
const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF64:
      return "f64";
    case DType::kI32:
      return "i32";
    case DType::kBF16:
      return "bf16";
  }
  return "?";
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  CHECK_LE(static_cast<int>(dims.size()), kMaxRank) << "tensors have at most 4 dimensions";
  for (int64_t d : dims) dims_[rank_++] = d;
}

Shape::Shape(const std::vector<int64_t>& dims) {
  CHECK_LE(static_cast<int>(dims.size()), kMaxRank) << "tensors have at most 4 dimensions";
  for (int64_t d : dims) dims_[rank_++] = d;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i) {
    if (dims_[i] != o.dims_[i]) return false;
  }
  return true;
}

std::string Shape::ToString() const {
  std::string s = "[";
  for (int i = 0; i < rank_; ++i) absl::StrAppend(&s, i ? ", " : "", dims_[i]);
  return s + "]";
}

std::string Tensor::ShapeString() const { return shape_.ToString(); }

StatusOr<Tensor> Tensor::TryEmpty(Shape shape, DType dtype, Device device, MemoryBudget* budget) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  for (int64_t d : t.shape_) {
    if (d < 0) return absl::InvalidArgumentError("negative tensor dimension");
  }
  ASSIGN_OR_RETURN(t.buffer_, Buffer::Allocate(device, t.bytes(), budget));
  return t;
}

Tensor Tensor::FromBuffer(std::shared_ptr<Buffer> buffer, Shape shape, DType dtype) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  CHECK(buffer != nullptr && t.bytes() <= buffer->bytes())
      << "a tensor of " << t.bytes() << " bytes over a smaller buffer";
  t.buffer_ = std::move(buffer);
  return t;
}

Tensor Tensor::Empty(Shape shape, DType dtype, Device device) {
  auto t = TryEmpty(shape, dtype, device, nullptr);
  CHECK(t.ok()) << t.status();
  return *std::move(t);
}

Tensor Tensor::Zeros(Shape shape, DType dtype, Device device) {
  Tensor t = Empty(shape, dtype, device);
  t.SetZero();
  return t;
}

Tensor Tensor::Reshape(Shape shape) const {
  Tensor t = *this;
  t.shape_ = shape;
  CHECK_EQ(t.numel(), numel()) << "reshape " << ShapeString() << " -> " << t.ShapeString();
  return t;
}

Tensor Tensor::View(int64_t offset, Shape shape) const {
  Tensor t = *this;
  t.shape_ = shape;
  t.offset_bytes_ += static_cast<size_t>(offset) * DTypeSize(dtype_);
  CHECK(offset >= 0 && t.offset_bytes_ + t.bytes() <= buffer_->bytes())
      << "view of " << t.ShapeString() << " at " << offset << " outside a buffer of "
      << buffer_->bytes() << " bytes";
  return t;
}

Tensor Tensor::Rows(int64_t begin, int64_t end) const {
  CHECK(rank() >= 1 && 0 <= begin && begin <= end && end <= shape_[0]);
  Tensor t = *this;
  int64_t row = 1;
  for (int i = 1; i < rank(); ++i) row *= shape_[i];
  t.shape_[0] = end - begin;
  t.offset_bytes_ += static_cast<size_t>(begin * row) * DTypeSize(dtype_);
  return t;
}

void ZeroBytes(Device device, void* data, size_t bytes) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    std::memset(data, 0, bytes);
  } else {
    internal::CudaZero(device.index, data, bytes);
  }
}

void Tensor::SetZero() {
  if (defined()) ZeroBytes(device(), raw_data(), bytes());
}

void Tensor::CopyFrom(const Tensor& src) {
  CHECK(src.shape_ == shape_ && src.dtype_ == dtype_)
      << src.ShapeString() << " -> " << ShapeString();
  if (bytes() == 0) return;
  if (device().is_cpu() && src.device().is_cpu()) {
    std::memcpy(raw_data(), src.raw_data(), bytes());
  } else {
    internal::CudaCopy(raw_data(), src.raw_data(), bytes());
  }
}

void Tensor::CopyToHost(void* dst) const {
  if (!defined() || bytes() == 0) return;
  if (device().is_cpu()) {
    std::memcpy(dst, raw_data(), bytes());
  } else {
    internal::CudaCopy(dst, raw_data(), bytes());
  }
}

void Tensor::CopyFromHost(const void* src) const {
  if (!defined() || bytes() == 0) return;
  if (device().is_cpu()) {
    std::memcpy(raw_data(), src, bytes());
  } else {
    internal::CudaCopy(raw_data(), src, bytes());
  }
}

Tensor Tensor::To(Device device) const {
  if (!defined() || this->device() == device) return *this;
  Tensor t = Empty(shape_, dtype_, device);
  t.CopyFrom(*this);
  return t;
}

}  // namespace strata
