// libFuzzer target: the server's /tokenize and /detokenize bodies, through the same calls as
// HttpServer::handle_tokenize / handle_detokenize (src/server/http_server.cpp; keep in step):
// parse_json (depth-bounded, core/untrusted.h) → with "messages": copy, drop "content", dump,
// parse_api_request(chat) and prepare_request — the exact prompt a chat request would get (issue 21:
// that dump() of a 100,000-level body crashed the server) — else "content" encoded with or without
// special tokens; "tokens" decoded. Everything either answers or throws kd::Error (a 400).
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

void tokenize(const json& body, const kd::ServedModel& m) {
  std::vector<int32_t> ids;
  if (body.contains("messages")) {
    json chat = body;
    chat.erase("content");
    kd::ApiRequest r = kd::parse_api_request(kd::Endpoint::chat, chat.dump());
    r.max_tokens = 1;
    ids = kd::prepare_request(r, m).prompt;
  } else {
    auto it = body.find("content");
    if (it == body.end() || !it->is_string()) return;
    bool parse_special = true;
    if (auto ps = body.find("parse_special"); ps != body.end()) {
      if (!ps->is_boolean()) return;
      parse_special = ps->get<bool>();
    }
    ids = m.tokenizer->encode(it->get<std::string>(), parse_special);
  }
  json out = {{"tokens", ids}, {"count", ids.size()}};
  auto wp = body.find("with_pieces");
  if (wp != body.end() && wp->is_boolean() && wp->get<bool>()) {
    json pieces = json::array();
    for (int32_t id : ids) pieces.push_back({{"id", id}, {"piece", kd::utf8_sanitize(m.tokenizer->token_bytes(id))}});
    out["tokens"] = pieces;
  }
  (void)out.dump();
}

void detokenize(const json& body, const kd::ServedModel& m) {
  auto it = body.find("tokens");
  if (it == body.end() || !it->is_array()) return;
  std::vector<int32_t> ids;
  for (const auto& v : *it) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= m.tokenizer->vocab_size()) return;
    ids.push_back(v.get<int32_t>());
  }
  const std::string text = m.tokenizer->decode(ids);
  if (kd::utf8_sanitize(text) != text) std::abort();
  (void)json{{"content", text}}.dump();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Fixture& f = fixture();
  const std::string text = kdfuzz::json_input(f.templates, data, size);
  for (bool detok : {false, true}) {
    try {
      const json body = kd::parse_json(text, "request body");
      if (!body.is_object()) return 0;
      if (detok) detokenize(body, f.model);
      else tokenize(body, f.model);
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
