// safetensors reading: memory-mapped files with fully validated headers, and a TensorMap that merges
// one file, a sharded set (model.safetensors.index.json) or every *.safetensors of a folder (as
// ExLlamaV2 writes them, without an index) into one name -> tensor lookup.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "exl2/json.h"
#include "exl2/tensor.h"

namespace exl2 {

struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  size_t begin = 0;  // byte offsets into the data section (after the header)
  size_t end = 0;
};

class SafetensorsFile {
 public:
  // Maps the file and validates the header: size field within the file, UTF-8 JSON object, known
  // dtypes, offsets inside the data section, sizes == numel * dtype size, no overlapping tensors,
  // no bytes of the data section unaccounted for. Throws ModelFormatError naming the file (Io if unreadable).
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  // __metadata__ string entries.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Zero-copy CPU tensor viewing the mapped bytes (keeps the mapping alive).
  Tensor get(const std::string& name) const;
  // A CPU tensor of its own holding the tensor's bytes, read from the file (Io error when the file got shorter).
  Tensor read(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  const TensorInfo& checked_find(const std::string& name) const;
  std::string path_;
  int fd_ = -1;  // kept open for read()
  void* map_ = nullptr;
  size_t map_size_ = 0;
  size_t data_offset_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::weak_ptr<SafetensorsFile> self_;
};

class TensorMap {
 public:
  // `path` is a .safetensors file, or a folder holding model.safetensors.index.json or *.safetensors.
  static TensorMap open(const std::string& path);

  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // ModelFormatError "missing tensor ..." if absent
  // A zero-copy CPU view of the mapping, or with set_copy(true) a copy read from the file.
  Tensor get(const std::string& name) const;
  // Checked fetch: dtype must be one of `dtypes` (empty = any) and shape must equal `shape`
  // (an entry of -1 matches any size). ModelFormatError naming the tensor otherwise.
  Tensor get_checked(const std::string& name, const Shape& shape, std::vector<DType> dtypes = {}) const;
  std::vector<std::string> names() const;
  const std::string& file_of(const std::string& name) const;
  std::string source() const;  // the file, or the folder of a sharded set (for messages)
  size_t total_bytes() const;  // sum of tensor sizes

  // Copies instead of views: what get() returns then holds no reference to the files, so a model keeps working
  // (and keeps its weights) when a file is truncated or overwritten under it. Loaders for the CPU backend set it.
  void set_copy(bool copy) { copy_ = copy; }

 private:
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // name -> files_ index
  bool copy_ = false;
};

}  // namespace exl2
