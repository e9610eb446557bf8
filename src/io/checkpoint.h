// Checkpoint directories exactly as published. ShardDir is the one reader of their tensors
// (DESIGN.md §3): model.safetensors, or the shards model.safetensors.index.json names, memory-mapped
// with their headers validated on open (tensor data is not read until a backend touches it). The
// target's Checkpoint and the DFlash drafter (CPU and GPU) both read through it. Checkpoint adds the
// target's config.json (+ generation_config.json) on top.
#pragma once
#include <initializer_list>
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

// The tensors of a checkpoint directory `dir`: model.safetensors, or model.safetensors.index.json
// and the shards its weight_map names (the index wins when both are present, and is authoritative:
// a shard's tensors that the index does not list under that shard are not visible). Throws kd::Error
// naming the file that is wrong when:
//   - dir is not a directory, or holds neither model.safetensors nor an index;
//   - the index is not a JSON object with a "weight_map" object, is larger than kMaxConfigBytes or
//     nests deeper than kMaxJsonDepth (core/untrusted.h), or lists a key twice in one object (a
//     tensor listed twice: JSON parsers keep one of the two silently);
//   - a weight_map value is not a string, or names anything but a file inside dir ("", ".", "..",
//     a '/' or a NUL byte);
//   - a shard the index names is absent (named), or is not a regular file;
//   - a shard's safetensors header is bad (SafetensorsFile), or a tensor the index lists is not in
//     the shard the index names;
//   - without an index: see SafetensorsFile (which refuses duplicate names within a file).
// Every name copied into a message is an escaped excerpt.
class ShardDir {
 public:
  explicit ShardDir(const std::string& dir);
  ShardDir(const ShardDir&) = delete;
  ShardDir& operator=(const ShardDir&) = delete;
  ShardDir(ShardDir&&) noexcept;
  ShardDir& operator=(ShardDir&&) noexcept;
  ~ShardDir();

  const std::string& dir() const { return dir_; }
  // DIR/model.safetensors or DIR/model.safetensors.index.json: what was read, for messages.
  const std::string& where() const { return where_; }
  // nullptr when absent.
  const TensorRef* find(const std::string& name) const;
  // Throws "DIR: missing tensor 'NAME' (looked in WHERE)" when absent.
  const TensorRef& get(const std::string& name) const;
  // Like get, and checks dtype ∈ allowed and the shape; errors name file, tensor, expected vs found.
  const TensorRef& get(const std::string& name, const std::vector<int64_t>& shape,
                       std::initializer_list<DType> allowed) const;
  const std::map<std::string, TensorRef>& tensors() const { return tensors_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  uint64_t total_bytes() const;  // of every shard file

 private:
  std::string dir_, where_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorRef> tensors_;
};

// The published layout's weight_map, checked as ShardDir checks it (the same code): tensor name →
// shard file name, and the shard names in first-listed order. `text` is the index file's content,
// `label` its path. Exposed for tests; ShardDir is the way to read a directory.
struct ShardIndex {
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> shards;
};
ShardIndex parse_shard_index(const std::string& text, const std::string& label);

class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);  // throws kd::Error naming the file that is wrong

  const std::string& dir() const { return shards_.dir(); }
  const ModelConfig& config() const { return config_; }
  const ShardDir& shards() const { return shards_; }
  const TensorRef* find(const std::string& name) const { return shards_.find(name); }
  const TensorRef& get(const std::string& name) const { return shards_.get(name); }
  const TensorRef& get(const std::string& name, const std::vector<int64_t>& shape,
                       std::initializer_list<DType> allowed) const {
    return shards_.get(name, shape, allowed);
  }
  const std::map<std::string, TensorRef>& tensors() const { return shards_.tensors(); }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return shards_.files(); }
  uint64_t total_bytes() const { return shards_.total_bytes(); }

 private:
  ModelConfig config_;  // read before the shards: a wrong config.json is reported first
  ShardDir shards_;
};

// config.json + generation_config.json's extra stop ids, as Checkpoint reads them (no tensors).
ModelConfig load_checkpoint_config(const std::string& dir);

std::string where_str(const TensorRef& t);  // "FILE: tensor 'NAME'"

}  // namespace kd
