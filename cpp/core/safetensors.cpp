// safetensors reading: mapping and validating single files, and merging single/sharded/folder layouts into a TensorMap.
#include "exl2/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/weight_arena.h"
#include "exl2/errors.h"

namespace exl2 {

namespace fs = std::filesystem;

namespace {

// safetensors' own reader refuses headers above 100 MB; a bigger length field means a corrupt file.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Byte counts are computed in 128 bits and saturated here, so hostile shapes cannot overflow.
constexpr unsigned __int128 kHugeBytes = static_cast<unsigned __int128>(1) << 64;

// The dtype strings of the safetensors format: the ones we map, and the ones we know but do not run.
bool parse_dtype(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> table[] = {{"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16},
                                                        {"I32", DType::I32}, {"I16", DType::I16}, {"I8", DType::I8},
                                                        {"U8", DType::U8}};
  for (const auto& e : table) {
    if (s == e.first) {
      *out = e.second;
      return true;
    }
  }
  return false;
}

bool is_known_unsupported_dtype(const std::string& s) {
  static const char* known[] = {"F64",     "I64",     "U64",     "U32",     "U16", "BOOL", "F8_E4M3",
                                "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4",  "C64"};
  for (const char* k : known)
    if (s == k) return true;
  return false;
}

std::string dir_of(const std::string& path) {
  const fs::path p(path);
  return p.has_parent_path() ? p.parent_path().string() : std::string(".");
}

}  // namespace

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->self_ = f;
  f->path_ = path;

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) EXL2_FAIL(Io, path, ": cannot open safetensors file (", std::strerror(errno), ")");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    EXL2_FAIL(Io, path, ": cannot stat file (", std::strerror(err), ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    EXL2_FAIL(Io, path, ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    EXL2_FAIL(Io, path, ": file is ", size,
              " bytes, shorter than the 8-byte safetensors header length (truncated or not a safetensors file)");
  }
  // Private and writable: a tensor view written by mistake gets a copy-on-write page, never a crash or a
  // changed file. Pages are only read from disk when touched.
  void* m = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  if (m == MAP_FAILED) {
    ::close(fd);
    EXL2_FAIL(Io, path, ": mmap of ", size, " bytes failed (", std::strerror(map_err), ")");
  }
  f->fd_ = fd;
  f->map_ = m;
  f->map_size_ = size;

  const unsigned char* bytes = static_cast<const unsigned char*>(m);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];  // little-endian u64
  if (header_len > size - 8)
    EXL2_FAIL(Io, path, ": header length field says ", header_len, " bytes but only ", size - 8,
              " bytes follow it (truncated file, or not a safetensors file)");
  if (header_len > kMaxHeaderBytes)
    EXL2_FAIL(ModelFormat, path, ": header length ", header_len, " exceeds the 100 MB limit of the format");
  if (header_len < 2 || bytes[8] != '{')
    EXL2_FAIL(ModelFormat, path, ": header does not start with a JSON object ('{'); not a safetensors file");
  f->data_offset_ = 8 + header_len;
  const size_t data_size = size - f->data_offset_;

  const std::string header_text(reinterpret_cast<const char*>(bytes + 8), header_len);
  const Json header = Json::parse(header_text, path + " (safetensors header)");
  if (!header.is_object()) EXL2_FAIL(ModelFormat, path, ": safetensors header must be a JSON object");

  for (const auto& [name, entry] : header.as_object()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        EXL2_FAIL(ModelFormat, path, ": __metadata__ must be an object of strings, got ", entry.type_name());
      for (const auto& [k, v] : entry.as_object()) {
        if (!v.is_string())
          EXL2_FAIL(ModelFormat, path, ": __metadata__[\"", k, "\"] must be a string, got ", v.type_name());
        f->metadata_[k] = v.as_string();
      }
      continue;
    }
    const std::string where = str_cat(path, ": tensor '", name, "'");
    if (!entry.is_object()) EXL2_FAIL(ModelFormat, where, " must be an object, got ", entry.type_name());
    const Json* jd = entry.find("dtype");
    const Json* js = entry.find("shape");
    const Json* jo = entry.find("data_offsets");
    if (!jd || !js || !jo) EXL2_FAIL(ModelFormat, where, " needs 'dtype', 'shape' and 'data_offsets'");
    TensorInfo info;
    info.name = name;
    const std::string& dtype_str = jd->as_string(where + " dtype");
    if (!parse_dtype(dtype_str, &info.dtype)) {
      if (is_known_unsupported_dtype(dtype_str))
        EXL2_FAIL(Unsupported, where, " has dtype ", dtype_str,
                  ", which exl2cpp does not load (supported: F32, F16, BF16, I32, I16, I8, U8); convert the "
                  "checkpoint, e.g. to F16 or BF16");
      EXL2_FAIL(ModelFormat, where, " has unknown dtype \"", dtype_str, "\" (not a safetensors dtype)");
    }
    // numel * element size, guarding against overflow on hostile shapes.
    unsigned __int128 nbytes = dtype_size(info.dtype);
    for (const Json& d : js->as_array(where + " shape")) {
      if (!d.is_integer() || d.as_int() < 0)
        EXL2_FAIL(ModelFormat, where, " shape entries must be non-negative integers, got ", d.dump());
      info.shape.push_back(d.as_int());
      nbytes *= static_cast<uint64_t>(d.as_int());
      if (nbytes > kHugeBytes) nbytes = kHugeBytes;  // dims < 2^63, so the next product still fits 128 bits
    }
    const auto& offs = jo->as_array(where + " data_offsets");
    if (offs.size() != 2 || !offs[0].is_integer() || !offs[1].is_integer() || offs[0].as_int() < 0 ||
        offs[1].as_int() < 0)
      EXL2_FAIL(ModelFormat, where, " data_offsets must be [begin, end] of non-negative integers, got ", jo->dump());
    const uint64_t begin = static_cast<uint64_t>(offs[0].as_int());
    const uint64_t end = static_cast<uint64_t>(offs[1].as_int());
    if (begin > end) EXL2_FAIL(ModelFormat, where, " data_offsets [", begin, ", ", end, "] have begin > end");
    if (end > data_size)
      EXL2_FAIL(Io, where, " data_offsets [", begin, ", ", end, "] reach past the end of the data section (", data_size,
                " bytes): truncated file?");
    if (static_cast<unsigned __int128>(end - begin) != nbytes)
      EXL2_FAIL(ModelFormat, where, " is ", dtype_str, shape_str(info.shape), " = ",
                (nbytes >= kHugeBytes ? std::string("over 2^64") : std::to_string(static_cast<uint64_t>(nbytes))),
                " bytes, but its data_offsets [", begin, ", ", end, "] span ", end - begin, " bytes");
    info.begin = begin;
    info.end = end;
    f->index_[name] = f->tensors_.size();
    f->tensors_.push_back(std::move(info));
  }

  // The format forbids overlaps and holes: sorted by offset, each tensor starts where the previous ended
  // and the last ends at the end of the file.
  std::vector<const TensorInfo*> order;
  order.reserve(f->tensors_.size());
  for (const auto& t : f->tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  size_t cursor = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo* t : order) {
    if (t->begin < cursor)
      EXL2_FAIL(ModelFormat, path, ": tensor '", t->name, "' [", t->begin, ", ", t->end, ") overlaps tensor '",
                prev->name, "' [", prev->begin, ", ", prev->end, ")");
    if (t->begin > cursor)
      EXL2_FAIL(ModelFormat, path, ": ", t->begin - cursor, " bytes of the data section before tensor '", t->name,
                "' belong to no tensor (holes are not allowed by the safetensors format)");
    cursor = t->end;
    prev = t;
  }
  if (cursor != data_size)
    EXL2_FAIL(ModelFormat, path, ": the data section is ", data_size, " bytes but the tensors cover ", cursor, " (",
              data_size - cursor, " trailing bytes belong to no tensor)");
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::checked_find(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (!info) EXL2_FAIL(ModelFormat, "missing tensor ", name, " in ", path_, " (has ", tensors_.size(), " tensors)");
  return *info;
}

Tensor SafetensorsFile::read(const std::string& name) const {
  const TensorInfo& info = checked_find(name);
  Tensor t = Tensor::empty(info.shape, info.dtype);
  char* dst = static_cast<char*>(t.data());
  size_t done = 0;
  const size_t n = info.end - info.begin;
  while (done < n) {  // pread, not the mapping: a file cut short is an error here, not a SIGBUS
    const ssize_t got = ::pread(fd_, dst + done, n - done, static_cast<off_t>(data_offset_ + info.begin + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      EXL2_FAIL(Io, path_, ": reading tensor '", name, "' (", n, " bytes at offset ", data_offset_ + info.begin,
                ") failed: ", (got < 0 ? std::strerror(errno) : "the file ends early; was it changed while loading?"));
    done += static_cast<size_t>(got);
  }
  return t;
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const TensorInfo* info = &checked_find(name);
  char* p = static_cast<char*>(map_) + data_offset_ + info->begin;
  // Misaligned data (legal in the format when the header length is not padded) is copied so kernels can
  // rely on natural alignment.
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(info->dtype) != 0)
    return Tensor::from_host(p, info->shape, info->dtype);
  return Tensor::from_blob(p, info->shape, info->dtype, Device::cpu(), self_.lock());
}

// ---- TensorMap ----------------------------------------------------------------------------------

TensorMap TensorMap::open(const std::string& path) {
  TensorMap tm;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found)
    EXL2_FAIL(Io, path, ": no such file or folder (expected a .safetensors file or a model folder)");
  if (ec) EXL2_FAIL(Io, path, ": cannot read (", ec.message(), ")");

  if (fs::is_regular_file(st)) {
    auto f = SafetensorsFile::open(path);
    for (const auto& t : f->tensors()) tm.where_[t.name] = 0;
    tm.files_.push_back(std::move(f));
    return tm;
  }
  if (!fs::is_directory(st)) EXL2_FAIL(Io, path, ": not a file or folder");

  const fs::path dir(path);
  const fs::path index_path = dir / "model.safetensors.index.json";
  if (fs::symlink_status(index_path, ec).type() != fs::file_type::not_found) {
    const Json index = Json::parse_file(index_path.string());
    const std::string ip = index_path.string();
    if (!index.is_object()) EXL2_FAIL(ModelFormat, ip, ": expected a JSON object");
    const Json* wm = index.find("weight_map");
    if (!wm) EXL2_FAIL(ModelFormat, ip, ": missing \"weight_map\"");
    std::map<std::string, size_t> shard_index;
    for (const auto& [name, file] : wm->as_object(ip + ": weight_map")) {
      const std::string& shard = file.as_string(str_cat(ip, ": weight_map[\"", name, "\"]"));
      if (shard.empty() || fs::path(shard).is_absolute() || shard.find("..") != std::string::npos)
        EXL2_FAIL(ModelFormat, ip, ": weight_map[\"", name, "\"] = \"", shard,
                  "\" is not a file name inside the model folder");
      auto it = shard_index.find(shard);
      if (it == shard_index.end()) {
        const fs::path sp = dir / shard;
        if (!fs::exists(sp, ec))
          EXL2_FAIL(Io, ip, ": shard \"", shard, "\" (holding tensor ", name, ") is missing from ", path,
                    "; download the complete model");
        tm.files_.push_back(SafetensorsFile::open(sp.string()));
        it = shard_index.emplace(shard, tm.files_.size() - 1).first;
      }
      if (!tm.files_[it->second]->find(name))
        EXL2_FAIL(ModelFormat, ip, ": tensor ", name, " is listed in shard \"", shard,
                  "\" but that file does not hold it");
      tm.where_[name] = it->second;
    }
    return tm;
  }

  std::vector<std::string> shards;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".safetensors") continue;
    std::error_code fec;
    const bool regular = e.is_regular_file(fec);
    if (fec)  // a symlink loop or a broken link: a shard that cannot be read, not one to skip
      EXL2_FAIL(Io, e.path().string(), ": cannot read (", fec.message(), ")");
    if (regular) shards.push_back(e.path().string());
  }
  if (ec) EXL2_FAIL(Io, path, ": cannot list folder (", ec.message(), ")");
  if (shards.empty())
    EXL2_FAIL(ModelFormat, path, ": no *.safetensors files and no model.safetensors.index.json in this folder");
  std::sort(shards.begin(), shards.end());
  for (const auto& sp : shards) {
    auto f = SafetensorsFile::open(sp);
    const size_t idx = tm.files_.size();
    for (const auto& t : f->tensors()) {
      auto [it, inserted] = tm.where_.emplace(t.name, idx);
      if (!inserted)
        EXL2_FAIL(ModelFormat, path, ": tensor ", t.name, " is in both ", tm.files_[it->second]->path(), " and ", sp,
                  "; remove the stale file");
    }
    tm.files_.push_back(std::move(f));
  }
  return tm;
}

const TensorInfo& TensorMap::info(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    EXL2_FAIL(ModelFormat, "missing tensor ", name, " in ", source(), " (has ", where_.size(), " tensors)");
  return *files_[it->second]->find(name);
}

std::string TensorMap::source() const {
  return files_.empty() ? std::string("<empty>") : files_.size() == 1 ? files_[0]->path() : dir_of(files_[0]->path());
}

Tensor TensorMap::get(const std::string& name) const {
  info(name);  // the missing-tensor error
  const SafetensorsFile& f = *files_[where_.at(name)];
  Tensor t;
  if (copy_) {
    // The copy is what the loader reads from, like the mapping it replaces: the loader's own tensors (converted,
    // dequantized, sharded) go into the weight arena, this staging copy does not (freed below a slab's top, it
    // would be lost until the slab goes).
    WeightArenaBypass bypass;
    t = f.read(name);
  } else {
    t = f.get(name);
  }
  return t;
}

Tensor TensorMap::get_checked(const std::string& name, const Shape& shape, std::vector<DType> dtypes) const {
  const TensorInfo& ti = info(name);
  if (!dtypes.empty() && std::find(dtypes.begin(), dtypes.end(), ti.dtype) == dtypes.end()) {
    std::string want;
    for (size_t i = 0; i < dtypes.size(); ++i) want += str_cat(i ? ", " : "", dtype_name(dtypes[i]));
    EXL2_FAIL(ModelFormat, "tensor ", name, " in ", file_of(name), " has dtype ", dtype_name(ti.dtype), ", expected ",
              (dtypes.size() > 1 ? "one of " : ""), want);
  }
  bool ok = ti.shape.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] == -1 || shape[i] == ti.shape[i];
  if (!ok)
    EXL2_FAIL(ModelFormat, "tensor ", name, " in ", file_of(name), " has shape ", shape_str(ti.shape), ", expected ",
              shape_str(shape), " (-1: any size); does config.json match these weights?");
  return get(name);
}

std::vector<std::string> TensorMap::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

const std::string& TensorMap::file_of(const std::string& name) const {
  info(name);
  return files_[where_.at(name)]->path();
}

size_t TensorMap::total_bytes() const {
  size_t total = 0;
  for (const auto& [name, idx] : where_) {
    const TensorInfo* t = files_[idx]->find(name);
    total += t->end - t->begin;
  }
  return total;
}

}  // namespace exl2
