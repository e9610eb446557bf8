// safetensors: an 8-byte little-endian header length N, N bytes of JSON describing every tensor
// (dtype, shape, [begin, end) byte offsets into the data section), then the data section.
// Reading validates everything a lying or truncated file could get wrong before any byte of
// tensor data is touched; writing streams tensor by tensor so a large model never sits in memory.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/mmap.h"

namespace kd {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section

  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
  std::string shape_str() const;  // "[2048, 896]"
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // in header order
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // 8 + N: where the data section starts in the file
};

// Parses and validates a header from the first `len` bytes of a file of `file_size` bytes
// (len may be less than file_size: only the header is needed). `label` names the file in errors.
// Throws kd::Error on: short file, header length beyond the file or over 100 MB, invalid JSON,
// non-object entries, unknown dtype, negative/overflowing shape, shape × itemsize ≠ byte range,
// range outside the data section, overlapping ranges, duplicate names.
SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, size_t len, uint64_t file_size,
                                           const std::string& label);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // mmap + validate
  const std::string& path() const { return map_.path(); }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const TensorInfo* find(const std::string& name) const;
  const uint8_t* data(const TensorInfo& t) const { return map_.data() + header_.data_offset + t.begin; }
  uint64_t file_size() const { return map_.size(); }

 private:
  MappedFile map_;
  SafetensorsHeader header_;
  std::map<std::string, size_t> index_;
};

// Streams a safetensors file: declare every tensor, then write() calls each fill function once,
// in order, with a buffer of exactly that tensor's size.
class SafetensorsWriter {
 public:
  using Fill = std::function<void(uint8_t* dst, uint64_t nbytes)>;
  void add(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill);
  void add_bytes(std::string name, DType dtype, std::vector<int64_t> shape, const void* data);
  void set_metadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }
  uint64_t total_bytes() const { return total_; }
  size_t size() const { return pending_.size(); }
  // on_bytes (optional) is told how many bytes each tensor added, for a progress bar.
  void write(const std::string& path, const std::function<void(uint64_t)>& on_bytes = {});

 private:
  struct Pending {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    uint64_t nbytes;
    Fill fill;
  };
  std::vector<Pending> pending_;
  std::map<std::string, std::string> metadata_;
  uint64_t total_ = 0;
};

}  // namespace kd
