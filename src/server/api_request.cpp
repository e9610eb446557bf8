#include "server/api_request.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/untrusted.h"

namespace kd {

using json = nlohmann::json;

void bad_request(const std::string& param, const std::string& message) {
  throw ApiError(400, "invalid_request_error", message, param);
}

std::string error_json(int status, const std::string& type, const std::string& message, const std::string& param) {
  json e = {{"code", status}, {"message", message}, {"type", type}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  // Error messages may quote request bytes; replace rather than throw on anything invalid.
  return json{{"error", e}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

[[noreturn]] void wrong_type(const std::string& field, const char* expected, const json& v) {
  bad_request(field, cat("'", field, "': expected ", expected, ", got ", type_name(v)));
}

// Each reader returns nullopt for an absent or null field.
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(name, "a boolean", *v);
  return v->get<bool>();
}

std::optional<double> get_number(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(name, "a number", *v);
  return v->get<double>();
}

std::optional<int64_t> get_int(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  // Above 2^63 − 1 nlohmann holds an unsigned that get<int64_t> would wrap (2^64 − 1 → −1).
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    bad_request(name, cat("'", name, "' = ", v->get<uint64_t>(), ": out of range (at most ", std::numeric_limits<int64_t>::max(), ")"));
  if (v->is_number_integer()) return v->get<int64_t>();
  // 16.0 is an integer in JSON's eyes (Python clients send floats sometimes); 16.5 is not.
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) return int64_t(d);
  }
  wrong_type(name, "an integer", *v);
}

std::optional<std::string> get_string(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(name, "a string", *v);
  return v->get<std::string>();
}

// A nested object's string field for comparisons only: "" (or dflt) when absent or not a string, so
// that a wrong type reads as a wrong value and is refused as one.
std::string string_or(const json& obj, const char* key, const std::string& dflt = "") {
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : (it == obj.end() || it->is_null() ? dflt : "");
}

// Known OpenAI parameters kdtree does not implement: a 400 unless the value is the neutral one.
void refuse_unsupported(const json& body) {
  if (auto n = get_int(body, "n"); n && *n != 1) bad_request("n", cat("'n' = ", *n, ": only n = 1 is supported"));
  if (auto b = get_int(body, "best_of"); b && *b != 1) bad_request("best_of", "'best_of': only 1 is supported");
  if (auto e = get_bool(body, "echo"); e && *e) bad_request("echo", "'echo': not supported");
  if (auto s = get_string(body, "suffix"); s && !s->empty()) bad_request("suffix", "'suffix': not supported");
  for (const char* p : {"presence_penalty", "frequency_penalty"})
    if (auto v = get_number(body, p); v && *v != 0.0) bad_request(p, cat("'", p, "': not supported (only 0)"));
  if (auto v = get_number(body, "repetition_penalty"); v && *v != 1.0)
    bad_request("repetition_penalty", "'repetition_penalty': not supported (only 1)");
  if (const json* lb = field(body, "logit_bias")) {
    if (!lb->is_object()) wrong_type("logit_bias", "an object", *lb);
    if (!lb->empty()) bad_request("logit_bias", "'logit_bias': not supported");
  }
  for (const char* p : {"functions", "function_call"})
    if (field(body, p)) bad_request(p, cat("'", p, "': the legacy function-calling fields are not supported; use 'tools'"));
  if (auto p = get_bool(body, "parallel_tool_calls"); p && !*p)
    bad_request("parallel_tool_calls", "'parallel_tool_calls': false cannot be enforced (Kimi may emit several calls)");
}

// response_format and grammar. The schema is re-read from the body text in document order: JSON
// objects here are key-sorted, and properties are generated in the schema's order.
void parse_constraint(const json& body, std::string_view body_text, ApiRequest& r) {
  if (const json* rf = field(body, "response_format")) {
    if (!rf->is_object()) wrong_type("response_format", "an object", *rf);
    const std::string type = string_or(*rf, "type", "text");
    if (type == "json_object") {
      r.constraint = ApiRequest::Constraint::json_object;
    } else if (type == "json_schema") {
      auto js = rf->find("json_schema");
      if (js == rf->end() || !js->is_object())
        bad_request("response_format", "'response_format.json_schema': expected an object with 'schema'");
      auto sc = js->find("schema");
      if (sc == js->end() || !(sc->is_object() || sc->is_boolean()))
        bad_request("response_format", "'response_format.json_schema.schema': expected a JSON Schema object");
      if (auto st = js->find("strict"); st != js->end() && !st->is_null()) {
        if (!st->is_boolean()) bad_request("response_format", "'response_format.json_schema.strict': expected a boolean");
        r.constraint_strict = st->get<bool>();
      }
      r.constraint = ApiRequest::Constraint::json_schema;
      r.constraint_source = nlohmann::ordered_json::parse(body_text)["response_format"]["json_schema"]["schema"].dump();
    } else if (type != "text") {
      bad_request("response_format", cat("'response_format.type': expected \"text\", \"json_object\" or \"json_schema\", got '",
                                         escaped_excerpt(type, 40), "'"));
    }
  }
  if (auto g = get_string(body, "grammar"); g && !g->empty()) {
    if (r.constraint != ApiRequest::Constraint::none) bad_request("grammar", "'grammar' and 'response_format' cannot both constrain the output");
    r.constraint = ApiRequest::Constraint::gbnf;
    r.constraint_source = *g;
  }
}

void parse_sampling(const json& body, ApiRequest& r) {
  for (const char* name : {"max_tokens", "max_completion_tokens"}) {
    if (auto v = get_int(body, name)) {
      if (*v < 1) bad_request(name, cat("'", name, "' = ", *v, ": must be at least 1"));
      r.max_tokens = *v;  // max_completion_tokens (the newer name) wins when both are given
    }
  }
  auto finite = [](const char* name, double v, double lo, double hi) {
    if (!std::isfinite(v) || v < lo || v > hi) bad_request(name, cat("'", name, "' = ", v, ": must be in [", lo, ", ", hi, "]"));
    return float(v);
  };
  if (auto v = get_number(body, "temperature")) r.temperature = finite("temperature", *v, 0.0, 100.0);
  if (auto v = get_number(body, "top_p")) {
    if (!(*v > 0.0 && *v <= 1.0)) bad_request("top_p", cat("'top_p' = ", *v, ": must be in (0, 1]"));
    r.top_p = float(*v);
  }
  if (auto v = get_number(body, "min_p")) r.min_p = finite("min_p", *v, 0.0, 1.0);
  if (auto v = get_int(body, "top_k")) {
    // vLLM's "off" is -1, llama.cpp's 0: accept both.
    if (*v < -1 || *v > std::numeric_limits<int32_t>::max()) bad_request("top_k", cat("'top_k' = ", *v, ": must be -1, 0 (off) or positive"));
    r.top_k = int32_t(*v < 0 ? 0 : *v);
  }
  if (auto v = get_int(body, "seed")) {
    if (*v < 0) bad_request("seed", cat("'seed' = ", *v, ": must be non-negative"));
    r.seed = uint64_t(*v);
  }
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (size_t i = 0; i < s->size(); ++i) {
        if (!(*s)[i].is_string()) wrong_type(cat("stop[", i, "]"), "a string", (*s)[i]);
        r.stop.push_back((*s)[i].get<std::string>());
      }
    } else {
      wrong_type("stop", "a string or an array of strings", *s);
    }
    if (r.stop.size() > kMaxStopStrings)
      bad_request("stop", cat("'stop': ", r.stop.size(), " stop strings (at most ", kMaxStopStrings, ")"));
    for (const auto& st : r.stop)
      if (st.empty()) bad_request("stop", "'stop': stop strings must not be empty");
  }
  r.stream = get_bool(body, "stream").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    if (!r.stream) bad_request("stream_options", "'stream_options' is only allowed with \"stream\": true");
    if (auto iu = get_bool(*so, "include_usage")) r.include_usage = *iu;
  }
  r.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
}

void parse_logprobs(const json& body, ApiRequest& r) {
  const json* lp = field(body, "logprobs");
  if (r.endpoint == Endpoint::chat) {
    // Chat: logprobs is a boolean, top_logprobs the number of alternatives (needs logprobs: true).
    const bool on = lp ? (lp->is_boolean() ? lp->get<bool>() : (wrong_type("logprobs", "a boolean", *lp), false)) : false;
    auto top = get_int(body, "top_logprobs");
    if (top && (*top < 0 || *top > kMaxTopLogprobs))
      bad_request("top_logprobs", cat("'top_logprobs' = ", *top, ": must be in [0, ", kMaxTopLogprobs, "]"));
    if (top && !on) bad_request("top_logprobs", "'top_logprobs' needs \"logprobs\": true");
    if (on) r.top_logprobs = int32_t(top.value_or(0));
  } else {
    // Completions: logprobs is the number of alternatives (0 → the chosen token's only).
    if (auto n = get_int(body, "logprobs")) {
      if (*n < 0 || *n > kMaxTopLogprobs) bad_request("logprobs", cat("'logprobs' = ", *n, ": must be in [0, ", kMaxTopLogprobs, "]"));
      r.top_logprobs = int32_t(*n);
    }
  }
}

void parse_prompt(const json& body, ApiRequest& r) {
  const json* p = field(body, "prompt");
  if (!p) bad_request("prompt", "'prompt' is required");
  auto ids_of = [&](const json& a, const std::string& where) {
    std::vector<int32_t> ids;
    for (size_t i = 0; i < a.size(); ++i) {
      const json& v = a[i];
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > std::numeric_limits<int32_t>::max())
        bad_request("prompt", cat("'", where, "[", i, "]': expected a non-negative token id"));
      ids.push_back(int32_t(v.get<int64_t>()));
    }
    return ids;
  };
  const json* one = p;
  // A list of prompts is a batch (n prompts → n choices); one element is just that prompt.
  if (p->is_array() && !p->empty() && (p->front().is_string() || p->front().is_array())) {
    if (p->size() != 1) bad_request("prompt", cat("'prompt': ", p->size(), " prompts in one request (only one is supported)"));
    one = &p->front();
  }
  if (one->is_string()) {
    r.prompt_text = one->get<std::string>();
    if (r.prompt_text.empty()) bad_request("prompt", "'prompt' is empty");
  } else if (one->is_array()) {
    if (one->empty()) bad_request("prompt", "'prompt' is empty");
    r.prompt_ids = ids_of(*one, "prompt");
    r.prompt_is_ids = true;
  } else {
    wrong_type("prompt", "a string or an array of token ids", *one);
  }
}

void parse_chat(const json& body, ApiRequest& r) {
  const json* m = field(body, "messages");
  if (!m) bad_request("messages", "'messages' is required");
  if (!m->is_array()) wrong_type("messages", "an array", *m);
  if (m->empty()) bad_request("messages", "'messages' is empty");
  try {
    r.messages = chat_messages_from_json(m->dump());
  } catch (const Error& e) {
    bad_request("messages", e.what());
  }
  if (const json* tools = field(body, "tools")) {
    if (!tools->is_array()) wrong_type("tools", "an array", *tools);
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string w = cat("tools[", i, "]");
      if (!t.is_object()) wrong_type(w, "an object", t);
      if (string_or(t, "type") != "function") bad_request(w, cat("'", w, ".type': only \"function\" tools are supported"));
      const json* f = field(t, "function");
      if (!f || !f->is_object()) bad_request(w, cat("'", w, ".function': expected an object"));
      auto name = get_string(*f, "name");
      if (!name || name->empty()) bad_request(w, cat("'", w, ".function.name': expected a non-empty string"));
      if (const json* params = field(*f, "parameters"); params && !params->is_object())
        wrong_type(w + ".function.parameters", "an object", *params);
      // Strict tools: the tool-call section is decoded under a grammar (server/tool_grammar.h).
      if (const json* strict = field(*f, "strict")) {
        if (!strict->is_boolean()) wrong_type(w + ".function.strict", "a boolean", *strict);
        r.strict_tools = r.strict_tools || strict->get<bool>();
      }
      r.tool_names.push_back(*name);
    }
    if (!tools->empty()) r.tools_json = tools->dump();
  }
  if (const json* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      const std::string s = tc->get<std::string>();
      if (s == "none") r.tool_choice = ToolChoice::none;
      else if (s == "auto") r.tool_choice = ToolChoice::auto_;
      else if (s == "required") r.tool_choice = ToolChoice::required;
      else bad_request("tool_choice", cat("'tool_choice': '", escaped_excerpt(s), "' (expected none, auto, required or {\"type\": \"function\", ...})"));
    } else if (tc->is_object()) {
      const json* f = field(*tc, "function");
      auto name = f && f->is_object() ? get_string(*f, "name") : std::nullopt;
      if (string_or(*tc, "type") != "function" || !name)
        bad_request("tool_choice", "'tool_choice': expected {\"type\": \"function\", \"function\": {\"name\": ...}}");
      r.tool_choice = ToolChoice::named;
      r.tool_choice_name = *name;
    } else {
      wrong_type("tool_choice", "a string or an object", *tc);
    }
    if ((r.tool_choice == ToolChoice::required || r.tool_choice == ToolChoice::named) && r.tool_names.empty())
      bad_request("tool_choice", "'tool_choice' requires a call but 'tools' is empty");
    if (r.tool_choice == ToolChoice::named &&
        std::find(r.tool_names.begin(), r.tool_names.end(), r.tool_choice_name) == r.tool_names.end())
      bad_request("tool_choice", cat("'tool_choice': function '", escaped_excerpt(r.tool_choice_name), "' is not in 'tools'"));
  }
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) wrong_type("chat_template_kwargs", "an object", *kw);
    for (auto it = kw->begin(); it != kw->end(); ++it) {
      if (it.key() != "thinking")
        bad_request("chat_template_kwargs", cat("'chat_template_kwargs.", escaped_excerpt(it.key()), "': not supported (the native templates know 'thinking')"));
    }
    if (auto t = get_bool(*kw, "thinking")) r.thinking = *t;
  }
}

}  // namespace

ApiRequest parse_api_request(Endpoint endpoint, std::string_view body_text) {
  json body;
  try {
    check_json_depth(body_text, "request body");
  } catch (const Error& e) {  // dump() and copies recurse per level: refuse before parsing
    bad_request("", e.what());
  }
  try {
    body = json::parse(body_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
    const std::string what = e.what();
    if (what.find("UTF-8") != std::string::npos)
      bad_request("", cat("request body is not valid UTF-8 (", what, ")"));
    bad_request("", cat("request body is not valid JSON (", what, ")"));
  }
  if (!body.is_object()) bad_request("", cat("request body: expected a JSON object, got ", type_name(body)));
  ApiRequest r;
  r.endpoint = endpoint;
  if (auto m = get_string(body, "model")) r.model = *m;
  refuse_unsupported(body);
  parse_constraint(body, body_text, r);
  parse_sampling(body, r);
  parse_logprobs(body, r);
  if (endpoint == Endpoint::chat) {
    parse_chat(body, r);
    // The parameter schemas in document order (this body's objects are key-sorted).
    // (Also for tool_choice required / named: the grammar then forces a call of a declared function.)
    if (r.strict_tools || r.tool_choice == ToolChoice::required || r.tool_choice == ToolChoice::named)
      r.tools_json_ordered = nlohmann::ordered_json::parse(body_text)["tools"].dump();
  } else {
    parse_prompt(body, r);
    for (const char* p : {"messages", "tools", "tool_choice", "chat_template_kwargs"})
      if (field(body, p)) bad_request(p, cat("'", p, "' belongs to /v1/chat/completions, not /v1/completions"));
  }
  return r;
}

}  // namespace kd
