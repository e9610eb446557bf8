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
using json = nlohmann::json;

std::string where_str(const TensorRef& t) { return cat(t.file->path(), ": tensor '", t.info->name, "'"); }

namespace {

// A SAX pass over already-validated JSON that stops at the first key an object holds twice.
// nlohmann (like Python's json) keeps one of the two silently, so an index listing a tensor under
// two shards would load whichever came last.
struct DuplicateKeys final : nlohmann::json_sax<json> {
  struct Frame {
    bool object = false, weight_map = false;
    std::set<std::string> keys;
  };
  std::vector<Frame> stack;
  std::string last_key;  // the key just read in the innermost object
  bool found = false, in_weight_map = false;
  std::string duplicate;

  bool value() { return true; }
  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override {
    Frame f;
    f.object = true;
    f.weight_map = stack.size() == 1 && stack.back().object && last_key == "weight_map";
    stack.push_back(std::move(f));
    return true;
  }
  bool key(string_t& k) override {
    Frame& f = stack.back();
    if (!f.keys.insert(k).second) {
      found = true;
      in_weight_map = f.weight_map;
      duplicate = k;
      return false;  // stop parsing
    }
    last_key = k;
    return true;
  }
  bool end_object() override {
    stack.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    stack.push_back(Frame{});
    return true;
  }
  bool end_array() override {
    stack.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

bool is_plain_file_name(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos && s.find('\0') == std::string::npos;
}

}  // namespace

ShardIndex parse_shard_index(const std::string& text, const std::string& label) {
  const json j = parse_json(text, label);  // depth-bounded; the caller read at most kMaxConfigBytes
  if (!j.is_object()) fail(label, ": not a JSON object");
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object()) fail(label, ": missing \"weight_map\" object");
  {
    DuplicateKeys dup;
    json::sax_parse(text, &dup);
    if (dup.found) {
      if (dup.in_weight_map)
        fail(label, ": weight_map lists tensor '", escaped_excerpt(dup.duplicate, 200), "' twice");
      fail(label, ": key '", escaped_excerpt(dup.duplicate, 200), "' appears twice in one object");
    }
  }
  ShardIndex out;
  std::set<std::string> seen;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string())
      fail(label, ": weight_map entry '", escaped_excerpt(it.key(), 200), "' is not a file name");
    std::string shard = it.value().get<std::string>();
    if (!is_plain_file_name(shard))
      fail(label, ": weight_map entry '", escaped_excerpt(it.key(), 200), "' names '", escaped_excerpt(shard, 200),
           "', not a file in this directory");
    if (seen.insert(shard).second) out.shards.push_back(shard);
    out.weight_map.emplace(it.key(), std::move(shard));
  }
  return out;
}

ShardDir::ShardDir(ShardDir&&) noexcept = default;
ShardDir& ShardDir::operator=(ShardDir&&) noexcept = default;
ShardDir::~ShardDir() = default;

ShardDir::ShardDir(const std::string& dir) : dir_(dir) {
  if (std::error_code ec; !fs::is_directory(dir, ec)) fail(dir, ": not a directory");
  const std::string index_path = dir + "/model.safetensors.index.json";
  const std::string single_path = dir + "/model.safetensors";
  ShardIndex index;
  bool indexed = false;
  if (std::error_code ec; fs::exists(index_path, ec)) {
    where_ = index_path;
    indexed = true;
    index = parse_shard_index(read_text_file(index_path, kMaxConfigBytes), index_path);
    for (const auto& s : index.shards)
      if (std::error_code shard_ec; !fs::exists(dir + "/" + s, shard_ec))
        fail(index_path, ": lists shard '", escaped_excerpt(s, 200), "', which is absent from ", dir);
  } else if (std::error_code single_ec; fs::exists(single_path, single_ec)) {
    where_ = single_path;
    index.shards.push_back("model.safetensors");
  } else {
    fail(dir, ": no model.safetensors and no model.safetensors.index.json");
  }

  // Every shard a regular file before any is opened: a FIFO would block open(), a device would
  // map endless bytes (MappedFile refuses both too, without blocking).
  uint64_t total = 0;
  for (const auto& s : index.shards) {
    const std::string p = dir + "/" + s;
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) fail(p, ": not a regular file (a safetensors shard must be one; symlinks are followed)");
    total += fs::file_size(p, ec);
  }
  Progress progress("mapping shards", index.shards.size(), "files");
  for (const auto& s : index.shards) {
    files_.push_back(std::make_unique<SafetensorsFile>(dir + "/" + s));
    const SafetensorsFile* f = files_.back().get();
    for (const auto& t : f->tensors()) {
      if (indexed) {
        auto it = index.weight_map.find(t.name);
        if (it == index.weight_map.end() || it->second != s) continue;  // the index is authoritative
      }
      if (!tensors_.emplace(t.name, TensorRef{&t, f}).second)
        fail(f->path(), ": tensor '", escaped_excerpt(t.name, 200), "' appears in more than one shard");
    }
    progress.add(1);
  }
  progress.finish();
  for (const auto& [name, shard] : index.weight_map)
    if (!tensors_.count(name))
      fail(index_path, ": lists tensor '", escaped_excerpt(name, 200), "' in '", escaped_excerpt(shard, 200),
           "', but that shard does not hold it");
  log_debug("shards ", dir, ": ", files_.size(), " file(s), ", tensors_.size(), " tensors, ", total, " bytes");
}

const TensorRef* ShardDir::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorRef& ShardDir::get(const std::string& name) const {
  const TensorRef* t = find(name);
  if (!t) fail(dir_, ": missing tensor '", name, "' (looked in ", where_, ")");
  return *t;
}

const TensorRef& ShardDir::get(const std::string& name, const std::vector<int64_t>& shape,
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

uint64_t ShardDir::total_bytes() const {
  uint64_t n = 0;
  for (const auto& f : files_) n += f->file_size();
  return n;
}

ModelConfig load_checkpoint_config(const std::string& dir) {
  if (std::error_code ec; !fs::is_directory(dir, ec))
    fail(dir, ": not a directory (expected a HuggingFace checkpoint directory)");
  ModelConfig config = load_model_config(dir);
  // generation_config.json may name more stop ids (K2-Thinking stops at <|im_end|> 163586, not
  // config.json's [EOS]); a user of the checkpoint expects both honoured.
  const std::string gpath = dir + "/generation_config.json";
  if (std::error_code ec; fs::exists(gpath, ec)) {
    const json j = read_json_file(gpath, kMaxConfigBytes);
    if (!j.is_object()) fail(gpath, ": not a JSON object");
    if (auto e = j.find("eos_token_id"); e != j.end() && !e->is_null()) {
      auto add = [&](const json& v) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= config.vocab_size)
          fail(gpath, ": eos_token_id ", json_excerpt(v), " is not a token id in [0, ", config.vocab_size, ")");
        const int32_t id = v.get<int32_t>();
        if (std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(), id) == config.eos_token_ids.end())
          config.eos_token_ids.push_back(id);
      };
      if (e->is_array()) {
        for (const auto& v : *e) add(v);
      } else {
        add(*e);
      }
    }
  }
  return config;
}

Checkpoint::Checkpoint(const std::string& dir) : config_(load_checkpoint_config(dir)), shards_(dir) {}

}  // namespace kd
