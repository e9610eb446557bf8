// Test helpers for the grammar engine: whether a grammar's language holds a byte string, or some
// JSON spelling of a value — the spelling a matcher over single bytes can reach, trying every order
// of each object's keys (the grammar writes properties in schema order) and, for numbers, both
// the value as parsed and an integral float's integer form ("1.0" and "1": JSON Schema calls both
// integers). Separators are the server's: ", " and ": ".
#pragma once
#include <algorithm>
#include <charconv>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "grammar/matcher.h"

namespace kd::test {

// A matcher over the 256 single bytes (no stop id).
inline grammar::Matcher byte_matcher(const grammar::Grammar& g) {
  static const std::shared_ptr<const grammar::VocabTrie> vocab = [] {
    std::vector<std::string> v;
    for (int b = 0; b < 256; ++b) v.push_back(std::string(1, char(b)));
    return std::make_shared<const grammar::VocabTrie>(v, std::vector<bool>(256, false));
  }();
  return grammar::Matcher(std::make_shared<const grammar::CompiledGrammar>(g), vocab, {});
}

inline bool accepts_bytes(const grammar::Grammar& g, const std::string& text) {
  grammar::Matcher m = byte_matcher(g);
  const auto s = m.advance_bytes(m.state(), text);
  return s != grammar::Matcher::kDead && m.accepting(s);
}

// The states the matcher can be in after some spelling of v, from s.
template <class Json>
std::vector<grammar::Matcher::State> after_value(grammar::Matcher& m, grammar::Matcher::State s, const Json& v) {
  using State = grammar::Matcher::State;
  std::vector<State> out;
  auto keep = [&](State t) {
    if (t != grammar::Matcher::kDead && std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  };
  if (v.is_object()) {
    std::vector<std::string> keys;
    for (auto it = v.begin(); it != v.end(); ++it) keys.push_back(it.key());
    // Depth-first over key orders: the matcher prunes an order at its first rejected byte.
    std::vector<bool> used(keys.size(), false);
    auto rec = [&](auto&& self, State at, size_t n_used) -> void {
      if (n_used == keys.size()) {
        keep(m.advance_bytes(at, "}"));
        return;
      }
      for (size_t i = 0; i < keys.size(); ++i) {
        if (used[i]) continue;
        const State k = m.advance_bytes(at, std::string(n_used ? ", " : "") + Json(keys[i]).dump() + ": ");
        if (k == grammar::Matcher::kDead) continue;
        used[i] = true;
        for (State t : after_value(m, k, v[keys[i]])) self(self, t, n_used + 1);
        used[i] = false;
      }
    };
    rec(rec, m.advance_bytes(s, "{"), 0);
    return out;
  }
  if (v.is_array()) {
    std::vector<State> cur{m.advance_bytes(s, "[")};
    for (size_t i = 0; i < v.size(); ++i) {
      std::vector<State> next;
      for (State c : cur) {
        const State sep = i ? m.advance_bytes(c, ", ") : c;
        if (sep == grammar::Matcher::kDead) continue;
        for (State t : after_value(m, sep, v[i]))
          if (std::find(next.begin(), next.end(), t) == next.end()) next.push_back(t);
      }
      cur = std::move(next);
    }
    for (State c : cur) keep(m.advance_bytes(c, "]"));
    return out;
  }
  std::vector<std::string> spellings{v.dump(-1, ' ', false, Json::error_handler_t::replace)};
  if (v.is_number_float()) {
    const double d = v.template get<double>();
    char buf[400];
    auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::fixed);
    spellings.push_back(std::string(buf, r.ptr));
    if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 1e300) spellings.push_back(std::string(buf, r.ptr).substr(0, std::string(buf, r.ptr).find('.')));
  }
  for (const std::string& sp : spellings) keep(m.advance_bytes(s, sp));
  return out;
}

template <class Json>
bool accepts_value(const grammar::Grammar& g, const Json& v) {
  grammar::Matcher m = byte_matcher(g);
  for (auto s : after_value(m, m.state(), v))
    if (m.accepting(s)) return true;
  return false;
}

}  // namespace kd::test
