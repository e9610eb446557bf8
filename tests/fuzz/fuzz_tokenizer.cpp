// libFuzzer target: the tiktoken tokenizer (tests/fixtures/tokenizer-kimi-small) on arbitrary bytes.
// Encode either throws kd::Error (invalid UTF-8) or returns ids that decode back to the input, with
// and without special-token parsing; decoding any id sequence yields valid UTF-8, and streaming it
// yields the same text. The same bytes also go in as a chat request (messages JSON, tools JSON) for
// every chat template: each renders or throws kd::Error, never anything else (the tools encoder
// and JSON dumps walk request-supplied JSON).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

#ifndef KDTREE_TOKENIZER_FIXTURE
#error "KDTREE_TOKENIZER_FIXTURE must name the tokenizer directory"
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<kd::Tokenizer> tok = kd::load_tokenizer(KDTREE_TOKENIZER_FIXTURE);
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    for (bool special : {false, true}) {
      const std::vector<int32_t> ids = tok->encode(text, special);
      if (tok->decode_bytes(ids) != text) std::abort();
    }
  } catch (const kd::Error&) {
    if (kd::utf8_sanitize(text) == text) std::abort();  // valid UTF-8 must encode
  }
  // The same bytes read as ids (2 bytes each).
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < size; i += 2) ids.push_back(int32_t(data[i] | (data[i + 1] << 8)) % tok->vocab_size());
  const std::string decoded = tok->decode(ids);
  if (kd::utf8_sanitize(decoded) != decoded) std::abort();
  kd::StreamDecoder sd(*tok);
  std::string streamed;
  for (int32_t id : ids) streamed += sd.push(id);
  streamed += sd.flush();
  if (streamed != decoded) std::abort();

  std::vector<kd::ChatMessage> msgs;
  try {
    msgs = kd::chat_messages_from_json(text);
  } catch (const kd::Error&) {
  }
  for (auto kind : {kd::ChatTemplateKind::kimi, kd::ChatTemplateKind::kimi_k2_thinking, kd::ChatTemplateKind::kimi_k25,
                    kd::ChatTemplateKind::kimi_k26, kd::ChatTemplateKind::deepseek_v3}) {
    kd::ChatOptions opts;
    opts.tools_json = text;
    for (bool with_tools : {false, true}) {
      try {
        kd::render_chat(kind, msgs, with_tools ? opts : kd::ChatOptions{});
      } catch (const kd::Error&) {
      }
    }
  }
  return 0;
}
