#include "grammar/json_number.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <vector>

#include "core/error.h"

// GCC 12 reports -Wrestrict on std::string concatenation at -O3 (a false positive, GCC bug 105329).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

namespace kd::grammar {

namespace {

std::string u128_string(u128 v) {
  if (v == 0) return "0";
  std::string s;
  for (; v; v /= 10) s += char('0' + int(v % 10));
  std::reverse(s.begin(), s.end());
  return s;
}

std::string lit(const std::string& digits) { return "\"" + digits + "\""; }
std::string digit_class(char a, char b) { return a == b ? lit(std::string(1, a)) : cat("[", a, "-", b, "]"); }

std::string any_of(const std::vector<std::string>& alts) {
  if (alts.size() == 1) return alts[0];
  std::string s = "(";
  for (size_t i = 0; i < alts.size(); ++i) s += (i ? " | " : "") + alts[i];
  return s + ")";
}

bool all(const std::string& s, size_t from, char c) {
  for (size_t i = from; i < s.size(); ++i)
    if (s[i] != c) return false;
  return true;
}

// Digit strings of A's length n in [A, B] (A ≤ B, leading zeros as given): one pattern per place
// where A and B first differ, split into "A's digit then ≥ A's rest", whole digits between, and
// "B's digit then ≤ B's rest".
std::string same_length(const std::string& a, const std::string& b) {
  size_t i = 0;
  while (i < a.size() && a[i] == b[i]) ++i;
  const std::string prefix = a.substr(0, i);
  if (i == a.size()) return lit(a);
  const size_t rest = a.size() - i - 1;
  const std::string head = prefix.empty() ? "" : lit(prefix) + " ";
  const std::string tail = rest ? cat(" [0-9]{", rest, "}") : "";
  char lo = a[i], hi = b[i];
  std::vector<std::string> alts;
  if (rest && !all(a, i + 1, '0')) {
    alts.push_back(head + lit(std::string(1, a[i])) + " " + same_length(a.substr(i + 1), std::string(rest, '9')));
    ++lo;
  }
  std::string high;
  if (rest && !all(b, i + 1, '9')) {
    high = head + lit(std::string(1, b[i])) + " " + same_length(std::string(rest, '0'), b.substr(i + 1));
    --hi;
  }
  if (lo <= hi) alts.push_back(head + digit_class(lo, hi) + tail);
  if (!high.empty()) alts.push_back(high);
  return any_of(alts);
}

// Non-negative integers without leading zeros in [a, b] (b absent: unbounded), a ≤ b.
std::string uint_range(u128 a, std::optional<u128> b) {
  const std::string as = u128_string(a);
  const size_t la = as.size();
  if (b && u128_string(*b).size() == la) return same_length(as, u128_string(*b));
  std::vector<std::string> alts{same_length(as, std::string(la, '9'))};
  if (!b) {
    alts.push_back(cat("[1-9] [0-9]{", la, ",}"));
    return any_of(alts);
  }
  const std::string bs = u128_string(*b);
  const size_t lb = bs.size();
  if (lb > la + 1) alts.push_back(cat("[1-9] [0-9]{", la, ",", lb - 2, "}"));
  alts.push_back(same_length("1" + std::string(lb - 1, '0'), bs));
  return any_of(alts);
}

// Fraction digits F (compared as a decimal fraction: "5" = "50") with F ≥ f, F ≤ f, or between;
// `need`: at least one digit (the first one after the '.').
std::string frac_ge(const std::string& f, size_t i, bool need) {
  if (all(f, i, '0')) return need ? "[0-9]+" : "[0-9]*";
  std::vector<std::string> alts;
  if (f[i] < '9') alts.push_back(digit_class(char(f[i] + 1), '9') + " [0-9]*");
  alts.push_back(lit(std::string(1, f[i])) + " " + frac_ge(f, i + 1, false));
  return any_of(alts);
}

std::string frac_le(const std::string& f, size_t i, bool need) {
  if (all(f, i, '0')) return need ? "\"0\"+" : "\"0\"*";
  std::vector<std::string> alts;
  if (!need) alts.push_back("\"\"");
  if (f[i] > '0') alts.push_back(digit_class('0', char(f[i] - 1)) + " [0-9]*");
  alts.push_back(lit(std::string(1, f[i])) + " " + frac_le(f, i + 1, false));
  return any_of(alts);
}

// lo ≤ F ≤ hi, both padded to one length.
std::string frac_between(const std::string& lo, const std::string& hi, size_t i, bool need) {
  if (i >= lo.size()) return need ? "\"0\"+" : "\"0\"*";
  std::vector<std::string> alts;
  if (!need && all(lo, i, '0')) alts.push_back("\"\"");
  const char a = lo[i], b = hi[i];
  if (a == b) {
    alts.push_back(lit(std::string(1, a)) + " " + frac_between(lo, hi, i + 1, false));
  } else {
    alts.push_back(lit(std::string(1, a)) + " " + frac_ge(lo, i + 1, false));
    if (a + 1 <= b - 1) alts.push_back(digit_class(char(a + 1), char(b - 1)) + " [0-9]*");
    alts.push_back(lit(std::string(1, b)) + " " + frac_le(hi, i + 1, false));
  }
  return any_of(alts);
}

// A non-negative decimal: integer part and fraction digits (trailing zeros removed).
struct Decimal {
  u128 whole = 0;
  std::string frac;
};

// The shortest spelling of |v| that reads back as v, as a Decimal.
Decimal spell(double v, const std::string& what) {
  char buf[400];
  const auto r = std::to_chars(buf, buf + sizeof buf, std::fabs(v), std::chars_format::fixed);
  if (r.ec != std::errc()) fail(what, ": cannot spell the bound ", v);
  const std::string s(buf, r.ptr);
  const size_t dot = s.find('.');
  const std::string w = s.substr(0, dot);
  Decimal d;
  if (w.size() > 19) fail(what, ": bounds beyond ±1e19 are not supported (got ", v, ")");
  for (char c : w) d.whole = d.whole * 10 + u128(c - '0');
  if (dot != std::string::npos) d.frac = s.substr(dot + 1);
  while (!d.frac.empty() && d.frac.back() == '0') d.frac.pop_back();
  if (d.frac.size() > 40) fail(what, ": bounds with more than 40 decimal places are not supported (got ", v, ")");
  return d;
}

// Non-negative literals with a fraction ("I.F") whose value is in [a, b] (b absent: unbounded).
std::string fraction_range(const Decimal& a, const std::optional<Decimal>& b) {
  const std::string ai = u128_string(a.whole);
  if (b && b->whole == a.whole) {
    const size_t n = std::max(a.frac.size(), b->frac.size());
    std::string lo = a.frac, hi = b->frac;
    lo.resize(n, '0'), hi.resize(n, '0');
    return lit(ai) + " \".\" " + frac_between(lo, hi, 0, true);
  }
  std::vector<std::string> alts{lit(ai) + " \".\" " + frac_ge(a.frac, 0, true)};
  if (!b) {
    alts.push_back(uint_range(a.whole + 1, std::nullopt) + " \".\" [0-9]+");
    return any_of(alts);
  }
  if (a.whole + 1 <= b->whole - 1) alts.push_back(uint_range(a.whole + 1, b->whole - 1) + " \".\" [0-9]+");
  alts.push_back(lit(u128_string(b->whole)) + " \".\" " + frac_le(b->frac, 0, true));
  return any_of(alts);
}

}  // namespace

std::string int128_string(i128 v) { return v < 0 ? "-" + u128_string(u128(-v)) : u128_string(u128(v)); }

std::string integer_range_gbnf(const IntRange& r) {
  if (r.lo && r.hi && *r.lo > *r.hi) return "";
  std::vector<std::string> alts;
  if (!r.hi || *r.hi >= 0) {
    const u128 a = r.lo && *r.lo > 0 ? u128(*r.lo) : 0;
    alts.push_back(uint_range(a, r.hi ? std::optional<u128>(u128(*r.hi)) : std::nullopt));
  }
  if (!r.lo || *r.lo < 0) {
    // "-n" for n in [max(1, −hi), −lo]: never "-0".
    const u128 a = r.hi && *r.hi < 0 ? u128(-*r.hi) : 1;
    alts.push_back("\"-\" " + uint_range(a, r.lo ? std::optional<u128>(u128(-*r.lo)) : std::nullopt));
  }
  return any_of(alts);
}

std::string number_range_gbnf(std::optional<double> lo, std::optional<double> hi, const std::string& what) {
  std::vector<std::string> alts;
  IntRange ints;
  auto whole = [&](double v) {
    if (std::fabs(v) >= 1e19) fail(what, ": bounds beyond ±1e19 are not supported (got ", v, ")");
    return i128(v);  // v is integral here: exact
  };
  if (lo) ints.lo = whole(std::ceil(*lo));
  if (hi) ints.hi = whole(std::floor(*hi));
  if (!(ints.lo && ints.hi && *ints.lo > *ints.hi)) alts.push_back(integer_range_gbnf(ints));
  if (!hi || *hi >= 0) {
    const Decimal a = lo && *lo > 0 ? spell(*lo, what) : Decimal{};
    alts.push_back(fraction_range(a, hi ? std::optional<Decimal>(spell(*hi, what)) : std::nullopt));
  }
  if (!lo || *lo < 0) {
    const Decimal a = hi && *hi < 0 ? spell(*hi, what) : Decimal{};
    alts.push_back("\"-\" " + fraction_range(a, lo ? std::optional<Decimal>(spell(*lo, what)) : std::nullopt));
  }
  return any_of(alts);
}

std::vector<std::pair<std::string, std::string>> multiple_of_rules(int64_t k, const std::string& prefix) {
  // r(j): the digits read so far are ≡ j (mod k); the literal may end where j = 0.
  auto state = [&](int64_t j) { return cat(prefix, "-r", j); };
  auto edges = [&](int64_t j, int first_digit) {
    std::vector<std::string> alts;
    for (int d = first_digit; d <= 9; ++d) {
      const int64_t n = (j * 10 + d) % k;
      alts.push_back(cat(digit_class(char('0' + d), char('0' + d)), " ", state(n)));
    }
    return alts;
  };
  std::vector<std::pair<std::string, std::string>> rules;
  std::string nz;
  for (const std::string& a : edges(0, 1)) nz += (nz.empty() ? "" : " | ") + a;
  rules.push_back({prefix, cat("\"0\" | \"-\"? ", prefix, "-nz")});
  rules.push_back({prefix + "-nz", nz});
  for (int64_t j = 0; j < k; ++j) {
    std::string body = j == 0 ? "\"\"" : "";
    for (const std::string& a : edges(j, 0)) body += (body.empty() ? "" : " | ") + a;
    rules.push_back({state(j), body});
  }
  return rules;
}

}  // namespace kd::grammar
