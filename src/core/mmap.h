// Read-only memory map of a whole file. Checkpoints are mapped, never read into heap copies, so a
// 594 GB model costs page cache, not RSS, and tensors are views into the mapping.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace kd {

class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path);  // throws kd::Error naming the file
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kd
