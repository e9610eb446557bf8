// libFuzzer target: the tokenizer files of a checkpoint — Kimi's tokenizer_config.json (special
// tokens, next to tests/fixtures/tokenizer-kimi-small's tiktoken.model), DeepSeek's tokenizer.json
// (BPE vocabulary, merges, pre-tokenizer regexes, added tokens) and tokenizer_config.json (its
// chat_template picks the template kind). load_tokenizer and chat_template_for_checkpoint either
// succeed — and the tokenizer then round-trips a short text — or throw kd::Error; never a crash,
// an unbounded recursion or a library exception.
// Input: byte 0 % 3 picks the file (0: Kimi tokenizer_config.json, 1: DeepSeek tokenizer.json,
// 2: DeepSeek tokenizer_config.json); the rest is the file as JSON text when it starts like it, else
// template mode (json_gen.h) over the fixture file. The tokenizer.json template is the fixture cut
// to its first 700 vocabulary entries and the merges among them (the 160 KB original makes a run
// take ~50 ms under ASan; the structure is the same).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.h"
#include "fuzz_common.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace {

struct Fixture {
  kdfuzz::Templates kimi_config, ds_tokenizer, ds_config;
  kdfuzz::ScratchDir scratch;
  std::string kimi_dir, ds_dir;
  std::string ds_tokenizer_text, ds_config_text;  // what a run that fuzzes the other file writes back
};

kdfuzz::ojson small_tokenizer_json(kdfuzz::ojson t) {
  constexpr int64_t kKeep = 700;
  kdfuzz::ojson vocab = kdfuzz::ojson::object();
  for (auto it = t["model"]["vocab"].begin(); it != t["model"]["vocab"].end(); ++it)
    if (it.value().get<int64_t>() < kKeep) vocab[it.key()] = it.value();
  kdfuzz::ojson merges = kdfuzz::ojson::array();
  for (const auto& m : t["model"]["merges"])
    if (vocab.contains(m[0].get<std::string>()) && vocab.contains(m[1].get<std::string>()) &&
        vocab.contains(m[0].get<std::string>() + m[1].get<std::string>()))
      merges.push_back(m);
  kdfuzz::ojson added = kdfuzz::ojson::array();
  int64_t next = kKeep;
  for (auto a : t["added_tokens"])
    if (a["id"].get<int64_t>() >= kKeep) {
      a["id"] = next;
      vocab[a["content"].get<std::string>()] = next++;
      added.push_back(a);
    } else {
      added.push_back(a);
    }
  t["model"]["vocab"] = vocab;
  t["model"]["merges"] = merges;
  t["added_tokens"] = added;
  return t;
}

Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    const std::string kimi = "tests/fixtures/tokenizer-kimi-small", ds = "tests/fixtures/tokenizer-deepseek-small";
    x.kimi_config.add_text(kdfuzz::read_file(kdfuzz::source_path(kimi + "/tokenizer_config.json")));
    const kdfuzz::ojson small = small_tokenizer_json(kdfuzz::ojson::parse(kdfuzz::read_file(kdfuzz::source_path(ds + "/tokenizer.json"))));
    x.ds_tokenizer.add(small);
    x.ds_tokenizer_text = small.dump();
    x.ds_config_text = kdfuzz::read_file(kdfuzz::source_path(ds + "/tokenizer_config.json"));
    x.ds_config.add_text(x.ds_config_text);
    return x;
  }();
  static const bool populated = [] {
    f.kimi_dir = f.scratch.populate("kimi", "tests/fixtures/tokenizer-kimi-small", {"tiktoken.model"});
    f.ds_dir = f.scratch.populate("deepseek", "tests/fixtures/tokenizer-deepseek-small", {});
    return true;
  }();
  (void)populated;
  return f;
}

void check_tokenizer(const std::string& dir) {
  const std::unique_ptr<kd::Tokenizer> tok = kd::load_tokenizer(dir);
  const std::string text = "héllo <|im_end|> 12345 世界";
  for (bool special : {false, true}) {
    const auto ids = tok->encode(text, special);
    for (int32_t id : ids)
      if (id < 0 || id >= tok->vocab_size()) std::abort();
    (void)tok->decode(ids);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  Fixture& f = fixture();
  const int which = data[0] % 3;
  const kdfuzz::Templates& t = which == 0 ? f.kimi_config : which == 1 ? f.ds_tokenizer : f.ds_config;
  const std::string text = kdfuzz::json_input(t, data + 1, size - 1);
  const std::string& dir = which == 0 ? f.kimi_dir : f.ds_dir;
  if (which == 0) {
    kdfuzz::write_file(dir + "/tokenizer_config.json", text);
  } else {
    kdfuzz::write_file(dir + "/tokenizer.json", which == 1 ? text : f.ds_tokenizer_text);
    kdfuzz::write_file(dir + "/tokenizer_config.json", which == 2 ? text : f.ds_config_text);
  }
  try {
    check_tokenizer(dir);
  } catch (const kd::Error&) {
  }
  try {
    (void)kd::chat_template_for_checkpoint(dir);
  } catch (const kd::Error&) {
  }
  return 0;
}
