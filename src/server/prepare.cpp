#include "server/prepare.h"

#include "grammar/gbnf.h"
#include "grammar/json_schema.h"
#include "server/tool_grammar.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/untrusted.h"

namespace kd {

using json = nlohmann::json;

GenerationDefaults load_generation_defaults(const std::string& dir) {
  GenerationDefaults d;
  const std::string path = dir + "/generation_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return d;
  const json j = parse_json(read_text_file(path, kMaxConfigBytes), path);
  if (!j.is_object()) fail(path, ": not a JSON object");
  // Every value is range-checked before it is converted (a double beyond int32 is undefined behaviour).
  auto number = [&](const char* key, double lo, double hi) -> std::optional<double> {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (!it->is_number()) fail(path, ": '", key, "' is not a number (found ", json_excerpt(*it), ")");
    const double v = it->get<double>();
    if (!(v >= lo && v <= hi)) fail(path, ": '", key, "' = ", v, " is out of range [", lo, ", ", hi, "]");
    return v;
  };
  // do_sample: false means greedy whatever temperature says (transformers' rule).
  const bool greedy = j.contains("do_sample") && j["do_sample"].is_boolean() && !j["do_sample"].get<bool>();
  if (auto v = number("temperature", 0, 1e6)) d.temperature = greedy ? 0.0f : float(*v);
  else if (greedy) d.temperature = 0.0f;
  if (auto v = number("top_p", 0, 1)) d.top_p = float(*v);
  if (auto v = number("min_p", 0, 1)) d.min_p = float(*v);
  if (auto v = number("top_k", -1, 2147483647.0)) d.top_k = int32_t(*v);
  if (auto v = number("max_new_tokens", 0, 9e15)) d.max_new_tokens = int64_t(*v);
  SamplingParams p;
  p.temperature = d.temperature.value_or(0.0f);
  p.top_p = d.top_p.value_or(1.0f);
  p.min_p = d.min_p.value_or(0.0f);
  p.top_k = d.top_k.value_or(0);
  try {
    validate(p);
  } catch (const Error& e) {
    fail(path, ": ", e.what());
  }
  return d;
}

namespace {

std::vector<int32_t> stop_ids_for(const ApiRequest& req, const ServedModel& m) {
  std::vector<int32_t> ids = m.eos_ids;
  if (req.endpoint == Endpoint::chat)
    for (const auto& name : chat_stop_tokens(m.chat_template))
      if (auto id = m.tokenizer->special_id(name))
        if (std::find(ids.begin(), ids.end(), *id) == ids.end()) ids.push_back(*id);
  return ids;
}

// response_format / grammar → the compiled grammar (a 400 naming the schema path or the GBNF line)
// and the tokenizer's trie. JSON is written with the separators json.dumps uses (", " and ": "), so
// a model is never free to pad with whitespace until max_tokens.
grammar::GrammarSpec compile_constraint(const ApiRequest& req, const ServedModel& m, const std::string& tool_gbnf) {
  namespace gr = kd::grammar;
  const std::string param = !tool_gbnf.empty() ? "tools" : req.constraint == ApiRequest::Constraint::gbnf ? "grammar" : "response_format";
  // What the grammar is a function of: the kind, strict, and the source (the tools' grammar is text).
  const std::string key = cat(int(req.constraint), req.constraint_strict ? "s" : "-", '\0', req.constraint_source, '\0', tool_gbnf);
  ServedModel::GrammarCache& cache = *m.grammar_cache;
  // (Under cache.mu.) The entry for key, made the most recent, or null.
  auto cached = [&cache, &key]() -> const grammar::GrammarSpec* {
    for (auto it = cache.lru.begin(); it != cache.lru.end(); ++it)
      if (it->first == key) {
        cache.lru.splice(cache.lru.begin(), cache.lru, it);
        return &it->second;
      }
    return nullptr;
  };
  {
    std::lock_guard lock(cache.mu);
    if (const grammar::GrammarSpec* hit = cached()) {
      ++cache.hits;
      return *hit;
    }
    ++cache.misses;
  }
  // Token references (<|tool_call_begin|>, <[id]>) resolve to the model's special tokens.
  const gr::SpecialTokens specials = [&m](std::string_view name) { return m.tokenizer->special_id(name); };
  gr::GrammarSpec spec;
  try {
    gr::JsonGrammarOptions jo;
    jo.any_whitespace = false;
    jo.strict = req.constraint_strict;
    gr::Grammar g;
    switch (req.constraint) {
      case ApiRequest::Constraint::json_object:
        g = gr::parse_gbnf(gr::json_object_gbnf(jo));
        break;
      case ApiRequest::Constraint::json_schema:
        g = gr::json_schema_grammar(nlohmann::ordered_json::parse(req.constraint_source), jo);
        break;
      case ApiRequest::Constraint::gbnf:
        g = gr::parse_gbnf(req.constraint_source, "root", specials);
        break;
      case ApiRequest::Constraint::none:
        g = gr::parse_gbnf(tool_gbnf, "root", specials);
        break;
    }
    spec.grammar = std::make_shared<const gr::CompiledGrammar>(g);
  } catch (const Error& e) {
    bad_request(param, cat("'", param, "': ", e.what()));
  }
  ServedModel::LazyVocab& lv = *m.grammar_vocab;
  std::call_once(lv.once, [&] { lv.trie = std::make_shared<const gr::VocabTrie>(gr::VocabTrie::from_tokenizer(*m.tokenizer)); });
  spec.vocab = lv.trie;
  spec.masks = std::make_shared<gr::SharedMasks>(spec.grammar, spec.vocab);
  std::lock_guard lock(cache.mu);
  if (const grammar::GrammarSpec* hit = cached()) return *hit;  // compiled meanwhile beside this request: one entry, one set of masks
  cache.lru.emplace_front(key, spec);
  if (cache.lru.size() > ServedModel::GrammarCache::kEntries) {
    const gr::SharedMasks::Stats gone = cache.lru.back().second.masks->stats();
    cache.gone_mask_hits += gone.hits, cache.gone_mask_misses += gone.misses;
    cache.lru.pop_back();
  }
  return spec;
}

int count_tool_calls(const std::vector<ChatMessage>& msgs) {
  int n = 0;
  for (const auto& m : msgs) n += int(m.tool_calls.size());
  return n;
}

}  // namespace

GrammarCacheStats grammar_cache_stats(const ServedModel& m) {
  ServedModel::GrammarCache& cache = *m.grammar_cache;
  std::lock_guard lock(cache.mu);
  GrammarCacheStats st{cache.hits, cache.misses, int64_t(cache.lru.size()), cache.gone_mask_hits, cache.gone_mask_misses, 0};
  for (const auto& [key, spec] : cache.lru) {
    const grammar::SharedMasks::Stats ms = spec.masks->stats();
    st.mask_hits += ms.hits, st.mask_misses += ms.misses, st.mask_bytes += ms.bytes;
  }
  return st;
}

PreparedRequest prepare_request(const ApiRequest& req, const ServedModel& m) {
  PreparedRequest p;
  std::string tool_gbnf;  // strict tools: the answer's grammar
  ResponseOptions& ro = p.response;
  ro.endpoint = req.endpoint;
  ro.stream = req.stream;
  ro.include_usage = req.include_usage;
  ro.stop = req.stop;
  ro.top_logprobs = req.top_logprobs;
  if (req.endpoint == Endpoint::completion) {
    if (req.prompt_is_ids) {
      p.prompt = req.prompt_ids;
      for (size_t i = 0; i < p.prompt.size(); ++i)
        if (p.prompt[i] >= m.vocab_size)
          bad_request("prompt", cat("'prompt[", i, "]' = ", p.prompt[i], " is outside the vocabulary [0, ", m.vocab_size, ")"));
    } else {
      // Special-token names in the text become special tokens, as HF tokenizers (vLLM) do.
      p.prompt = m.tokenizer->encode(req.prompt_text, /*parse_special=*/true);
    }
  } else {
    const bool kimi = m.chat_template == ChatTemplateKind::kimi;
    if (!kimi && !req.tools_json.empty())
      bad_request("tools", cat("'tools': the ", chat_template_kind_name(m.chat_template),
                               " template does not declare tools (tool calling needs a Kimi model)"));
    ChatOptions co;
    co.tools_json = req.tools_json;
    co.thinking = req.thinking;
    std::string text;
    try {
      text = render_chat(m.chat_template, req.messages, co);
    } catch (const Error& e) {
      bad_request("messages", e.what());
    }
    const std::string think_open = "<think>";
    const bool in_reasoning = kimi && text.size() >= think_open.size() &&
                              text.compare(text.size() - think_open.size(), think_open.size(), think_open) == 0;
    // tool_choice required / named: the answer is forced to start with the tool-call section by
    // prefilling its markers after the generation prompt (reasoning is closed first: no thinking).
    std::string prefill;
    if (req.tool_choice == ToolChoice::required || req.tool_choice == ToolChoice::named) {
      if (in_reasoning) prefill += "</think>";
      prefill += "<|tool_calls_section_begin|>";
      if (req.tool_choice == ToolChoice::named)
        prefill += cat("<|tool_call_begin|>functions.", req.tool_choice_name, ":", count_tool_calls(req.messages),
                       "<|tool_call_argument_begin|>");
    }
    if (req.strict_tools && req.constraint != ApiRequest::Constraint::none)
      bad_request("response_format", "'response_format' / 'grammar' and strict tools cannot both constrain the answer");
    // Constrained output has no reasoning either: the grammar covers the whole answer.
    if (req.constraint != ApiRequest::Constraint::none) {
      if (req.tool_choice == ToolChoice::required || req.tool_choice == ToolChoice::named)
        bad_request("tool_choice", "'tool_choice' forces a tool call, which 'response_format' / 'grammar' does not allow");
      if (in_reasoning) prefill = "</think>";
    }
    p.prompt = m.tokenizer->encode(text + prefill, /*parse_special=*/true);
    ro.parse_output = kimi;
    ro.parser.starts_in_reasoning = in_reasoning;
    ro.parser.reasoning = true;
    // tool_choice none: the tools stay declared in the prompt (vLLM's default) but calls are not parsed.
    ro.parser.tool_calls = req.tool_choice != ToolChoice::none;
    ro.prefill = prefill;
    // The tool-call grammar: with a strict tool (its arguments follow its schema), and for
    // tool_choice required / named with any tools (the call, a declared name and JSON-object
    // arguments are enforced by the grammar, not left to the prefill).
    const bool forced = req.tool_choice == ToolChoice::required || req.tool_choice == ToolChoice::named;
    if ((req.strict_tools && req.tool_choice != ToolChoice::none) || (forced && req.constraint == ApiRequest::Constraint::none)) {
      try {
        tool_gbnf = kimi_tool_call_gbnf(nlohmann::ordered_json::parse(req.tools_json_ordered), req.tool_choice,
                                        req.tool_choice_name, in_reasoning && prefill.empty());
      } catch (const Error& e) {
        bad_request("tools", e.what());
      }
    }
  }
  const int64_t n_prompt = int64_t(p.prompt.size());
  if (n_prompt == 0) bad_request("prompt", "the prompt encodes to no tokens");
  if (n_prompt >= m.context)
    throw ApiError(400, "exceed_context_size_error",
                   cat("the request has ", n_prompt, " prompt tokens but the context holds ", m.context,
                       " (at least one must be left for the answer)"),
                   req.endpoint == Endpoint::chat ? "messages" : "prompt");
  ro.n_prompt = n_prompt;

  GenerateOptions& g = p.gen;
  const GenerationDefaults& d = m.defaults;
  // max_tokens: the request, else generation_config's max_new_tokens, else the rest of the context.
  g.max_new_tokens = req.max_tokens.value_or(d.max_new_tokens.value_or(m.context - n_prompt));
  g.context = m.context;
  g.sampling.temperature = req.temperature.value_or(d.temperature.value_or(1.0f));
  g.sampling.top_p = req.top_p.value_or(d.top_p.value_or(1.0f));
  g.sampling.top_k = req.top_k.value_or(d.top_k.value_or(0));
  g.sampling.min_p = req.min_p.value_or(d.min_p.value_or(0.0f));
  g.sampling.seed = req.seed.value_or(0);
  try {
    validate(g.sampling);
  } catch (const Error& e) {
    bad_request("", e.what());
  }
  g.ignore_eos = req.ignore_eos;
  g.stop_ids = stop_ids_for(req, m);
  g.seq_id = 0;  // samples depend on (seed, position) only, never on what else runs
  p.top_logprobs = req.top_logprobs;
  if (!req.ignore_eos) ro.hidden_ids = g.stop_ids;
  if (req.constraint != ApiRequest::Constraint::none || !tool_gbnf.empty()) p.grammar = compile_constraint(req, m, tool_gbnf);
  return p;
}

json tokenize_response(const json& body, const ServedModel& m) {
  std::vector<int32_t> ids;
  if (body.contains("messages")) {
    json chat = body;
    chat.erase("content");
    ApiRequest r = parse_api_request(Endpoint::chat, chat.dump());
    r.max_tokens = 1;
    ids = prepare_request(r, m).prompt;
  } else {
    auto it = body.find("content");
    if (it == body.end() || !it->is_string()) bad_request("content", "'content': expected a string (or give 'messages')");
    bool parse_special = true;
    if (auto ps = body.find("parse_special"); ps != body.end()) {
      if (!ps->is_boolean()) bad_request("parse_special", "'parse_special': expected a boolean");
      parse_special = ps->get<bool>();
    }
    try {
      ids = m.tokenizer->encode(it->get<std::string>(), parse_special);
    } catch (const ApiError&) {
      throw;
    } catch (const Error& e) {
      bad_request("content", e.what());
    }
  }
  json out = {{"tokens", ids}, {"count", ids.size()}};
  auto wp = body.find("with_pieces");
  if (wp != body.end() && !wp->is_boolean() && !wp->is_null()) bad_request("with_pieces", "'with_pieces': expected a boolean");
  if (wp != body.end() && wp->is_boolean() && wp->get<bool>()) {
    json pieces = json::array();
    for (int32_t id : ids) pieces.push_back({{"id", id}, {"piece", utf8_sanitize(m.tokenizer->token_bytes(id))}});
    out["tokens"] = pieces;
  }
  return out;
}

json detokenize_response(const json& body, const ServedModel& m) {
  auto it = body.find("tokens");
  if (it == body.end() || !it->is_array()) bad_request("tokens", "'tokens': expected an array of token ids");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& v = (*it)[i];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= m.tokenizer->vocab_size())
      bad_request("tokens", cat("'tokens[", i, "]': not a token id in [0, ", m.tokenizer->vocab_size(), ")"));
    ids.push_back(v.get<int32_t>());
  }
  return json{{"content", m.tokenizer->decode(ids)}};
}

}  // namespace kd
