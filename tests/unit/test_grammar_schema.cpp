// JSON Schema keywords beyond the basics (grammar/json_number.h, grammar/json_format.h,
// json_schema.cpp): each language checked against a brute-force rule over every candidate in a
// range (integers, decimals, multiples), format samples on both sides of the RFC, oneOf's
// disjointness, enum values filtered by their siblings, and the 400s naming path and keyword.
// The official JSON-Schema-Test-Suite runs in test_grammar_suite.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar/gbnf.h"
#include "grammar/json_number.h"
#include "grammar/json_schema.h"
#include "grammar_accepts.h"

namespace {

namespace g = kd::grammar;
using ojson = nlohmann::ordered_json;
using kd::test::accepts_bytes;

g::Grammar schema(const char* text) {
  g::JsonGrammarOptions o;
  o.any_whitespace = false;
  o.strict = false;
  return g::json_schema_grammar(ojson::parse(text), o);
}

std::string error_of(const char* text) {
  try {
    schema(text);
  } catch (const kd::Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(GrammarSchema, IntegerRangesAreExactOverEveryCandidate) {
  const std::vector<std::pair<std::optional<int64_t>, std::optional<int64_t>>> ranges = {
      {0, 0}, {-7, 7}, {1, 9}, {10, 99}, {-250, -13}, {5, 1234}, {-1000, 37}, {99, 100}, {0, std::nullopt}, {std::nullopt, -1},
      {-305, std::nullopt}, {std::nullopt, 512}, {199, 1200}, {-1200, 1200}, {101, 109}};
  for (auto [lo, hi] : ranges) {
    const std::string expr = g::integer_range_gbnf({lo ? std::optional<g::i128>(*lo) : std::nullopt, hi ? std::optional<g::i128>(*hi) : std::nullopt});
    const g::Grammar gr = g::parse_gbnf("root ::= " + expr);
    for (int64_t n = -1500; n <= 1500; ++n) {
      const bool in = (!lo || n >= *lo) && (!hi || n <= *hi);
      ASSERT_EQ(accepts_bytes(gr, std::to_string(n)), in) << n << " in [" << (lo ? *lo : -1) << ", " << (hi ? *hi : -1) << "]";
    }
    for (const char* bad : {"-0", "007", "00", "+1", "1.0", ""}) EXPECT_FALSE(accepts_bytes(gr, bad)) << bad;
  }
  // Far bounds: the patterns stay exact at 19 digits.
  const g::Grammar big = g::parse_gbnf("root ::= " + g::integer_range_gbnf({g::i128(-9223372036854775807LL) - 1, g::i128(999999999999999999LL)}));
  EXPECT_TRUE(accepts_bytes(big, "-9223372036854775808"));
  EXPECT_FALSE(accepts_bytes(big, "-9223372036854775809"));
  EXPECT_TRUE(accepts_bytes(big, "999999999999999999"));
  EXPECT_FALSE(accepts_bytes(big, "1000000000000000000"));
}

TEST(GrammarSchema, IntegerKeywordsIncludingDraft4ExclusiveForm) {
  const g::Grammar a = schema(R"({"type": "integer", "minimum": -3.5, "exclusiveMaximum": 12})");
  const g::Grammar b = schema(R"({"type": "integer", "minimum": 2, "exclusiveMinimum": true, "maximum": 9, "exclusiveMaximum": false})");
  for (int n = -20; n <= 20; ++n) {
    EXPECT_EQ(accepts_bytes(a, std::to_string(n)), n >= -3 && n < 12) << n;
    EXPECT_EQ(accepts_bytes(b, std::to_string(n)), n > 2 && n <= 9) << n;
  }
  EXPECT_NE(error_of(R"({"type": "integer", "minimum": 5, "maximum": 4})").find("$.maximum"), std::string::npos);
  EXPECT_NE(error_of(R"({"type": "integer", "minimum": 1e30})").find("$.minimum"), std::string::npos);
}

TEST(GrammarSchema, NumberRangesAgreeWithDoubleComparisons) {
  // Candidates: integers and decimals with up to 3 places in [-30, 30]; for these, decimal order and
  // double order agree with the bounds used, so the reference is the validator's own comparison.
  std::vector<std::string> cands;
  for (int n = -30; n <= 30; ++n) cands.push_back(std::to_string(n));
  for (int n = -30000; n <= 30000; n += 7) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%d.%03d", n < 0 ? "-" : "", std::abs(n) / 1000, std::abs(n) % 1000);
    cands.push_back(buf);
    std::snprintf(buf, sizeof buf, "%s%d.%d", n < 0 ? "-" : "", std::abs(n) / 1000, (std::abs(n) % 1000) / 100);
    cands.push_back(buf);
  }
  const std::vector<std::pair<std::optional<double>, std::optional<double>>> ranges = {
      {0.0, std::nullopt}, {std::nullopt, 0.0}, {1.1, std::nullopt}, {std::nullopt, 3.0}, {-2.5, 2.5}, {0.1, 0.3}, {-12.75, -0.125},
      {-1.0, 27.0}, {0.3, 0.3}, {5.0, 5.25}, {-0.25, 0.0}, {std::nullopt, -7.3}};
  for (auto [lo, hi] : ranges) {
    const g::Grammar gr = g::parse_gbnf("root ::= " + g::number_range_gbnf(lo, hi, "$"));
    for (const std::string& c : cands) {
      const double x = std::strtod(c.c_str(), nullptr);
      if (x == 0 && c[0] == '-') continue;  // "-0.0": the grammar may leave a negative zero out
      const bool in = (!lo || x >= *lo) && (!hi || x <= *hi);
      ASSERT_EQ(accepts_bytes(gr, c), in) << c << " in [" << (lo ? *lo : -999) << ", " << (hi ? *hi : 999) << "]";
    }
  }
  // Through the schema, with long fractions and the bound's own spelling.
  const g::Grammar s = schema(R"({"type": "number", "minimum": 0.1, "maximum": 100})");
  for (const char* ok : {"0.1", "0.10000", "0.1000000000000000000001", "100", "100.000", "42", "99.999999999"}) EXPECT_TRUE(accepts_bytes(s, ok)) << ok;
  for (const char* bad : {"0.0999999999999", "100.0000001", "101", "0", "-5", "1e1", "0.1e0"}) EXPECT_FALSE(accepts_bytes(s, bad)) << bad;
  EXPECT_NE(error_of(R"({"type": "number", "exclusiveMinimum": 0})").find("$.exclusiveMinimum: not supported for type number"), std::string::npos);
  EXPECT_NE(error_of(R"({"type": "number", "multipleOf": 0.5})").find("$.multipleOf"), std::string::npos);
}

TEST(GrammarSchema, MultipleOfIsAnAutomatonOverTheDigits) {
  for (int k : {1, 2, 3, 7, 10, 12, 25}) {
    const g::Grammar gr = schema(("{\"type\": \"integer\", \"multipleOf\": " + std::to_string(k) + "}").c_str());
    for (int n = -700; n <= 700; ++n) ASSERT_EQ(accepts_bytes(gr, std::to_string(n)), n % k == 0) << n << " mod " << k;
    for (const char* bad : {"-0", "00", "012"}) EXPECT_FALSE(accepts_bytes(gr, bad)) << bad;
  }
  EXPECT_NE(error_of(R"({"type": "integer", "multipleOf": 3, "minimum": 0})").find("$.multipleOf: multipleOf together with minimum"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"type": "integer", "multipleOf": 1.5})").find("$.multipleOf"), std::string::npos);
}

TEST(GrammarSchema, FormatsAcceptTheirRfcSubsetOnly) {
  auto fmt = [](const char* f) { return schema((std::string("{\"type\": \"string\", \"format\": \"") + f + "\"}").c_str()); };
  auto q = [](const std::string& s) { return "\"" + s + "\""; };
  const std::vector<std::tuple<const char*, std::vector<std::string>, std::vector<std::string>>> cases = {
      {"date", {"2024-02-29", "2000-02-29", "1999-12-31", "2023-04-30", "0001-01-01", "0400-02-29"},
       {"0000-01-01", "2023-02-29", "1900-02-29", "2023-04-31", "2023-13-01", "2023-00-10", "2023-1-01", "20230101"}},
      {"time", {"23:59:59Z", "00:00:00.123+05:30", "12:30:00-08:00"}, {"24:00:00Z", "12:60:00Z", "12:00:00", "12:00Z", "12:00:00+5:00"}},
      {"date-time", {"2024-01-31T08:15:00Z", "1985-04-12T23:20:50.52+01:00"}, {"2024-01-31 08:15:00Z", "2024-02-30T00:00:00Z"}},
      {"uuid", {"123e4567-e89b-12d3-a456-426614174000", "ABCDEF01-2345-6789-abcd-ef0123456789"},
       {"123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"}},
      {"ipv4", {"0.0.0.0", "192.168.1.255", "255.255.255.255"}, {"256.1.1.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"}},
      {"ipv6", {"::", "::1", "fe80::1", "2001:db8:0:0:1:0:0:1", "1:2:3:4:5:6:7:8", "::ffff:192.0.2.128", "1::"},
       {"1:2:3:4:5:6:7:8:9", "1::2::3", "12345::", ":1", "g::1", "1:2:3:4:5:6:7"}},
      {"hostname", {"localhost", "example.com", "a-b.c0.d", std::string(62, 'x')}, {"-a.com", "a-.com", "a..b", std::string(63, 'x'), "a_b"}},
      {"email", {"joe@example.com", "first.last+tag@mail.example.org"}, {"joe", "@example.com", "a..b@example.com", "joe@-x.com"}},
      {"uri", {"https://example.com/a/b?c=d#e", "urn:isbn:0451450523", "mailto:joe@example.com", "http://[::1]:8080/", "file:///etc/x"},
       {"example.com", "1http://x", "http://a b", "://x"}},
  };
  for (const auto& [f, good, bad] : cases) {
    const g::Grammar gr = fmt(f);
    for (const std::string& s : good) EXPECT_TRUE(accepts_bytes(gr, q(s))) << f << ": " << s;
    for (const std::string& s : bad) EXPECT_FALSE(accepts_bytes(gr, q(s))) << f << ": " << s;
  }
  EXPECT_EQ(error_of(R"({"type": "string", "format": "int32"})"),
            "$.format: format 'int32' is not supported (supported: date, time, date-time, uuid, ipv4, ipv6, hostname, email, uri)");
  EXPECT_NE(error_of(R"({"type": "string", "format": "date", "maxLength": 20})").find("$.format: format together with minLength"), std::string::npos);
}

TEST(GrammarSchema, OneOfIsExactWhenBranchesAreDisjointAndRefusedOtherwise) {
  const g::Grammar types = schema(R"({"oneOf": [{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "null"}]})");
  for (const char* ok : {"\"x\"", "5", "null"}) EXPECT_TRUE(accepts_bytes(types, ok)) << ok;
  for (const char* bad : {"-1", "true", "[]"}) EXPECT_FALSE(accepts_bytes(types, bad)) << bad;
  // A discriminated union: a required const property tells the branches apart.
  const g::Grammar tagged = schema(R"({"$defs": {"cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                                                       "required": ["kind"], "additionalProperties": false}},
                                       "oneOf": [{"$ref": "#/$defs/cat"},
                                                 {"type": "object", "properties": {"kind": {"enum": ["dog", "wolf"]}, "bark": {"type": "boolean"}},
                                                  "required": ["kind", "bark"], "additionalProperties": false}]})");
  EXPECT_TRUE(accepts_bytes(tagged, R"({"kind": "cat", "lives": 9})"));
  EXPECT_TRUE(accepts_bytes(tagged, R"({"kind": "wolf", "bark": true})"));
  EXPECT_FALSE(accepts_bytes(tagged, R"({"kind": "cat", "bark": true})"));
  EXPECT_TRUE(accepts_bytes(schema(R"({"oneOf": [{"enum": [1, 2]}, {"enum": [3, "a"]}]})"), "3"));
  EXPECT_NE(error_of(R"({"properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}})")
                .find("$.properties.v.oneOf: branches 0 and 1 may both match"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"oneOf": [{"enum": [1, 2]}, {"enum": [2.0, 3]}]})").find("branches 0 and 1"), std::string::npos);
}

TEST(GrammarSchema, EnumValuesAreFilteredByTheirSiblingKeywords) {
  const g::Grammar gr = schema(R"({"type": "string", "enum": ["a", 1, "bcd", null], "maxLength": 2})");
  EXPECT_TRUE(accepts_bytes(gr, "\"a\""));
  for (const char* bad : {"1", "\"bcd\"", "null"}) EXPECT_FALSE(accepts_bytes(gr, bad)) << bad;
  EXPECT_NE(error_of(R"({"type": "integer", "enum": ["x"]})").find("$.enum: no value satisfies"), std::string::npos);
}

TEST(GrammarSchema, UntypedKeywordsConstrainOnlyTheirOwnType) {
  const g::Grammar gr = schema(R"({"minLength": 2, "maximum": 3, "required": ["a"], "properties": {"a": {}}})");
  for (const char* ok : {"\"ab\"", "3", "-9.5", "null", "true", "[1]", R"({"a": 1})"}) EXPECT_TRUE(accepts_bytes(gr, ok)) << ok;
  for (const char* bad : {"\"a\"", "4", "3.5", "{}"}) EXPECT_FALSE(accepts_bytes(gr, bad)) << bad;
}

TEST(GrammarSchema, RefusedKeywordsNameThePath) {
  EXPECT_EQ(error_of(R"({"properties": {"x": {"not": {"type": "string"}}}})"),
            "$.properties.x.not: not supported (a grammar cannot take the complement of a schema)");
  EXPECT_NE(error_of(R"({"if": {"type": "string"}, "then": {"minLength": 1}})").find("$.if: not supported (conditional"), std::string::npos);
  EXPECT_NE(error_of(R"({"type": "array", "uniqueItems": true})").find("$.uniqueItems: true is supported only with maxItems ≤ 1"), std::string::npos);
  EXPECT_TRUE(accepts_bytes(schema(R"({"type": "array", "uniqueItems": true, "maxItems": 1})"), "[7]"));
  EXPECT_TRUE(accepts_bytes(schema(R"({"type": "array", "uniqueItems": false})"), "[7, 7]"));
  EXPECT_NE(error_of(R"({"type": "string", "pattern": "a+", "maxLength": 3})").find("$.pattern: pattern together with minLength"), std::string::npos);
  EXPECT_EQ(error_of(R"({"type": "object", "minProperties": 1})"), "$.minProperties: not supported");
  EXPECT_NE(error_of(R"({"type": "integer", "minimum": "3"})").find("$.minimum: must be a number"), std::string::npos);
}

}  // namespace
