#include "grammar/grammar.h"

#include <algorithm>
#include <functional>
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
  for (size_t i = 0; i < g_.names.size(); ++i)
    if (g_.names[i] == name) return int32_t(i);
  g_.names.emplace_back(name);
  g_.rules.emplace_back();
  defined_.push_back(false);
  return int32_t(g_.names.size() - 1);
}

int32_t GrammarBuilder::fresh(std::string_view base) {
  for (;;) {
    const std::string n = cat(base, "-", ++n_fresh_);
    if (std::find(g_.names.begin(), g_.names.end(), n) == g_.names.end()) return rule(n);
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
  for (size_t i = 0; i < g_.sets.size(); ++i)
    if (g_.sets[i] == s) return {Element::bytes, int32_t(i)};
  g_.sets.push_back(s);
  return {Element::bytes, int32_t(g_.sets.size() - 1)};
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
  auto it = std::find(g_.names.begin(), g_.names.end(), root_name);
  if (it == g_.names.end()) fail("grammar: no '", root_name, "' rule");
  g_.root = int32_t(it - g_.names.begin());
  // Nullable rules (fixpoint), then the "starts with" graph through nullable prefixes: a cycle in
  // it is left recursion, which a top-down matcher cannot run (llama.cpp refuses it too).
  std::vector<bool> nullable(n, false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const Sequence& s : g_.rules[r]) {
        const bool all = std::all_of(s.begin(), s.end(), [&](const Element& e) {
          return e.kind == Element::rule && nullable[size_t(e.index)];
        });
        if (all) {
          nullable[r] = changed = true;
          break;
        }
      }
    }
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
  std::vector<int32_t> path;
  std::function<void(int32_t)> dfs = [&](int32_t r) {
    color[size_t(r)] = 1;
    path.push_back(r);
    for (int32_t t : starts[size_t(r)]) {
      if (color[size_t(t)] == 1) {
        std::string cyc;
        for (auto p = std::find(path.begin(), path.end(), t); p != path.end(); ++p) cyc += g_.names[size_t(*p)] + " → ";
        fail("grammar: rule '", g_.names[size_t(t)], "' is left-recursive (", cyc, g_.names[size_t(t)],
             "); rewrite it with repetition, e.g. x ::= y (\",\" y)*");
      }
      if (color[size_t(t)] == 0) dfs(t);
    }
    path.pop_back();
    color[size_t(r)] = 2;
  };
  for (size_t r = 0; r < n; ++r)
    if (color[r] == 0) dfs(int32_t(r));
  return std::move(g_);
}

}  // namespace kd::grammar
