// libFuzzer target: the grammar front ends (issue 20) — GBNF, JSON Schema and regex — must either
// build a grammar or throw kd::Error, never crash, hang or let a library exception escape; a grammar
// that builds is then run: the rest of the input is fed to its matcher byte by byte over a small
// vocabulary (the 256 bytes, a few multi-byte tokens, a stop id), with a mask at every step, and a
// mask must agree with allowed() for every token. A matcher may refuse a grammar too ambiguous to
// match or past its work budget (kd::Error), never run exponentially long. The walk's masks go into a
// SharedMasks, and a second matcher with a memo small enough to be dropped and rebuilt under other
// ids replays the walk reading them: each of its masks must equal the first matcher's.
// Input: byte 0 chooses the front end (mod 3: GBNF, JSON Schema, regex); then the source text up to
// the first NUL; the bytes after it are the walk.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar/gbnf.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "grammar/regex.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace g = kd::grammar;
  static const std::shared_ptr<const g::VocabTrie> vocab = [] {
    std::vector<std::string> v;
    for (int b = 0; b < 256; ++b) v.push_back(std::string(1, char(b)));
    for (const char* t : {"{\"", "\": ", ", \"", "\"}", "true", "null", "\xC3\xA9", "\xE4\xB8", "\xAD!", "ab", "12"}) v.push_back(t);
    v.push_back("<eos>");
    std::vector<bool> special(v.size(), false);
    special.back() = true;
    return std::make_shared<const g::VocabTrie>(v, special);
  }();
  if (size < 1) return 0;
  const int mode = data[0] % 3;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const size_t nul = rest.find('\0');
  const std::string src = rest.substr(0, nul);
  const std::string walk = nul == std::string::npos ? "" : rest.substr(nul + 1);
  std::shared_ptr<const g::CompiledGrammar> cg;
  try {
    if (mode == 0) {
      cg = std::make_shared<const g::CompiledGrammar>(g::parse_gbnf(src));
    } else if (mode == 1) {
      nlohmann::ordered_json schema;
      try {
        schema = nlohmann::ordered_json::parse(src);
      } catch (const nlohmann::json::exception&) {
        return 0;  // not JSON: the server's parser refuses it before the converter sees it
      }
      g::JsonGrammarOptions o;
      o.any_whitespace = (data[0] / 3) % 2 == 0;
      cg = std::make_shared<const g::CompiledGrammar>(g::json_schema_grammar(schema, o));
    } else {
      cg = std::make_shared<const g::CompiledGrammar>(g::regex_grammar(src));
    }
  } catch (const kd::Error&) {
    return 0;
  }
  std::unique_ptr<g::Matcher> mp;
  const auto shared = std::make_shared<g::SharedMasks>(cg, vocab);
  try {
    mp = std::make_unique<g::Matcher>(cg, vocab, std::vector<int32_t>{vocab->vocab_size() - 1}, shared);
  } catch (const kd::Error&) {
    return 0;  // e.g. <[id]> naming a token that is not special here
  }
  g::Matcher& m = *mp;
  m.set_memo_limits(4096, 4096);
  // A quarter of the server's work budget (Matcher::kWorkBurst, kWorkPerToken): a walk then costs at
  // most 2^20 + 64 · 2^14 parser steps (≈ 0.45 s under ASan at the ≈ 0.2 µs a step measured), so a
  // timeout is work the budget does not count — the bug this target looks for — not budgeted work.
  m.set_work_limits(g::Matcher::kWorkBurst / 4, g::Matcher::kWorkPerToken / 4);
  std::vector<std::vector<uint32_t>> masks;
  std::vector<int32_t> committed;
  try {
    for (size_t i = 0; i < walk.size() && i < 64; ++i) {
      const std::vector<uint32_t> mask = m.mask(m.state());
      for (int32_t id = 0; id < vocab->vocab_size(); ++id)
        if (bool((mask[size_t(id) >> 5] >> (id & 31)) & 1) != m.allowed(m.state(), id)) std::abort();
      const int32_t tok = uint8_t(walk[i]) % vocab->vocab_size();
      if (!m.commit(tok)) continue;
      masks.push_back(mask);
      committed.push_back(tok);
    }
  } catch (const kd::Error&) {
    return 0;  // too ambiguous to match (kMaxStacksPerState) or past the work budget: the request fails cleanly
  }
  try {
    g::Matcher again(cg, vocab, std::vector<int32_t>{vocab->vocab_size() - 1}, shared);
    again.set_memo_limits(16, 16);
    again.set_work_limits(g::Matcher::kWorkBurst / 4, g::Matcher::kWorkPerToken / 4);
    for (size_t i = 0; i < committed.size(); ++i) {
      if (again.mask(again.state()) != masks[i]) std::abort();
      if (!again.commit(committed[i])) std::abort();
    }
  } catch (const kd::Error&) {
    return 0;  // the small memo's rebuilds can cost more work than the first walk did
  }
  return 0;
}
