#include "io/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "core/untrusted.h"

namespace kd {

namespace fs = std::filesystem;

std::string where_str(const TensorRef& t) { return cat(t.file->path(), ": tensor '", t.info->name, "'"); }

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  if (!fs::is_directory(dir)) fail(dir, ": not a directory (expected a HuggingFace checkpoint directory)");
  config_ = load_model_config(dir);
  // generation_config.json may name more stop ids (K2-Thinking stops at <|im_end|> 163586, not
  // config.json's [EOS]); a user of the checkpoint expects both honoured.
  if (const std::string gpath = dir + "/generation_config.json"; fs::exists(gpath)) {
    const nlohmann::json j = read_json_file(gpath, kMaxConfigBytes);
    if (!j.is_object()) fail(gpath, ": not a JSON object");
    if (auto e = j.find("eos_token_id"); e != j.end() && !e->is_null()) {
      auto add = [&](const nlohmann::json& v) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= config_.vocab_size)
          fail(gpath, ": eos_token_id ", json_excerpt(v), " is not a token id in [0, ", config_.vocab_size, ")");
        const int32_t id = v.get<int32_t>();
        if (std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(), id) == config_.eos_token_ids.end())
          config_.eos_token_ids.push_back(id);
      };
      if (e->is_array()) {
        for (const auto& v : *e) add(v);
      } else {
        add(*e);
      }
    }
  }

  const std::string index_path = dir + "/model.safetensors.index.json";
  std::vector<std::string> shard_names;
  std::map<std::string, std::string> weight_map;
  if (fs::exists(index_path)) {
    where_ = index_path;
    const nlohmann::json j = read_json_file(index_path, kMaxConfigBytes);
    if (!j.is_object()) fail(index_path, ": not a JSON object");
    auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object()) fail(index_path, ": missing \"weight_map\" object");
    std::set<std::string> seen;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string())
        fail(index_path, ": weight_map entry '", escaped_excerpt(it.key(), 200), "' is not a file name");
      std::string shard = it.value().get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
        fail(index_path, ": weight_map entry '", escaped_excerpt(it.key(), 200), "' names '", escaped_excerpt(shard, 200),
             "', not a file in this directory");
      weight_map[it.key()] = shard;
      if (seen.insert(shard).second) shard_names.push_back(shard);
    }
    for (const auto& s : shard_names)
      if (std::error_code ec; !fs::exists(dir + "/" + s, ec))
        fail(index_path, ": lists shard '", escaped_excerpt(s, 200), "', which is absent from ", dir);
  } else if (fs::exists(dir + "/model.safetensors")) {
    where_ = dir + "/model.safetensors";
    shard_names.push_back("model.safetensors");
  } else {
    fail(dir, ": no model.safetensors and no model.safetensors.index.json");
  }

  // Every shard a regular file before any is opened: a FIFO would block open(), a device would
  // map endless bytes (MappedFile refuses both too, without blocking).
  uint64_t total = 0;
  for (const auto& s : shard_names) {
    const std::string p = dir + "/" + s;
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) fail(p, ": not a regular file (a safetensors shard must be one; symlinks are followed)");
    total += fs::file_size(p, ec);
  }
  Progress progress("mapping shards", shard_names.size(), "files");
  for (const auto& s : shard_names) {
    files_.push_back(std::make_unique<SafetensorsFile>(dir + "/" + s));
    const SafetensorsFile* f = files_.back().get();
    for (const auto& t : f->tensors()) {
      if (!weight_map.empty()) {
        auto it = weight_map.find(t.name);
        if (it == weight_map.end() || it->second != s) continue;  // the index is authoritative
      }
      if (!tensors_.emplace(t.name, TensorRef{&t, f}).second)
        fail(f->path(), ": tensor '", escaped_excerpt(t.name, 200), "' appears in more than one shard");
    }
    progress.add(1);
  }
  progress.finish();
  for (const auto& [name, shard] : weight_map)
    if (!tensors_.count(name))
      fail(index_path, ": lists tensor '", escaped_excerpt(name, 200), "' in '", escaped_excerpt(shard, 200),
           "', but that shard does not hold it");
  log_debug("checkpoint ", dir, ": ", files_.size(), " file(s), ", tensors_.size(), " tensors, ", total, " bytes");
}

const TensorRef* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorRef& Checkpoint::get(const std::string& name) const {
  const TensorRef* t = find(name);
  if (!t) fail(dir_, ": missing tensor '", name, "' (looked in ", where_, ")");
  return *t;
}

const TensorRef& Checkpoint::get(const std::string& name, const std::vector<int64_t>& shape,
                                 std::initializer_list<DType> allowed) const {
  const TensorRef& t = get(name);
  bool ok = false;
  std::string names;
  for (DType d : allowed) {
    ok |= d == t.info->dtype;
    names += cat(names.empty() ? "" : "/", dtype_name(d));
  }
  if (!ok) {
    if (t.info->dtype == DType::F8_E4M3 || t.info->dtype == DType::F8_E5M2)
      fail(where_str(t), " is FP8 (", dtype_name(t.info->dtype), "): FP8 checkpoints such as Kimi-K2-Instruct are not supported");
    fail(where_str(t), " has dtype ", dtype_name(t.info->dtype), ", expected ", names);
  }
  if (t.info->shape != shape) {
    TensorInfo want;
    want.shape = shape;
    fail(where_str(t), " has shape ", t.info->shape_str(), ", expected ", want.shape_str());
  }
  return t;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& f : files_) n += f->file_size();
  return n;
}

}  // namespace kd
