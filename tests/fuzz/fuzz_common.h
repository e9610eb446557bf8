// Shared by the libFuzzer targets: fixture and template loading, and a per-process scratch
// directory for the entry points that only take a checkpoint directory (the index, generation_config,
// a drafter's config.json). KDTREE_SOURCE_DIR is the repository root (set by CMakeLists.txt).
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "json_gen.h"

#ifndef KDTREE_SOURCE_DIR
#error "KDTREE_SOURCE_DIR must name the repository root"
#endif

namespace kdfuzz {

inline std::string source_path(const std::string& rel) { return std::string(KDTREE_SOURCE_DIR) + "/" + rel; }

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "fuzz: cannot read %s\n", path.c_str());
    std::abort();
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline void write_file(const std::string& path, std::string_view text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(text.data(), std::streamsize(text.size()));
  if (!f) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// The JSON header of a safetensors file (its 8-byte length prefix and the data stripped).
inline std::string safetensors_header_text(const std::string& file_bytes) {
  uint64_t n = 0;
  std::memcpy(&n, file_bytes.data(), 8);
  return file_bytes.substr(8, n);
}

// A scratch directory of this process (each -jobs worker has its own), removed at exit. A crash
// leaves it behind under $TMPDIR as kdtree-fuzz-*: it holds copies of fixtures only.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/kdtree-fuzz-XXXXXX";
    if (!mkdtemp(pattern.data())) {
      std::perror("fuzz: mkdtemp");
      std::abort();
    }
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(ScratchDir&& o) noexcept : path_(std::move(o.path_)) { o.path_.clear(); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  // A subdirectory holding copies of `files` from the repository-relative `from` folder.
  std::string populate(const std::string& sub, const std::string& from, std::initializer_list<const char*> files) const {
    const std::string d = path_ + "/" + sub;
    std::filesystem::create_directories(d);
    for (const char* f : files) std::filesystem::copy_file(source_path(from + "/" + f), d + "/" + f);
    return d;
  }

 private:
  std::string path_;
};

}  // namespace kdfuzz
