// Tensor, Storage, Device and the half-precision conversions. CPU memory is 64-byte aligned; CUDA memory comes
// from the device API (cuda/device.cu); inside a WeightArenaScope both come from its slabs (core/weight_arena.h).
#include "exl2/tensor.h"

#include <cstdlib>
#include <cstring>

#include "core/checked.h"
#include "core/device_api.h"
#include "core/weight_arena.h"

namespace exl2 {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::I16: return "i16";
    case DType::I8: return "i8";
    case DType::U8: return "u8";
  }
  return "?";
}

bool dtype_is_float(DType d) { return d == DType::F32 || d == DType::F16 || d == DType::BF16; }

Device Device::parse(const std::string& text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.rfind("cuda:", 0) == 0 && text.size() > 5) {
    const std::string num = text.substr(5);
    bool digits = num.size() <= 4;
    for (char c : num) digits = digits && c >= '0' && c <= '9';
    if (digits) return cuda(std::atoi(num.c_str()));
  }
  EXL2_FAIL(InvalidArgument, "device must be \"cpu\", \"cuda\" or \"cuda:N\", got \"", text, "\"");
}

std::string Device::str() const { return is_cpu() ? std::string("cpu") : str_cat("cuda:", index); }

Storage::Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter,
                 std::shared_ptr<void> keepalive)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)), keepalive_(std::move(keepalive)) {}

Storage::~Storage() {
  if (deleter_ && data_) deleter_(data_);
}

std::string shape_str(const Shape& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape)
    if (s == 0) return 0;  // [2^62, 4, 0] has no elements: a zero anywhere wins over an overflow before it
  for (int64_t s : shape)
    EXL2_CHECK(!__builtin_mul_overflow(n, s, &n), "tensor shape ", shape_str(shape),
               " has more than 2^63 - 1 elements");
  return n;
}

static void check_shape(const Shape& shape) {
  for (int64_t s : shape) EXL2_CHECK(s >= 0, "tensor dimensions must be >= 0, got ", shape_str(shape));
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  check_shape(shape);
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  const size_t nbytes = static_cast<size_t>(checked_mul(ErrorKind::OutOfMemory, {shape_numel(shape),
      static_cast<int64_t>(dtype_size(dtype))}, "a ", dtype_name(dtype), shape_str(shape), " tensor's byte count"));
  const size_t alloc = nbytes ? nbytes : 1;
  {
    std::function<void(void*)> deleter;
    std::shared_ptr<void> slab;
    if (void* p = weight_arena_alloc(device, alloc, &deleter, &slab)) {  // a WeightArenaScope is active
      t.storage_ = std::make_shared<Storage>(p, nbytes, device, std::move(deleter), std::move(slab));
      return t;
    }
  }
  if (device.is_cpu()) {
    check_host_fits(nbytes, str_cat("a ", dtype_name(dtype), shape_str(shape), " tensor"));
    void* p = host_alloc(alloc, 64);
    if (!p) EXL2_FAIL(OutOfMemory, "out of host memory allocating ", nbytes, " bytes for a ", dtype_name(dtype),
                      shape_str(shape), " tensor");
    t.storage_ = std::make_shared<Storage>(p, nbytes, device, [alloc](void* q) { host_free(q, alloc); });
  } else {
    const int index = device.index;
    void* p = device::cuda_malloc(alloc, index);
    t.storage_ = std::make_shared<Storage>(p, nbytes, device, [index](void* q) { device::cuda_free(q, index); });
  }
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  device::memset_zero(t.data(), device, t.nbytes());
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, Device device, std::shared_ptr<void> keepalive) {
  check_shape(shape);
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(data, t.nbytes(), device, nullptr, std::move(keepalive));
  return t;
}

Tensor Tensor::from_host(const void* data, const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype, Device::cpu());
  if (t.nbytes()) std::memcpy(t.data(), data, t.nbytes());
  return t;
}

int64_t Tensor::size(int64_t i) const {
  const int64_t d = dim();
  if (i < 0) i += d;
  EXL2_CHECK(i >= 0 && i < d, "dimension index out of range for ", describe());
  return shape_[i];
}

void* Tensor::data() const {
  EXL2_CHECK_KIND(Internal, storage_ != nullptr, "use of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_;
}

Tensor Tensor::view(const Shape& shape) const {
  Shape s = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      EXL2_CHECK(infer < 0, "view: at most one -1 in ", shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    EXL2_CHECK(known > 0 && numel() % known == 0, "view: cannot reshape ", describe(), " to ", shape_str(shape));
    s[infer] = numel() / known;
  }
  EXL2_CHECK(shape_numel(s) == numel(), "view: cannot reshape ", describe(), " to ", shape_str(shape));
  Tensor t = *this;
  t.shape_ = s;
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  EXL2_CHECK(dim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0], "slice [", begin, ", ", end,
             ") out of range for ", describe());
  Tensor t = *this;
  const int64_t row = shape_[0] ? numel() / shape_[0] : 0;
  t.offset_ += static_cast<size_t>(begin * row) * dtype_size(dtype_);
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::to(Device dev) const {
  Tensor t = empty(shape_, dtype_, dev);
  device::copy(t.data(), dev, data(), device(), nbytes());
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  EXL2_CHECK(src.numel() == numel() && src.dtype() == dtype_, "copy_from: ", src.describe(), " into ", describe());
  device::copy(data(), device(), src.data(), src.device(), nbytes());
}

Tensor Tensor::to_dtype(DType target) const {
  if (target == dtype_) return *this;
  EXL2_CHECK(dtype_is_float(dtype_) && dtype_is_float(target), "to_dtype: only float dtypes convert, got ",
             describe(), " -> ", dtype_name(target));
  EXL2_CHECK(device().is_cpu(), "to_dtype on ", device().str(), ": use ops::convert");
  Tensor out = empty(shape_, target, device());
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) {
    float v;
    switch (dtype_) {
      case DType::F32: v = data_as<float>()[i]; break;
      case DType::F16: v = f16_to_f32(data_as<uint16_t>()[i]); break;
      default: v = bf16_to_f32(data_as<uint16_t>()[i]); break;
    }
    switch (target) {
      case DType::F32: out.data_as<float>()[i] = v; break;
      case DType::F16: out.data_as<uint16_t>()[i] = f32_to_f16(v); break;
      default: out.data_as<uint16_t>()[i] = f32_to_bf16(v); break;
    }
  }
  return out;
}

std::string Tensor::describe() const {
  if (!defined()) return "<undefined tensor>";
  return str_cat(dtype_name(dtype_), shape_str(shape_), " on ", device().str());
}

// ---- half precision --------------------------------------------------------------------------------------

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
  }
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  const int32_t exp = static_cast<int32_t>(absx >> 23) - 127;
  if (exp < -14) {  // subnormal half (or zero): value = mant * 2^-24
    if (exp < -25) return static_cast<uint16_t>(sign);
    const uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
    const int shift = -exp - 14 + 13;  // bits to drop
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = ((static_cast<uint32_t>(exp + 15)) << 10) | ((absx >> 13) & 0x3ffu);
  const uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
  const uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace exl2
