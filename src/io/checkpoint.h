// A HuggingFace checkpoint directory exactly as published: config.json plus model.safetensors, or
// shards named by model.safetensors.index.json. Shards are memory-mapped and their headers
// validated on open; tensor data is not read until a backend touches it.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/safetensors.h"

namespace kd {

struct TensorRef {
  const TensorInfo* info = nullptr;
  const SafetensorsFile* file = nullptr;
  const uint8_t* data() const { return file->data(*info); }
};

class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);  // throws kd::Error naming the file that is wrong

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  // nullptr when absent.
  const TensorRef* find(const std::string& name) const;
  // Throws "missing tensor NAME (looked in …)" when absent.
  const TensorRef& get(const std::string& name) const;
  // Like get, and checks dtype ∈ allowed and the shape; errors name file, tensor, expected vs found.
  const TensorRef& get(const std::string& name, const std::vector<int64_t>& shape,
                       std::initializer_list<DType> allowed) const;
  const std::map<std::string, TensorRef>& tensors() const { return tensors_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  uint64_t total_bytes() const;

 private:
  std::string dir_, where_;  // where_: "model.safetensors" or the index file, for messages
  ModelConfig config_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorRef> tensors_;
};

std::string where_str(const TensorRef& t);  // "FILE: tensor 'NAME'"

}  // namespace kd
