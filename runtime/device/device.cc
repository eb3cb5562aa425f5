#include "runtime/device/device.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_format.h"

namespace strata {

#ifndef STRATA_WITH_CUDA
int CudaDeviceCount() { return 0; }
#endif

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
  if (!device.is_cpu()) {
    return absl::UnimplementedError(
        absl::StrCat("allocation on ", device.ToString(), " needs the CUDA backend"));
  }
  if (budget != nullptr) RETURN_IF_ERROR(budget->Reserve(bytes));
  size_t rounded = (bytes + 63) / 64 * 64;
  void* data = rounded == 0 ? nullptr : std::aligned_alloc(64, rounded);
  if (rounded != 0 && data == nullptr) {
    if (budget != nullptr) budget->Release(bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("out of host memory allocating ", bytes, " bytes"));
  }
  return std::shared_ptr<Buffer>(new Buffer(device, data, bytes, budget));
}

std::shared_ptr<Buffer> Buffer::Wrap(Device device, void* data, size_t bytes) {
  return std::shared_ptr<Buffer>(new Buffer(device, data, bytes, nullptr, /*owned=*/false));
}

Buffer::~Buffer() {
  if (!owned_) return;
  std::free(data_);
  if (budget_ != nullptr) budget_->Release(bytes_);
}

size_t DTypeSize(DType dtype) { return dtype == DType::kF64 ? 8 : 4; }
const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF64:
      return "f64";
    case DType::kI32:
      return "i32";
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

void Tensor::SetZero() {
  if (defined() && bytes() > 0) std::memset(raw_data(), 0, bytes());
}

void Tensor::CopyFrom(const Tensor& src) {
  CHECK(src.shape_ == shape_ && src.dtype_ == dtype_)
      << src.ShapeString() << " -> " << ShapeString();
  if (bytes() > 0) std::memcpy(raw_data(), src.raw_data(), bytes());
}

}  // namespace strata
