// A validated ApiRequest → what the engine and the response builder need: the prompt ids (chat:
// the model's template rendered natively, tool_choice enforced by a prefill), the generation
// options (request fields over generation_config.json over kdtree's defaults), and the output
// parser's settings. No I/O and no engine: unit-testable with a tokenizer.
#pragma once
#include <cstdint>
#include <list>
#include <nlohmann/json_fwd.hpp>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "grammar/matcher.h"
#include "server/api_request.h"
#include "server/response_builder.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace kd {

// Sampling defaults a checkpoint publishes in generation_config.json (absent fields stay unset).
struct GenerationDefaults {
  std::optional<float> temperature, top_p, min_p;
  std::optional<int32_t> top_k;
  std::optional<int64_t> max_new_tokens;
};
// Reads dir/generation_config.json when it exists; errors name the file and the field.
GenerationDefaults load_generation_defaults(const std::string& dir);

struct ServedModel {
  std::string name;  // the id /v1/models lists and requests must name (or omit)
  const Tokenizer* tokenizer = nullptr;
  ChatTemplateKind chat_template = ChatTemplateKind::kimi;
  int32_t vocab_size = 0;
  int64_t context = 0;  // per-request context limit in tokens
  std::vector<int32_t> eos_ids;
  GenerationDefaults defaults;
  // The tokenizer's vocabulary trie for constrained requests, built on the first one (≈ 0.1 s for
  // Kimi's 163,840 tokens) and shared by every copy of this ServedModel.
  struct LazyVocab {
    std::once_flag once;
    std::shared_ptr<const grammar::VocabTrie> trie;
  };
  std::shared_ptr<LazyVocab> grammar_vocab = std::make_shared<LazyVocab>();
  // Compiled constraints (response_format, grammar, strict tools) by their source, so requests that
  // repeat a schema or a tool set — an agent's every turn — share the compiled grammar and the masks
  // its earlier requests computed (grammar::SharedMasks). The least recently used goes past kEntries:
  // SharedMasks::kDefaultMaxBytes of masks (4 MB) each for the kEntries kept, plus the grammars
  // dropped while requests still run on them (≈ (16 + running requests) × 4 MB at most).
  struct GrammarCache {
    static constexpr size_t kEntries = 16;
    std::mutex mu;
    std::list<std::pair<std::string, grammar::GrammarSpec>> lru;  // most recently used first
    int64_t hits = 0, misses = 0;
    int64_t gone_mask_hits = 0, gone_mask_misses = 0;  // the mask counters of grammars dropped from lru
  };
  std::shared_ptr<GrammarCache> grammar_cache = std::make_shared<GrammarCache>();
};

// The grammar cache's counters for /metrics: compiled grammars found / compiled and kept; masks found
// in a grammar's SharedMasks (another request walked them) / walked, over every grammar cached since
// the start (monotonic); the bytes of masks kept now.
struct GrammarCacheStats {
  int64_t hits = 0, misses = 0, entries = 0;
  int64_t mask_hits = 0, mask_misses = 0, mask_bytes = 0;
};
GrammarCacheStats grammar_cache_stats(const ServedModel& model);

struct PreparedRequest {
  std::vector<int32_t> prompt;
  GenerateOptions gen;
  int32_t top_logprobs = -1;
  ResponseOptions response;  // id, model and created are the caller's to fill
  grammar::GrammarSpec grammar;  // constrained output: the compiled grammar and the vocabulary (else empty)
};

// Throws ApiError: 400 for bad input (exceed_context_size_error when the prompt leaves no room).
PreparedRequest prepare_request(const ApiRequest& req, const ServedModel& model);

// The /tokenize and /detokenize answers for a parsed (depth-bounded) body object; bad fields throw
// ApiError (400) naming them. Pure, so the fuzz target (tests/fuzz/fuzz_tokenize.cpp) runs the same code.
// /tokenize with "messages": the exact prompt a chat request would see (template, tools, thinking).
nlohmann::json tokenize_response(const nlohmann::json& body, const ServedModel& model);
nlohmann::json detokenize_response(const nlohmann::json& body, const ServedModel& model);

}  // namespace kd
