// The one reader of shard directories (io/checkpoint.h ShardDir): the target's Checkpoint and the
// DFlash drafter read their tensors through it, and the GPU drafter uploads from a loaded
// DFlashDrafter (model/dflash_cuda.h CudaDFlashWeights), so every check here holds for all three.
// Each case builds a small directory (k25-sharded's shards, or dflash-rope's tensors split into two
// shards), breaks one thing and expects an error naming the file and what is wrong.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/untrusted.h"
#include "decode/dflash_drafter.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/deepseek_v3.h"
#include "model/dflash.h"

namespace kd {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string fixture(const std::string& name) { return std::string(KDTREE_FIXTURES) + "/" + name; }
bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

struct TempDir {
  std::string dir;
  explicit TempDir(const std::string& name) {
    dir = (fs::temp_directory_path() / cat("kdtree_ckpt_", ::getpid(), "_", name)).string();
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TempDir() { fs::remove_all(dir); }
  std::string operator/(const std::string& f) const { return dir + "/" + f; }
};

const char* const kShardA = "model-00001-of-00002.safetensors";
const char* const kShardB = "model-00002-of-00002.safetensors";

// dflash-rope's drafter with its tensors split over two shards and an index naming them; `edit`
// may change the index before it is written (as JSON), or `raw` replaces its text outright.
struct ShardedDrafter : TempDir {
  json index;
  ShardedDrafter(const std::string& name, const std::function<void(json&)>& edit = {}, const std::string& raw = "")
      : TempDir(name) {
    fs::copy_file(fixture("dflash-rope/config.json"), *this / "config.json");
    SafetensorsFile src(fixture("dflash-rope/model.safetensors"));
    SafetensorsWriter a, b;
    index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
    size_t i = 0;
    for (const auto& t : src.tensors()) {
      const bool first = i++ % 2 == 0;
      (first ? a : b).add_bytes(t.name, t.dtype, t.shape, src.data(t));
      index["weight_map"][t.name] = first ? kShardA : kShardB;
    }
    a.write(*this / kShardA);
    b.write(*this / kShardB);
    if (edit) edit(index);
    write_text(*this / "model.safetensors.index.json", raw.empty() ? index.dump(1) : raw);
  }
};

const ModelConfig& drafter_target() {
  static const ModelConfig c = load_model_config(fixture("k2-bf16"));
  return c;
}

std::string drafter_error(const ShardedDrafter& d) {
  return error_of([&] { DFlashDrafter x(d.dir, drafter_target()); });
}

TEST(ShardDir, ReadsThePublishedShardedLayout) {
  const ShardDir s(fixture("k25-sharded"));
  EXPECT_EQ(s.files().size(), 3u);
  EXPECT_TRUE(has(s.where(), "model.safetensors.index.json"));
  const TensorRef& t = s.get("language_model.lm_head.weight");
  EXPECT_TRUE(has(t.file->path(), "model-00003-of-00003.safetensors"));
  EXPECT_EQ(s.find("no.such.tensor"), nullptr);
  EXPECT_TRUE(has(error_of([&] { s.get("no.such.tensor"); }), "missing tensor 'no.such.tensor' (looked in "));
  // Checkpoint reads exactly these tensors (its own config on top).
  const Checkpoint ck(fixture("k25-sharded"));
  EXPECT_EQ(ck.tensors().size(), s.tensors().size());
  EXPECT_EQ(ck.total_bytes(), s.total_bytes());
}

TEST(ShardDir, ADrafterSplitIntoShardsDraftsAsTheSingleFile) {
  ShardedDrafter d("split");
  const ShardDir s(d.dir);
  EXPECT_EQ(s.files().size(), 2u);
  const DFlashDrafter one(fixture("dflash-rope"), drafter_target()), two(d.dir, drafter_target());
  EXPECT_EQ(two.weight_bytes(), one.weight_bytes());
  EXPECT_EQ(two.shards().tensors().size(), one.shards().tensors().size());
  for (const auto& [name, ref] : one.shards().tensors()) {
    const TensorRef& other = two.shards().get(name);
    ASSERT_EQ(other.info->nbytes(), ref.info->nbytes()) << name;
    EXPECT_EQ(std::memcmp(other.data(), ref.data(), ref.info->nbytes()), 0) << name;
  }
}

// The checks every reader of shard directories gets (the GPU drafter's own copy of this code had
// none of them: it followed '../' names, skipped absent tensors and re-read the index unchecked).
TEST(ShardDir, RefusesBrokenIndexesNamingTheFile) {
  const std::string idx = "model.safetensors.index.json";
  {
    ShardedDrafter d("escape", [](json& j) { j["weight_map"]["fc.weight"] = "../model.safetensors"; });
    const std::string e = drafter_error(d);
    EXPECT_TRUE(has(e, idx) && has(e, "'fc.weight' names '../model.safetensors', not a file in this directory")) << e;
  }
  for (const char* bad : {"", ".", "..", "sub/x.safetensors"}) {
    ShardedDrafter d("bad_name", [&](json& j) { j["weight_map"]["fc.weight"] = bad; });
    EXPECT_TRUE(has(drafter_error(d), "not a file in this directory")) << bad;
  }
  {
    ShardedDrafter d("nul", [](json& j) { j["weight_map"]["fc.weight"] = std::string(kShardA) + std::string(1, '\0') + "x"; });
    const std::string e = drafter_error(d);
    EXPECT_TRUE(has(e, "not a file in this directory") && has(e, "\\x00")) << e;
  }
  {
    ShardedDrafter d("absent", [](json& j) { j["weight_map"]["fc.weight"] = "model-00003-of-00002.safetensors"; });
    const std::string e = drafter_error(d);
    EXPECT_TRUE(has(e, idx) && has(e, "lists shard 'model-00003-of-00002.safetensors', which is absent")) << e;
  }
  {
    // Listed under the other shard: that shard does not hold it.
    ShardedDrafter d("wrong_shard", [](json& j) {
      j["weight_map"]["fc.weight"] = j["weight_map"]["fc.weight"] == kShardA ? kShardB : kShardA;
    });
    const std::string e = drafter_error(d);
    EXPECT_TRUE(has(e, idx) && has(e, "lists tensor 'fc.weight'") && has(e, "but that shard does not hold it")) << e;
  }
  {
    ShardedDrafter d("not_string", [](json& j) { j["weight_map"]["fc.weight"] = 7; });
    EXPECT_TRUE(has(drafter_error(d), "weight_map entry 'fc.weight' is not a file name"));
  }
  {
    ShardedDrafter d("no_map", {}, R"({"metadata": {}})");
    EXPECT_TRUE(has(drafter_error(d), "missing \"weight_map\" object"));
  }
  {
    ShardedDrafter d("array", {}, "[]");
    EXPECT_TRUE(has(drafter_error(d), idx + ": not a JSON object"));
  }
  {
    // A tensor listed twice: a JSON parser keeps one silently; the reader refuses.
    ShardedDrafter probe("twice_probe");
    std::string text = probe.index.dump(1);
    const std::string entry = cat("\"fc.weight\": \"", probe.index["weight_map"]["fc.weight"].get<std::string>(), "\"");
    ASSERT_TRUE(has(text, entry));
    text.insert(text.find("\"weight_map\": {") + 15, "\n\"fc.weight\": \"" + std::string(kShardB) + "\",");
    ShardedDrafter d("twice", {}, text);
    const std::string e = drafter_error(d);
    EXPECT_TRUE(has(e, idx) && has(e, "weight_map lists tensor 'fc.weight' twice")) << e;
    ShardedDrafter meta("twice_meta", {}, R"({"metadata": {"a": 1, "a": 2}, "weight_map": {}})");
    EXPECT_TRUE(has(drafter_error(meta), "key 'a' appears twice in one object"));
  }
  {
    std::string deep(100, '[');
    deep += std::string(100, ']');
    ShardedDrafter d("deep", {}, R"({"metadata": )" + deep + R"(, "weight_map": {}})");
    const std::string e = drafter_error(d);
    EXPECT_TRUE(has(e, idx) && has(e, "nests deeper than 64")) << e;
  }
  {
    ShardedDrafter d("oversized");
    fs::resize_file(d / idx, kMaxConfigBytes + 1);
    EXPECT_TRUE(has(drafter_error(d), idx)) << drafter_error(d);
  }
  {
    ShardedDrafter d("shard_is_dir");
    fs::remove(d / kShardB);
    fs::create_directory(d / kShardB);
    const std::string e = drafter_error(d);
    EXPECT_TRUE(has(e, kShardB) && has(e, "not a regular file")) << e;
  }
  {
    TempDir d("empty");
    fs::copy_file(fixture("dflash-rope/config.json"), d / "config.json");
    const std::string e = error_of([&] { DFlashDrafter x(d.dir, drafter_target()); });
    EXPECT_TRUE(has(e, "no model.safetensors and no model.safetensors.index.json")) << e;
    EXPECT_TRUE(has(error_of([&] { ShardDir s(d / "config.json"); }), "not a directory"));
  }
  {
    // The target's Checkpoint: the same reader, the same message.
    TempDir d("target_twice");
    for (const auto& e : fs::directory_iterator(fixture("k25-sharded"))) fs::copy_file(e.path(), d / e.path().filename().string());
    std::string text = read_text_file(d / idx, kMaxConfigBytes);
    text.insert(text.find("\"weight_map\": {") + 15, "\n\"language_model.lm_head.weight\": \"model-00001-of-00003.safetensors\",");
    write_text(d / idx, text);
    const std::string e = error_of([&] { Checkpoint c(d.dir); });
    EXPECT_TRUE(has(e, idx) && has(e, "lists tensor 'language_model.lm_head.weight' twice")) << e;
  }
}

TEST(ShardIndex, ParsesShardsInFirstListedOrder) {
  const ShardIndex i = parse_shard_index(R"({"weight_map": {"b": "s2", "a": "s1", "c": "s2"}})", "idx");
  // nlohmann's json keeps keys sorted: a → s1 comes first.
  EXPECT_EQ(i.shards, (std::vector<std::string>{"s1", "s2"}));
  EXPECT_EQ(i.weight_map.at("c"), "s2");
  EXPECT_TRUE(has(error_of([] { parse_shard_index("{\"weight_map\": {", "idx"); }), "idx: not valid JSON"));
}

// The drafter loaded once: one DFlashDrafter serves every sequence's adapter, and the files are
// not read again.
TEST(DFlashWeights, OneLoadServesManySequences) {
  static Checkpoint ck(fixture("k2-bf16"));
  static DeepseekV3 target(ck);
  const auto shared = DFlashDrafter::load(fixture("dflash-rope"), target.config());
  DFlashAdapter a(shared, target, 64), b(shared, target, 64), alone(fixture("dflash-rope"), target, 64);
  EXPECT_EQ(&a.model(), &b.model());
  EXPECT_EQ(shared.use_count(), 3);
  const DFlashConfig& c = shared->config();
  const int64_t n = 5;
  std::vector<float> taps(size_t(n * c.n_taps() * c.hidden_size));
  for (size_t i = 0; i < taps.size(); ++i) taps[i] = float(int(i % 17) - 8) * 0.125f;
  std::vector<float> la(size_t((c.block_size - 1) * c.vocab_size)), lb = la, lc = la;
  a.append_context(taps.data(), n);
  alone.append_context(taps.data(), n);
  a.draft(3, n, la.data());
  alone.draft(3, n, lc.data());
  EXPECT_EQ(la, lc);  // bit for bit: the same weights, read once
  EXPECT_EQ(b.context_len(), 0);  // b's context is its own
  b.append_context(taps.data(), n);
  b.draft(3, n, lb.data());
  EXPECT_EQ(lb, la);
  // A drafter loaded for another target is refused by the adapter too.
  ModelConfig other = target.config();
  other.hidden_size *= 2;
  EXPECT_TRUE(has(error_of([&] { check_fits_target(c, other, "x/config.json", false); }), "x/config.json: hidden_size"));
}

}  // namespace
}  // namespace kd
