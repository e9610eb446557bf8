// The server's response building (src/server/response_builder.h): forced token sequences, committed
// in batches of 1…16 tokens (a DDTree round commits several at once), → the exact OpenAI objects.
// Expected objects are written here by hand from OpenAI's API reference (chat.completion,
// chat.completion.chunk, text_completion, usage) — never produced by the builder itself — and every
// streamed run must concatenate to the non-streamed answer.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "server/prepare.h"
#include "server/response_builder.h"
#include "tokenizer/tokenizer.h"

namespace {

using json = nlohmann::json;
using kd::Endpoint;
using kd::ResponseBuilder;
using kd::ResponseOptions;

const kd::Tokenizer& tok() {
  static const std::unique_ptr<kd::Tokenizer> t = kd::load_tokenizer(std::string(KDTREE_FIXTURES) + "/tokenizer-kimi-small");
  return *t;
}
int32_t special(const char* name) { return *tok().special_id(name); }

std::vector<int32_t> ids_of(const std::string& text) { return tok().encode(text, /*parse_special=*/true); }

ResponseOptions base(Endpoint ep, bool stream) {
  ResponseOptions o;
  o.endpoint = ep;
  o.stream = stream;
  o.id = "x-1";
  o.model = "tiny";
  o.created = 1700000000;
  o.n_prompt = 7;
  o.hidden_ids = {special("[EOS]"), special("<|im_end|>")};
  return o;
}

kd::RequestStats stats(int64_t n_gen) {
  kd::RequestStats s;
  s.n_prompt = 7;
  s.n_cached = 3;
  s.n_generated = n_gen;
  s.prefill_ms = 2;
  s.decode_ms = 10;
  return s;
}

struct BuilderRun {
  std::vector<json> payloads;  // every payload, streamed ones first, then finish()'s
  bool stopped = false;
  std::string reason;
};

// Feeds ids in commits of `k` tokens (the last commit may be shorter); stops feeding once a stop
// string matched, as the server does.
BuilderRun run(const ResponseOptions& o, const std::vector<int32_t>& ids, size_t k, const std::string& engine_reason) {
  ResponseBuilder b(tok(), o);
  BuilderRun r;
  for (size_t i = 0; i < ids.size() && !b.stop_matched(); i += k) {
    std::vector<int32_t> part(ids.begin() + long(i), ids.begin() + long(std::min(ids.size(), i + k)));
    for (const auto& p : b.add(part)) r.payloads.push_back(json::parse(p));
  }
  r.stopped = b.stop_matched();
  for (const auto& p : b.finish(r.stopped ? "cancelled" : engine_reason, stats(int64_t(ids.size()))))
    r.payloads.push_back(json::parse(p));
  r.reason = b.finish_reason();
  return r;
}

// The streamed chat deltas folded into one message, the way OpenAI's SDK accumulates them.
json fold_chat(const std::vector<json>& chunks, std::string* finish) {
  json msg = {{"role", "assistant"}};
  std::string content, reasoning;
  bool any_content = false;
  json calls = json::array();
  for (const auto& c : chunks) {
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    EXPECT_EQ(c["id"], "x-1");
    EXPECT_EQ(c["model"], "tiny");
    if (c["choices"].empty()) continue;  // the usage chunk
    const json& ch = c["choices"][0];
    if (!ch["finish_reason"].is_null()) *finish = ch["finish_reason"];
    const json& d = ch["delta"];
    if (d.contains("content")) {
      content += d["content"].get<std::string>();
      any_content |= !d["content"].get<std::string>().empty();
    }
    if (d.contains("reasoning_content")) {
      EXPECT_EQ(d["reasoning"], d["reasoning_content"]);
      reasoning += d["reasoning_content"].get<std::string>();
    }
    if (d.contains("tool_calls")) {
      for (const auto& tc : d["tool_calls"]) {
        const size_t i = tc["index"];
        if (i == calls.size()) {
          EXPECT_TRUE(tc.contains("id")) << "the first delta of a call carries its id and name";
          calls.push_back({{"id", tc["id"]}, {"type", "function"}, {"function", {{"name", tc["function"]["name"]}, {"arguments", ""}}}});
        } else {
          EXPECT_FALSE(tc.contains("id")) << "later deltas carry argument fragments only";
        }
        calls[i]["function"]["arguments"] = calls[i]["function"]["arguments"].get<std::string>() +
                                            tc["function"]["arguments"].get<std::string>();
      }
    }
  }
  msg["content"] = any_content || calls.empty() ? json(content) : json(nullptr);
  if (!reasoning.empty()) msg["reasoning_content"] = msg["reasoning"] = reasoning;
  if (!calls.empty()) msg["tool_calls"] = calls;
  return msg;
}

std::string fold_text(const std::vector<json>& chunks, std::string* finish) {
  std::string text;
  for (const auto& c : chunks) {
    EXPECT_EQ(c["object"], "text_completion");
    if (c["choices"].empty()) continue;
    const json& ch = c["choices"][0];
    text += ch["text"].get<std::string>();
    if (!ch["finish_reason"].is_null()) *finish = ch["finish_reason"];
  }
  return text;
}

TEST(ResponseBuilder, CompletionNonStreamedIsTheExactOpenAIObject) {
  const std::string text = "The quick brown fox";
  std::vector<int32_t> ids = ids_of(text);
  const size_t n = ids.size();
  ids.push_back(special("[EOS]"));  // the engine's stop id: counted, never rendered
  const BuilderRun r = run(base(Endpoint::completion, false), ids, 3, "stop");
  ASSERT_EQ(r.payloads.size(), 1u);
  json t = r.payloads[0];
  EXPECT_TRUE(t["timings"].is_object());
  EXPECT_EQ(t["timings"]["cache_n"], 3);
  EXPECT_EQ(t["timings"]["prompt_n"], 4);
  EXPECT_EQ(t["timings"]["predicted_n"], int64_t(n + 1));
  t.erase("timings");
  const json expected = {
      {"id", "x-1"}, {"object", "text_completion"}, {"created", 1700000000}, {"model", "tiny"},
      {"choices", {{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", "stop"}}}},
      {"usage", {{"prompt_tokens", 7}, {"completion_tokens", n + 1}, {"total_tokens", 7 + n + 1},
                 {"prompt_tokens_details", {{"cached_tokens", 3}}}}}};
  EXPECT_EQ(t, expected) << t.dump(2);
}

// A stop string that spans token boundaries is found in the text, cut with everything after it,
// and never streamed — not even its first bytes — whatever the commit size.
TEST(ResponseBuilder, StopStringAcrossTokenBoundariesInEveryCommitSize) {
  const std::string text = "alpha beta gamma delta epsilon";
  const std::vector<int32_t> ids = ids_of(text);
  ASSERT_GT(ids.size(), 4u);
  for (const std::string stop : {"ta gam", "a d", "epsilon", "x never"}) {
    const std::string want = stop == "x never" ? text : text.substr(0, text.find(stop));
    for (size_t k = 1; k <= 16; ++k) {
      ResponseOptions o = base(Endpoint::completion, true);
      o.stop = {"zzz", stop};
      const BuilderRun s = run(o, ids, k, "length");
      std::string finish;
      EXPECT_EQ(fold_text(s.payloads, &finish), want) << "stop '" << stop << "' k=" << k;
      EXPECT_EQ(finish, stop == "x never" ? "length" : "stop");
      o.stream = false;
      const BuilderRun ns = run(o, ids, k, "length");
      EXPECT_EQ(ns.payloads[0]["choices"][0]["text"], want);
    }
  }
}

TEST(ResponseBuilder, StreamedTextIsValidUtf8AtEveryCommit) {
  const std::string text = "naïve 世界 🙂 done";
  const std::vector<int32_t> ids = ids_of(text);
  for (size_t k = 1; k <= 4; ++k) {
    const BuilderRun s = run(base(Endpoint::completion, true), ids, k, "length");
    std::string finish;
    for (const auto& c : s.payloads)  // json::parse already rejected invalid UTF-8; no U+FFFD either
      if (!c["choices"].empty()) {
        EXPECT_EQ(c["choices"][0]["text"].get<std::string>().find("\xEF\xBF\xBD"), std::string::npos);
      }
    EXPECT_EQ(fold_text(s.payloads, &finish), text);
  }
}

TEST(ResponseBuilder, StreamEndsWithFinishChunkTimingsAndUsage) {
  ResponseOptions o = base(Endpoint::chat, true);
  o.include_usage = true;
  const std::vector<int32_t> ids = ids_of("Hi there");
  const BuilderRun s = run(o, ids, 16, "length");
  ASSERT_GE(s.payloads.size(), 4u);
  EXPECT_EQ(s.payloads[0]["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  const json& fin = s.payloads[s.payloads.size() - 2];
  EXPECT_EQ(fin["choices"][0]["delta"], json::object());
  EXPECT_EQ(fin["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(fin["timings"].is_object());
  const json& usage = s.payloads.back();
  EXPECT_EQ(usage["choices"], json::array());
  EXPECT_EQ(usage["usage"], json({{"prompt_tokens", 7}, {"completion_tokens", ids.size()}, {"total_tokens", 7 + ids.size()},
                                  {"prompt_tokens_details", {{"cached_tokens", 3}}}}));
  for (const auto& c : s.payloads) EXPECT_EQ(c["created"], 1700000000);
}

// Kimi output (forced): reasoning, content, then two tool calls; <|im_end|> ends the turn.
const std::string kAgentTurn =
    "Let me look that up.</think>I'll check both."
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    "{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>functions.get-time.v2:1<|tool_call_argument_begin|>"
    "{\"tz\": \"Europe/Paris\", \"note\": \"<b>x</b>\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>";

const json kAgentMessage = {
    {"role", "assistant"},
    {"content", "I'll check both."},
    {"reasoning_content", "Let me look that up."},
    {"reasoning", "Let me look that up."},
    {"tool_calls",
     {{{"id", "functions.get_weather:0"}, {"type", "function"},
       {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}},
      {{"id", "functions.get-time.v2:1"}, {"type", "function"},
       {"function", {{"name", "get-time.v2"}, {"arguments", "{\"tz\": \"Europe/Paris\", \"note\": \"<b>x</b>\"}"}}}}}}};

ResponseOptions chat_opts(bool stream) {
  ResponseOptions o = base(Endpoint::chat, stream);
  o.parse_output = true;
  o.parser.starts_in_reasoning = true;  // the Kimi template prefilled <think>
  return o;
}

TEST(ResponseBuilder, ChatToolCallsAndReasoningNonStreamed) {
  const BuilderRun r = run(chat_opts(false), ids_of(kAgentTurn), 5, "stop");
  const json& c = r.payloads.at(0)["choices"][0];
  EXPECT_EQ(c["message"], kAgentMessage) << c["message"].dump(2);
  EXPECT_EQ(c["finish_reason"], "tool_calls");
  EXPECT_EQ(r.payloads[0]["object"], "chat.completion");
}

// Markers split across commits and merged within one: every commit size gives the same message,
// streamed or not, and no marker text ever reaches content or reasoning.
TEST(ResponseBuilder, ChatStreamFoldsToTheSameMessageForCommitsOf1To16) {
  const std::vector<int32_t> ids = ids_of(kAgentTurn);
  for (size_t k = 1; k <= 16; ++k) {
    const BuilderRun s = run(chat_opts(true), ids, k, "stop");
    std::string finish;
    const json msg = fold_chat(s.payloads, &finish);
    EXPECT_EQ(msg, kAgentMessage) << "k=" << k << "\n" << msg.dump(2);
    EXPECT_EQ(finish, "tool_calls") << "k=" << k;
    for (const auto& c : s.payloads) EXPECT_EQ(c.dump().find("<|"), std::string::npos) << c.dump();
  }
}

// tool_choice named: the prompt ended with the call's markers (prefill); the model writes only the
// arguments, and the parser sees prefill + output.
TEST(ResponseBuilder, PrefilledNamedToolCall) {
  ResponseOptions o = chat_opts(false);
  o.prefill = "</think><|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:3<|tool_call_argument_begin|>";
  const BuilderRun r = run(o, ids_of("{\"q\": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"), 2, "stop");
  const json& c = r.payloads.at(0)["choices"][0];
  const json want = {{"role", "assistant"}, {"content", nullptr},
                     {"tool_calls", {{{"id", "functions.lookup:3"}, {"type", "function"},
                                      {"function", {{"name", "lookup"}, {"arguments", "{\"q\": 1}"}}}}}}};
  EXPECT_EQ(c["message"], want) << c["message"].dump(2);
  EXPECT_EQ(c["finish_reason"], "tool_calls");
}

// A call cut by max_tokens: finish_reason stays "length" and the call says it is incomplete.
TEST(ResponseBuilder, ToolCallCutByLengthIsReported) {
  const std::string cut = "ok</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": ";
  const BuilderRun r = run(chat_opts(false), ids_of(cut), 3, "length");
  const json& c = r.payloads.at(0)["choices"][0];
  EXPECT_EQ(c["finish_reason"], "length");
  ASSERT_EQ(c["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(c["message"]["tool_calls"][0]["function"]["arguments"], "{\"a\":");
  EXPECT_TRUE(c["message"]["tool_calls"][0]["error"].is_string());
}

// Chat logprobs: one entry per generated token, the engine's values passed through, top
// alternatives capped at top_logprobs; the stop id that ended the turn has none.
TEST(ResponseBuilder, ChatLogprobsShape) {
  ResponseOptions o = base(Endpoint::chat, false);
  o.top_logprobs = 1;
  std::vector<int32_t> ids = ids_of("ab cd");
  std::vector<kd::TokenLogprob> lps;
  for (size_t i = 0; i < ids.size(); ++i) lps.push_back({ids[i], -0.5f * float(i + 1), {{ids[i], -0.5f}, {7, -3.0f}}});
  ids.push_back(special("<|im_end|>"));
  lps.push_back({ids.back(), -0.1f, {}});
  ResponseBuilder b(tok(), o);
  b.add(ids, lps);
  const json r = json::parse(b.finish("stop", stats(int64_t(ids.size()))).at(0));
  const json& content = r["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), ids.size() - 1);
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    EXPECT_EQ(content[i]["token"], tok().token_bytes(ids[i]));
    EXPECT_FLOAT_EQ(content[i]["logprob"].get<float>(), -0.5f * float(i + 1));
    ASSERT_EQ(content[i]["top_logprobs"].size(), 1u);
    EXPECT_EQ(content[i]["bytes"].size(), tok().token_bytes(ids[i]).size());
  }
}

TEST(ResponseBuilder, IgnoreEosRendersNothingHiddenAndCountsEverything) {
  ResponseOptions o = base(Endpoint::completion, false);
  o.hidden_ids.clear();  // ignore_eos: the server hides nothing
  std::vector<int32_t> ids = ids_of("a");
  ids.push_back(special("[EOS]"));
  const BuilderRun r = run(o, ids, 1, "length");
  EXPECT_EQ(r.payloads[0]["choices"][0]["text"], "a[EOS]");
}

// A model's vocabulary may be larger than its tokenizer's (Kimi K2: 163,840 embedding rows, 163,584
// tokenizer ids): the padding ids can still be sampled, or appear among the top alternatives. They
// have no bytes — they render as nothing (as HF's decode skips unknown ids) — and must never throw:
// a throw in the streaming path escaped httplib's content provider and aborted the server.
TEST(ResponseBuilder, IdsBeyondTheTokenizerRenderAsNothing) {
  const int32_t pad = tok().vocab_size();  // a valid model id with no tokenizer entry
  const std::vector<int32_t> ab = {ids_of("a").at(0), ids_of("b").at(0)};
  ASSERT_EQ(ids_of("a").size(), 1u);
  ASSERT_EQ(ids_of("b").size(), 1u);
  for (bool stream : {false, true}) {
    for (Endpoint ep : {Endpoint::completion, Endpoint::chat}) {
      ResponseOptions o = base(ep, stream);
      o.top_logprobs = 2;
      ResponseBuilder b(tok(), o);
      const std::vector<int32_t> ids = {ab[0], pad, ab[1]};
      std::vector<kd::TokenLogprob> lps;
      for (int32_t id : ids) lps.push_back({id, -1.0f, {{pad + 1, -0.5f}, {ab[0], -2.0f}}});
      std::vector<json> payloads;
      ASSERT_NO_THROW(for (const auto& p : b.add(ids, lps)) payloads.push_back(json::parse(p)));
      std::vector<std::string> fin;
      ASSERT_NO_THROW(fin = b.finish("length", stats(3)));
      for (const auto& p : fin) payloads.push_back(json::parse(p));
      EXPECT_EQ(b.text(), "ab");
      EXPECT_EQ(b.n_generated(), 3);
      if (!stream && ep == Endpoint::chat) {
        const json& content = payloads.at(0)["choices"][0]["logprobs"]["content"];
        ASSERT_EQ(content.size(), 3u);
        EXPECT_EQ(content[1]["token"], "");
        EXPECT_EQ(content[1]["bytes"], json::array());
        EXPECT_EQ(content[0]["top_logprobs"][0]["token"], "");
      }
      if (!stream && ep == Endpoint::completion) {
        const json& lp = payloads.at(0)["choices"][0]["logprobs"];
        EXPECT_EQ(lp["tokens"], json::array({"a", "", "b"}));
      }
    }
  }
}

TEST(GenerationDefaults, MissingFileLeavesEverythingUnset) {
  const kd::GenerationDefaults d = kd::load_generation_defaults(std::string(KDTREE_FIXTURES) + "/tokenizer-kimi-small");
  EXPECT_FALSE(d.temperature || d.top_p || d.top_k || d.min_p || d.max_new_tokens);
}

}  // namespace
