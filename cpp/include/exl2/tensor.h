// Tensor: a dense, row-major, contiguous n-d array on one device (CPU or CUDA:n), with shared ownership of
// its storage. Views (reshape, row slices, memory-mapped file regions) share storage; nothing is strided.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "exl2/errors.h"

namespace exl2 {

enum class DType : uint8_t { F32, F16, BF16, I32, I16, I8, U8 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
bool dtype_is_float(DType dtype);

struct Device {
  enum class Kind : uint8_t { CPU, CUDA };
  Kind kind = Kind::CPU;
  int index = 0;  // CUDA ordinal; 0 for CPU

  static Device cpu() { return {Kind::CPU, 0}; }
  static Device cuda(int index = 0) { return {Kind::CUDA, index}; }
  // "cpu", "cuda", "cuda:1"; throws InvalidArgument otherwise.
  static Device parse(const std::string& text);
  bool is_cpu() const { return kind == Kind::CPU; }
  bool is_cuda() const { return kind == Kind::CUDA; }
  std::string str() const;
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

// A block of memory on one device. Owning storages free their memory through the allocator of their
// device; borrowed storages (mmap regions, caller buffers) keep `keepalive` alive instead.
class Storage {
 public:
  Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter,
          std::shared_ptr<void> keepalive = nullptr);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  std::function<void(void*)> deleter_;
  std::shared_ptr<void> keepalive_;
};

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& shape);
int64_t shape_numel(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // Uninitialized tensor. Throws OutOfMemory (with the numbers) when the allocation fails. Inside a
  // WeightArenaScope of `device` on this thread it is sub-allocated from the scope's slabs (core/weight_arena.h).
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Wrap memory owned elsewhere; `keepalive` is held for the tensor's lifetime.
  static Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device,
                          std::shared_ptr<void> keepalive = nullptr);
  // Copy host data into a new CPU tensor.
  static Tensor from_host(const void* data, const Shape& shape, DType dtype);
  template <typename T>
  static Tensor from_vector(const std::vector<T>& v, DType dtype) {
    return from_host(v.data(), {static_cast<int64_t>(v.size())}, dtype);
  }

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t i) const;  // negative i counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }

  void* data() const;
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data());
  }

  // Same storage, new shape (numel must match; one dim may be -1).
  Tensor view(const Shape& shape) const;
  // Rows [begin, end) of the outermost dimension, sharing storage.
  Tensor slice(int64_t begin, int64_t end) const;
  // Copy to another device (or a deep copy on the same device).
  Tensor to(Device device) const;
  Tensor clone() const { return to(device()); }
  // Convert between float dtypes (f32/f16/bf16) on the tensor's device; same dtype returns *this.
  Tensor to_dtype(DType dtype) const;
  // Copy `src` (same numel and dtype, any device) into this tensor.
  void copy_from(const Tensor& src);

  std::string describe() const;  // "f16[576, 1536] on cpu"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes into storage
  Shape shape_;
  DType dtype_ = DType::F32;
};

// Half-precision conversions (IEEE binary16 with subnormals, round-to-nearest-even; bf16 likewise).
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);

}  // namespace exl2
