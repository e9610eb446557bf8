// libFuzzer target: the server's /tokenize and /detokenize bodies, through the functions its handlers
// call: parse_json (depth-bounded, core/untrusted.h) → tokenize_response / detokenize_response
// (server/prepare.h; with "messages" the exact prompt a chat request would get — issue 21: the dump()
// of a 100,000-level body there crashed the server). Everything either answers or throws kd::Error (a 400).
// Input: JSON text as is (first byte '{', '[', '"' or whitespace), or else template mode (json_gen.h)
// over tests/fuzz/shapes/tokenize-*.json and detokenize.json.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/untrusted.h"
#include "fuzz_common.h"
#include "server/api_request.h"
#include "server/prepare.h"
#include "tokenizer/tokenizer.h"

#ifndef KDTREE_TOKENIZER_FIXTURE
#error "KDTREE_TOKENIZER_FIXTURE must name the tokenizer directory"
#endif

namespace {

using json = nlohmann::json;

struct Fixture {
  kdfuzz::Templates templates;
  std::unique_ptr<kd::Tokenizer> tok;
  kd::ServedModel model;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture x;
    for (const char* s : {"tokenize-chat", "tokenize-content", "detokenize"})
      x.templates.add_text(kdfuzz::read_file(kdfuzz::source_path(std::string("tests/fuzz/shapes/") + s + ".json")));
    x.tok = kd::load_tokenizer(KDTREE_TOKENIZER_FIXTURE);
    x.model.name = "fuzz";
    x.model.tokenizer = x.tok.get();
    x.model.vocab_size = x.tok->vocab_size();
    x.model.context = 256;
    x.model.eos_ids = {4001};
    return x;
  }();
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Fixture& f = fixture();
  const std::string text = kdfuzz::json_input(f.templates, data, size);
  for (bool detok : {false, true}) {
    try {
      const json body = kd::parse_json(text, "request body");
      if (!body.is_object()) return 0;
      if (detok) {
        const std::string content = kd::detokenize_response(body, f.model)["content"].get<std::string>();
        if (kd::utf8_sanitize(content) != content) std::abort();  // /detokenize answers valid UTF-8
      } else {
        (void)kd::tokenize_response(body, f.model).dump();
      }
    } catch (const kd::Error&) {  // ApiError included: the server answers 400
    } catch (const std::exception& e) {  // a library exception escaped: the server would answer 500
      std::fprintf(stderr, "escaped exception: %s\n", e.what());
      std::abort();
    } catch (...) {
      std::abort();
    }
  }
  return 0;
}
