#include "server/response_builder.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "tokenizer/utf8.h"

namespace kd {

namespace {
const char* const kGrammarIncomplete =
    "max_tokens ended the output before the grammar (response_format / grammar) was complete: the text is a prefix of a valid answer, not a valid answer";
}  // namespace

using ojson = nlohmann::ordered_json;

namespace {

std::string dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

// Length of the longest prefix of b that does not end inside a well-formed-so-far UTF-8 sequence:
// an unfinished character is held back until its last byte arrives (or generation ends).
size_t complete_utf8_prefix(const std::string& b) {
  const size_t n = b.size();
  for (size_t k = 1; k <= 3 && k <= n; ++k) {
    const auto c = static_cast<unsigned char>(b[n - k]);
    if (c < 0x80) return n;
    if (c < 0xC0) continue;  // a continuation byte: look further back for its lead
    size_t len = 0;
    unsigned char lo = 0, hi = 0;
    if (!utf8_lead(c, &len, &lo, &hi) || len <= k) return n;
    for (size_t j = 1; j < k; ++j) {  // the bytes so far must fit, or the sequence is already broken
      const auto d = static_cast<unsigned char>(b[n - k + j]);
      const bool ok = j == 1 ? (d >= lo && d <= hi) : (d >= 0x80 && d <= 0xBF);
      if (!ok) return n;
    }
    return n - k;
  }
  return n;
}

// The bytes of a generated id. The model's vocabulary may be larger than the tokenizer's (Kimi
// K2: 163,840 embedding rows, 163,584 tokenizer ids); the padding ids can be sampled or listed
// among the alternatives. They have no bytes and render as nothing, as HF's decode skips them.
const std::string& bytes_of(const Tokenizer& tok, int32_t id) {
  static const std::string none;
  return id >= 0 && id < tok.vocab_size() ? tok.token_bytes(id) : none;
}

ojson token_entry(const Tokenizer& tok, int32_t id, float logprob) {
  const std::string& b = bytes_of(tok, id);
  ojson bytes = ojson::array();
  for (unsigned char c : b) bytes.push_back(int(c));
  return ojson{{"token", utf8_sanitize(b)}, {"logprob", logprob}, {"bytes", bytes}};
}

}  // namespace

ojson timings_object(const RequestStats& st) {
  const int64_t prompt_n = st.n_prompt - st.n_cached;  // what prefill computed
  auto per_s = [](double n, double ms) { return ms > 0 ? n / ms * 1e3 : 0.0; };
  auto per_tok = [](double ms, double n) { return n > 0 ? ms / n : 0.0; };
  ojson t;
  t["cache_n"] = st.n_cached;
  t["prompt_n"] = prompt_n;
  t["prompt_ms"] = st.prefill_ms;
  t["prompt_per_token_ms"] = per_tok(st.prefill_ms, double(prompt_n));
  t["prompt_per_second"] = per_s(double(prompt_n), st.prefill_ms);
  t["predicted_n"] = st.n_generated;
  t["predicted_ms"] = st.decode_ms;
  t["predicted_per_token_ms"] = per_tok(st.decode_ms, double(st.n_generated));
  t["predicted_per_second"] = per_s(double(st.n_generated), st.decode_ms);
  t["queue_ms"] = st.queue_ms;
  t["draft_n"] = st.drafted;
  t["draft_n_accepted"] = st.accepted;
  t["spec_rounds"] = st.rounds;
  // τ: tokens committed per round (the accepted drafts plus the target's own token).
  t["mean_accepted_length"] = st.rounds > 0 ? double(st.accepted + st.rounds) / double(st.rounds) : 1.0;
  // Each round's τ (Σ = predicted_n − 1: the prefill commits the first token), as run --json's spec.round_tau.
  if (st.rounds > 0) t["spec_round_tau"] = st.round_tau;
  return t;
}

ResponseBuilder::ResponseBuilder(const Tokenizer& tok, ResponseOptions opt) : tok_(tok), opt_(std::move(opt)) {
  if (opt_.parse_output) parser_.emplace(opt_.parser);
}

void ResponseBuilder::append_ids(const std::vector<int32_t>& ids, const std::vector<TokenLogprob>& logprobs) {
  for (size_t i = 0; i < ids.size(); ++i) {
    ++n_generated_;
    const int32_t id = ids[i];
    const bool hidden = std::find(opt_.hidden_ids.begin(), opt_.hidden_ids.end(), id) != opt_.hidden_ids.end();
    if (!hidden) bytes_ += bytes_of(tok_, id);
    complete_text(false);
    if (opt_.top_logprobs >= 0 && !hidden) {
      TokenRecord rec{i < logprobs.size() ? logprobs[i] : TokenLogprob{id, 0.0f, {}}, text_.size()};
      rec.lp.id = id;
      tokens_.push_back(std::move(rec));
    }
    if (stopped_) return;  // tokens after a stop string are not part of the answer
  }
}

void ResponseBuilder::complete_text(bool final) {
  if (stopped_) return;
  const size_t cut = final ? bytes_.size() : complete_utf8_prefix(bytes_);
  if (cut <= bytes_done_) return;
  text_ += utf8_sanitize(std::string_view(bytes_).substr(bytes_done_, cut - bytes_done_));
  bytes_done_ = cut;
  // Earliest match of any stop string that ends in the new text.
  size_t max_stop = 0;
  for (const auto& s : opt_.stop) max_stop = std::max(max_stop, s.size());
  size_t best = std::string::npos;
  for (const auto& s : opt_.stop) {
    const size_t p = text_.find(s, stop_scan_);
    if (p != std::string::npos) best = std::min(best, p);
  }
  if (best != std::string::npos) {
    text_.resize(best);
    stopped_ = true;
    return;
  }
  // A match needs at least max_stop bytes; anything earlier than that cannot start a new one.
  stop_scan_ = text_.size() >= max_stop ? text_.size() - max_stop + 1 : 0;
}

size_t ResponseBuilder::visible_len() const {
  if (stopped_) return text_.size();
  size_t hold = 0;
  for (const auto& s : opt_.stop) {
    for (size_t k = std::min(s.size() - 1, text_.size()); k > hold; --k) {
      if (text_.compare(text_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  return text_.size() - hold;
}

size_t ResponseBuilder::answer_tokens() const {
  if (!stopped_) return tokens_.size();
  // After a stop match: the tokens whose text starts inside the (truncated) answer.
  size_t n = 0;
  while (n < tokens_.size() && (n == 0 ? 0 : tokens_[n - 1].text_end) < text_.size()) ++n;
  return n;
}

ojson ResponseBuilder::logprobs_object(size_t from, size_t to) const {
  if (opt_.top_logprobs < 0) return nullptr;
  if (opt_.endpoint == Endpoint::chat) {
    ojson content = ojson::array();
    for (size_t i = from; i < to; ++i) {
      const TokenLogprob& lp = tokens_[i].lp;
      ojson e = token_entry(tok_, lp.id, lp.logprob);
      ojson top = ojson::array();
      for (size_t k = 0; k < lp.top.size() && int32_t(k) < opt_.top_logprobs; ++k)
        top.push_back(token_entry(tok_, lp.top[k].first, lp.top[k].second));
      e["top_logprobs"] = top;
      content.push_back(e);
    }
    return ojson{{"content", content}};
  }
  // Completions (legacy shape): parallel arrays; text_offset counts bytes into the completion text.
  ojson tokens = ojson::array(), token_logprobs = ojson::array(), top = ojson::array(), offsets = ojson::array();
  for (size_t i = from; i < to; ++i) {
    const TokenLogprob& lp = tokens_[i].lp;
    tokens.push_back(utf8_sanitize(bytes_of(tok_, lp.id)));
    token_logprobs.push_back(lp.logprob);
    ojson alt = ojson::object();
    for (size_t k = 0; k < lp.top.size() && int32_t(k) < opt_.top_logprobs; ++k)
      alt[utf8_sanitize(bytes_of(tok_, lp.top[k].first))] = lp.top[k].second;
    top.push_back(alt);
    offsets.push_back(i == 0 ? size_t(0) : std::min(tokens_[i - 1].text_end, text_.size()));
  }
  return ojson{{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

// One streaming chunk. delta: for chat the delta object's JSON, for completions the text.
std::string ResponseBuilder::chunk(const std::string& delta, const std::string* finish_reason, bool with_logprobs) {
  ojson c;
  c["id"] = opt_.id;
  c["object"] = opt_.endpoint == Endpoint::chat ? "chat.completion.chunk" : "text_completion";
  c["created"] = opt_.created;
  c["model"] = opt_.model;
  ojson choice;
  choice["index"] = 0;
  if (opt_.endpoint == Endpoint::chat) choice["delta"] = ojson::parse(delta);
  else choice["text"] = delta;
  // Logprobs of the tokens streamed so far; with a stop match, only those inside the answer.
  const size_t to = std::max(tokens_sent_, answer_tokens());
  if (with_logprobs && opt_.top_logprobs >= 0) {
    choice["logprobs"] = logprobs_object(tokens_sent_, to);
    tokens_sent_ = to;
  } else {
    choice["logprobs"] = nullptr;
  }
  choice["finish_reason"] = finish_reason ? ojson(*finish_reason) : ojson(nullptr);
  c["choices"] = ojson::array({choice});
  return dump(c);
}

namespace {

ojson delta_json(const OutputDelta& d) {
  ojson j = ojson::object();
  if (!d.reasoning.empty()) {
    j["reasoning_content"] = d.reasoning;
    j["reasoning"] = d.reasoning;  // the alias newer clients read
  }
  if (!d.content.empty()) j["content"] = d.content;
  if (!d.tool_calls.empty()) {
    ojson calls = ojson::array();
    for (const auto& tc : d.tool_calls) {
      ojson c;
      c["index"] = tc.index;
      if (!tc.id.empty()) {
        c["id"] = tc.id;
        c["type"] = "function";
        c["function"] = {{"name", tc.name}, {"arguments", tc.arguments}};
      } else {
        c["function"] = {{"arguments", tc.arguments}};
      }
      calls.push_back(c);
    }
    j["tool_calls"] = calls;
  }
  return j;
}

}  // namespace

std::vector<std::string> ResponseBuilder::add(const std::vector<int32_t>& ids, const std::vector<TokenLogprob>& logprobs) {
  if (stopped_) return {};
  append_ids(ids, logprobs);
  if (!opt_.stream) return {};
  std::vector<std::string> out;
  if (opt_.endpoint == Endpoint::chat && !role_sent_) {
    role_sent_ = true;
    out.push_back(chunk(dump(ojson{{"role", "assistant"}, {"content", ""}}), nullptr, false));
  }
  const size_t vis = visible_len();
  if (opt_.endpoint == Endpoint::chat) {
    if (parser_) {
      const OutputDelta d = parser_->update(opt_.prefill + text_.substr(0, vis), false);
      if (!d.empty()) out.push_back(chunk(dump(delta_json(d)), nullptr, true));
    } else if (vis > content_sent_) {
      out.push_back(chunk(dump(ojson{{"content", text_.substr(content_sent_, vis - content_sent_)}}), nullptr, true));
      content_sent_ = vis;
    }
  } else if (vis > content_sent_) {
    out.push_back(chunk(text_.substr(content_sent_, vis - content_sent_), nullptr, true));
    content_sent_ = vis;
  }
  return out;
}

std::vector<std::string> ResponseBuilder::finish(const std::string& engine_reason, const RequestStats& stats) {
  complete_text(true);  // an unfinished character at the very end becomes U+FFFD
  std::string reason = engine_reason;
  if (stopped_) reason = "stop";
  bool has_tool_calls = false;
  std::vector<std::string> out;
  if (opt_.stream) {
    if (opt_.endpoint == Endpoint::chat && !role_sent_) {
      role_sent_ = true;
      out.push_back(chunk(dump(ojson{{"role", "assistant"}, {"content", ""}}), nullptr, false));
    }
    std::string last;  // the remaining delta
    if (opt_.endpoint == Endpoint::chat && parser_) {
      const OutputDelta d = parser_->update(opt_.prefill + text_, true);
      has_tool_calls = !parser_->state().tool_calls.empty();
      if (!d.empty()) out.push_back(chunk(dump(delta_json(d)), nullptr, true));
    } else if (text_.size() > content_sent_) {
      last = text_.substr(content_sent_);
      content_sent_ = text_.size();
      out.push_back(opt_.endpoint == Endpoint::chat ? chunk(dump(ojson{{"content", last}}), nullptr, true)
                                                    : chunk(last, nullptr, true));
    }
  } else if (parser_) {
    has_tool_calls = !parse_kimi_output(opt_.prefill + text_, opt_.parser, true).tool_calls.empty();
  }
  if (has_tool_calls && reason == "stop") reason = "tool_calls";
  finish_reason_ = reason;
  if (!opt_.stream) return {final_response(stats)};

  // The chunk that carries finish_reason has an empty delta, plus the timings (llama-server).
  ojson fin = ojson::parse(chunk(opt_.endpoint == Endpoint::chat ? "{}" : "", &reason, tokens_sent_ < answer_tokens()));
  fin["timings"] = timings_object(stats);
  if (grammar_incomplete_ && reason == "length") fin["choices"][0]["error"] = kGrammarIncomplete;
  out.push_back(dump(fin));
  if (opt_.include_usage) {
    ojson u;
    u["id"] = opt_.id;
    u["object"] = opt_.endpoint == Endpoint::chat ? "chat.completion.chunk" : "text_completion";
    u["created"] = opt_.created;
    u["model"] = opt_.model;
    u["choices"] = ojson::array();
    u["usage"] = {{"prompt_tokens", opt_.n_prompt},
                  {"completion_tokens", n_generated_},
                  {"total_tokens", opt_.n_prompt + n_generated_},
                  {"prompt_tokens_details", {{"cached_tokens", stats.n_cached}}}};
    out.push_back(dump(u));
  }
  return out;
}

std::string ResponseBuilder::final_response(const RequestStats& stats) {
  ojson r;
  r["id"] = opt_.id;
  r["object"] = opt_.endpoint == Endpoint::chat ? "chat.completion" : "text_completion";
  r["created"] = opt_.created;
  r["model"] = opt_.model;
  ojson choice;
  choice["index"] = 0;
  if (opt_.endpoint == Endpoint::chat) {
    ojson msg;
    msg["role"] = "assistant";
    if (parser_) {
      const ParsedOutput p = parse_kimi_output(opt_.prefill + text_, opt_.parser, true);
      // OpenAI sends content null when the answer is only tool calls.
      msg["content"] = p.content.empty() && !p.tool_calls.empty() ? ojson(nullptr) : ojson(p.content);
      if (!p.reasoning.empty()) {
        msg["reasoning_content"] = p.reasoning;
        msg["reasoning"] = p.reasoning;
      }
      if (!p.tool_calls.empty()) {
        ojson calls = ojson::array();
        // Invalid or cut-off arguments are passed on as generated, with a non-standard "error" saying so.
        for (const auto& tc : p.tool_calls) calls.push_back(ojson::parse(tool_call_to_openai(tc).dump()));
        msg["tool_calls"] = calls;
      }
    } else {
      msg["content"] = text_;
    }
    choice["message"] = msg;
  } else {
    choice["text"] = text_;
  }
  choice["logprobs"] = logprobs_object(0, answer_tokens());
  choice["finish_reason"] = finish_reason_;
  if (grammar_incomplete_ && finish_reason_ == "length") choice["error"] = kGrammarIncomplete;
  r["choices"] = ojson::array({choice});
  r["usage"] = {{"prompt_tokens", opt_.n_prompt},
                {"completion_tokens", n_generated_},
                {"total_tokens", opt_.n_prompt + n_generated_},
                {"prompt_tokens_details", {{"cached_tokens", stats.n_cached}}}};
  r["timings"] = timings_object(stats);
  return dump(r);
}

}  // namespace kd
