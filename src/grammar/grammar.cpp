#include "grammar/grammar.h"

#include <algorithm>
#include <map>

#include "core/error.h"

namespace kd::grammar {

namespace {

constexpr uint32_t kMaxScalar = 0x10FFFF;

int utf8_len(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

void encode(uint32_t cp, int n, uint8_t out[4]) {
  if (n == 1) {
    out[0] = uint8_t(cp);
    return;
  }
  static constexpr uint8_t lead[5] = {0, 0, 0xC0, 0xE0, 0xF0};
  for (int i = n - 1; i > 0; --i, cp >>= 6) out[i] = uint8_t(0x80 | (cp & 0x3F));
  out[0] = uint8_t(lead[n] | cp);
}

// [lo, hi] share one encoding length n: cut it until every piece is a product of byte ranges (its
// low 6·i bits span everything or the higher bits agree), then each byte position is one range.
void split_same_length(uint32_t lo, uint32_t hi, int n, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out) {
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (uint32_t(1) << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        split_same_length(lo, lo | m, n, out);
        split_same_length((lo | m) + 1, hi, n, out);
        return;
      }
      if ((hi & m) != m) {
        split_same_length(lo, (hi & ~m) - 1, n, out);
        split_same_length(hi & ~m, hi, n, out);
        return;
      }
    }
  }
  uint8_t a[4], b[4];
  encode(lo, n, a);
  encode(hi, n, b);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (int k = 0; k < n; ++k) seq.push_back({a[k], b[k]});
  out.push_back(std::move(seq));
}

}  // namespace

std::vector<std::vector<std::pair<uint8_t, uint8_t>>> utf8_ranges(uint32_t lo, uint32_t hi) {
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> out;
  hi = std::min(hi, kMaxScalar);
  auto add = [&](uint32_t a, uint32_t b) {
    static constexpr uint32_t bounds[4] = {0x7F, 0x7FF, 0xFFFF, kMaxScalar};
    while (a <= b) {
      const int n = utf8_len(a);
      const uint32_t e = std::min(b, bounds[n - 1]);
      split_same_length(a, e, n, out);
      if (e == b) break;
      a = e + 1;
    }
  };
  if (lo > hi) return out;
  // Surrogates (U+D800–U+DFFF) are not scalar values: UTF-8 never encodes them.
  if (hi < 0xD800 || lo > 0xDFFF) {
    add(lo, hi);
  } else {
    if (lo < 0xD800) add(lo, 0xD7FF);
    if (hi > 0xDFFF) add(0xE000, hi);
  }
  return out;
}

int32_t GrammarBuilder::rule(std::string_view name) {
  auto [it, added] = rule_index_.try_emplace(std::string(name), int32_t(g_.names.size()));
  if (added) {
    g_.names.emplace_back(name);
    g_.rules.emplace_back();
    defined_.push_back(false);
  }
  return it->second;
}

int32_t GrammarBuilder::fresh(std::string_view base) {
  for (;;) {
    const std::string n = cat(base, "-", ++n_fresh_);
    if (!rule_index_.count(n)) return rule(n);
  }
}

void GrammarBuilder::add_alternative(int32_t r, Sequence seq) {
  n_elements_ += int64_t(seq.size()) + 1;
  if (n_elements_ > kMaxElements)
    fail("grammar: more than ", kMaxElements, " elements once repetitions are written out (rule '", g_.names[size_t(r)], "'): it is too large");
  g_.rules[size_t(r)].push_back(std::move(seq));
  defined_[size_t(r)] = true;
}

Element GrammarBuilder::byte_set(const ByteSet& s) {
  std::string key(reinterpret_cast<const char*>(s.bits.data()), sizeof(s.bits));
  auto [it, added] = set_index_.try_emplace(std::move(key), int32_t(g_.sets.size()));
  if (added) g_.sets.push_back(s);
  return {Element::bytes, it->second};
}

void GrammarBuilder::literal(Sequence& seq, std::string_view bytes) {
  for (unsigned char c : bytes) {
    ByteSet s;
    s.add(c);
    seq.push_back(byte_set(s));
  }
}

int32_t GrammarBuilder::char_class(const CodepointRanges& ranges_in, bool negated, std::string_view what) {
  CodepointRanges r;
  for (auto [a, b] : ranges_in)
    if (a <= b && a <= kMaxScalar) r.push_back({a, std::min(b, kMaxScalar)});
  std::sort(r.begin(), r.end());
  CodepointRanges merged;
  for (auto [a, b] : r) {
    if (!merged.empty() && a <= merged.back().second + 1)
      merged.back().second = std::max(merged.back().second, b);
    else
      merged.push_back({a, b});
  }
  if (negated) {
    CodepointRanges inv;
    uint32_t next = 0;
    for (auto [a, b] : merged) {
      if (a > next) inv.push_back({next, a - 1});
      next = b + 1;
    }
    if (next <= kMaxScalar) inv.push_back({next, kMaxScalar});
    merged = std::move(inv);
  }
  const int32_t id = fresh("class");
  bool any = false;
  // One alternative per UTF-8 shape; single-byte ranges share one set.
  ByteSet ascii;
  bool have_ascii = false;
  for (auto [a, b] : merged)
    for (const auto& seq : utf8_ranges(a, b)) {
      if (seq.size() == 1) {
        ascii.add_range(seq[0].first, seq[0].second);
        have_ascii = true;
        continue;
      }
      Sequence s;
      for (auto [x, y] : seq) {
        ByteSet bs;
        bs.add_range(x, y);
        s.push_back(byte_set(bs));
      }
      add_alternative(id, std::move(s));
      any = true;
    }
  if (have_ascii) add_alternative(id, {byte_set(ascii)}), any = true;
  if (!any) fail(what, ": the character class matches no character");
  return id;
}

int32_t GrammarBuilder::repeat(const Sequence& body, int64_t min, int64_t max, std::string_view base) {
  if (min < 0 || (max >= 0 && max < min)) fail(base, ": repetition {", min, ",", max, "} is empty");
  if (min > kMaxRepeat || max > kMaxRepeat)
    fail(base, ": repetition counts above ", kMaxRepeat, " are not supported (got {", min, ",", max, "})");
  const int32_t id = fresh(base);
  // tail: what may follow the `min` copies — `body*` (right-recursive) or up to max − min more,
  // nested so that each count has one parse: t_k ::= "" | body t_{k−1}.
  int32_t tail = -1;
  if (max < 0) {
    tail = fresh(cat(base, "-star"));
    Sequence s = body;
    s.push_back({Element::rule, tail});
    add_alternative(tail, std::move(s));
    add_alternative(tail, {});
  } else {
    for (int64_t k = 0; k < max - min; ++k) {
      const int32_t t = fresh(cat(base, "-opt"));
      Sequence s = body;
      if (tail >= 0) s.push_back({Element::rule, tail});
      add_alternative(t, std::move(s));
      add_alternative(t, {});
      tail = t;
    }
  }
  Sequence s;
  for (int64_t k = 0; k < min; ++k) {
    if (int64_t(s.size()) > kMaxElements) fail(base, ": the repetition is too large once written out");
    s.insert(s.end(), body.begin(), body.end());
  }
  if (tail >= 0) s.push_back({Element::rule, tail});
  add_alternative(id, std::move(s));
  return id;
}

Grammar GrammarBuilder::finish(std::string_view root_name) {
  const size_t n = g_.rules.size();
  for (size_t r = 0; r < n; ++r)
    if (!defined_[r]) fail("grammar: rule '", g_.names[r], "' is used but never defined");
  auto it = rule_index_.find(std::string(root_name));
  if (it == rule_index_.end()) fail("grammar: no '", root_name, "' rule");
  g_.root = it->second;
  // Nullable rules, then the "starts with" graph through nullable prefixes: a cycle in it is left
  // recursion, which a top-down matcher cannot run (llama.cpp refuses it too). Both in linear time
  // and without recursion (a chain of 10^5 rules neither takes a pass per link nor the stack).
  // An alternative of rule elements only is nullable once each of them is: count the ones not yet
  // known, and mark its rule when the count reaches 0 (a worklist of rules found nullable).
  std::vector<bool> nullable(n, false);
  std::vector<int32_t> alt_rule, left;           // [alternatives of rule elements only]
  std::vector<std::vector<int32_t>> occurs(n);   // [rule] → those alternatives, once per occurrence
  std::vector<int32_t> found;
  auto mark = [&](int32_t r) {
    if (!nullable[size_t(r)]) nullable[size_t(r)] = true, found.push_back(r);
  };
  for (size_t r = 0; r < n; ++r)
    for (const Sequence& s : g_.rules[r]) {
      if (!std::all_of(s.begin(), s.end(), [](const Element& e) { return e.kind == Element::rule; })) continue;
      if (s.empty()) {
        mark(int32_t(r));
        continue;
      }
      const int32_t a = int32_t(alt_rule.size());
      alt_rule.push_back(int32_t(r));
      left.push_back(int32_t(s.size()));
      for (const Element& e : s) occurs[size_t(e.index)].push_back(a);
    }
  while (!found.empty()) {
    const int32_t r = found.back();
    found.pop_back();
    for (int32_t a : occurs[size_t(r)])
      if (--left[size_t(a)] == 0) mark(alt_rule[size_t(a)]);
  }
  std::vector<std::vector<int32_t>> starts(n);
  for (size_t r = 0; r < n; ++r)
    for (const Sequence& s : g_.rules[r])
      for (const Element& e : s) {
        if (e.kind != Element::rule) break;
        starts[r].push_back(e.index);
        if (!nullable[size_t(e.index)]) break;
      }
  std::vector<int> color(n, 0);  // 0 new, 1 on the DFS path, 2 done
  std::vector<std::pair<int32_t, size_t>> path;  // the DFS path: (rule, next edge to follow)
  for (size_t root = 0; root < n; ++root) {
    if (color[root] != 0) continue;
    color[root] = 1;
    path.push_back({int32_t(root), 0});
    while (!path.empty()) {
      auto& [r, next] = path.back();
      if (next == starts[size_t(r)].size()) {
        color[size_t(r)] = 2;
        path.pop_back();
        continue;
      }
      const int32_t t = starts[size_t(r)][next++];
      if (color[size_t(t)] == 1) {
        std::string cyc;
        size_t k = 0;
        while (path[k].first != t) ++k;
        for (; k < path.size(); ++k) cyc += g_.names[size_t(path[k].first)] + " → ";
        fail("grammar: rule '", g_.names[size_t(t)], "' is left-recursive (", cyc, g_.names[size_t(t)],
             "); rewrite it with repetition, e.g. x ::= y (\",\" y)*");
      }
      if (color[size_t(t)] == 0) {
        color[size_t(t)] = 1;
        path.push_back({t, 0});  // (invalidates r and next: not used past here)
      }
    }
  }
  return std::move(g_);
}

}  // namespace kd::grammar
