#include "model/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/int4.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "core/untrusted.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/deepseek_v3.h"

namespace fs = std::filesystem;

namespace kd {

void ct_quantize_row_bf16(const uint16_t* w, int64_t cols, int32_t group, int8_t* q, uint16_t* scales) {
  for (int64_t g = 0; g * group < cols; ++g) {
    const int64_t c0 = g * group, c1 = std::min<int64_t>(cols, c0 + group);
    float absmax = 0;  // exact: a bf16 value
    for (int64_t c = c0; c < c1; ++c) absmax = std::max(absmax, std::fabs(bf16_to_f32(w[c])));
    // torch's bf16 division: both operands widened to fp32, the quotient rounded to bf16 (RNE).
    uint16_t sb = f32_to_bf16(absmax / 7.5f);
    if (sb == 0 || sb == 0x8000) sb = 0x3c00;  // torch.finfo(bfloat16).eps = 2^-7
    scales[g] = sb;
    const float s = bf16_to_f32(sb);
    for (int64_t c = c0; c < c1; ++c) {
      const float scaled = bf16_to_f32(f32_to_bf16(bf16_to_f32(w[c]) / s));  // bf16 tensor op
      q[c] = int8_t(std::nearbyint(std::clamp(scaled, -8.0f, 7.0f)));        // torch.round: half to even
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Ignore lists

IgnoreList::IgnoreList(std::vector<std::string> patterns) : patterns_(std::move(patterns)) {
  for (const auto& p : patterns_) {
    if (p.empty()) fail("--ignore: an empty pattern (give a module name or re:REGEX)");
    if (p.rfind("re:", 0) == 0) {
      if (p.size() == 3) fail("--ignore '", p, "': empty regular expression after re:");
      try {
        re_.emplace_back(p, Regex(p.substr(3)));
      } catch (const Error& e) {
        fail("--ignore '", escaped_excerpt(p, 200), "': not a valid regular expression: ", e.what());
      }
      continue;
    }
    // An exact module name: word characters and dots. Anything else is another syntax (a glob,
    // a regex without its prefix) that compressed-tensors would compare literally and never match.
    for (char ch : p) {
      const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                      ch == '.' || ch == '-';
      if (!ok)
        fail("--ignore '", escaped_excerpt(p, 200), "': unknown pattern syntax (character '", escaped_excerpt(std::string(1, ch)),
             "'); compressed-tensors takes an exact module name such as model.layers.3.mlp.experts.7.down_proj or a "
             "regular expression written re:REGEX (matched at the start of the name, as Python's re.match), e.g. "
             "'re:.*shared_experts.*'");
    }
    exact_.push_back(p);
  }
}

bool IgnoreList::matches(const std::string& module) const {
  for (const auto& e : exact_)
    if (e == module) return true;
  for (const auto& [p, re] : re_)
    if (re.match_prefix(module)) return true;
  return false;
}

std::vector<std::string> IgnoreList::unmatched(const std::vector<std::string>& modules) const {
  std::vector<std::string> out;
  for (const auto& e : exact_)
    if (std::find(modules.begin(), modules.end(), e) == modules.end()) out.push_back(e);
  for (const auto& [p, re] : re_) {
    bool any = false;
    for (const auto& m : modules) any = any || re.match_prefix(m);
    if (!any) out.push_back(p);
  }
  return out;
}

std::vector<std::string> kimi_ignore_list() {
  return {"lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"};
}

bool is_linear_weight(const std::string& tensor, const std::vector<int64_t>& shape, const std::string& text_prefix) {
  if (shape.size() != 2) return false;
  const std::string suffix = ".weight";
  if (tensor.size() <= suffix.size() || tensor.compare(tensor.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  const std::string module = tensor.substr(0, tensor.size() - suffix.size());
  // lm_head sits beside the text model: "lm_head" or "language_model.lm_head".
  const std::string outer = text_prefix.size() >= 6 ? text_prefix.substr(0, text_prefix.size() - 6) : "";  // minus "model."
  if (module == outer + "lm_head") return true;
  if (module.rfind(text_prefix, 0) != 0) return false;
  const size_t dot = module.rfind('.');
  const std::string leaf = module.substr(dot + 1);
  return leaf == "kv_a_proj_with_mqa" || (leaf.size() > 5 && leaf.compare(leaf.size() - 5, 5, "_proj") == 0);
}

namespace {

// safetensors' Dtype enum order (BOOL … U64); save_file sorts by it descending, then by name.
int safetensors_rank(DType t) {
  switch (t) {
    case DType::BOOL: return 0;
    case DType::U8: return 4;
    case DType::I8: return 5;
    case DType::F8_E5M2: return 6;
    case DType::F8_E4M3: return 7;
    case DType::I16: return 9;
    case DType::F16: return 11;
    case DType::BF16: return 12;
    case DType::I32: return 13;
    case DType::F32: return 15;
    case DType::F64: return 17;
    case DType::I64: return 18;
  }
  return 0;
}

}  // namespace

bool safetensors_order_less(DType a, const std::string& na, DType b, const std::string& nb) {
  const int ra = safetensors_rank(a), rb = safetensors_rank(b);
  if (ra != rb) return ra > rb;
  return na < nb;
}

namespace {

nlohmann::ordered_json quant_config(int32_t group, const std::vector<std::string>& ignore) {
  // Key order as compressed-tensors' QuantizationConfig dumps it into Kimi's config.json (sorted).
  nlohmann::ordered_json weights = {{"actorder", nullptr},  {"block_structure", nullptr}, {"dynamic", false},
                                    {"group_size", group},  {"num_bits", 4},              {"observer", "minmax"},
                                    {"observer_kwargs", nlohmann::ordered_json::object()},
                                    {"strategy", "group"},  {"symmetric", true},          {"type", "int"}};
  nlohmann::ordered_json g0 = {{"input_activations", nullptr}, {"output_activations", nullptr},
                               {"targets", {"Linear"}},        {"weights", weights}};
  return {{"config_groups", {{"group_0", g0}}},
          {"format", "pack-quantized"},
          {"ignore", ignore},
          {"kv_cache_scheme", nullptr},
          {"quant_method", "compressed-tensors"},
          {"quantization_status", "compressed"}};
}

// One tensor of the output: copied from the input, or one of a quantised module's three.
struct OutTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes;
  const TensorRef* src;  // the input tensor (the bf16 weight for the quantised three)
  enum Kind { copy, packed, scale, shape_vec } kind;
};

std::string shard_name(int64_t i, int64_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05lld-of-%05lld.safetensors", (long long)i + 1, (long long)n);
  return buf;
}

void check_finite_row(const uint16_t* w, int64_t cols, const TensorRef& t, int64_t row) {
  for (int64_t c = 0; c < cols; ++c)
    if ((w[c] & 0x7f80) == 0x7f80)
      fail(where_str(t), ": element [", row, ", ", c, "] is ", (w[c] & 0x7f) ? "NaN" : "infinite",
           "; a non-finite weight has no INT4 scale");
}

}  // namespace

std::string quantization_config_json(int32_t group, const std::vector<std::string>& ignore) {
  return quant_config(group, ignore).dump(2);
}

QuantizeResult quantize_checkpoint(const QuantizeOptions& o) {
  const double t0 = now_s();
  if (o.group < 8 || o.group % 8 != 0 || o.group > 65536)
    fail("--group ", o.group, ": the group size must be a multiple of 8 (whole int32 words of nibbles), e.g. 32 or 128");
  if (o.max_shard_bytes < 4096) fail("--max-shard-size must be at least 4 KiB");
  std::error_code ec;
  if (fs::exists(o.out_dir, ec)) {
    if (!fs::is_directory(o.out_dir, ec)) fail(o.out_dir, ": exists and is not a directory");
    if (!fs::is_empty(o.out_dir, ec)) fail(o.out_dir, ": output directory is not empty (refusing to overwrite)");
    if (fs::equivalent(o.out_dir, o.model_dir, ec)) fail(o.out_dir, ": the output directory is the input");
  }

  // Everything is validated before a byte is written: config, every tensor the forward needs.
  Checkpoint ck(o.model_dir);
  const ModelConfig& cfg = ck.config();
  if (cfg.quant.enabled)
    fail(o.model_dir, "/config.json: already has a quantization_config (the checkpoint is quantised); quantize reads bf16 checkpoints");
  DeepseekV3 model_check(ck);  // names, dtypes and shapes of every tensor the model reads
  (void)model_check;

  const IgnoreList ignore(o.ignore.empty() ? kimi_ignore_list() : o.ignore);
  std::vector<std::string> linear_modules;
  for (const auto& [name, ref] : ck.tensors())
    if (is_linear_weight(name, ref.info->shape, cfg.tensor_prefix)) linear_modules.push_back(name.substr(0, name.size() - 7));
  if (o.ignore_given) {
    const auto none = ignore.unmatched(linear_modules);
    if (!none.empty())
      fail("--ignore '", escaped_excerpt(none.front(), 200), "' matches no Linear module of ", o.model_dir,
           " (modules are named like ", linear_modules.empty() ? std::string("model.layers.0.self_attn.o_proj") : linear_modules.front(),
           "; regexes need the re: prefix)");
  }

  // The output tensors in input-name order; a quantised module's three stay together.
  std::vector<OutTensor> outs;
  QuantizeResult res;
  for (const auto& [name, ref] : ck.tensors()) {
    const TensorInfo& ti = *ref.info;
    res.bytes_in += ti.nbytes();
    const bool linear = is_linear_weight(name, ti.shape, cfg.tensor_prefix);
    const std::string module = linear ? name.substr(0, name.size() - 7) : "";
    if (!linear || ignore.matches(module)) {
      outs.push_back({name, ti.dtype, ti.shape, ti.nbytes(), &ref, OutTensor::copy});
      ++res.n_copied;
      continue;
    }
    if (ti.dtype != DType::BF16)
      fail(where_str(ref), " is ", dtype_name(ti.dtype), ": quantize reads bf16 weights (what compressed-tensors' "
           "bf16 flow quantises); convert the checkpoint to bf16 first, or --ignore this module");
    const int64_t rows = ti.shape[0], cols = ti.shape[1];
    if (cols % o.group != 0)
      fail(where_str(ref), " has ", cols, " input columns, not a multiple of --group ", o.group,
           " (compressed-tensors requires it); --ignore this module or pick another group size");
    outs.push_back({module + ".weight_packed", DType::I32, {rows, cols / 8}, uint64_t(rows) * uint64_t(cols / 8) * 4, &ref, OutTensor::packed});
    outs.push_back({module + ".weight_scale", DType::BF16, {rows, cols / o.group}, uint64_t(rows) * uint64_t(cols / o.group) * 2, &ref, OutTensor::scale});
    // compressed-tensors stores torch.tensor(weight.shape): int64 (Kimi's published files have int32).
    outs.push_back({module + ".weight_shape", DType::I64, {2}, 16, &ref, OutTensor::shape_vec});
    ++res.n_quantized;
  }

  // Shards: greedy in that order up to max_shard_bytes (a module never split).
  std::vector<std::vector<const OutTensor*>> shards(1);
  uint64_t cur = 0;
  for (size_t i = 0; i < outs.size();) {
    size_t j = i + (outs[i].kind == OutTensor::copy ? 1 : 3);
    uint64_t b = 0;
    for (size_t k = i; k < j; ++k) b += outs[k].nbytes;
    if (cur > 0 && cur + b > o.max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    for (size_t k = i; k < j; ++k) shards.back().push_back(&outs[k]);
    cur += b;
    i = j;
  }
  const int64_t n_shards = int64_t(shards.size());
  for (auto& s : shards)
    std::sort(s.begin(), s.end(), [](const OutTensor* a, const OutTensor* b) {
      return safetensors_order_less(a->dtype, a->name, b->dtype, b->name);
    });

  const bool created = !fs::exists(o.out_dir, ec);
  fs::create_directories(o.out_dir, ec);
  if (ec) fail(o.out_dir, ": cannot create the output directory: ", ec.message());
  try {
    uint64_t total_out = 0;
    for (const auto& t : outs) total_out += t.nbytes;
    Progress bar("quantize", total_out, "B");
    const int32_t group = o.group;
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    std::map<std::string, std::string> wm_sorted;
    for (int64_t si = 0; si < n_shards; ++si) {
      const std::string fname = n_shards == 1 ? std::string("model.safetensors") : shard_name(si, n_shards);
      SafetensorsWriter w;
      w.set_metadata("format", "pt");  // what save_pretrained / save_file(metadata=...) write
      for (const OutTensor* t : shards[size_t(si)]) {
        wm_sorted[t->name] = fname;
        const TensorRef* src = t->src;
        const OutTensor::Kind kind = t->kind;
        w.add(t->name, t->dtype, t->shape, [src, kind, group](uint8_t* dst, uint64_t nbytes) {
          const TensorInfo& ti = *src->info;
          if (kind == OutTensor::copy) {
            std::memcpy(dst, src->data(), nbytes);
            return;
          }
          const int64_t rows = ti.shape[0], cols = ti.shape[1];
          if (kind == OutTensor::shape_vec) {
            const int64_t v[2] = {rows, cols};
            std::memcpy(dst, v, 16);
            return;
          }
          // Rows are independent (groups run along a row): quantised in parallel, each written to its
          // own place, so the bytes do not depend on the thread count. A bad row fails the run with
          // the message of the first one in row order, as a serial loop would.
          const uint8_t* base = src->data();
          std::mutex mu;
          int64_t bad_row = -1;
          std::string bad_msg;
          ThreadPool::global().parallel_for(rows, 16, [&](int64_t r0, int64_t r1) {
            std::vector<uint16_t> row(static_cast<size_t>(cols)), scales(static_cast<size_t>(cols / group));
            std::vector<int8_t> digits(static_cast<size_t>(cols));
            std::vector<uint32_t> words(static_cast<size_t>(cols / 8));
            for (int64_t r = r0; r < r1; ++r) {
              try {
                std::memcpy(row.data(), base + uint64_t(r) * uint64_t(cols) * 2, size_t(cols) * 2);  // may be unaligned
                check_finite_row(row.data(), cols, *src, r);
              } catch (const std::exception& e) {
                std::lock_guard<std::mutex> lk(mu);
                if (bad_row < 0 || r < bad_row) bad_row = r, bad_msg = e.what();
                return;
              }
              ct_quantize_row_bf16(row.data(), cols, group, digits.data(), scales.data());
              if (kind == OutTensor::scale) {
                std::memcpy(dst + uint64_t(r) * uint64_t(cols / group) * 2, scales.data(), size_t(cols / group) * 2);
              } else {
                pack_int4_row(digits.data(), cols, words.data());
                std::memcpy(dst + uint64_t(r) * uint64_t(cols / 8) * 4, words.data(), size_t(cols / 8) * 4);
              }
            }
          });
          if (bad_row >= 0) fail(bad_msg);
        });
      }
      res.bytes_out += w.total_bytes();
      w.write(o.out_dir + "/" + fname, [&bar](uint64_t n) { bar.add(n); });
      res.shard_names.push_back(fname);
    }
    bar.finish();
    res.n_shards = n_shards;
    if (n_shards > 1) {
      for (const auto& [k, v] : wm_sorted) weight_map[k] = v;
      nlohmann::ordered_json idx = {{"metadata", {{"total_size", res.bytes_out}}}, {"weight_map", weight_map}};
      const std::string s = idx.dump(2) + "\n";
      std::FILE* f = std::fopen((o.out_dir + "/model.safetensors.index.json").c_str(), "wb");
      if (!f || std::fwrite(s.data(), 1, s.size(), f) != s.size() || std::fclose(f) != 0)
        fail(o.out_dir, "/model.safetensors.index.json: write failed");
    }

    // config.json: the input's, in its key order, with the quantization_config (also inside
    // text_config for the K2.5 wrapper, as Kimi publishes it).
    const std::string cpath = o.model_dir + "/config.json";
    nlohmann::ordered_json cj = parse_ordered_json(read_text_file(cpath, kMaxConfigBytes), cpath);
    const auto qc = quant_config(o.group, ignore.patterns());
    cj["quantization_config"] = qc;
    if (cj.contains("text_config") && cj["text_config"].is_object()) cj["text_config"]["quantization_config"] = qc;
    const std::string cs = cj.dump(2) + "\n";
    std::FILE* f = std::fopen((o.out_dir + "/config.json").c_str(), "wb");
    if (!f || std::fwrite(cs.data(), 1, cs.size(), f) != cs.size() || std::fclose(f) != 0) fail(o.out_dir, "/config.json: write failed");

    // Every other file as is (tokenizer, generation_config.json, chat template, code, …).
    std::set<std::string> skip = {"config.json", "model.safetensors.index.json"};
    for (const auto& file : ck.files()) skip.insert(fs::path(file->path()).filename().string());
    for (const auto& e : fs::directory_iterator(o.model_dir)) {
      const std::string n = e.path().filename().string();
      if (skip.count(n)) continue;
      fs::copy(e.path(), fs::path(o.out_dir) / n, fs::copy_options::recursive);
      ++res.n_other_files;
    }
  } catch (...) {
    // No half-written checkpoint is left to be mistaken for a whole one.
    if (created) fs::remove_all(o.out_dir, ec);
    throw;
  }
  res.seconds = now_s() - t0;
  return res;
}

}  // namespace kd
