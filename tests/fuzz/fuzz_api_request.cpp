// libFuzzer target: the server's request path short of the engine — parse_api_request (both
// endpoints) → prepare_request (chat template, tool_choice prefill, tokenizer) → ResponseBuilder fed
// the prompt's own ids as if generated, with the request's stop strings and parser settings.
// Input: byte 0 picks the commit size (1…16); the rest is the request body as is when it starts like
// JSON text (the seeds), else template mode (json_gen.h) over tests/fuzz/shapes/ chat and completion
// requests: deep nesting in messages / content / tools[].function.parameters / any extra field
// (issue 21: parse_chat dumped them, recursing once per level), huge numbers, wrong types.
// Checked: nothing but kd::ApiError / kd::Error escapes (a JSON library exception would be a 500 in
// the server, i.e. a bug); errors are 4xx; streamed completions text concatenates to the
// non-streamed text, and every streamed payload is a JSON object.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "server/api_request.h"
#include "server/prepare.h"
#include "server/response_builder.h"
#include "tokenizer/tokenizer.h"

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

const kd::ServedModel& model() {
  static const std::unique_ptr<kd::Tokenizer> tok = kd::load_tokenizer(KDTREE_TOKENIZER_FIXTURE);
  static const kd::ServedModel m = [] {
    kd::ServedModel s;
    s.name = "fuzz";
    s.tokenizer = tok.get();
    s.vocab_size = 4256;
    s.context = 256;
    s.eos_ids = {4001};
    return s;
  }();
  return m;
}

std::string run_builder(const kd::ResponseOptions& o, const std::vector<int32_t>& ids, size_t k) {
  kd::ResponseBuilder b(*model().tokenizer, o);
  std::string text;
  auto take = [&](const std::vector<std::string>& payloads) {
    for (const auto& p : payloads) {
      const auto j = nlohmann::json::parse(p);  // throws (→ abort below) if not JSON
      check(j.is_object());
      if (o.endpoint == kd::Endpoint::completion && j.contains("choices") && !j["choices"].empty())
        text += j["choices"][0]["text"].get<std::string>();
    }
  };
  for (size_t i = 0; i < ids.size() && !b.stop_matched(); i += k) {
    std::vector<int32_t> part(ids.begin() + long(i), ids.begin() + long(std::min(ids.size(), i + k)));
    take(b.add(part));
  }
  kd::RequestStats st;
  const auto fin = b.finish(b.stop_matched() ? "cancelled" : "length", st);
  take(fin);
  if (!o.stream) text = b.text();
  return text;
}

const kdfuzz::Templates& templates() {
  static const kdfuzz::Templates t = [] {
    kdfuzz::Templates x;
    for (const char* f : {"chat-tools", "chat-simple", "chat-named-tool", "chat-required", "completion-text", "completion-ids"})
      x.add_text(kdfuzz::read_file(kdfuzz::source_path(std::string("tests/fuzz/shapes/") + f + ".json")));
    return x;
  }();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t k = 1 + data[0] % 16;
  const std::string body = kdfuzz::json_input(templates(), data + 1, size - 1);
  for (kd::Endpoint ep : {kd::Endpoint::chat, kd::Endpoint::completion}) {
    try {
      const kd::ApiRequest r = kd::parse_api_request(ep, body);
      kd::PreparedRequest p = kd::prepare_request(r, model());
      check(!p.prompt.empty() && int64_t(p.prompt.size()) < model().context);
      std::vector<int32_t> gen(p.prompt.begin(), p.prompt.begin() + long(std::min<size_t>(p.prompt.size(), 64)));
      kd::ResponseOptions o = p.response;
      o.stream = true;
      const std::string streamed = run_builder(o, gen, k);
      o.stream = false;
      const std::string whole = run_builder(o, gen, k);
      if (ep == kd::Endpoint::completion) check(streamed == whole);
    } catch (const kd::ApiError& e) {
      check(e.status >= 400 && e.status < 500);
    } catch (const kd::Error&) {
      // tokenizer / template errors: the server answers 400
    } catch (const std::exception& e) {  // a library exception escaped: the server would answer 500
      std::fprintf(stderr, "escaped exception: %s\n", e.what());
      std::abort();
    } catch (...) {
      std::abort();
    }
  }
  return 0;
}
